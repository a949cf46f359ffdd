"""Structural features of a sparsity pattern: for the families' parameter grids, the policy
and the logs. Computed on the host from ``rowptr`` (and ``col`` for locality) with numpy."""

from __future__ import annotations

import numpy as np

from ..data.arrays import sorted_unique


def structural_features(rowptr, col, shape) -> dict[str, float]:
    """Row-length statistics and histogram, bandwidth and column locality of a CSR pattern."""
    rowptr = np.asarray(rowptr, dtype=np.int64)
    col = np.asarray(col, dtype=np.int64)
    rows, cols = int(shape[0]), int(shape[1])
    lengths = np.diff(rowptr)
    nnz = int(rowptr[-1]) if rows else 0
    mean = float(lengths.mean()) if rows else 0.0
    std = float(lengths.std()) if rows else 0.0
    features: dict[str, float] = {
        "rows": rows, "cols": cols, "nnz": nnz,
        "row_mean": mean, "row_max": int(lengths.max()) if rows else 0,
        "row_min": int(lengths.min()) if rows else 0,
        "row_cv": std / mean if mean else 0.0,
        "empty_rows": float((lengths == 0).mean()) if rows else 0.0,
        "density": nnz / (rows * cols) if rows and cols else 0.0,
    }
    # Share of the nonzeros in the longest 1% of rows: how much a few hub rows dominate.
    if rows:
        top = np.sort(lengths)[::-1][: max(1, rows // 100)]
        features["top1pct_share"] = float(top.sum() / nnz) if nnz else 0.0
        for q in (50, 90, 99):
            features[f"row_p{q}"] = float(np.percentile(lengths, q))
    if nnz:
        row_of = np.repeat(np.arange(rows, dtype=np.int64), lengths)
        distance = np.abs(col - row_of * (cols / max(rows, 1)))
        features["bandwidth_p99"] = float(np.percentile(distance, 99))
        # Locality of X reads: mean jump between consecutive column indices inside rows.
        jumps = np.abs(np.diff(col))
        same_row = np.diff(row_of) == 0
        features["col_jump_mean"] = float(jumps[same_row].mean()) if same_row.any() else 0.0
        features["diag_fraction"] = float((col == row_of).mean())
    return features


def window_reuse(rowptr: np.ndarray, col: np.ndarray, window: int = 16, samples: int = 4096,
                 most_nonzeros: int = 1 << 18) -> float:
    """Nonzeros per distinct column in windows of ``window`` consecutive rows: how many times a
    kernel that gathers each column's row of X once per window (tc_tiles) reads it less than
    one gathering per nonzero. Exact over up to ``samples`` evenly spaced windows, fewer where
    windows are long (about ``most_nonzeros`` in all), and estimated from them. Not part of
    :func:`structural_features`: only the opt-in tc_tiles grid reads it (``tune(opt_in=...)``
    adds it), so the runtime's decisions do not pay for it."""
    rowptr = np.asarray(rowptr, dtype=np.int64)
    rows = rowptr.size - 1
    windows = -(-rows // window)
    if windows == 0 or rowptr[-1] == 0:
        return 1.0
    per_window = max(1.0, float(rowptr[-1]) / windows)
    samples = max(16, min(samples, windows, int(most_nonzeros / per_window)))
    picked = np.unique(np.linspace(0, windows - 1, num=min(samples, windows)).astype(np.int64))
    starts, ends = rowptr[picked * window], rowptr[np.minimum(picked * window + window, rows)]
    counts = ends - starts
    total = int(counts.sum())
    if total == 0:
        return 1.0
    owner = np.repeat(np.arange(picked.size, dtype=np.int64), counts)
    index = np.repeat(starts - np.cumsum(counts) + counts, counts) + np.arange(total)
    distinct = sorted_unique(owner * (int(col.max()) + 1) + np.asarray(col, dtype=np.int64)[index]).size
    return total / distinct
