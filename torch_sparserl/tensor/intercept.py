"""Route eager products of raw ``torch.sparse_csr`` tensors to the sparserl operators.

Dynamo refuses sparse tensors, so a model called with one runs eagerly even under
``torch.compile(backend="sparserl")``. To still serve those products, this module
overrides ``aten::addmm`` (reached by ``torch.sparse.mm``, ``torch.mm``, ``@``,
``torch.matmul``), ``aten::mv`` and ``aten::addmv`` for the ``SparseCsrCPU`` and
``SparseCsrCUDA`` dispatch keys.

The override is a process-wide side effect, so it is opt-in and scoped:

* it is never installed at import; it is installed by :func:`intercept_sparse` (a context
  manager) and by the backend once ``torch.compile`` names it, and removed when the last
  user is gone (:func:`deactivate_backend` ends the backend's use);
* while installed it acts only inside an :func:`intercept_sparse` block or inside a call of
  a model compiled with the sparserl backend — recognized through Dynamo's active frame
  callback — and only for a 2-D CSR matrix times a dense operand of the same supported
  dtype. Every other call is handed to torch's own kernel, with identical results.

Inside a compiled model the first intercepted product logs one warning that says how to
avoid the graph break.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
import weakref

import torch
from torch.utils.weak import WeakIdKeyDictionary

from ..config import BackendOptions, logger
from ..dtypes import VALUE_DTYPES
from ..kernels import vendor

_DISPATCH_KEYS = ("SparseCsrCPU", "SparseCsrCUDA")
_lock = threading.RLock()
_library: torch.library.Library | None = None
_users = 0
_backend_active = False
_suspend_depth = 0
_local = threading.local()
_views = WeakIdKeyDictionary()  # sparse tensor -> (crow, col): stable objects for the pattern cache
_warned = weakref.WeakSet()
_warned_ids: set[int] = set()
_counts = {"routed": 0, "delegated": 0, "fallbacks": 0}

GRAPH_BREAK_WARNING = (
    "torch_sparserl: the compiled model was given a torch.sparse_csr tensor, which Dynamo cannot "
    "trace, so the frame that takes it runs eagerly (a graph break); its sparse products are "
    "routed to the sparserl operators. To compile the whole model, pass torch_sparserl.csr(A) "
    "instead of the sparse tensor, or compile with torch_sparserl.compile(model), which converts "
    "sparse arguments and buffers for you.")


# ------------------------------------------------------------------ installation


def _register() -> torch.library.Library:
    lib = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():
        # torch warns that an existing kernel is overridden: that is the point.
        warnings.simplefilter("ignore")
        for key in _DISPATCH_KEYS:
            lib.impl("addmm", _addmm, key)
            lib.impl("mv", _mv, key)
            lib.impl("addmv", _addmv, key)
    vendor.override_installed(True)  # torch's own products (the fallback) go around it now
    return lib


def _unregister(lib: torch.library.Library) -> None:
    lib._destroy()
    vendor.override_installed(False)


def _acquire() -> None:
    global _library, _users
    with _lock:
        _users += 1
        if _library is None and _suspend_depth == 0:
            _library = _register()


def _release() -> None:
    global _library, _users
    with _lock:
        _users -= 1
        if _users == 0 and _library is not None:
            _unregister(_library)
            _library = None


def installed() -> bool:
    """Whether the dispatcher override is in place now."""
    return _library is not None


def activate_for_backend() -> None:
    """Install the override for models compiled with the sparserl backend (idempotent)."""
    global _backend_active
    with _lock:
        if not _backend_active:
            _backend_active = True
            _acquire()


def deactivate_backend() -> None:
    """Stop intercepting inside compiled models; the override goes once nothing else needs it."""
    global _backend_active
    with _lock:
        if _backend_active:
            _backend_active = False
            _release()


@contextlib.contextmanager
def intercept_sparse(settings: BackendOptions | dict | None = None):
    """Within the block, eager ``torch.sparse.mm`` / ``mm`` / ``@`` / ``mv`` / ``addmm`` /
    ``addmv`` on 2-D ``torch.sparse_csr`` tensors run on the sparserl operators."""
    settings = BackendOptions.from_options(settings)
    stack = getattr(_local, "explicit", None)
    if stack is None:
        stack = _local.explicit = []
    _acquire()
    stack.append(settings)
    try:
        yield
    finally:
        stack.pop()
        _release()


@contextlib.contextmanager
def _suspended():
    """Take the override out so that a call reaches torch's own kernel, then put it back."""
    global _library, _suspend_depth
    with _lock:
        _suspend_depth += 1
        if _library is not None:
            _unregister(_library)
            _library = None
    try:
        yield
    finally:
        with _lock:
            _suspend_depth -= 1
            if _suspend_depth == 0 and _users > 0 and _library is None:
                _library = _register()


def stats() -> dict[str, int]:
    """How many products were routed, handed to torch, or fell back after an error."""
    return dict(_counts)


def reset_warnings() -> None:
    """Forget which compiled models were warned about (for tests)."""
    _warned.clear()
    _warned_ids.clear()


# -------------------------------------------------------------------- routing


def _sparserl_callback():
    """``(callback, settings)`` if a model compiled with the sparserl backend is running."""
    from torch._C._dynamo import eval_frame

    callback = eval_frame.get_eval_frame_callback()
    node, options = callback, None
    for _ in range(8):
        if node is None:
            return None
        if getattr(node, "_sparserl_backend", False):
            return callback, BackendOptions.from_options(options)
        kwargs = getattr(node, "kwargs", None)
        if isinstance(kwargs, dict) and options is None:
            options = kwargs.get("options")
        node = getattr(node, "_torchdynamo_orig_backend", None) or getattr(node, "compiler_fn", None)
    return None


