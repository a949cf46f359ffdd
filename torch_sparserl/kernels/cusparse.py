"""cuSPARSE through ``torch.sparse``: the CUDA baseline and the fallback.

Calls go through the ``out=`` overloads of ``aten::addmm`` / ``aten::addmv`` on purpose:
while :mod:`torch_sparserl.intercept` overrides the functional overloads for CSR tensors,
these still reach cuSPARSE directly, so the fallback never re-enters the override.
"""

from __future__ import annotations

import torch

from ..dtypes import HALF_DTYPES
from ..pattern import Pattern


def _as_torch_csr(pattern: Pattern, crow, col, val) -> torch.Tensor:
    return torch.sparse_csr_tensor(crow, col, val, (pattern.nrows, pattern.ncols),
                                   check_invariants=False)


def spmm(pattern: Pattern, crow: torch.Tensor, col: torch.Tensor, val: torch.Tensor,
         X: torch.Tensor) -> torch.Tensor:
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
    if val.dtype in HALF_DTYPES:
        # torch's CSR addmv has no half kernels on CUDA; SpMM with one column does.
        return spmm(pattern, crow, col, val, x.unsqueeze(1)).squeeze(1)
    if pattern.nnz == 0 or pattern.nrows == 0 or pattern.ncols == 0:
        return torch.zeros(pattern.nrows, dtype=val.dtype, device=val.device)
    out = torch.empty(pattern.nrows, dtype=val.dtype, device=val.device)
    torch.addmv(out, _as_torch_csr(pattern, crow, col, val), x.contiguous(),
                beta=0, alpha=1, out=out)
    return out
