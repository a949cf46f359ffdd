"""The one eager door: every eager product of a ``CSRMatrix`` goes through :func:`product`.

The tensor layer hands it a matrix's parts (``crow``, ``col``, the values, ``ncols``) and the
matrix's :class:`Door`, the little this module keeps per matrix between calls; never the
matrix itself (``ops`` sits below ``tensor``), and the tensor layer never reaches the JIT
itself. :func:`product` tries, in order:

1. **C++'s eager door** (``door.cpp``: the C++ library's ``serve``, :mod:`~torch_sparserl.jit.fastpath`):
   once the Python path has recorded a CUDA product of this matrix there (:func:`record`),
   C++ serves the next one like it from its registry, without Python; it declines whatever
   the Python path must see (autograd, autocast, a mode, a changed pattern, other operands).
2. **the kernel the matrix kept** (``door.hot``): where C++ does not serve, the installed
   kernel that served a direct ``spmm``/``spmv`` of this matrix, launched from its decision
   record with no checks, pattern lookup or dispatch while nothing it was kept for changed
   (:func:`hot_product`).
3. **the Python path** (:func:`python_product`): the implementation without the dispatcher
   (:func:`direct`) where nothing needs to see the operator (:func:`~.common.direct_ok`), after
   which a CUDA call is recorded for C++ (stage 1) or the kernel that served it is kept
   (stage 2); one autograd node around the implementation (:func:`eager_product`) where only
   autograd does (:func:`~.common.eager_ok`); the differentiable operator otherwise.

``CSRMatrix.__matmul__`` runs stages 1 and 2 inline and calls :func:`python_product` on a
miss: on a small graph a served call's host time is those checks and the launch, and a call
into :func:`product` would add its own.

Every door runs the same implementation (the same checks, errors and kernels) and asks the same
decision record of the runtime (:class:`~torch_sparserl.jit.decisions.Decision`); each exists for
one kind of caller, because what the caller has already done (differentiate, trace, dispatch)
is not paid for twice:

=============================  ===================================================================
door                           who calls it, and why it exists
=============================  ===================================================================
``sparserl::<op>``             users, tracers and ``torch.compile`` before AOTAutograd: the public,
                               differentiable operator with its fake and autograd formulas.
``sparserl_direct::<op>``      graphs AOTAutograd has differentiated (the backend's post-grad pass
                               retargets them, :data:`~.twins.DIRECT_OPS`): the implementation
                               only, no autograd kernel, whose layers would cost several times the
                               dispatch. Its CUDA products are recorded for C++ (:func:`record`).
``sparserl_fast::<op>``        the same graphs' CUDA ``spmm``/``spmv`` and their transposes when the
                               backend's ``fast_path`` is on (:data:`~.twins.FAST_OPS`): served in
                               C++ from the registry that repeats the runtime's records, else
                               ``sparserl_direct``.
:func:`product`                eager ``CSRMatrix`` products, above.
=============================  ===================================================================

Recording for C++ happens in one place, :func:`record`, whichever door served the call.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import config
from .. import pattern as patterns
from ..jit import fastpath
from ..jit.decisions import Installed
from ..jit.runtime import active, active_or_none
from .backward import _IMPLS
from .common import direct_ok, eager_ok
from .products import _BACKWARDS, _DIRECT
from .sampled import _sddmm


class Door:
    """What the eager door keeps for one matrix between its products; the matrix owns it
    (``CSRMatrix.__dict__["_door"]``) and passes it to :func:`product`. Only a matrix whose
    values need no gradient has one (autograd must see every product of the others).

    ``ncols``: the matrix's columns (fixed for its life). ``cpp``: C++'s eager door, the
    library's ``serve``, once a product of this matrix was recorded there (or C++ serves its
    young pattern: :func:`stage`); None before. ``hot``: ``(X.dim(), N)`` -> what
    :func:`hot_product` launches, for the products an installed kernel served directly.
    """

    __slots__ = ("ncols", "cpp", "hot")

    def __init__(self, ncols: int):
        self.ncols = ncols
        self.cpp = None
        self.hot: dict = {}


_FAST_INDEX = {name: index for index, name in enumerate(fastpath.OPS)}  # what the C++ registry serves


def autocast_operands(val: Tensor, X: Tensor) -> tuple[Tensor, Tensor]:
    """Under ``torch.autocast``, a product runs in the autocast dtype, as ``torch.mm`` does:
    float32 values and operands are cast to it (float64 ones are not), and the kernels
    accumulate in float32 (:mod:`torch_sparserl.dtypes`)."""
    device_type = X.device.type
    try:
        enabled = torch.is_autocast_enabled(device_type)
    except RuntimeError:  # a device type with no autocast (meta): the operator's checks speak
        return val, X
    if not enabled:
        return val, X
    dtype = torch.get_autocast_dtype(device_type)
    if val.dtype == torch.float32:
        val = val.to(dtype)
    if X.dtype == torch.float32:
        X = X.to(dtype)
    return val, X


# ------------------------------------------------------------------ the one eager door


def product(op: str, crow: Tensor, col: Tensor, val: Tensor, ncols: int, X: Tensor,
            door: Door | None = None) -> Tensor:
    """``torch.ops.sparserl.<op>(crow, col, val, ncols, X)`` for eager code (``op``: ``spmm``,
    ``spmv`` or a transpose of one), by the first of the stages in this module's docstring that
    serves it: C++'s eager door, the kernel ``door`` kept, the Python path. Same checks, errors,
    kernels and gradients as the operator. ``door``: the matrix's, where its values need no
    gradient; None while torch.compile traces (the Python path then, keeping nothing)."""
    if door is not None and type(X) is Tensor:
        serve = door.cpp
        if serve is not None:
            index = _FAST_INDEX.get(op)
            if index is not None:
                out = serve(index, crow, col, val, ncols, X)
                if out is not None:
                    return out
        elif door.hot and (op == "spmm" or op == "spmv"):
            dim = X.dim()
            if dim == (2 if op == "spmm" else 1):
                out = hot_product(door.hot, crow, col, val, X, dim)
                if out is not None:
                    return out
    return python_product(op, crow, col, val, ncols, X, door)


def python_product(op: str, crow: Tensor, col: Tensor, val: Tensor, ncols: int, X: Tensor,
                   door: Door | None = None) -> Tensor:
    """:func:`product` once C++'s door and the kept kernel have declined (or do not apply): the
    implementation directly where nothing needs to see the operator, recording a CUDA call for
    C++ (``door.cpp``) or keeping the kernel that served it (``door.hot``); a lean autograd node
    where only autograd needs to; the operator otherwise."""
    values = val
    val, X = autocast_operands(val, X)
    if direct_ok(val, X):
        if door is None:
            return direct(op, crow, col, val, ncols, X)
        runtime = active_or_none()
        served = runtime.stats["installed_calls"] if runtime is not None else None
        out = direct(op, crow, col, val, ncols, X)
        runtime = runtime or active_or_none()  # the first product of a process creates it
        if op in _FAST_INDEX and runtime is not None:
            if _recordable(X):
                if val is values:  # else autocast cast the values: C++ leaves autocast to Python
                    record(op, crow, col, val, ncols, X, runtime)
                    door.cpp = fastpath.serve
            elif (op == "spmm" or op == "spmv") and runtime.stats["installed_calls"] != served:
                _keep(door, runtime, op, crow, col, values, X)  # a kernel served this call
        return out
    if eager_ok(val, X):
        return eager_product(op, crow, col, val, ncols, X)
    return getattr(torch.ops.sparserl, op)(crow, col, val, ncols, X)


def hot_product(hot: dict, crow: Tensor, col: Tensor, val: Tensor, X: Tensor, dim: int) -> Tensor | None:
    """``A @ X`` by the kernel the decision record in ``hot`` (a :class:`Door`'s) names, when every
    condition of the direct path still holds and the pattern is unchanged; None otherwise.
    ``crow``, ``col``, ``val``: the matrix's parts; ``dim``: ``X.dim()``, 1 or 2.

    Every check here is a plain attribute read: what is fixed for the matrix's life (its
    columns; that it needs no gradient, since only such a matrix has a door) was stored with
    the kernel (:func:`_keep`).
    """
    found = hot.get((dim, X.shape[1] if dim == 2 else 1))
    if found is None:
        return None
    runtime, decision, _, versions, (crow_v, col_v), device, dtype, ncols = found
    state = decision.state
    if (runtime is not active_or_none() or state.__class__ is not Installed or X.dtype != dtype
            or val.dtype != dtype or X.device != device or X.shape[0] != ncols or val.shape[0] != col_v.shape[0]
            or patterns.versions(crow, col) != versions or not direct_ok(val, X)
            or torch.is_autocast_enabled(device.type)):
        return None
    return runtime.launch(state.launch, crow_v, col_v, val, X)  # the indices the pattern validated


def _keep(door: Door, runtime, op: str, crow: Tensor, col: Tensor, val: Tensor, X: Tensor) -> None:
    """After a direct product a kernel served, keep its decision record in the matrix's door,
    so the next ``A @ X`` of this shape skips torch's function dispatch, the checks and the
    pattern lookup (:func:`hot_product`). The record, not its kernel, is kept: the runtime
    may replace the kernel (its library's build after the interim NVRTC build), and the next
    call reads what the record says then."""
    n = X.shape[1] if op == "spmm" else 1
    entry = patterns.lookup(crow, col, door.ncols)
    decision = runtime.decision(op, entry, n, val.dtype)
    if isinstance(decision.state, Installed) and not entry.transient and entry.settle():
        # the pattern is kept too: the record lives as long as it does
        door.hot[(X.dim(), n)] = (runtime, decision, entry, patterns.versions(crow, col),
                                  entry.indices(crow, col), X.device, val.dtype, door.ncols)


# ------------------------------------------------------------------ recording for C++


def _recordable(X: Tensor) -> bool:
    """Whether C++ can take over a product on ``X``'s device: CUDA, the library loaded."""
    return X.is_cuda and fastpath.loaded


def record(op: str, crow: Tensor, col: Tensor, val: Tensor, ncols: int, X: Tensor, runtime=None) -> None:
    """After the Python implementation served this call, let C++ serve the next one like it
    (:func:`torch_sparserl.jit.fastpath.record`, which repeats the runtime's decision record: its
    kernel, or cuSPARSE), where the call is on CUDA, the library is loaded and a runtime is
    active (``runtime``: the one that served it, else the active one). The one place any door
    records: ``op`` is a product or ``sddmm`` (then ``val`` is Y and ``ncols`` X's rows)."""
    if not _recordable(X):
        return
    runtime = runtime or active_or_none()
    if runtime is not None:
        fastpath.record(runtime, op, crow, col, val, ncols, X)


def _recording(op: str, impl):
    """``impl``, after which a CUDA call is recorded for C++ (:func:`record`)."""
    def run(crow: Tensor, col: Tensor, val: Tensor, ncols: int, X: Tensor) -> Tensor:
        out = impl(crow, col, val, ncols, X)
        record(op, crow, col, val, ncols, X)
        return out

    run.__name__ = impl.__name__
    return run


def _recording_sddmm(crow: Tensor, col: Tensor, Y: Tensor, X: Tensor) -> Tensor:
    """:func:`~.sampled._sddmm`, after which a CUDA call an installed kernel served is recorded
    for C++ (cuSPARSE's SDDMM stays in Python)."""
    out = _sddmm(crow, col, Y, X)
    record("sddmm", crow, col, Y, X.shape[0], X)
    return out


_RECORDING = {**{op: _recording(op, impl) for op, impl in _DIRECT.items()}, "sddmm": _recording_sddmm}
"""The implementations that record their CUDA calls for C++: what the twins run
(:mod:`.twins`), and, behind C++'s door, eager autograd."""


# ------------------------------------------------------------------ the Python path's doors


def direct(op: str, crow: Tensor, col: Tensor, val: Tensor, ncols: int, X: Tensor) -> Tensor:
    """``torch.ops.sparserl.<op>(crow, col, val, ncols, X)`` without the dispatcher; only
    where :func:`~.common.direct_ok` holds. Same checks, same errors, same kernels."""
    return _DIRECT[op](crow, col, val, ncols, X)


def _door_first(op: str, recorded):
    """``recorded`` (the implementation that records a CUDA call for C++), after asking C++'s
    eager door (:data:`torch_sparserl.jit.fastpath.serve`). For the products that eager autograd
    runs: :class:`_EagerProduct`'s forward and the backward's products, where grad mode is
    off, so the door may serve once the call was recorded."""
    index = _FAST_INDEX[op]

    def run(crow: Tensor, col: Tensor, val: Tensor, ncols: int, X: Tensor) -> Tensor:
        serve = fastpath.serve
        if serve is not None:
            out = serve(index, crow, col, val, ncols, X)
            if out is not None:
                return out
        return recorded(crow, col, val, ncols, X)

    run.__name__ = recorded.__name__
    return run


def _sddmm_door_first(crow: Tensor, col: Tensor, Y: Tensor, X: Tensor) -> Tensor:
    """The values' gradient in an eager backward: C++'s installed kernel, once the Python
    implementation has served (and recorded) the same call."""
    serve = fastpath.serve
    if serve is not None and type(X) is Tensor and X.dim() == 2:
        out = serve(fastpath.SDDMM, crow, col, Y, X.shape[0], X)
        if out is not None:
            return out
    return _recording_sddmm(crow, col, Y, X)


_EAGER = {op: _door_first(op, _RECORDING[op]) for op in _DIRECT}
_IMPLS.update(_EAGER)  # the backward's products go through the door too
_IMPLS["sddmm"] = _sddmm_door_first


class _EagerProduct(torch.autograd.Function):
    """A differentiable product for eager code: the implementation forward, the operator's
    own backward formula (which calls the implementations again when it can).

    The operator's autograd (custom_op's wrapper around its dispatch) costs about three
    times the CPU of a whole product on a small graph; this node costs one
    ``autograd.Function`` call. Double backward goes through the differentiable operators.
    """

    @staticmethod
    def forward(ctx, crow, col, val, ncols, X, op):
        ctx.ncols, ctx.op = ncols, op
        ctx.save_for_backward(crow, col, val, X)
        return _EAGER[op](crow, col, val, ncols, X)

    @staticmethod
    def backward(ctx, grad):
        return (*_BACKWARDS[ctx.op](ctx, grad), None)


def eager_product(op: str, crow: Tensor, col: Tensor, val: Tensor, ncols: int, X: Tensor) -> Tensor:
    """``torch.ops.sparserl.<op>(crow, col, val, ncols, X)`` for eager code that needs a
    gradient; only where :func:`~.common.eager_ok` holds. Same checks, errors, kernels and gradients."""
    return _EagerProduct.apply(crow, col, val, ncols, X, op)


# ------------------------------------------------------------------ what else the tensor layer asks


def can_stage() -> bool:
    """Whether the C++ library is loaded to stage host CSR arrays for a CUDA device (:func:`stage`)."""
    return fastpath.stage_csr is not None


def stage(crow: Tensor, col: Tensor, val: Tensor | None, nrows: int, ncols: int, device: torch.device, *,
          young: bool = False) -> tuple[list[Tensor], Door | None] | None:
    """Host CSR arrays sent to a CUDA device by the C++ library (``fastpath.stage_csr``: the
    metadata checked, the indices checked on their private pinned copy, then sent), or None
    where it is not loaded. Else ``(staged, door)``: ``staged`` is ``[crow, col]``, then the
    values where given, or ``[]`` where the library declines (a check that fails among them);
    with ``young``, ``door`` is the door of a matrix on them, whose products C++ serves by
    cuSPARSE while the pattern is young (the active runtime's admission age:
    :func:`~torch_sparserl.jit.fastpath.young_ns`), and None where it does not."""
    stage_csr = fastpath.stage_csr
    if stage_csr is None:
        return None
    if not young:
        return stage_csr(crow, col, val, nrows, ncols, device), None
    young_ns = fastpath.young_ns(active())
    staged = stage_csr(crow, col, val, nrows, ncols, device, young_ns)
    door = None
    if young_ns and len(staged) == 3:  # C++ serves it while young: its products ask C++'s door first
        door = Door(ncols)
        door.cpp = fastpath.serve
    return staged, door


def strict() -> bool:
    """The runtime's ``strict`` setting: the active runtime's, or the environment's
    (``jit.strict``) before there is one."""
    runtime = active_or_none()
    return runtime.settings.strict if runtime is not None else config.read("jit.strict")