def _warn_once(callback) -> None:
    try:
        if callback in _warned:
            return
        _warned.add(callback)
    except TypeError:  # not weak-referenceable
        if id(callback) in _warned_ids:
            return
        _warned_ids.add(id(callback))
    logger.warning(GRAPH_BREAK_WARNING)


def _route(mat: torch.Tensor, dense: torch.Tensor, dense_dim: int) -> BackendOptions | None:
    """The settings to route this product with, or None to leave it to torch."""
    if getattr(_local, "busy", False):
        return None
    if not (mat.layout == torch.sparse_csr and mat.dim() == 2 and mat.values().dim() == 1
            and isinstance(dense, torch.Tensor) and dense.layout == torch.strided
            and dense.dim() == dense_dim and dense.dtype == mat.dtype
            and mat.dtype in VALUE_DTYPES and dense.device == mat.device):
        return None
    explicit = getattr(_local, "explicit", None)
    if explicit:
        return explicit[-1] if explicit[-1].intercept_sparse else None
    if not _backend_active:
        return None
    found = _sparserl_callback()
    if found is None or not found[1].intercept_sparse:
        return None
    _warn_once(found[0])
    return found[1]


def _pattern_views(mat: torch.Tensor):
    # Fresh index views on every call would miss the pattern cache (it is keyed by
    # identity), so keep one pair per sparse tensor for as long as it lives.
    views = _views.get(mat)
    if views is None:
        views = (mat.crow_indices().detach(), mat.col_indices().detach())
        _views[mat] = views
    return views


def _run(settings: BackendOptions, name: str, product, delegate):
    _local.busy = True
    try:
        result = product()
        _counts["routed"] += 1
        return result
    except Exception as exc:
        if _strict(settings):
            raise
        _counts["fallbacks"] += 1
        logger.warning("torch_sparserl: %s on a sparse CSR tensor fell back to torch's kernel: %s",
                       name, exc, exc_info=logger.isEnabledFor(10))
    finally:
        _local.busy = False
    return delegate()


def _strict(settings: BackendOptions) -> bool:
    """The model's ``strict`` option, else the runtime's (``jit.strict``: the active runtime's,
    or the environment's before there is one)."""
    if settings.strict is not None:
        return settings.strict
    from ..ops import doors

    return doors.strict()


_OUT_OVERLOADS = {"addmm": torch.addmm, "addmv": torch.addmv, "mv": torch.mv}


def _delegate(name: str, *args, **kwargs):
    """torch's own kernel for a call the override does not route.

    The override replaces the functional kernels only. For these ops torch's functional
    sparse-compressed kernel is an empty result (of the first operand's layout; ``mv``'s is
    dense) plus the ``out=`` kernel, so calling the ``out=`` overload on such a result is the
    same call, for the cost of an allocation. Taking the override out and putting it back
    (:func:`_suspended`) instead costs a registration round trip on every eager sparse
    product of the process, several times this way's overhead (``benchmarks/bench_intercept.py``
    times both against no override); it stays only for what the ``out=`` call refuses,
    so that torch's own error (or result) comes back.
    """
    _counts["delegated"] += 1
    first = args[0]
    try:
        out = torch.empty((0,) * (2 if name == "addmm" else 1), dtype=first.dtype, device=first.device,
                          layout=torch.strided if name == "mv" else first.layout)
        return _OUT_OVERLOADS[name](*args, **kwargs, out=out)
    except (RuntimeError, NotImplementedError, TypeError):
        with _suspended():
            return getattr(torch.ops.aten, name).default(*args, **kwargs)


def _combine(input, product, beta, alpha):
    # torch.addmm's result has the product's shape; input only broadcasts into it, and
    # beta == 0 ignores input altogether (NaN in it must not leak).
    if alpha != 1:
        product = product * alpha
    return product if beta == 0 else torch.add(product, input, alpha=beta)


def _spmm(mat, dense):
    crow, col = _pattern_views(mat)
    return torch.ops.sparserl.spmm(crow, col, mat.values(), mat.shape[1], dense)


def _spmv(mat, vec):
    crow, col = _pattern_views(mat)
    return torch.ops.sparserl.spmv(crow, col, mat.values(), mat.shape[1], vec)


def _addmm(self, mat1, mat2, *, beta=1, alpha=1):
    delegate = lambda: _delegate("addmm", self, mat1, mat2, beta=beta, alpha=alpha)  # noqa: E731
    settings = _route(mat1, mat2, 2) if isinstance(self, torch.Tensor) and self.layout == torch.strided else None
    if settings is None:
        return delegate()
    return _run(settings, "addmm", lambda: _combine(self, _spmm(mat1, mat2), beta, alpha), delegate)


def _mv(self, vec):
    delegate = lambda: _delegate("mv", self, vec)  # noqa: E731
    settings = _route(self, vec, 1)
    if settings is None:
        return delegate()
    return _run(settings, "mv", lambda: _spmv(self, vec), delegate)


def _addmv(self, mat, vec, *, beta=1, alpha=1):
    delegate = lambda: _delegate("addmv", self, mat, vec, beta=beta, alpha=alpha)  # noqa: E731
    settings = _route(mat, vec, 1) if isinstance(self, torch.Tensor) and self.layout == torch.strided else None
    if settings is None:
        return delegate()
    return _run(settings, "addmv", lambda: _combine(self, _spmv(mat, vec), beta, alpha), delegate)
