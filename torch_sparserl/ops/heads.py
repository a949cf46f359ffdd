"""The heads operators: ``sparserl::spmm_heads``, ``spmm_heads_transposed`` and ``sddmm_heads``.

A graph attention layer sums each head's messages with that head's attention as the
matrix's values: ``heads`` products on one pattern. These operators run them as one product
on the pattern's block-diagonal, node-major form (Pattern.with_heads, computed once), so a
layer launches one kernel, specialized to that form, instead of one per head, and reads its
features and writes its output as they lie.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import pattern as patterns
from ..dtypes import VALUE_DTYPES
from ..jit import fastpath
from ..pattern.validation import check_csr_meta, check_dense, check_tensor, require
from .backward import _IMPLS, _OPERATORS, _product_backward_of, _sddmm_backward_of, _sddmm_setup, _spmm_setup
from .common import _pattern, _product
from .sampled import _sddmm


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


spmm_heads.register_autograd(_product_backward_of("spmm_heads"), setup_context=_spmm_setup)


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


spmm_heads_transposed.register_autograd(_product_backward_of("spmm_heads_transposed"), setup_context=_spmm_setup)


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

_HEADS = {"spmm_heads": _spmm_heads, "spmm_heads_transposed": _spmm_heads_transposed, "sddmm_heads": _sddmm_heads}
"""The heads operators' implementations (their backwards call these where nothing needs to see the operators)."""
_IMPLS.update(_HEADS)
_OPERATORS.update({"spmm_heads": spmm_heads, "spmm_heads_transposed": spmm_heads_transposed,
                   "sddmm_heads": sddmm_heads})
