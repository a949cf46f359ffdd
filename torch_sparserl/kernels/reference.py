"""Vectorized sparse products from torch operations; no Python loop over rows.

Products are formed over chunks of nonzeros, so that the gathered rows of the dense
operand never take more than ``_CHUNK_ELEMENTS`` elements at once, and summed with
``index_add_``. Half types are accumulated in float32.
"""

from __future__ import annotations

import torch

from ..dtypes import accumulate_dtype
from ..pattern import Pattern

_CHUNK_ELEMENTS = 1 << 22


def _chunks(nnz: int, width: int):
    step = max(1, _CHUNK_ELEMENTS // max(width, 1))
    for start in range(0, nnz, step):
        yield start, min(nnz, start + step)


def spmm(pattern: Pattern, crow: torch.Tensor, col: torch.Tensor, val: torch.Tensor,
         X: torch.Tensor) -> torch.Tensor:
    """A @ X for A = (crow, col, val) of shape (nrows, ncols); X is (ncols, N)."""
    acc = accumulate_dtype(val.dtype)
    n = X.shape[1]
    out = torch.zeros(pattern.nrows, n, dtype=acc, device=X.device)  # (nrows, N)
    if pattern.nnz and n:
        rows = pattern.row_indices(crow)
        col64 = col.to(torch.int64)
        for start, stop in _chunks(pattern.nnz, n):
            gathered = X.index_select(0, col64[start:stop]).to(acc)  # (chunk, N)
            gathered.mul_(val[start:stop].to(acc).unsqueeze(1))
            out.index_add_(0, rows[start:stop], gathered)
    return out.to(val.dtype)


def spmv(pattern: Pattern, crow: torch.Tensor, col: torch.Tensor, val: torch.Tensor,
         x: torch.Tensor) -> torch.Tensor:
    """A @ x for a vector x of length ncols."""
    return spmm(pattern, crow, col, val, x.unsqueeze(1)).squeeze(1)


def sddmm(pattern: Pattern, crow: torch.Tensor, col: torch.Tensor, Y: torch.Tensor,
          X: torch.Tensor) -> torch.Tensor:
    """out[k] = dot(Y[row(k)], X[col(k)]) for every nonzero k; Y is (nrows, N), X (ncols, N)."""
    acc = accumulate_dtype(Y.dtype)
    n = Y.shape[1]
    out = torch.zeros(pattern.nnz, dtype=acc, device=Y.device)  # (nnz,)
    if pattern.nnz and n:
        rows = pattern.row_indices(crow)
        col64 = col.to(torch.int64)
        for start, stop in _chunks(pattern.nnz, n):
            left = Y.index_select(0, rows[start:stop]).to(acc)  # (chunk, N)
            right = X.index_select(0, col64[start:stop]).to(acc)
            out[start:stop] = (left * right).sum(1)
    return out.to(Y.dtype)
