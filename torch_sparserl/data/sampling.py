"""Mini-batches of a large graph: seed nodes and their sampled neighbourhoods, as CSR.

What a GNN trained with neighbour sampling (PyG's ``NeighborLoader``) multiplies by every
step, without needing PyG: for each batch of seed nodes, up to ``fanouts[0]`` neighbours of
each seed are drawn without replacement, then up to ``fanouts[1]`` of each node reached, and so
on; the subgraph's adjacency holds the sampled edges (a row per node, its sampled neighbours
as columns), numbered with the seeds first. Every step's pattern is new: the case of issue 36.

    batches = list(neighbor_batches(A, batch_size=1024, fanouts=(10, 5), seed=0))
    batch = batches[0]
    A_i = ts.csr(batch.parts(), batch.shape, device="cuda")  # rows: batch.nodes, mean aggregation
    out = model(A_i, features[batch.nodes])[: batch.seeds]

(:func:`torch_sparserl.data.prefetch.prefetch` makes the next batch's ``ts.csr`` while a step
trains.)
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import scipy.sparse

from .arrays import sorted_unique


@dataclass(frozen=True)
class Batch:
    """One sampled subgraph. ``nodes[i]`` is local node ``i`` in the full graph; the first
    ``seeds`` of them are the batch's seeds (the rows a step trains on). ``crow``/``col`` are
    the subgraph's CSR structure over local numbers, columns sorted in each row: int32 where
    the subgraph's nodes and edges fit it (half the bytes to send, and the index type of the
    kernels that serve the classes of young patterns), else int64."""

    nodes: np.ndarray
    seeds: int
    crow: np.ndarray
    col: np.ndarray

    @property
    def nnz(self) -> int:
        return int(self.col.size)

    @property
    def shape(self) -> tuple[int, int]:
        """The adjacency's shape: (nodes, nodes)."""
        return (self.nodes.size, self.nodes.size)

    def values(self, values: str = "mean") -> np.ndarray:
        """The adjacency's values (float32): ``mean`` gives each row 1/degree (a mean over the
        sampled neighbours, GraphSAGE's), ``ones`` gives 1 (a sum)."""
        if values not in ("mean", "ones"):
            raise ValueError(f"Batch: values must be 'mean' or 'ones' (got {values!r})")
        data = np.ones(self.nnz, dtype=np.float32)
        if values == "mean":
            degree = np.diff(self.crow)
            data /= np.repeat(np.maximum(degree, 1), degree).astype(np.float32)
        return data

    def adjacency(self, values: str = "mean") -> scipy.sparse.csr_matrix:
        """The subgraph's adjacency as SciPy CSR (float32), with :meth:`values`."""
        return scipy.sparse.csr_matrix((self.values(values), self.col, self.crow), shape=self.shape)

    def parts(self, values: str = "mean"):
        """``(crow, col, val)`` as host torch tensors sharing this batch's arrays, for
        ``ts.csr(batch.parts(), batch.shape, device="cuda")``: the library's C++ path checks and
        sends them in one call (a SciPy matrix takes the general path)."""
        import torch

        return (torch.from_numpy(self.crow), torch.from_numpy(self.col), torch.from_numpy(self.values(values)))


