"""How the rows of a square sparse matrix (and of the dense operands it multiplies) are split
over the ranks: :class:`Partition`, pure data, and :func:`partition`, which computes one.

A partition is an order of the rows (``perm``: position ``i`` of the new order holds original
row ``perm[i]``; none for the matrix's own order) cut into ``world_size`` contiguous runs:
rank ``r`` owns the new positions ``bounds[r]:bounds[r + 1]``, that is the original rows
``perm[bounds[r]:bounds[r + 1]]`` (:meth:`Partition.rows_of`). Columns are split as the rows are,
so that the rows of ``X`` a rank holds are the columns of ``A`` its block reads locally.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import scipy.sparse as sp
import torch
from torch import Tensor

from ..tensor.construct import csr
from ..tensor.csr_matrix import CSRMatrix, indices_of

ORDERS = ("rows", "degree", "rcm", "metis", "local")
"""The orders :func:`partition` knows: the matrix's own (``rows``), rows by decreasing degree
(``degree``), reverse Cuthill-McKee on the symmetrized pattern (``rcm``, bandwidth-reducing so a
rank's columns stay mostly its own), METIS's ``world_size``-way partition (``metis``, needs
``pymetis``), and ``local``: METIS when ``pymetis`` is installed, else RCM."""

BALANCES = ("rows", "nnz")
"""How the cuts are placed: equal numbers of rows (``rows``), or equal work, a row weighing
its nonzeros plus one (``nnz``)."""


@dataclass(frozen=True)
class Partition:
    """The rows of an ``n x n`` matrix split over ``world_size`` ranks: rank ``r`` owns
    positions ``bounds[r]:bounds[r + 1]`` of the order ``perm`` (new position -> original row;
    ``None``: the original order). ``order`` names how it was made."""

    bounds: tuple[int, ...]
    perm: Tensor | None = None
    order: str = "rows"
    _inverse: Tensor | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self):
        op = "torch_sparserl.distributed.Partition"
        bounds = tuple(int(b) for b in self.bounds)
        object.__setattr__(self, "bounds", bounds)
        if len(bounds) < 2 or bounds[0] != 0 or any(b >= c for b, c in zip(bounds, bounds[1:])):
            raise ValueError(f"{op}: bounds must rise from 0, one more than the ranks, each rank owning at least "
                             f"one row (got {bounds})")
        if self.perm is not None:
            perm = torch.as_tensor(self.perm, dtype=torch.int64).cpu()
            if perm.dim() != 1 or perm.numel() != bounds[-1]:
                raise ValueError(f"{op}: perm must have {bounds[-1]} entries, one per row (got shape {tuple(perm.shape)})")
            seen = torch.zeros(perm.numel(), dtype=torch.bool)
            inside = (perm >= 0) & (perm < perm.numel())
            if not bool(inside.all()) or bool(seen.index_fill_(0, perm, True).logical_not().any()):
                raise ValueError(f"{op}: perm must be a permutation of 0..{perm.numel() - 1}")
            inverse = torch.empty_like(perm)
            inverse[perm] = torch.arange(perm.numel())
            object.__setattr__(self, "perm", perm)
            object.__setattr__(self, "_inverse", inverse)

    @property
    def world_size(self) -> int:
        return len(self.bounds) - 1

    @property
    def n(self) -> int:
        """The number of rows (and columns) of the matrix it splits."""
        return self.bounds[-1]

    def size_of(self, rank: int) -> int:
        """How many rows ``rank`` owns."""
        self._check_rank(rank)
        return self.bounds[rank + 1] - self.bounds[rank]

    def rows_of(self, rank: int) -> Tensor:
        """The original indices of the rows ``rank`` owns, in the order the rank holds them."""
        self._check_rank(rank)
        start, stop = self.bounds[rank], self.bounds[rank + 1]
        return torch.arange(start, stop) if self.perm is None else self.perm[start:stop].clone()

    def new_positions(self, rows: Tensor) -> Tensor:
        """Where the original rows ``rows`` sit in the partition's order."""
        return rows if self._inverse is None else self._inverse[rows]

    def owner_of(self, positions: Tensor) -> Tensor:
        """The rank that owns each position of the partition's order."""
        return torch.searchsorted(torch.tensor(self.bounds[1:]), positions, right=True)

    def shard_rows(self, X: Tensor, rank: int) -> Tensor:
        """``rank``'s rows of ``X`` (``n`` rows, original order), as the rank holds them."""
        if not isinstance(X, Tensor) or X.dim() < 1 or X.shape[0] != self.n:
            got = f"shape {tuple(X.shape)}" if isinstance(X, Tensor) else type(X).__name__
            raise ValueError(f"Partition.shard_rows: X must be a tensor with {self.n} rows (got {got})")
        return X.index_select(0, self.rows_of(rank).to(X.device))

    def gather_rows(self, blocks: Sequence[Tensor]) -> Tensor:
        """The whole ``X`` in the original order from every rank's block (``blocks[r]`` holds
        the rows :meth:`rows_of` ``(r)`` gives); differentiable."""
        if len(blocks) != self.world_size:
            raise ValueError(f"Partition.gather_rows: expected {self.world_size} blocks, one per rank "
                             f"(got {len(blocks)})")
        for rank, block in enumerate(blocks):
            if block.shape[0] != self.size_of(rank):
                raise ValueError(f"Partition.gather_rows: block {rank} must have {self.size_of(rank)} rows "
                                 f"(got shape {tuple(block.shape)})")
        stacked = torch.cat(list(blocks))
        if self._inverse is None:
            return stacked
        return stacked.index_select(0, self._inverse.to(stacked.device))

    def digest(self) -> int:
        """A 63-bit hash of the bounds and the order, for ranks to check that they agree."""
        h = hashlib.blake2b(np.asarray(self.bounds, dtype=np.int64).tobytes(), digest_size=8)
        if self.perm is not None:
            h.update(self.perm.numpy().tobytes())
        return int.from_bytes(h.digest(), "little") >> 1

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"Partition: rank must be in [0, {self.world_size}) (got {rank})")


