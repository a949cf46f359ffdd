"""Sampled subgraphs padded to a few sizes, so that a training step's shapes repeat.

Every neighbour-sampled batch (:mod:`.sampling`) has its own number of rows and nonzeros, so a
model under ``torch.compile`` with static shapes compiles once per batch (or falls back to dynamic
shapes), and a CUDA graph captured for one batch fits no other. :class:`Buckets` is a small set of
``(rows, nnz)`` sizes; :meth:`Buckets.pad` turns a batch into a :class:`PaddedBatch` of exactly the
smallest size that holds it, so an epoch shows as many shapes as there are buckets:

    buckets = Buckets.fit(batches, count=3)      # or Buckets([(12000, 60000), (14000, 70000)])
    for batch in map(buckets.pad, batches):
        A = ts.csr(batch.parts(), batch.shape, device="cuda")
        out = model(A, features[batch.nodes])             # padding rows gather node nodes[0]
        loss = F.cross_entropy(out[: batch.seeds], labels[batch.nodes[: batch.seeds]])

What padding leaves unchanged. The real rows come first, unchanged (crow, col, values); the padding
rows hold the padding nonzeros, with value 0.0, in the padding columns only, so the padded
adjacency is block-diagonal: ``[[A, 0], [0, P]]``. No padding entry is in a real row or a real
column: the real rows of ``A_pad @ X_pad`` and of ``A_padᵀ @ G_pad`` are the products of the real
subgraph alone (bitwise, where the kernel sums each row in its own order), whatever the padding
rows of ``X_pad`` or ``G_pad`` hold. The caller gathers features with ``batch.nodes``, whose padding
entries repeat the batch's first node (any valid node would do: their outputs never reach a real
row), and takes the loss over ``out[: batch.seeds]`` only, as without padding; ``out[:
batch.real_rows]`` is every real node's output. The padding nonzeros are spread evenly over the
padding rows and columns (no long row in the product nor in its transpose); a padding row holds
repeated columns only where it has more entries than there are padding columns.

Indices are int32 where the bucket's rows and nonzeros fit it, else int64, as :class:`.Batch`'s:
the buckets of one set share an index type unless they straddle 2**31.

A batch larger than every bucket (a later epoch sampled larger than the one the buckets were fitted
on) gets, by default (``oversize="grow"``), a new bucket ``growth`` times its size, with a
:class:`RuntimeWarning` naming the sizes: one more shape to compile or capture, and no crash in the
middle of an epoch; later batches that size share it. ``oversize="error"`` raises a ``ValueError``
instead, for a loop whose shapes were compiled or captured ahead.
"""

from __future__ import annotations

import math
import numbers
import threading
import warnings
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from .sampling import Batch

OVERSIZE = ("grow", "error")
_CANDIDATES = 2048  # the most distinct nonzero counts Buckets.fit partitions exactly; beyond, a quantile grid


@dataclass(frozen=True)
class PaddedBatch(Batch):
    """A :class:`.Batch` padded to a bucket's size: ``nodes``, ``crow`` and ``col`` have the
    bucket's rows and nonzeros; the first ``real_rows`` rows and ``real_nnz`` entries are the
    sampled subgraph's, unchanged, and :meth:`values` gives the padding entries 0."""

    real_rows: int
    real_nnz: int

    def values(self, values: str = "mean") -> np.ndarray:
        """:meth:`.Batch.values` of the real rows (``mean``: 1/degree, ``ones``: 1) and 0.0 for
        every padding entry."""
        data = super().values(values)
        data[self.real_nnz:] = 0.0
        return data

    def unpadded(self) -> Batch:
        """The sampled batch this was padded from."""
        return Batch(nodes=self.nodes[: self.real_rows], seeds=self.seeds, crow=self.crow[: self.real_rows + 1],
                     col=self.col[: self.real_nnz])


