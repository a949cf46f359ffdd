"""cuSPARSE through ``torch.sparse``: the CUDA baseline and the fallback.

Calls go through the ``out=`` overloads of ``aten::addmm`` / ``aten::addmv`` on purpose:
while :mod:`torch_sparserl.intercept` overrides the functional overloads for CSR tensors,
these still reach cuSPARSE directly, so the fallback never re-enters the override.
"""

from __future__ import annotations

import warnings

import torch

from ..dtypes import HALF_DTYPES
from ..pattern import Pattern


def _as_torch_csr(pattern: Pattern, crow, col, val) -> torch.Tensor:
    # The pattern was validated once (pattern.py): opt out of torch's per-call invariant
    # check explicitly, which also keeps torch from warning that it was skipped.
    with torch.sparse.check_sparse_tensor_invariants(enable=False), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "sparse CSR support is in beta state"
        return torch.sparse_csr_tensor(crow, col, val, (pattern.nrows, pattern.ncols))


def spmm(pattern: Pattern, crow: torch.Tensor, col: torch.Tensor, val: torch.Tensor,
         X: torch.Tensor) -> torch.Tensor:
    if val.dtype in HALF_DTYPES:
        # Measured on an H100 (torch 2.11): cuSPARSE through torch sums a row of 4096
        # float16 ones to 4768, so half inputs are widened and summed in float32.
        return spmm(pattern, crow, col, val.float(), X.float()).to(val.dtype)
    n = X.shape[1]
    if pattern.nnz == 0 or n == 0 or pattern.nrows == 0 or pattern.ncols == 0:
        return torch.zeros(pattern.nrows, n, dtype=val.dtype, device=val.device)
    out = torch.empty(pattern.nrows, n, dtype=val.dtype, device=val.device)  # (nrows, N)
    # beta=0: cuSPARSE does not read `out`, so its uninitialized contents cannot leak in.
    torch.addmm(out, _as_torch_csr(pattern, crow, col, val), X.contiguous(),
                beta=0, alpha=1, out=out)
    return out


def spmv(pattern: Pattern, crow: torch.Tensor, col: torch.Tensor, val: torch.Tensor,
         x: torch.Tensor) -> torch.Tensor:
    if val.dtype in HALF_DTYPES:  # summed in float32, as in spmm
        return spmv(pattern, crow, col, val.float(), x.float()).to(val.dtype)
    if pattern.nnz == 0 or pattern.nrows == 0 or pattern.ncols == 0:
        return torch.zeros(pattern.nrows, dtype=val.dtype, device=val.device)
    out = torch.empty(pattern.nrows, dtype=val.dtype, device=val.device)
    torch.addmv(out, _as_torch_csr(pattern, crow, col, val), x.contiguous(),
                beta=0, alpha=1, out=out)
    return out