def _pattern(A) -> sp.csr_matrix:
    """``A``'s pattern as a SciPy CSR matrix (values not read), from what ``ts.csr`` accepts."""
    if sp.issparse(A):
        return sp.csr_matrix(A)
    matrix = A if isinstance(A, CSRMatrix) else csr(A)
    crow, col = indices_of(matrix, "torch_sparserl.distributed.partition")
    return sp.csr_matrix((np.ones(col.numel(), dtype=np.int8), col.cpu().numpy(), crow.cpu().numpy()),
                         shape=tuple(matrix.shape))


def _symmetric(P: sp.csr_matrix) -> sp.csr_matrix:
    """The pattern of ``P + Pᵀ`` without the diagonal (what the graph orders read)."""
    S = (P + P.T).tocsr()
    S.setdiag(0)
    S.eliminate_zeros()
    S.sort_indices()
    return S


def _metis_parts(P: sp.csr_matrix, world_size: int) -> np.ndarray:
    try:
        pymetis = importlib.import_module("pymetis")
    except ImportError as exc:
        raise ImportError("torch_sparserl.distributed.partition: order='metis' needs the pymetis package "
                          "(pip install pymetis); order='rcm' or 'local' (METIS when installed, else RCM) "
                          "work without it") from exc
    S = _symmetric(P)
    _, parts = pymetis.part_graph(world_size, xadj=S.indptr, adjncy=S.indices)
    return np.asarray(parts, dtype=np.int64)


def _cuts(weights: np.ndarray, world_size: int) -> list[int]:
    """``world_size + 1`` bounds cutting rows of ``weights`` into runs of about equal weight,
    every run holding at least one row."""
    n = weights.shape[0]
    total = np.cumsum(weights, dtype=np.float64)
    targets = total[-1] * np.arange(1, world_size) / world_size
    inner = np.searchsorted(total, targets, side="left") + 1
    bounds = [0]
    for k, cut in enumerate(inner.tolist(), start=1):
        bounds.append(min(max(cut, bounds[-1] + 1), n - (world_size - k)))
    return bounds + [n]


def partition(A, world_size: int, order: str = "rows", balance: str = "rows") -> Partition:
    """Split the rows of the square matrix ``A`` (anything ``ts.csr`` takes, or SciPy) over
    ``world_size`` ranks, in the order ``order`` (one of :data:`ORDERS`) and cut as
    ``balance`` says (one of :data:`BALANCES`; METIS balances its own parts)."""
    op = "torch_sparserl.distributed.partition"
    if order not in ORDERS:
        raise ValueError(f"{op}: order must be one of {', '.join(ORDERS)} (got {order!r})")
    if balance not in BALANCES:
        raise ValueError(f"{op}: balance must be one of {', '.join(BALANCES)} (got {balance!r})")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"{op}: world_size must be a positive int (got {world_size!r})")
    P = _pattern(A)
    n = P.shape[0]
    if P.shape[0] != P.shape[1]:
        raise ValueError(f"{op}: A must be square, its columns split as its rows (got shape {P.shape})")
    if n < world_size:
        raise ValueError(f"{op}: A has {n} rows, fewer than the {world_size} ranks (each must own one)")
    if order == "local":
        order = "metis" if importlib.util.find_spec("pymetis") is not None else "rcm"
    degree = np.diff(P.indptr)
    if order == "metis":
        parts = _metis_parts(P, world_size)
        perm = np.argsort(parts, kind="stable")
        counts = np.bincount(parts, minlength=world_size)
        if (counts == 0).any():
            raise ValueError(f"{op}: METIS left ranks {np.flatnonzero(counts == 0).tolist()} without rows; "
                             "use order='rcm'")
        return Partition(tuple(np.concatenate([[0], np.cumsum(counts)]).tolist()), torch.from_numpy(perm), "metis")
    if order == "rows":
        perm = None
    elif order == "degree":
        perm = np.argsort(-degree, kind="stable")
    else:
        from scipy.sparse.csgraph import reverse_cuthill_mckee
        perm = np.asarray(reverse_cuthill_mckee(_symmetric(P), symmetric_mode=True), dtype=np.int64)
    weights = np.ones(n) if balance == "rows" else (degree + 1.0)[perm if perm is not None else slice(None)]
    return Partition(tuple(_cuts(weights, world_size)), None if perm is None else torch.from_numpy(perm), order)
