"""The ``sparserl`` operators: each defined once, with schema, fake and autograd.

Pipeline stage 9 of 14: the ``torch.ops.sparserl`` operators: schema, checks, fake and autograd,
served by the runtime.
May import: config, dtypes, data, pattern, kernels, abi, toolchain, evaluate, specialize, jit.

=========================================================  ==================================
``sparserl::spmm(crow, col, val, ncols, X)``               A @ X, X of shape (ncols, N)
``sparserl::spmv(crow, col, val, ncols, x)``               A @ x, x of shape (ncols,)
``sparserl::spmm_transposed(crow, col, val, ncols, G)``    Aᵀ @ G, G of shape (nrows, N)
``sparserl::spmv_transposed(crow, col, val, ncols, g)``    Aᵀ @ g, g of shape (nrows,)
``sparserl::sddmm(crow, col, Y, X)``                       out[k] = dot(Y[row(k)], X[col(k)])
``sparserl::spmm_epilogue(crow, col, val, ncols, X,``      relu(scale[:, None] * (A @ X) + bias),
``scale, bias, relu)``                                     each step optional (post-grad fusion)
``sparserl::spmm_heads(crow, col, val, ncols, X)``         out[:, h] = A_h @ X[:, h], val (nnz, H),
                                                           X (ncols, H, C): attention heads
``sparserl::spmm_heads_transposed(crow, col, val,``        out[:, h] = A_hᵀ @ G[:, h]
``ncols, G)``
``sparserl::sddmm_heads(crow, col, Y, X)``                 out[k, h] = dot(Y[row(k), h], X[col(k), h])
=========================================================  ==================================

A is the CSR matrix ``(crow, col, val)`` with ``crow.numel() - 1`` rows and ``ncols``
columns. The transposed operators run on the transposed *pattern*, which is computed once
per pattern and cached (:mod:`torch_sparserl.pattern`); they are what the backward of the
forward products calls, and SDDMM gives the gradient of the values. The ``_heads`` operators
run one product per attention head as a single product on the pattern's block-diagonal form
(computed once per pattern and number of heads). The products close under differentiation
(the plain ones among themselves, the heads ones likewise), so higher-order gradients work too.

**The doors.** Every door below runs the same implementation (the same checks, errors and
kernels) and asks the same decision record of the runtime
(:class:`~torch_sparserl.jit.decisions.Decision`); each exists for one kind of caller, because
what the caller has already done (differentiate, trace, dispatch) is not paid for twice:

=============================  ===================================================================
door                           who calls it, and why it exists
=============================  ===================================================================
``sparserl::<op>``             users, tracers and ``torch.compile`` before AOTAutograd: the public,
                               differentiable operator with its fake and autograd formulas.
``sparserl_direct::<op>``      graphs AOTAutograd has differentiated (the backend's post-grad pass
                               retargets them, :data:`DIRECT_OPS`): the implementation only, no
                               autograd kernel, whose layers would cost several times the dispatch.
``sparserl_fast::<op>``        the same graphs' CUDA ``spmm``/``spmv`` and their transposes when the
                               backend's ``fast_path`` is on (:data:`FAST_OPS`): served in C++ from
                               the registry that repeats the runtime's records
                               (:mod:`~torch_sparserl.jit.fastpath`), else ``sparserl_direct``.
:func:`direct`                 eager ``CSRMatrix`` products with nothing to differentiate, trace or
                               dispatch (:func:`direct_ok`): the implementation without the
                               dispatcher. ``A @ X`` then keeps the record on the matrix, and its
                               next call launches what the record names without a lookup.
:func:`eager_product`          eager ``CSRMatrix`` products that autograd records
                               (:func:`eager_ok`): one ``autograd.Function`` node around the
                               implementation instead of custom_op's autograd wrapper.
=============================  ===================================================================
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import pattern as patterns
from ..abi import EPILOGUE_STEPS
from ..dtypes import VALUE_DTYPES
from ..jit import fastpath, runtime
from ..kernels import vendor
from ..pattern.validation import check_csr_meta, check_dense, check_tensor, require

__all__ = ["spmm", "spmv", "spmm_transposed", "spmv_transposed", "sddmm", "spmm_epilogue", "spmm_heads",
           "spmm_heads_transposed", "sddmm_heads", "NAMESPACE"]

NAMESPACE = "sparserl"


def _product(op: str, entry: patterns.Pattern, crow: Tensor, col: Tensor, val: Tensor, X: Tensor) -> Tensor:
    """``A @ X`` (``op="spmm"``) or ``A @ x`` (``"spmv"``) on validated operands.

    The runtime's specialized kernel for this pattern when one is installed (it serves CUDA
    devices); otherwise torch's own sparse kernels: cuSPARSE on CUDA, MKL's or torch's on the CPU.
    Either reads the indices as the pattern validated them (:meth:`Pattern.indices`), never
    the caller's tensors again.
    """
    crow, col = entry.indices(crow, col)
    if not (entry.transient or entry.overfull):
        out = runtime.active().call(op, entry, crow, col, val, X)
        if out is not None:
            return out
    return _vendor(op, entry, crow, col, val, X)


def _vendor(op: str, entry: patterns.Pattern, crow: Tensor, col: Tensor, val: Tensor, X: Tensor) -> Tensor:
    """``A @ X`` by torch's own kernels, cuSPARSE's on CUDA: called from C++ where the library is
    loaded (one call, no sparse tensor built; a pattern met once pays no more than this), else,
    and for what that call declines (empty or overfull products, a type cuSPARSE refuses) or Dynamo
    traces (the library's ops have no fake kernels), through torch
    (:mod:`torch_sparserl.kernels.vendor`)."""
    cusparse_once = fastpath.cusparse_once
    if cusparse_once is not None and X.is_cuda and not entry.overfull and not torch.compiler.is_compiling():
        out = cusparse_once(crow, col, val, entry.ncols, X, False)
        if out is not None:
            return out
    return getattr(vendor, op)(entry, crow, col, val, X)


def _pattern(op: str, crow: Tensor, col: Tensor, val: Tensor | None, ncols: int) -> patterns.Pattern:
    entry = patterns.validated(crow, col, ncols)
    if entry is not None and (val is None or (
            isinstance(val, Tensor) and val.dim() == 1 and val.shape[0] == entry.nnz and val.device == entry.device
            and val.dtype in VALUE_DTYPES and val.layout == torch.strided)):
        return entry  # crow and col are the validated ones, unchanged; val fits them
    check_csr_meta(op, crow, col, val, ncols)
    entry = patterns.lookup(crow, col, ncols)
    entry.validate(op, crow, col)
    return entry


# --------------------------------------------------------------------------- spmm


def _spmm(crow: Tensor, col: Tensor, val: Tensor, ncols: int, X: Tensor) -> Tensor:
    entry = _pattern("sparserl.spmm", crow, col, val, ncols)
    check_dense("sparserl.spmm", "X", X, dim=2, rows=ncols, rows_name="ncols", like=val)
    return _product("spmm", entry, crow, col, val, X)


@torch.library.custom_op("sparserl::spmm", mutates_args=())
def spmm(crow: Tensor, col: Tensor, val: Tensor, ncols: int, X: Tensor) -> Tensor:
    """A @ X for the CSR matrix A = (crow, col, val) with ``ncols`` columns."""
    return _spmm(crow, col, val, ncols, X)


@spmm.register_fake
def _spmm_fake(crow, col, val, ncols, X):
    check_csr_meta("sparserl.spmm", crow, col, val, ncols)
    check_dense("sparserl.spmm", "X", X, dim=2, rows=ncols, rows_name="ncols", like=val)
    return X.new_empty((crow.shape[0] - 1, X.shape[1]))


def _spmm_setup(ctx, inputs, output):
    crow, col, val, ncols, X = inputs
    ctx.ncols = ncols
    ctx.save_for_backward(crow, col, val, X)


def _backward_impls(*tensors) -> dict:
    """The products a backward runs: the implementations themselves when nothing needs to
    see the operators (an eager backward: no double backward, no tracer, no mode), since the
    operators' dispatch costs more CPU than the products on a small graph; the
    differentiable operators otherwise."""
    if all(direct_ok(a, b) for a, b in zip(tensors, tensors[1:])):
        return _IMPLS
    return _OPERATORS


def _spmm_backward_of(kind: str = ""):
    """The backward of ``spmm<kind>`` (``""`` or ``"_heads"``): the values' gradient by
    ``sddmm<kind>``, the features' by ``spmm<kind>_transposed``."""
    def backward(ctx, grad):
        crow, col, val, X = ctx.saved_tensors
        impl = _backward_impls(val, grad, X)
        grad_val = impl[f"sddmm{kind}"](crow, col, grad, X) if ctx.needs_input_grad[2] else None
        grad_X = impl[f"spmm{kind}_transposed"](crow, col, val, ctx.ncols, grad) if ctx.needs_input_grad[4] else None
        return None, None, grad_val, None, grad_X

    return backward


def _spmm_transposed_backward_of(kind: str = ""):
    """The backward of ``spmm<kind>_transposed``: ``sddmm<kind>`` and ``spmm<kind>``."""
    def backward(ctx, grad):
        crow, col, val, G = ctx.saved_tensors
        impl = _backward_impls(val, grad, G)
        grad_val = impl[f"sddmm{kind}"](crow, col, G, grad) if ctx.needs_input_grad[2] else None
        grad_G = impl[f"spmm{kind}"](crow, col, val, ctx.ncols, grad) if ctx.needs_input_grad[4] else None
        return None, None, grad_val, None, grad_G

    return backward


def _sddmm_backward_of(kind: str = ""):
    """The backward of ``sddmm<kind>``: ``spmm<kind>`` and ``spmm<kind>_transposed``."""
    def backward(ctx, grad):
        crow, col, Y, X = ctx.saved_tensors
        ncols = X.shape[0]
        impl = _backward_impls(grad, Y, X)
        grad_Y = impl[f"spmm{kind}"](crow, col, grad, ncols, X) if ctx.needs_input_grad[2] else None
        grad_X = impl[f"spmm{kind}_transposed"](crow, col, grad, ncols, Y) if ctx.needs_input_grad[3] else None
        return None, None, grad_Y, grad_X

    return backward


_spmm_backward = _spmm_backward_of()
spmm.register_autograd(_spmm_backward, setup_context=_spmm_setup)


# ------------------------------------------------------------------ spmm_transposed


def _transposed_once(entry: patterns.Pattern, crow: Tensor, col: Tensor, val: Tensor, ncols: int,
                     G: Tensor) -> Tensor | None:
    """``Aᵀ @ G`` without the transpose, for a pattern's first transposed product: cuSPARSE on the
    pattern's own arrays (its transpose operation), through the C++ library. A one-off pattern
    (the backward of a sampled mini-batch) has no second one, and computing its transpose (a
    sort and a handful of launches on the host's critical path) costs more than the product.
    From the second on, the transpose is computed, and the product may be specialized and
    served from C++. None where this does not apply: not CUDA, the library not loaded, the
    transpose there already, an overfull pattern, deterministic algorithms asked for (cuSPARSE's
    transposed products may differ in the last bits from run to run), or a product cuSPARSE is
    not called with here (a type or int64 sizes it refuses)."""
    cusparse_once = fastpath.cusparse_once
    if (cusparse_once is None or not G.is_cuda or entry.has_transpose or entry.overfull
            or torch.compiler.is_compiling()):
        return None
    first = entry.transposed_products == 0
    entry.transposed_products += 1
    if not (first or entry.transient) or torch.are_deterministic_algorithms_enabled():
        return None
    crow, col = entry.indices(crow, col)
    out = cusparse_once(crow, col, val, ncols, G, True)
    if out is not None:
        patterns.count("transposes_avoided")
    return out


def _spmm_transposed(crow: Tensor, col: Tensor, val: Tensor, ncols: int, G: Tensor) -> Tensor:
    op = "sparserl.spmm_transposed"
    entry = _pattern(op, crow, col, val, ncols)
    check_dense(op, "G", G, dim=2, rows=entry.nrows, rows_name="nrows", like=val)
    out = _transposed_once(entry, crow, col, val, ncols, G)
    if out is not None:
        return out
    entry_t, crow_t, col_t, perm = entry.transpose(crow, col)
    return _product("spmm", entry_t, crow_t, col_t, entry.transposed_values(val, perm), G)


@torch.library.custom_op("sparserl::spmm_transposed", mutates_args=())
def spmm_transposed(crow: Tensor, col: Tensor, val: Tensor, ncols: int, G: Tensor) -> Tensor:
    """Aᵀ @ G for the CSR matrix A = (crow, col, val); G is (nrows, N), the result (ncols, N)."""
    return _spmm_transposed(crow, col, val, ncols, G)


@spmm_transposed.register_fake
def _spmm_transposed_fake(crow, col, val, ncols, G):
    op = "sparserl.spmm_transposed"
    check_csr_meta(op, crow, col, val, ncols)
    check_dense(op, "G", G, dim=2, rows=crow.shape[0] - 1, rows_name="nrows", like=val)
    return G.new_empty((ncols, G.shape[1]))


_spmm_transposed_backward = _spmm_transposed_backward_of()
spmm_transposed.register_autograd(_spmm_transposed_backward, setup_context=_spmm_setup)


# --------------------------------------------------------------------------- spmv


def _spmv(crow: Tensor, col: Tensor, val: Tensor, ncols: int, x: Tensor) -> Tensor:
    entry = _pattern("sparserl.spmv", crow, col, val, ncols)
    check_dense("sparserl.spmv", "x", x, dim=1, rows=ncols, rows_name="ncols", like=val)
    return _product("spmv", entry, crow, col, val, x)


@torch.library.custom_op("sparserl::spmv", mutates_args=())
def spmv(crow: Tensor, col: Tensor, val: Tensor, ncols: int, x: Tensor) -> Tensor:
    """A @ x for the CSR matrix A = (crow, col, val) and a vector x of length ``ncols``."""
    return _spmv(crow, col, val, ncols, x)


@spmv.register_fake
def _spmv_fake(crow, col, val, ncols, x):
    check_csr_meta("sparserl.spmv", crow, col, val, ncols)
    check_dense("sparserl.spmv", "x", x, dim=1, rows=ncols, rows_name="ncols", like=val)
    return x.new_empty((crow.shape[0] - 1,))


def _spmv_backward(ctx, grad):
    crow, col, val, x = ctx.saved_tensors
    impl = _backward_impls(val, grad, x)
    grad_val = impl["sddmm"](crow, col, grad.unsqueeze(1), x.unsqueeze(1)) if ctx.needs_input_grad[2] else None
    grad_x = impl["spmv_transposed"](crow, col, val, ctx.ncols, grad) if ctx.needs_input_grad[4] else None
    return None, None, grad_val, None, grad_x


spmv.register_autograd(_spmv_backward, setup_context=_spmm_setup)


# ------------------------------------------------------------------ spmv_transposed


def _spmv_transposed(crow: Tensor, col: Tensor, val: Tensor, ncols: int, g: Tensor) -> Tensor:
    op = "sparserl.spmv_transposed"
    entry = _pattern(op, crow, col, val, ncols)
    check_dense(op, "g", g, dim=1, rows=entry.nrows, rows_name="nrows", like=val)
    out = _transposed_once(entry, crow, col, val, ncols, g)
    if out is not None:
        return out
    entry_t, crow_t, col_t, perm = entry.transpose(crow, col)
    return _product("spmv", entry_t, crow_t, col_t, entry.transposed_values(val, perm), g)


@torch.library.custom_op("sparserl::spmv_transposed", mutates_args=())
def spmv_transposed(crow: Tensor, col: Tensor, val: Tensor, ncols: int, g: Tensor) -> Tensor:
    """Aᵀ @ g for the CSR matrix A = (crow, col, val) and a vector g of length nrows."""
    return _spmv_transposed(crow, col, val, ncols, g)


@spmv_transposed.register_fake
def _spmv_transposed_fake(crow, col, val, ncols, g):
    op = "sparserl.spmv_transposed"
    check_csr_meta(op, crow, col, val, ncols)
    check_dense(op, "g", g, dim=1, rows=crow.shape[0] - 1, rows_name="nrows", like=val)
    return g.new_empty((ncols,))


def _spmv_transposed_backward(ctx, grad):
    crow, col, val, g = ctx.saved_tensors
    impl = _backward_impls(val, grad, g)
    grad_val = impl["sddmm"](crow, col, g.unsqueeze(1), grad.unsqueeze(1)) if ctx.needs_input_grad[2] else None
    grad_g = impl["spmv"](crow, col, val, ctx.ncols, grad) if ctx.needs_input_grad[4] else None
    return None, None, grad_val, None, grad_g


spmv_transposed.register_autograd(_spmv_transposed_backward, setup_context=_spmm_setup)


# -------------------------------------------------------------------------- sddmm


def _check_sddmm(op: str, crow: Tensor, col: Tensor, Y: Tensor, X: Tensor) -> None:
    check_tensor(op, "Y", Y, dim=2, dtypes=VALUE_DTYPES)
    check_tensor(op, "X", X, dim=2, dtypes=VALUE_DTYPES)
    check_csr_meta(op, crow, col, None, X.shape[0])
    if crow.device != Y.device:
        raise ValueError(f"{op}: Y must be on the device of the sparse pattern, {crow.device} (got {Y.device})")
    check_dense(op, "Y", Y, dim=2, rows=crow.shape[0] - 1, rows_name="nrows", like=Y)
    check_dense(op, "X", X, dim=2, rows=X.shape[0], rows_name="ncols", like=Y)
    require(op, X.shape[1] == Y.shape[1],
            lambda: f"Y and X must have the same number of columns N (got Y {tuple(Y.shape)}, X {tuple(X.shape)})")


def _sddmm_fits(entry: patterns.Pattern | None, Y, X) -> bool:
    """Whether the operands of an SDDMM on a validated pattern pass every check of
    :func:`_check_sddmm`, read from attributes alone (the fast path of the backward)."""
    return (entry is not None and type(Y) is Tensor and type(X) is Tensor and Y.dim() == 2 and X.dim() == 2
            and Y.layout == torch.strided and X.layout == torch.strided and Y.dtype == X.dtype
            and Y.dtype in VALUE_DTYPES and Y.shape[0] == entry.nrows and X.shape[1] == Y.shape[1]
            and Y.device == entry.device and X.device == entry.device)


def _sddmm(crow: Tensor, col: Tensor, Y: Tensor, X: Tensor) -> Tensor:
    op = "sparserl.sddmm"
    entry = patterns.validated(crow, col, X.shape[0]) if isinstance(X, Tensor) and X.dim() == 2 else None
    if not _sddmm_fits(entry, Y, X):
        _check_sddmm(op, crow, col, Y, X)  # includes the metadata checks of the pattern
        entry = patterns.lookup(crow, col, X.shape[0])
        entry.validate(op, crow, col)
    crow, col = entry.indices(crow, col)
    if not (entry.transient or entry.overfull):
        out = runtime.active().call("sddmm", entry, crow, col, Y, X)  # Y rides in the kernels' val slot
        if out is not None:
            return out
    return vendor.sddmm(entry, crow, col, Y, X)


@torch.library.custom_op("sparserl::sddmm", mutates_args=())
def sddmm(crow: Tensor, col: Tensor, Y: Tensor, X: Tensor) -> Tensor:
    """Sampled dense-dense product at the nonzeros: out[k] = dot(Y[row(k)], X[col(k)]).

    Y is (nrows, N), X is (ncols, N); the result has one value per nonzero, (nnz,).
    """
    return _sddmm(crow, col, Y, X)


@sddmm.register_fake
def _sddmm_fake(crow, col, Y, X):
    _check_sddmm("sparserl.sddmm", crow, col, Y, X)
    return Y.new_empty((col.shape[0],))


def _sddmm_setup(ctx, inputs, output):
    crow, col, Y, X = inputs
    ctx.save_for_backward(crow, col, Y, X)


sddmm.register_autograd(_sddmm_backward_of(), setup_context=_sddmm_setup)


# -------------------------------------------------------------------------- heads
#
# A graph attention layer sums each head's messages with that head's attention as the
# matrix's values: ``heads`` products on one pattern. These operators run them as one product
# on the pattern's block-diagonal, node-major form (Pattern.with_heads, computed once), so a
# layer launches one kernel, specialized to that form, instead of one per head, and reads its
# features and writes its output as they lie.

def _check_heads_val(op: str, col: Tensor, val: Tensor) -> int:
    """``val`` of a heads product: ``(nnz, heads)``, a value dtype, on the pattern's device;
    returns ``heads``."""
    check_tensor(op, "val", val, dim=2, dtypes=VALUE_DTYPES)
    require(op, val.shape[0] == col.shape[0] and val.shape[1] >= 1,
            lambda: f"val must have shape (nnz, heads) = ({col.shape[0]}, heads >= 1) (got {tuple(val.shape)})")
    if val.device != col.device:
        raise ValueError(f"{op}: val must be on the device of the sparse pattern, {col.device} (got {val.device})")
    return val.shape[1]


def check_heads_index(op: str, crow: Tensor, col: Tensor, ncols: int, heads: int) -> None:
    """That the pattern's block-diagonal form for ``heads`` heads (:meth:`Pattern.with_heads`)
    can be numbered with its index dtype."""
    require(op, max(col.shape[0], ncols, crow.shape[0] - 1) * heads <= torch.iinfo(col.dtype).max,
            lambda: f"{heads} heads of a pattern of shape ({crow.shape[0] - 1}, {ncols}) with {col.shape[0]} nonzeros "
                    f"need indices beyond {col.dtype}; use int64 indices")


def _check_heads_dense(op: str, name: str, t: Tensor, rows: int, rows_name: str, heads: int, like: Tensor) -> None:
    check_dense(op, name, t, dim=3, rows=rows, rows_name=rows_name, like=like)
    require(op, t.shape[1] == heads, lambda: f"{name} must have {heads} heads, shape ({rows}, {heads}, C) "
            f"(got {tuple(t.shape)})")


def _heads_fit(entry: patterns.Pattern | None, heads: int, like: Tensor, *dense: tuple[Tensor, int]) -> bool:
    """Whether a heads operator's operands on a validated pattern pass every check its
    ``_check_heads_*`` calls make, read from attributes alone (the path of every call after
    the first): ``like`` (the values, or Y) and each ``(tensor, rows)`` of ``dense`` are
    strided tensors of one value dtype on the pattern's device, ``dense`` of shape
    ``(rows, heads, C)``, and the pattern's form for ``heads`` exists (its index check passed)."""
    if (entry is None or type(like) is not Tensor or like.layout != torch.strided or like.device != entry.device
            or like.dtype not in VALUE_DTYPES or heads not in entry._heads):
        return False
    for t, rows in dense:
        if not (type(t) is Tensor and t.dim() == 3 and t.layout == torch.strided and t.dtype == like.dtype
                and t.device == like.device and t.shape[0] == rows and t.shape[1] == heads):
            return False
    return True


def _heads_pattern(op: str, crow: Tensor, col: Tensor, val: Tensor, ncols: int, name: str, dense: Tensor,
                   rows: int, rows_name: str):
    """``(pattern, heads)`` of ``spmm_heads`` or ``spmm_heads_transposed`` after their checks
    (skipped where :func:`_heads_fit` vouches for the operands)."""
    entry = patterns.validated(crow, col, ncols)
    heads = val.shape[1] if type(val) is Tensor and val.dim() == 2 else -1
    if (heads >= 1 and entry is not None and val.shape[0] == entry.nnz
            and _heads_fit(entry, heads, val, (dense, rows))):
        return entry, heads
    entry = _pattern(op, crow, col, None, ncols)  # the pattern's checks, once per pattern
    heads = _check_heads_val(op, col, val)
    check_heads_index(op, crow, col, ncols, heads)
    _check_heads_dense(op, name, dense, rows, rows_name, heads, val)
    return entry, heads


def _form_product(crow_f: Tensor, col_f: Tensor, ncols_f: int, val_f: Tensor, X: Tensor,
                  form: patterns.Pattern | None = None) -> Tensor:
    """The heads operators' product on a block-diagonal form or its transpose (validated with
    their pattern; ``form``: its entry, else looked up when needed). The form's tensors are the
    same on every call, so where the C++ fast path is loaded a CUDA product goes through
    ``sparserl_fast::spmm``: served from its registry without Python once the Python
    implementation has served (and recorded) the same call."""
    if fastpath.loaded and X.is_cuda:
        return torch.ops.sparserl_fast.spmm.default(crow_f, col_f, val_f, ncols_f, X)
    form = form if form is not None else patterns.lookup(crow_f, col_f, ncols_f)
    return _product("spmm", form, crow_f, col_f, val_f, X)


def _spmm_heads(crow: Tensor, col: Tensor, val: Tensor, ncols: int, X: Tensor) -> Tensor:
    entry, heads = _heads_pattern("sparserl.spmm_heads", crow, col, val, ncols, "X", X, ncols, "ncols")
    crow_h, col_h, order, _ = entry.with_heads(crow, col, heads)
    out = _form_product(crow_h, col_h, ncols * heads, val.reshape(-1).index_select(0, order),
                        X.reshape(ncols * heads, X.shape[2]))
    return out.reshape(crow.shape[0] - 1, heads, X.shape[2])


@torch.library.custom_op("sparserl::spmm_heads", mutates_args=())
def spmm_heads(crow: Tensor, col: Tensor, val: Tensor, ncols: int, X: Tensor) -> Tensor:
    """One product per head on one pattern: ``out[:, h] = A_h @ X[:, h]``, A_h the CSR matrix
    ``(crow, col, val[:, h])``. val is (nnz, heads), X (ncols, heads, C), the result
    (nrows, heads, C): a graph attention layer's message sum."""
    return _spmm_heads(crow, col, val, ncols, X)


@spmm_heads.register_fake
def _spmm_heads_fake(crow, col, val, ncols, X):
    op = "sparserl.spmm_heads"
    check_csr_meta(op, crow, col, None, ncols)
    _check_heads_dense(op, "X", X, ncols, "ncols", _check_heads_val(op, col, val), val)
    return X.new_empty((crow.shape[0] - 1, val.shape[1], X.shape[2]))


spmm_heads.register_autograd(_spmm_backward_of("_heads"), setup_context=_spmm_setup)


def _spmm_heads_transposed(crow: Tensor, col: Tensor, val: Tensor, ncols: int, G: Tensor) -> Tensor:
    entry, heads = _heads_pattern("sparserl.spmm_heads_transposed", crow, col, val, ncols, "G", G,
                                  crow.shape[0] - 1, "nrows")
    form_t, crow_t, col_t, order_t = entry.with_heads_transposed(crow, col, heads)
    out = _form_product(crow_t, col_t, form_t.ncols, val.reshape(-1).index_select(0, order_t),
                        G.reshape(-1, G.shape[2]), form_t)
    return out.reshape(ncols, heads, G.shape[2])


@torch.library.custom_op("sparserl::spmm_heads_transposed", mutates_args=())
def spmm_heads_transposed(crow: Tensor, col: Tensor, val: Tensor, ncols: int, G: Tensor) -> Tensor:
    """``out[:, h] = A_hᵀ @ G[:, h]`` for each head h (see :func:`spmm_heads`): G is
    (nrows, heads, C), the result (ncols, heads, C)."""
    return _spmm_heads_transposed(crow, col, val, ncols, G)


@spmm_heads_transposed.register_fake
def _spmm_heads_transposed_fake(crow, col, val, ncols, G):
    op = "sparserl.spmm_heads_transposed"
    check_csr_meta(op, crow, col, None, ncols)
    _check_heads_dense(op, "G", G, crow.shape[0] - 1, "nrows", _check_heads_val(op, col, val), val)
    return G.new_empty((ncols, val.shape[1], G.shape[2]))


spmm_heads_transposed.register_autograd(_spmm_transposed_backward_of("_heads"), setup_context=_spmm_setup)


def _check_sddmm_heads(op: str, crow: Tensor, col: Tensor, Y: Tensor, X: Tensor) -> None:
    check_tensor(op, "Y", Y, dim=3, dtypes=VALUE_DTYPES)
    check_tensor(op, "X", X, dim=3, dtypes=VALUE_DTYPES)
    check_csr_meta(op, crow, col, None, X.shape[0])
    if crow.device != Y.device:
        raise ValueError(f"{op}: Y must be on the device of the sparse pattern, {crow.device} (got {Y.device})")
    _check_heads_dense(op, "Y", Y, crow.shape[0] - 1, "nrows", Y.shape[1], Y)
    _check_heads_dense(op, "X", X, X.shape[0], "ncols", Y.shape[1], Y)
    require(op, X.shape[2] == Y.shape[2],
            lambda: f"Y and X must have the same number of columns C (got Y {tuple(Y.shape)}, X {tuple(X.shape)})")


def _sddmm_heads(crow: Tensor, col: Tensor, Y: Tensor, X: Tensor) -> Tensor:
    op = "sparserl.sddmm_heads"
    entry = patterns.validated(crow, col, X.shape[0]) if type(X) is Tensor and X.dim() == 3 else None
    if not (entry is not None and type(Y) is Tensor and Y.dim() == 3 and X.shape[2] == Y.shape[2]
            and _heads_fit(entry, Y.shape[1], Y, (Y, entry.nrows), (X, entry.ncols))):
        _check_sddmm_heads(op, crow, col, Y, X)
        check_heads_index(op, crow, col, X.shape[0], Y.shape[1])
        entry = _pattern(op, crow, col, None, X.shape[0])
    heads = Y.shape[1]
    crow_h, col_h, _, position = entry.with_heads(crow, col, heads)
    out = _sddmm(crow_h, col_h, Y.reshape(-1, Y.shape[2]), X.reshape(-1, X.shape[2]))
    return out.index_select(0, position).reshape(col.shape[0], heads)


@torch.library.custom_op("sparserl::sddmm_heads", mutates_args=())
def sddmm_heads(crow: Tensor, col: Tensor, Y: Tensor, X: Tensor) -> Tensor:
    """SDDMM per head: ``out[k, h] = dot(Y[row(k), h], X[col(k), h])``. Y is (nrows, heads, C),
    X (ncols, heads, C), the result (nnz, heads): the gradient of :func:`spmm_heads`' values."""
    return _sddmm_heads(crow, col, Y, X)


@sddmm_heads.register_fake
def _sddmm_heads_fake(crow, col, Y, X):
    _check_sddmm_heads("sparserl.sddmm_heads", crow, col, Y, X)
    return Y.new_empty((col.shape[0], Y.shape[1]))


sddmm_heads.register_autograd(_sddmm_backward_of("_heads"), setup_context=_sddmm_setup)


# ------------------------------------------------------------------ spmm_epilogue


def _check_epilogue(op: str, crow: Tensor, X: Tensor, scale: Tensor | None, bias: Tensor | None) -> None:
    rows, n = crow.shape[0] - 1, X.shape[1]
    if scale is not None:
        check_tensor(op, "scale", scale, dtypes=VALUE_DTYPES)
        require(op, scale.dim() in (1, 2) and scale.numel() == rows and scale.shape[0] == rows,
                lambda: f"scale must have nrows = {rows} values, shape ({rows},) or ({rows}, 1) "
                        f"(got shape {tuple(scale.shape)})")
    if bias is not None:
        check_tensor(op, "bias", bias, dtypes=VALUE_DTYPES)
        require(op, bias.dim() in (1, 2) and bias.numel() == n and bias.shape[-1] == n,
                lambda: f"bias must have N = {n} values, shape ({n},) or (1, {n}) (got shape {tuple(bias.shape)})")
    for name, t in (("scale", scale), ("bias", bias)):
        if t is not None and (t.dtype != X.dtype or t.device != X.device):
            raise ValueError(f"{op}: {name} must be {X.dtype} on {X.device}, like X (got {t.dtype} on {t.device})")


def _spmm_epilogue(crow: Tensor, col: Tensor, val: Tensor, ncols: int, X: Tensor, scale: Tensor | None,
                   bias: Tensor | None, relu: bool) -> Tensor:
    op = "sparserl.spmm_epilogue"
    entry = _pattern(op, crow, col, val, ncols)
    check_dense(op, "X", X, dim=2, rows=ncols, rows_name="ncols", like=val)
    _check_epilogue(op, crow, X, scale, bias)
    scale = scale.reshape(-1) if scale is not None else None
    bias = bias.reshape(-1) if bias is not None else None
    steps = "+".join(step for step, on in zip(EPILOGUE_STEPS, (scale is not None, bias is not None, relu)) if on)
    if steps and X.device.type == "cuda" and not (entry.transient or entry.overfull):
        out = runtime.active().call_fused(entry, *entry.indices(crow, col), val, X, steps, bias, scale)
        if out is not None:
            return out
    Y = _product("spmm", entry, crow, col, val, X)
    if scale is not None and bias is not None:
        Y = torch.addcmul(bias, Y, scale.unsqueeze(1))  # one kernel for both
    elif scale is not None:
        Y = Y.mul_(scale.unsqueeze(1))
    elif bias is not None:
        Y = Y.add_(bias)
    return Y.relu_() if relu else Y


@torch.library.custom_op("sparserl::spmm_epilogue", mutates_args=())
def spmm_epilogue(crow: Tensor, col: Tensor, val: Tensor, ncols: int, X: Tensor, scale: Tensor | None,
                  bias: Tensor | None, relu: bool) -> Tensor:
    """``relu(scale[:, None] * (A @ X) + bias)``, each step optional: the product with what
    follows it in a GNN layer, in one kernel where the installed SpMM kernel can store its
    rows through the epilogue (else the product, then the steps).

    The backend's post-grad pass writes it into compiled graphs in place of ``spmm``
    followed by a row scaling, a bias add and a ReLU (``passes.fuse_epilogues``); it has no
    autograd of its own, since post-grad graphs are already differentiated (there it runs as
    ``sparserl_direct::spmm_epilogue``, see :data:`DIRECT_OPS`).
    """
    return _spmm_epilogue(crow, col, val, ncols, X, scale, bias, relu)


def _spmm_epilogue_backward(ctx, grad):
    raise RuntimeError("sparserl.spmm_epilogue: not differentiable (it is the fused form the post-grad pass "
                       "writes into already differentiated graphs); use A @ X and apply the epilogue with torch "
                       "operations")


spmm_epilogue.register_autograd(_spmm_epilogue_backward, setup_context=lambda ctx, inputs, output: None)


@spmm_epilogue.register_fake
def _spmm_epilogue_fake(crow, col, val, ncols, X, scale, bias, relu):
    op = "sparserl.spmm_epilogue"
    check_csr_meta(op, crow, col, val, ncols)
    check_dense(op, "X", X, dim=2, rows=ncols, rows_name="ncols", like=val)
    _check_epilogue(op, crow, X, scale, bias)
    return X.new_empty((crow.shape[0] - 1, X.shape[1]))


# ------------------------------------------------------------- the direct eager path

_DIRECT_DEVICES = ("cuda", "cpu")  # not meta: fake tensors go through the operator's fake implementation
_DIRECT = {"spmm": _spmm, "spmv": _spmv, "spmm_transposed": _spmm_transposed, "spmv_transposed": _spmv_transposed}
_HEADS = {"spmm_heads": _spmm_heads, "spmm_heads_transposed": _spmm_heads_transposed, "sddmm_heads": _sddmm_heads}
_IMPLS = {**_DIRECT, "sddmm": _sddmm, **_HEADS}
_OPERATORS = {"spmm": spmm, "spmv": spmv, "spmm_transposed": spmm_transposed, "spmv_transposed": spmv_transposed,
              "sddmm": sddmm, "spmm_heads": spmm_heads, "spmm_heads_transposed": spmm_heads_transposed,
              "sddmm_heads": sddmm_heads}
_BACKWARDS = {"spmm": _spmm_backward, "spmv": _spmv_backward, "spmm_transposed": _spmm_transposed_backward,
              "spmv_transposed": _spmv_transposed_backward}


def eager_ok(val: Tensor, X: Tensor) -> bool:
    """Whether no tracer, dispatch mode or functorch transform needs to see a product of
    these operands: eager code on plain CPU or CUDA tensors. Autograd may (see
    :func:`eager_product`)."""
    return (type(X) is Tensor and type(val) is Tensor and X.device.type in _DIRECT_DEVICES
            and not torch.compiler.is_compiling()
            and torch._C._len_torch_dispatch_stack() == 0
            and torch._C._functorch.peek_interpreter_stack() is None)


def direct_ok(val: Tensor, X: Tensor) -> bool:
    """Whether calling an operator's implementation directly is indistinguishable from
    calling the operator: :func:`eager_ok`, and nothing to differentiate.

    The operator's dispatch (custom_op, autograd wrapper) costs tens of microseconds of
    CPU per call, as much as a whole cuSPARSE product on a small graph; ``CSRMatrix``
    products take this path when they can (:func:`direct`).
    """
    return not (torch.is_grad_enabled() and (X.requires_grad or val.requires_grad)) and eager_ok(val, X)


def direct(op: str, crow: Tensor, col: Tensor, val: Tensor, ncols: int, X: Tensor) -> Tensor:
    """``torch.ops.sparserl.<op>(crow, col, val, ncols, X)`` without the dispatcher; only
    where :func:`direct_ok` holds. Same checks, same errors, same kernels."""
    return _DIRECT[op](crow, col, val, ncols, X)


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
    gradient; only where :func:`eager_ok` holds. Same checks, errors, kernels and gradients."""
    return _EagerProduct.apply(crow, col, val, ncols, X, op)


# ------------------------------------------------ operators for differentiated graphs

DIRECT_NAMESPACE = "sparserl_direct"
_direct_library = torch.library.Library(DIRECT_NAMESPACE, "DEF")
_FAKES = {"spmm": _spmm_fake, "spmv": _spmv_fake, "spmm_transposed": _spmm_transposed_fake,
          "spmv_transposed": _spmv_transposed_fake, "sddmm": _sddmm_fake, "spmm_epilogue": _spmm_epilogue_fake,
          "spmm_heads": _spmm_heads_fake, "spmm_heads_transposed": _spmm_heads_transposed_fake,
          "sddmm_heads": _sddmm_heads_fake}


def _define_twin(library: torch.library.Library, name: str, impl, *, autograd_fallthrough: bool = False) -> tuple:
    """``<library's namespace>::<name>``: the schema, implementation and fake of ``sparserl::<name>``
    with no autograd kernel (or, with ``autograd_fallthrough``, autograd passed through),
    registered straight with the dispatcher."""
    public = getattr(torch.ops.sparserl, name).default
    library.define(str(public._schema).split("::", 1)[1])
    library.impl(name, impl, "CompositeExplicitAutograd")
    if autograd_fallthrough:
        library.impl(name, torch.library.fallthrough_kernel, "Autograd")
    torch.library.register_fake(f"{library.ns}::{name}", _FAKES[name], lib=library)
    return public, getattr(getattr(torch.ops, library.ns), name).default


def _recording(op: str, impl):
    """``impl``, after which what served a CUDA call is recorded for the C++ fast path
    (:func:`torch_sparserl.jit.fastpath.record`), once its library is loaded."""
    def run(crow: Tensor, col: Tensor, val: Tensor, ncols: int, X: Tensor) -> Tensor:
        out = impl(crow, col, val, ncols, X)
        if fastpath.loaded and X.is_cuda:
            active = runtime.active_or_none()
            if active is not None:
                fastpath.record(active, op, crow, col, val, ncols, X)
        return out

    run.__name__ = impl.__name__
    return run


def _recording_sddmm(crow: Tensor, col: Tensor, Y: Tensor, X: Tensor) -> Tensor:
    """:func:`_sddmm`, after which a CUDA call an installed kernel served is recorded for the
    C++ fast path (cuSPARSE's SDDMM stays in Python)."""
    out = _sddmm(crow, col, Y, X)
    if fastpath.loaded and X.is_cuda:
        active = runtime.active_or_none()
        if active is not None:
            fastpath.record(active, "sddmm", crow, col, Y, X.shape[0], X)
    return out


_DISPATCHED = {**{op: _recording(op, impl) for op, impl in _DIRECT.items()}, "sddmm": _recording_sddmm,
               "spmm_epilogue": _spmm_epilogue, **_HEADS}



def _door_first(op: str, recorded):
    """``recorded`` (the implementation that records a CUDA call for C++), after asking the C++
    fast path's eager door (:data:`torch_sparserl.jit.fastpath.serve`). For the products that
    eager autograd runs: :class:`_EagerProduct`'s forward and the backward's products, where
    grad mode is off, so the door may serve once the call was recorded."""
    index = fastpath.OPS.index(op)

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
    """The values' gradient in an eager backward: the C++ door's installed kernel, once the
    Python implementation has served (and recorded) the same call."""
    serve = fastpath.serve
    if serve is not None and type(X) is Tensor and X.dim() == 2:
        out = serve(fastpath.SDDMM, crow, col, Y, X.shape[0], X)
        if out is not None:
            return out
    return _recording_sddmm(crow, col, Y, X)


_EAGER = {op: _door_first(op, _DISPATCHED[op]) for op in _DIRECT}
_IMPLS.update(_EAGER)  # the backward's products go through the door too
_IMPLS["sddmm"] = _sddmm_door_first

DIRECT_OPS: dict = dict(_define_twin(_direct_library, name, impl) for name, impl in _DISPATCHED.items())
"""``torch.ops.sparserl.<op>.default`` -> ``torch.ops.sparserl_direct.<op>.default``.

A graph Inductor compiles has been differentiated by AOTAutograd already: its products need
no autograd, yet custom_op's layers around each call (the autograd wrapper, the redispatch,
the aliasing check) cost several times the dispatcher's own work. The backend's post-grad
pass (:func:`torch_sparserl.compiler.passes.to_direct_ops`) retargets the graph's calls to these
implementation-only twins: same schema, same checks, errors and kernels, same fake."""

FAST_NAMESPACE = "sparserl_fast"
_fast_library = torch.library.Library(FAST_NAMESPACE, "DEF")


# the C++ fast path registers its CUDA kernels for these once loaded
FAST_OPS: dict = dict(_define_twin(_fast_library, name, _DISPATCHED[name], autograd_fallthrough=True)
                      for name in fastpath.OPS)
"""``torch.ops.sparserl.<op>.default`` -> ``torch.ops.sparserl_fast.<op>.default`` for the four
products: what compiled graphs call when the backend's ``fast_path`` is on. Their CUDA calls
are served in C++ (:mod:`torch_sparserl.jit.fastpath`) once its library is loaded and the Python
implementation has served the same call; until then, and on other devices, they are the
``sparserl_direct`` twins."""


def registered_ops() -> list[str]:
    """Names of every operator registered in the ``sparserl`` namespace (discovered, not listed)."""
    prefix = NAMESPACE + "::"
    return sorted(name[len(prefix):] for name in torch._C._dispatch_get_all_op_names()
                  if name.startswith(prefix))