class Buckets:
    """A small set of ``(rows, nnz)`` sizes that batches are padded to (:meth:`pad`).

    ``sizes``: pairs of whole numbers, ``rows >= 1`` and ``nnz >= 0``, in any order (kept sorted
    by nonzeros, then rows; repeats dropped). A batch of ``r`` rows and ``z`` nonzeros fits a
    bucket ``(R, Z)`` when ``z <= Z`` and ``r < R``, so that a padding row exists to hold the
    padding nonzeros, or when it is exactly ``(R, Z)``. ``oversize``: what :meth:`pad` does with a
    batch that fits no bucket: ``"grow"`` (the default) adds the bucket
    ``(max(r + 1, ceil(growth * r)), ceil(growth * z))`` and warns; ``"error"`` raises.
    ``growth``: a real number >= 1.

    Safe to share between threads (a prefetching loader pads on its own thread).
    """

    def __init__(self, sizes: Iterable, *, oversize: str = "grow", growth: float = 1.25):
        if oversize not in OVERSIZE:
            raise ValueError(f"Buckets: oversize must be one of {', '.join(map(repr, OVERSIZE))} (got {oversize!r})")
        if isinstance(growth, bool) or not isinstance(growth, numbers.Real) or not math.isfinite(growth) \
                or growth < 1:
            raise ValueError(f"Buckets: growth must be a finite real number >= 1 (got {growth!r})")
        self.oversize, self.growth = oversize, float(growth)
        self._sizes = _checked_sizes(sizes)
        self._lock = threading.Lock()

    @classmethod
    def fit(cls, batches: Iterable[Batch], count: int, *, oversize: str = "grow", growth: float = 1.25) -> Buckets:
        """At most ``count`` buckets that hold every one of ``batches`` with the fewest padded
        nonzeros in all.

        The rule: sort the batches by nonzeros and split them into ``count`` consecutive groups,
        chosen (by dynamic programming) so that the sum over the batches of their group's largest
        nonzero count is the least; each group's bucket has that many nonzeros and one row more
        than the most rows in it or any smaller group. Why: each bucket is one more compile (or
        CUDA graph capture) and padding is work done for nothing; for a given number of buckets
        this partition pads the least of the work that scales with nonzeros (the sparse
        products), and rows follow nonzeros closely in sampled subgraphs. Batches of a fixed seed
        count differ by a few percent, but for the last, smaller one: 2 to 4 buckets leave a few
        percent of padding. Over more than 2048 distinct nonzero counts, group boundaries are
        taken from 2048 evenly spaced ranks (near the least padding, not always at it). A
        :class:`PaddedBatch` counts with its real size. ``oversize`` and ``growth``: as in
        :class:`Buckets`.
        """
        if isinstance(count, bool) or not isinstance(count, numbers.Integral) or count < 1:
            raise ValueError(f"Buckets.fit: count must be a whole number >= 1 (got {count!r})")
        rows, nnz = [], []
        for number, batch in enumerate(batches):
            _check_batch("Buckets.fit", batch, f"batches[{number}]")
            if isinstance(batch, PaddedBatch):  # its real part, the one pad() pads
                batch = batch.unpadded()
            rows.append(batch.nodes.size)
            nnz.append(batch.nnz)
        if not rows:
            raise ValueError("Buckets.fit: expected at least one batch (got none)")
        return cls(_fitted(np.asarray(rows, dtype=np.int64), np.asarray(nnz, dtype=np.int64), int(count)),
                   oversize=oversize, growth=growth)

    @property
    def sizes(self) -> tuple[tuple[int, int], ...]:
        """The buckets' ``(rows, nnz)``, by nonzeros then rows (with any that :meth:`pad` added)."""
        return self._sizes

    def __len__(self) -> int:
        return len(self._sizes)

    def __repr__(self) -> str:
        return f"Buckets({list(self._sizes)}, oversize={self.oversize!r}, growth={self.growth:g})"

    def select(self, rows: int, nnz: int) -> tuple[int, int] | None:
        """The smallest bucket (fewest nonzeros, then rows) that holds a batch of ``rows`` rows
        and ``nnz`` nonzeros; None where none does."""
        for size in self._sizes:
            if _holds(size, rows, nnz):
                return size
        return None

    def pad(self, batch: Batch) -> PaddedBatch:
        """``batch`` padded to the smallest bucket that holds it (a :class:`PaddedBatch` is
        padded again from its real part). A batch larger than every bucket: see ``oversize``."""
        _check_batch("Buckets.pad", batch, "batch")
        if isinstance(batch, PaddedBatch):
            batch = batch.unpadded()
        rows, nnz = batch.nodes.size, batch.nnz
        size = self.select(rows, nnz)
        if size is None:
            size = self._oversized(rows, nnz)
        return _padded(batch, *size)

    def _oversized(self, rows: int, nnz: int) -> tuple[int, int]:
        largest = max(self._sizes, key=lambda s: (s[1], s[0]))
        what = (f"a batch of {rows} rows and {nnz} nonzeros fits no bucket (the largest: {largest[0]} rows, "
                f"{largest[1]} nonzeros; a bucket holds fewer rows, or exactly its own size)")
        if self.oversize == "error":
            raise ValueError(f"Buckets.pad: {what}; fit the buckets on larger batches or pass oversize='grow'")
        with self._lock:
            size = self.select(rows, nnz)  # another thread may have added one that holds it
            if size is None:
                size = (max(rows + 1, math.ceil(self.growth * rows)), math.ceil(self.growth * nnz))
                self._sizes = tuple(sorted(self._sizes + (size,), key=lambda s: (s[1], s[0])))
                warnings.warn(f"Buckets.pad: {what}; added the bucket ({size[0]} rows, {size[1]} nonzeros): one more "
                              "shape to compile or capture", RuntimeWarning, stacklevel=3)
        return size


def _checked_sizes(sizes) -> tuple[tuple[int, int], ...]:
    expected = "Buckets: sizes must be a non-empty list of (rows, nnz) pairs of whole numbers, rows >= 1, nnz >= 0"
    if isinstance(sizes, (str, bytes)) or not isinstance(sizes, Iterable):
        raise ValueError(f"{expected} (got {sizes!r})")
    checked = set()
    for size in sizes:
        pair = tuple(size) if isinstance(size, (tuple, list, np.ndarray)) else None
        if pair is None or len(pair) != 2 or not all(isinstance(v, numbers.Integral) and not isinstance(v, bool)
                                                      for v in pair) or pair[0] < 1 or pair[1] < 0:
            raise ValueError(f"{expected} (got {size!r})")
        checked.add((int(pair[0]), int(pair[1])))
    if not checked:
        raise ValueError(f"{expected} (got none)")
    return tuple(sorted(checked, key=lambda s: (s[1], s[0])))


