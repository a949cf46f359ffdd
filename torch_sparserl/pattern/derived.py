"""The forms derived from a pattern: its transpose, its block-diagonal heads form, and the
pattern with or without its diagonal.

Torch operations on the pattern's validated indices, no Python loop over rows or nonzeros. Each
function takes the pattern's :class:`~torch_sparserl.pattern.cache.Pattern` (its sizes, index
dtype and cached row indices) and returns the form's tensors. The pattern computes each form
once and keeps it, and :mod:`.cache` registers the form's indices as a pattern of their own.
"""

from __future__ import annotations

import torch


def row_indices(crow: torch.Tensor, nnz: int) -> torch.Tensor:
    """The row of each of the ``nnz`` nonzeros of the row pointers ``crow``, int64. Uncached
    and traceable (a compiled graph computes it); :meth:`Pattern.row_indices` caches it."""
    lengths = (crow[1:] - crow[:-1]).to(torch.int64)
    rows = torch.arange(crow.shape[0] - 1, device=crow.device)
    return torch.repeat_interleave(rows, lengths, output_size=nnz)


def transposed(pattern, crow: torch.Tensor, col: torch.Tensor):
    """``(crow_t, col_t, perm)``: the transpose's indices, and where each of its nonzeros sits
    in ``col`` (``val_t = val[perm]``)."""
    rows = pattern.row_indices(crow)
    perm = torch.argsort(col, stable=True)
    col_t = rows.index_select(0, perm).to(pattern.index_dtype)
    # row c of the transpose starts where the sorted columns reach c: no host synchronization
    # (bincount sizes its output from the largest column, which a GPU tensor must send to the host)
    boundaries = torch.arange(pattern.ncols + 1, device=col.device, dtype=col.dtype)
    crow_t = torch.searchsorted(col.index_select(0, perm), boundaries).to(pattern.index_dtype)
    return crow_t, col_t, perm


def with_heads(pattern, crow: torch.Tensor, col: torch.Tensor, heads: int):
    """``(crow_h, col_h, order, position)``: the block-diagonal form of ``heads`` products
    (:meth:`~torch_sparserl.pattern.cache.Pattern.with_heads` says what each is)."""
    device, nnz = col.device, pattern.nnz
    starts = crow.to(torch.int64)
    rows = pattern.row_indices(crow)
    lengths = starts[1:] - starts[:-1]
    head = torch.arange(heads, device=device)
    first = starts[:-1].unsqueeze(1) * heads + head * lengths.unsqueeze(1)  # (nrows, heads): where row (i, h) starts
    crow_h = torch.full((pattern.nrows * heads + 1,), nnz * heads, dtype=torch.int64, device=device)
    crow_h[:-1] = first.reshape(-1)
    within = torch.arange(nnz, device=device) - starts.index_select(0, rows)
    position = (first.index_select(0, rows) + within.unsqueeze(1)).reshape(-1)  # of entry (k, h), flat k * heads + h
    order = torch.empty_like(position)
    order[position] = torch.arange(nnz * heads, device=device)
    col_h = torch.empty(nnz * heads, dtype=pattern.index_dtype, device=device)
    col_h[position] = (col.to(torch.int64).unsqueeze(1) * heads + head).reshape(-1).to(pattern.index_dtype)
    crow_h = crow_h.to(pattern.index_dtype)
    # gather indices in the pattern's index dtype: half the memory for int32 patterns, whose
    # form's positions fit int32 by the operators' check
    return crow_h, col_h, order.to(pattern.index_dtype), position.to(pattern.index_dtype)


def without_diagonal(pattern, crow: torch.Tensor, col: torch.Tensor):
    """``(crow_n, col_n, keep)``: the pattern without its diagonal entries, and the positions
    of the entries kept."""
    rows = pattern.row_indices(crow)
    keep = (rows != col.to(torch.int64)).nonzero().squeeze(1)
    counts = torch.bincount(rows.index_select(0, keep), minlength=pattern.nrows)
    crow_n = torch.zeros(pattern.nrows + 1, dtype=pattern.index_dtype, device=col.device)
    crow_n[1:] = counts.cumsum(0)
    col_n = col.index_select(0, keep)
    return crow_n, col_n, keep


def with_diagonal(pattern, crow: torch.Tensor, col: torch.Tensor):
    """``(crow_d, col_d, src_pos, diag_pos)``: the pattern with every diagonal position present,
    where its own nonzeros and the diagonal's sit in it."""
    n = min(pattern.nrows, pattern.ncols)
    device = col.device
    rows = pattern.row_indices(crow)
    cols = col.to(torch.int64)
    on_diagonal = (rows == cols).nonzero().squeeze(1)
    # first existing entry of each diagonal position, or -1
    first = torch.full((n,), pattern.nnz, dtype=torch.int64, device=device)
    first.scatter_reduce_(0, rows[on_diagonal], on_diagonal, reduce="amin")
    missing = (first == pattern.nnz).nonzero().squeeze(1)
    all_rows = torch.cat([rows, missing])
    all_cols = torch.cat([cols, missing])
    order = torch.argsort(all_rows * max(pattern.ncols, 1) + all_cols, stable=True)
    position = torch.empty_like(order)
    position[order] = torch.arange(order.shape[0], device=device)
    src_pos = position[:pattern.nnz]
    diag_pos = torch.where(first < pattern.nnz, src_pos[first.clamp(max=max(pattern.nnz - 1, 0))]
                           if pattern.nnz else first, torch.zeros_like(first))
    diag_pos[missing] = position[pattern.nnz:]
    counts = torch.bincount(all_rows, minlength=pattern.nrows)
    crow_d = torch.zeros(pattern.nrows + 1, dtype=pattern.index_dtype, device=device)
    crow_d[1:] = counts.cumsum(0)
    col_d = all_cols.index_select(0, order).to(pattern.index_dtype)
    return crow_d, col_d, src_pos, diag_pos


