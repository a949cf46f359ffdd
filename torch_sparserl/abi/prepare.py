"""The once-per-pattern preprocessing a plan names, done on the pattern's device with torch ops.

``prepare(plan, rowptr, col, shape, n)`` returns the ``aux`` array (layouts in
``csrc/README.md`` section 3), ``parts``, and the launch geometry with the plan's expressions
evaluated. No Python loop runs over rows or nonzeros; the only host syncs are the few
scalars the geometry needs. A plan that cannot be prepared for this pattern (the grid is
negative, shared memory is over the limit, ``n`` disagrees) raises :class:`PlanError`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .plan import MAX_SMEM_BYTES, Plan, PlanError

_INT32_MAX = 2**31 - 1
_MAX_GRID = 2**31 - 1


@dataclass(frozen=True)
class Prepared:
    """What a launch needs besides the operands: plan data and evaluated geometry."""

    plan: Plan
    aux: torch.Tensor | None  # int32 plan data on the pattern's device, or None
    parts: int
    grid: int
    block: int
    smem: int
    init_zero: bool
    work_numel: int
    rows: int
    cols: int
    nnz: int
    n: int
    hubs: int = 0  # rows stored in more than one piece (split=rowchunks, nnz)
    work_once: bool = False  # work_init=once: zero before the first launch, left zero by every launch

    @property
    def env(self) -> dict[str, int]:
        return {"rows": self.rows, "cols": self.cols, "nnz": self.nnz, "n": self.n, "parts": self.parts,
                "hubs": self.hubs}


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _row_lengths(rowptr: torch.Tensor) -> torch.Tensor:
    rowptr = rowptr.long()
    return rowptr[1:] - rowptr[:-1]  # (rows,)


def _sorted_desc(lengths: torch.Tensor) -> torch.Tensor:
    return torch.argsort(lengths, descending=True, stable=True)


def _binned(lengths: torch.Tensor, edges: tuple[int, ...]) -> tuple[torch.Tensor, int]:
    boundaries = torch.tensor(edges, dtype=lengths.dtype, device=lengths.device)
    bins = torch.bucketize(lengths, boundaries, right=True)  # bin b: e_b <= len < e_{b+1}
    perm = torch.argsort(bins, stable=True)
    counts = torch.bincount(bins, minlength=len(edges) + 1)
    bin_start = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
    return torch.cat([bin_start, perm]), len(edges) + 1


def _sell(rowptr: torch.Tensor, col: torch.Tensor, lengths: torch.Tensor, chunk: int,
          sigma: int) -> tuple[torch.Tensor, int]:
    rows = lengths.numel()
    device = lengths.device
    slices = _ceil_div(rows, chunk)
    if rows == 0:
        return torch.zeros(1, dtype=torch.int64, device=device), 0
    # Sort by descending length inside windows of sigma rows: rows stay near their
    # neighbours (locality of X and y) while a slice's rows have similar lengths.
    window = torch.arange(rows, device=device) // sigma
    longest = int(lengths.max()) + 1
    perm = torch.argsort(window * longest + (longest - 1 - lengths), stable=True)
    padded_lengths = torch.zeros(slices * chunk, dtype=torch.int64, device=device)
    padded_lengths[:rows] = lengths[perm]
    slice_len = padded_lengths.view(slices, chunk).amax(1)  # (slices,)
    slice_ptr = torch.cat([slice_len.new_zeros(1), (slice_len * chunk).cumsum(0)])
    total = int(slice_ptr[-1])
    pos = torch.arange(total, device=device)
    slice_of = torch.searchsorted(slice_ptr, pos, right=True) - 1
    offset = pos - slice_ptr[slice_of]
    k, lane = offset // chunk, offset % chunk
    slot = slice_of * chunk + lane  # index into perm, may point past the last row
    real = slot < rows
    row = perm[slot.clamp(max=rows - 1)]
    valid = real & (k < lengths[row])
    nz = torch.where(valid, rowptr.long()[row] + k, torch.full_like(k, -1))
    sell_col = torch.where(valid, col.long()[nz.clamp(min=0)], torch.zeros_like(k))
    return torch.cat([slice_ptr, perm, sell_col, nz]), slices


def _nnz_split(rowptr: torch.Tensor, nnz: int, chunk: int, hub_slots: bool) -> tuple[torch.Tensor, int, int]:
    parts = _ceil_div(nnz, chunk)
    rows = rowptr.numel() - 1
    starts = torch.arange(parts, device=rowptr.device, dtype=torch.int64) * chunk
    part_row = torch.searchsorted(rowptr.long(), starts, right=True) - 1
    tail = torch.full((1,), rows, dtype=torch.int64, device=rowptr.device)
    # hubs: the non-empty rows whose nonzeros meet more than one chunk, numbered in row order
    # (a half-precision kernel sums their pieces in a float32 workspace slot); -1 for the others
    begin, end = rowptr[:-1].long(), rowptr[1:].long()
    hub = (end > begin) & (torch.div(end - 1, chunk, rounding_mode="floor") != torch.div(begin, chunk, rounding_mode="floor"))
    hubs = int(hub.sum())
    if not hub_slots:
        return torch.cat([part_row, tail]), parts, hubs
    row_hub = torch.where(hub, hub.long().cumsum(0) - 1, torch.full_like(begin, -1))
    return torch.cat([part_row, tail, row_hub]), parts, hubs


def _merge_split(rowptr: torch.Tensor, nnz: int, chunk: int) -> tuple[torch.Tensor, int]:
    rows = rowptr.numel() - 1
    total = rows + nnz
    parts = _ceil_div(total, chunk)
    device = rowptr.device
    diagonals = (torch.arange(parts + 1, device=device, dtype=torch.int64) * chunk).clamp(max=total)
    row_end_position = rowptr.long()[1:] + torch.arange(rows, device=device)  # merged position of row end r
    part_row = torch.searchsorted(row_end_position, diagonals, right=False)  # #{r : position < d}
    return torch.cat([part_row, diagonals - part_row]), parts


def _rowchunks(rowptr: torch.Tensor, lengths: torch.Tensor, chunk: int) -> tuple[torch.Tensor, int, int]:
    device = rowptr.device
    # segments of each row; an empty row is one empty segment, so every row of y is written
    per_row = ((lengths + chunk - 1) // chunk).clamp(min=1)
    parts = int(per_row.sum())
    seg_row = torch.repeat_interleave(torch.arange(lengths.numel(), device=device), per_row)
    first_seg = per_row.cumsum(0) - per_row
    seg_index = torch.arange(parts, device=device) - first_seg[seg_row]
    seg_start = rowptr.long()[seg_row] + seg_index * chunk
    # hubs: the rows of more than one segment, numbered in row order (the shipped kernels sum
    # their pieces in a float32 workspace slot); -1 for the segments of whole rows
    hub = per_row > 1
    hub_slot = torch.where(hub, hub.long().cumsum(0) - 1, torch.full_like(per_row, -1))
    return torch.cat([seg_row, seg_start, hub_slot[seg_row]]), parts, int(hub.sum())


TILE_K = 8  # condensed columns per block of split=tiles(W): the K of a TF32 tensor-core tile


def _tiles(rowptr: torch.Tensor, col: torch.Tensor, cols: int, window: int) -> tuple[torch.Tensor, int]:
    """``split=tiles(W)``: rows in windows of W; a window's distinct columns, in increasing order,
    condensed into blocks of TILE_K; the nonzeros reordered by block, each with its slot
    ``rank * 32 + row``: the rank of its column among the window's and its row in the window."""
    device = rowptr.device
    rows = rowptr.numel() - 1
    windows = _ceil_div(rows, window)
    lengths = _row_lengths(rowptr)
    row_of = torch.repeat_interleave(torch.arange(rows, device=device), lengths)
    win_of = row_of // window
    stride = max(cols, 1)  # (window, column) pairs as one sortable key
    pairs, pair_of = torch.unique(win_of * stride + col.long(), sorted=True, return_inverse=True)
    pair_win = pairs // stride
    distinct = torch.bincount(pair_win, minlength=windows)
    per_win = (distinct + TILE_K - 1) // TILE_K
    win_blk = torch.cat([per_win.new_zeros(1), per_win.cumsum(0)])
    blocks = int(win_blk[-1]) if windows else 0
    first_pair = distinct.cumsum(0) - distinct
    pos = torch.arange(pairs.numel(), device=device) - first_pair[pair_win]  # rank among its window's columns
    pair_blk = win_blk[pair_win] + pos // TILE_K
    blk_col = torch.full((blocks * TILE_K,), -1, dtype=torch.int64, device=device)
    blk_col[pair_blk * TILE_K + pos % TILE_K] = pairs % stride
    nz_blk = pair_blk[pair_of]
    nz_slot = pos[pair_of] * 32 + (row_of - win_of * window)
    order = torch.argsort(nz_blk, stable=True)
    blk_nz = torch.cat([nz_blk.new_zeros(1), torch.bincount(nz_blk, minlength=blocks).cumsum(0)])
    return torch.cat([win_blk, blk_col, blk_nz, order, nz_slot[order]]), windows