def _check_batch(where: str, batch, name: str) -> None:
    if not isinstance(batch, Batch):
        raise TypeError(f"{where}: {name} must be a torch_sparserl.data.sampling.Batch (got {type(batch).__name__})")
    if batch.crow.size != batch.nodes.size + 1 or (batch.crow.size and int(batch.crow[-1]) != batch.nnz):
        raise ValueError(f"{where}: {name} is not a CSR batch: expected len(crow) = nodes + 1 = "
                         f"{batch.nodes.size + 1} and crow[-1] = len(col) = {batch.nnz} (got len(crow) = "
                         f"{batch.crow.size}, crow[-1] = {int(batch.crow[-1]) if batch.crow.size else None})")


def _holds(size: tuple[int, int], rows: int, nnz: int) -> bool:
    return nnz <= size[1] and (rows < size[0] or (rows == size[0] and nnz == size[1]))


def _fitted(rows: np.ndarray, nnz: np.ndarray, count: int) -> list[tuple[int, int]]:
    """:meth:`Buckets.fit`'s sizes for batches of ``rows`` and ``nnz``."""
    values = np.unique(nnz)
    if values.size > _CANDIDATES:  # boundaries on a quantile grid: the partition's cost stays small
        ranks = np.linspace(0, nnz.size - 1, _CANDIDATES).round().astype(np.int64)
        values = np.unique(np.sort(nnz)[ranks])  # holds the largest, so every batch has a candidate
    candidate = np.searchsorted(values, nnz)  # the smallest candidate >= each batch's nonzeros
    weight = np.bincount(candidate, minlength=values.size)
    ends = _least_padding(values, weight, min(count, values.size))
    group = np.searchsorted(np.asarray(ends) - 1, candidate)  # candidates [ends[g-1], ends[g]) are group g
    most_rows = np.zeros(len(ends), dtype=np.int64)
    np.maximum.at(most_rows, group, rows)
    most_rows = np.maximum.accumulate(most_rows)  # a chain: a larger bucket holds a smaller one's batches
    return [(int(r) + 1, int(values[end - 1])) for r, end in zip(most_rows, ends)]


def _least_padding(values: np.ndarray, weight: np.ndarray, groups: int) -> list[int]:
    """The ends of ``groups`` consecutive groups of the sorted ``values`` (``weight[i]`` batches
    at ``values[i]``) that minimize the sum of each batch's group maximum."""
    m = values.size
    before = np.concatenate([[0], np.cumsum(weight)]).astype(np.float64)
    best = np.full(m + 1, np.inf)  # best[j]: the least cost of the first j candidates in the groups so far
    best[0] = 0.0
    starts = []
    for _ in range(groups):
        cost, start = np.full(m + 1, np.inf), np.zeros(m + 1, dtype=np.int64)
        for j in range(1, m + 1):  # the last group is candidates [i, j): its batches padded to values[j - 1]
            total = best[:j] + (before[j] - before[:j]) * values[j - 1]
            start[j] = int(np.argmin(total))
            cost[j] = total[start[j]]
        best = cost
        starts.append(start)
    ends, j = [], m
    for start in reversed(starts):
        ends.append(j)
        j = int(start[j])
    return ends[::-1]


def _padded(batch: Batch, rows: int, nnz: int) -> PaddedBatch:
    """``batch`` padded to ``rows`` rows and ``nnz`` nonzeros (a size that holds it)."""
    real_rows, real_nnz = batch.nodes.size, batch.nnz
    pad_rows, pad_nnz = rows - real_rows, nnz - real_nnz
    index = np.int32 if rows < 2**31 and nnz < 2**31 else np.int64
    crow = np.empty(rows + 1, dtype=index)
    crow[: real_rows + 1] = batch.crow
    col = np.empty(nnz, dtype=index)
    col[:real_nnz] = batch.col
    if pad_rows:
        per_row = np.full(pad_rows, pad_nnz // pad_rows, dtype=np.int64)
        per_row[: pad_nnz % pad_rows] += 1  # the padding nonzeros spread evenly over the padding rows
        crow[real_rows + 1:] = real_nnz + np.cumsum(per_row)
        # and over the padding columns, each row's sorted: entry e in column real_rows + e mod pad_rows
        owner = np.repeat(np.arange(pad_rows), per_row)
        column = np.arange(pad_nnz, dtype=np.int64) % pad_rows
        col[real_nnz:] = real_rows + column[np.lexsort((column, owner))]
    first = batch.nodes[0] if real_rows else 0
    nodes = np.concatenate([batch.nodes, np.full(pad_rows, first, dtype=batch.nodes.dtype)])
    return PaddedBatch(nodes=nodes, seeds=batch.seeds, crow=crow, col=col, real_rows=real_rows, real_nnz=real_nnz)