def neighbor_batches(adjacency: scipy.sparse.csr_matrix, batch_size: int, fanouts: Sequence[int], *,
                     seed: int = 0, shuffle: bool = True, limit: int | None = None,
                     nodes: np.ndarray | None = None) -> Iterator[Batch]:
    """The batches of one epoch over every node of ``adjacency`` (square CSR: row ``v`` lists
    the neighbours of ``v``), or over ``nodes`` (1-D node indices: e.g. one rank's share),
    ``batch_size`` seeds each (the last may be smaller), sampled with ``fanouts`` (one per
    hop). ``limit``: stop after that many batches. Deterministic for a ``seed``."""
    if not scipy.sparse.issparse(adjacency) or adjacency.shape[0] != adjacency.shape[1]:
        raise ValueError(f"neighbor_batches: expected a square sparse matrix (got "
                         f"{getattr(adjacency, 'shape', type(adjacency).__name__)})")
    if batch_size < 1 or not fanouts or any(int(f) < 1 for f in fanouts):
        raise ValueError(f"neighbor_batches: expected batch_size >= 1 and fanouts of positive counts "
                         f"(got {batch_size}, {list(fanouts)})")
    A = adjacency.tocsr()
    indptr, indices = A.indptr.astype(np.int64), A.indices.astype(np.int64)
    rng = np.random.default_rng(seed)
    if nodes is None:
        nodes = np.arange(A.shape[0])
    else:
        nodes = np.asarray(nodes)
        if nodes.ndim != 1 or (nodes.size and (nodes.dtype.kind not in "iu" or nodes.min() < 0
                                               or nodes.max() >= A.shape[0])):
            raise ValueError(f"neighbor_batches: nodes must be a 1-D array of node indices in [0, {A.shape[0]}) "
                             f"(got shape {nodes.shape}, {nodes.dtype}"
                             f"{f', {nodes.min()}..{nodes.max()}' if nodes.size and nodes.dtype.kind in 'iuf' else ''})")
        nodes = nodes.astype(np.int64)
    order = rng.permutation(nodes) if shuffle else nodes
    for number, start in enumerate(range(0, order.size, batch_size)):
        if limit is not None and number >= limit:
            return
        yield _sample(indptr, indices, order[start:start + batch_size], fanouts, rng)


def _sample(indptr: np.ndarray, indices: np.ndarray, seeds: np.ndarray, fanouts: Sequence[int],
            rng: np.random.Generator) -> Batch:
    nodes = [seeds]
    known = np.zeros(indptr.size - 1, dtype=bool)  # nodes in the subgraph so far
    known[seeds] = True
    rows, cols = [], []  # sampled edges, global numbers: row (the node expanded) -> col (a neighbour)
    frontier = seeds
    for fanout in fanouts:
        source, target = _draw(indptr, indices, frontier, int(fanout), rng)
        rows.append(source)
        cols.append(target)
        fresh = sorted_unique(target[~known[target]])
        known[fresh] = True
        nodes.append(fresh)
        frontier = fresh
    every = np.concatenate(nodes)
    local = np.empty(indptr.size - 1, dtype=np.int64)  # only the subgraph's entries are read
    local[every] = np.arange(every.size)
    row = local[np.concatenate(rows)]
    col = local[np.concatenate(cols)]
    order = np.argsort(row * np.int64(every.size) + col, kind="stable")  # by row, then column
    row, col = row[order], col[order]
    crow = np.zeros(every.size + 1, dtype=np.int64)
    np.cumsum(np.bincount(row, minlength=every.size), out=crow[1:])
    if every.size < 2**31 and col.size < 2**31:
        crow, col = crow.astype(np.int32), col.astype(np.int32)
    return Batch(nodes=every, seeds=int(seeds.size), crow=crow, col=col)


def _draw(indptr, indices, frontier, fanout: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Up to ``fanout`` neighbours of each frontier node, without replacement: every neighbour
    of a node that has at most ``fanout``; else a uniform ``fanout``-subset by Floyd's
    algorithm, vectorized over the nodes, whose cost does not grow with the degree (the hubs
    of a power-law graph)."""
    start, degree = indptr[frontier], indptr[frontier + 1] - indptr[frontier]
    few = np.flatnonzero(degree <= fanout)
    few_degree = degree[few]
    owner = np.repeat(few, few_degree)
    offset = np.arange(owner.size) - np.repeat(np.cumsum(few_degree) - few_degree, few_degree)
    many = np.flatnonzero(degree > fanout)
    chosen = np.empty((many.size, fanout), dtype=np.int64)
    for step in range(fanout):  # Floyd: offset j joins where the draw from [0, j] was taken already
        j = degree[many] - fanout + step
        draw = rng.integers(0, j + 1)
        taken = (chosen[:, :step] == draw[:, None]).any(axis=1)
        chosen[:, step] = np.where(taken, j, draw)
    owner = np.concatenate([owner, np.repeat(many, fanout)])
    offset = np.concatenate([offset, chosen.ravel()])
    return frontier[owner], indices[start[owner] + offset]