def prepare(plan: Plan, rowptr: torch.Tensor, col: torch.Tensor, shape: tuple[int, int], n: int) -> Prepared:
    """Build the plan's data for the pattern ``(rowptr, col, shape)`` and evaluate its geometry."""
    rows, cols = int(shape[0]), int(shape[1])
    if rowptr.dim() != 1 or rowptr.numel() != rows + 1:
        raise PlanError(f"prepare: rowptr must have rows + 1 = {rows + 1} entries (got shape {tuple(rowptr.shape)})")
    nnz = int(col.numel())
    if max(rows, cols, nnz, n) > _INT32_MAX:
        raise PlanError(f"prepare: the kernel ABI takes int32 sizes (got rows={rows}, cols={cols}, nnz={nnz}, n={n})")
    if plan.op == "spmv" and n != 1:
        raise PlanError(f"prepare: op=spmv takes n=1 (got n={n})")
    if plan.n is not None and plan.n != n:
        raise PlanError(f"prepare: the plan was written for n={plan.n} (got a call with n={n})")

    lengths = _row_lengths(rowptr)
    aux, parts, hubs = None, 0, 0
    if plan.rows == "sorted_desc":
        aux = _sorted_desc(lengths)
    elif plan.rows == "binned":
        aux, parts = _binned(lengths, plan.rows_args)
    elif plan.rows == "sell":
        aux, parts = _sell(rowptr, col, lengths, *plan.rows_args)
    elif plan.split == "nnz":
        aux, parts, hubs = _nnz_split(rowptr, nnz, plan.split_arg, hub_slots="hubs" in plan.work.text)
    elif plan.split == "merge":
        aux, parts = _merge_split(rowptr, nnz, plan.split_arg)
    elif plan.split == "rowchunks":
        aux, parts, hubs = _rowchunks(rowptr, lengths, plan.split_arg)
    elif plan.split == "tiles":
        aux, parts = _tiles(rowptr, col, cols, plan.split_arg)
    if aux is not None:
        if aux.numel() and int(aux.max()) > _INT32_MAX:
            raise PlanError("prepare: the plan's data does not fit int32")
        aux = aux.to(torch.int32).contiguous()

    env = {"rows": rows, "cols": cols, "nnz": nnz, "n": n, "parts": parts, "hubs": hubs}
    grid = plan.grid.evaluate(env)
    smem = plan.smem.evaluate(env)
    work = plan.work.evaluate(env)
    if not 0 <= grid <= _MAX_GRID:
        raise PlanError(f"prepare: grid={plan.grid} evaluates to {grid} for {env} (expected 0..{_MAX_GRID})")
    if not 0 <= smem <= MAX_SMEM_BYTES:
        raise PlanError(f"prepare: smem={plan.smem} evaluates to {smem} bytes (expected 0..{MAX_SMEM_BYTES})")
    if not 0 <= work <= 1 << 31:
        raise PlanError(f"prepare: work={plan.work} evaluates to {work} elements (expected 0..2^31)")
    return Prepared(plan=plan, aux=aux, parts=parts, grid=grid, block=plan.block, smem=smem,
                    init_zero=plan.init == "zero", work_numel=work,
                    rows=rows, cols=cols, nnz=nnz, n=n, hubs=hubs, work_once=work > 0 and plan.work_init == "once")
