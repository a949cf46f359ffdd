"""The matrix encoder: sampled nonzero coordinates and structural features as prefix embeddings.

SparseRL reads the sparsity pattern through a sinusoidal embedding of the nonzeros' row and
column indices. For a coordinate ``i`` and embedding width ``d``::

    PE(i, 2j) = sin(i / 10000^(2j/d)),   PE(i, 2j+1) = cos(i / 10000^(2j/d))

Row and column are embedded separately and concatenated (``2d`` values per nonzero), then a
linear layer maps each nonzero to the model width: one prefix position per sampled nonzero.
A last prefix position carries the structural features (:mod:`torch_sparserl.pattern.features`) and
the request (op, dtype, N) through a small MLP.

Sampling keeps any matrix within the context: ``samples`` nonzeros drawn uniformly without
replacement (with replacement when the matrix has fewer), sorted by (row, column) so the
sequence reads the matrix top to bottom. ``coords="raw"`` is the ablation: the coordinates
scaled to [0, 1] by the matrix shape, linear, with no sinusoids.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn

from ...pattern.features import structural_features

OPS = ("spmv", "spmm")
DTYPES = ("f32", "f16", "bf16")
# Structural features fed to the model, each as log1p of its value (a fraction stays a fraction).
_LOG_FEATURES = ("rows", "cols", "nnz", "row_mean", "row_max", "row_min", "row_p50", "row_p90",
                 "row_p99", "row_cv")
_FRACTIONS = ("empty_rows", "top1pct_share", "diag_fraction")
N_FEATURES = len(_LOG_FEATURES) + len(_FRACTIONS) + 3 + len(OPS) + len(DTYPES) + 1


def sinusoidal(positions: torch.Tensor, dim: int) -> torch.Tensor:
    """``PE(i, 2j) = sin(i / 10000^(2j/dim))``, ``PE(i, 2j+1) = cos(...)`` for integer positions."""
    if dim % 2:
        raise ValueError(f"sinusoidal: dim must be even (got {dim})")
    j = torch.arange(dim // 2, dtype=torch.float64, device=positions.device)
    freq = torch.pow(10000.0, -2.0 * j / dim)
    angle = positions.to(torch.float64).unsqueeze(-1) * freq
    out = torch.empty(*positions.shape, dim, dtype=torch.float64, device=positions.device)
    out[..., 0::2] = torch.sin(angle)
    out[..., 1::2] = torch.cos(angle)
    return out.to(torch.float32)


def sample_coordinates(rowptr, col, samples: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``samples`` (row, col) pairs of nonzeros, uniform over the nonzeros, sorted row-major."""
    rowptr = np.asarray(rowptr, dtype=np.int64)
    col = np.asarray(col, dtype=np.int64)
    nnz = int(rowptr[-1]) if len(rowptr) else 0
    if nnz == 0:
        return np.zeros(samples, np.int64), np.zeros(samples, np.int64)
    rng = np.random.default_rng(seed)
    if nnz >= samples:
        idx = np.sort(rng.choice(nnz, size=samples, replace=False))
    else:
        idx = np.sort(rng.integers(0, nnz, size=samples))
    rows = np.searchsorted(rowptr, idx, side="right") - 1
    return rows.astype(np.int64), col[idx].astype(np.int64)


def feature_vector(features: dict, op: str, dtype: str, n: int) -> np.ndarray:
    """The structural features and the request as one float vector of length N_FEATURES."""
    if op not in OPS:
        raise ValueError(f"policy: op expected one of {OPS}, got {op!r}")
    if dtype not in DTYPES:
        raise ValueError(f"policy: dtype expected one of {DTYPES}, got {dtype!r}")
    v = [math.log1p(max(float(features.get(k, 0.0)), 0.0)) for k in _LOG_FEATURES]
    v += [float(features.get(k, 0.0)) for k in _FRACTIONS]
    cols = max(float(features.get("cols", 1.0)), 1.0)
    v += [math.log1p(float(features.get("bandwidth_p99", 0.0))) / math.log1p(cols),
          math.log1p(float(features.get("col_jump_mean", 0.0))) / math.log1p(cols),
          math.log10(max(float(features.get("density", 0.0)), 1e-12)) / 12.0]
    v += [float(op == o) for o in OPS] + [float(dtype == d) for d in DTYPES]
    v += [math.log2(max(n, 1)) / 8.0]
    return np.asarray(v, dtype=np.float32)


class PatternInput:
    """One encoded request: sampled coordinates, matrix shape and the feature vector."""

    def __init__(self, rows: np.ndarray, cols: np.ndarray, shape: tuple[int, int], features: np.ndarray):
        self.rows, self.cols, self.shape, self.features = rows, cols, shape, features

    @classmethod
    def from_pattern(cls, rowptr, col, shape, op: str, dtype: str, n: int, samples: int,
                     seed: int = 0, features: dict | None = None) -> "PatternInput":
        feats = features if features is not None else structural_features(rowptr, col, shape)
        r, c = sample_coordinates(rowptr, col, samples, seed)
        return cls(r, c, (int(shape[0]), int(shape[1])), feature_vector(feats, op, dtype, n))


def collate(inputs: list[PatternInput]) -> dict[str, torch.Tensor]:
    return {
        "rows": torch.from_numpy(np.stack([p.rows for p in inputs])),
        "cols": torch.from_numpy(np.stack([p.cols for p in inputs])),
        "shape": torch.tensor([p.shape for p in inputs], dtype=torch.float32),
        "features": torch.from_numpy(np.stack([p.features for p in inputs])),
    }


class PatternEncoder(nn.Module):
    """(sampled coordinates, features) -> ``samples + 1`` prefix embeddings of width ``hidden``."""

    def __init__(self, hidden: int, pe_dim: int = 64, coords: str = "sinusoidal"):
        super().__init__()
        if coords not in ("sinusoidal", "raw"):
            raise ValueError(f"PatternEncoder: coords expected 'sinusoidal' or 'raw', got {coords!r}")
        self.pe_dim, self.coords = pe_dim, coords
        self.coord_proj = nn.Linear(2 * pe_dim if coords == "sinusoidal" else 2, hidden)
        self.feature_mlp = nn.Sequential(nn.Linear(N_FEATURES, hidden), nn.GELU(), nn.Linear(hidden, hidden))
        self.norm = nn.LayerNorm(hidden)

    def forward(self, rows: torch.Tensor, cols: torch.Tensor, shape: torch.Tensor,
                features: torch.Tensor) -> torch.Tensor:
        if self.coords == "sinusoidal":
            coord = torch.cat([sinusoidal(rows, self.pe_dim), sinusoidal(cols, self.pe_dim)], dim=-1)
        else:
            scale = shape.clamp_min(1.0).unsqueeze(1)  # (B, 1, 2)
            coord = torch.stack([rows, cols], dim=-1).to(torch.float32) / scale
        coord = coord.to(self.coord_proj.weight.dtype)
        tokens = self.coord_proj(coord)
        feat = self.feature_mlp(features.to(self.coord_proj.weight.dtype)).unsqueeze(1)
        return self.norm(torch.cat([tokens, feat], dim=1))
