"""``sparserl::sddmm``, the sampled dense-dense product: ``out[k] = dot(Y[row(k)], X[col(k)])``
at the nonzeros of A; the gradient of a product's values."""

from __future__ import annotations

import torch
from torch import Tensor

from .. import pattern as patterns
from ..dtypes import VALUE_DTYPES
from ..jit import runtime
from ..kernels import vendor
from ..pattern.validation import check_csr_meta, check_dense, check_tensor, require
from .backward import _IMPLS, _OPERATORS, _sddmm_backward_of, _sddmm_setup


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
    check = entry.check  # a device check whose verdict has not come: the product is poisoned should it fail
    out = None
    if not (entry.transient or entry.overfull):
        out = runtime.active().call("sddmm", entry, crow, col, Y, X)  # Y rides in the kernels' val slot
    if out is None:
        out = vendor.sddmm(entry, crow, col, Y, X)
    return out if check is None else check.poison(out)


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


sddmm.register_autograd(_sddmm_backward_of(), setup_context=_sddmm_setup)
_IMPLS["sddmm"] = _sddmm
_OPERATORS["sddmm"] = sddmm
