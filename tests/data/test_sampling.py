"""Neighbour-sampled mini-batches (torch_sparserl.data.sampling): what every step multiplies by."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp

from torch_sparserl.data import synthetic
from torch_sparserl.data.sampling import neighbor_batches

from helpers import REPO


@pytest.fixture(scope="module")
def graph():
    A = synthetic.make("rmat:scale=12,edge_factor=8")
    return ((A + A.T) > 0).astype(np.float32).tocsr()


def test_each_batch_is_a_subgraph_sampled_hop_by_hop(graph):
    batches = list(neighbor_batches(graph, 100, (6, 3), seed=1, limit=4))
    assert len(batches) == 4
    seen = set()
    for batch in batches:
        n = batch.nodes.size
        assert np.unique(batch.nodes).size == n and batch.seeds == 100
        seen.update(batch.nodes[: batch.seeds].tolist())
        degree = np.diff(batch.crow)
        rows = np.repeat(np.arange(n), degree)
        assert np.all(np.asarray(graph[batch.nodes[rows], batch.nodes[batch.col]]).ravel() == 1)  # real edges
        assert len(set(zip(rows.tolist(), batch.col.tolist()))) == batch.nnz  # without replacement
        full = np.diff(graph.indptr)[batch.nodes]
        assert np.all(degree[: batch.seeds] == np.minimum(full[: batch.seeds], 6))  # fanout 6, else all
        assert np.all(degree[batch.seeds:] <= 3)
        assert all(np.all(np.diff(batch.col[s:e]) > 0) for s, e in zip(batch.crow[:-1], batch.crow[1:]))
    assert len(seen) == 400  # each node a seed once per epoch


def test_a_hubs_neighbours_are_drawn_uniformly():
    """Each of a node's d neighbours is among its f drawn ones with probability f / d."""
    from torch_sparserl.data.sampling import _draw

    d, f, draws = 12, 4, 6000
    indptr = np.array([0, d, d + 2])
    indices = np.concatenate([np.arange(d), [0, 1]])
    frontier = np.zeros(draws, dtype=np.int64)  # node 0, drawn independently `draws` times
    owner, picked = _draw(indptr, indices, frontier, f, np.random.default_rng(3))
    assert owner.size == draws * f
    assert all(np.unique(row).size == f for row in picked.reshape(draws, f))  # without replacement
    counts = np.bincount(picked, minlength=d) / draws
    assert np.allclose(counts, f / d, atol=0.03), counts
    owner, picked = _draw(indptr, indices, np.array([1]), f, np.random.default_rng(3))  # degree 2 <= f: both
    assert sorted(picked.tolist()) == [0, 1] and owner.tolist() == [1, 1]


def test_the_adjacency_averages_or_sums(graph):
    batch = next(neighbor_batches(graph, 50, (4,), seed=0))
    mean, ones = batch.adjacency(), batch.adjacency("ones")
    sums = np.asarray(mean.sum(axis=1)).ravel()
    assert np.allclose(sums[np.diff(batch.crow) > 0], 1.0) and np.all(ones.data == 1)
    with pytest.raises(ValueError, match="values must be 'mean' or 'ones'"):
        batch.adjacency("max")


def test_batches_are_reproducible_and_cover_the_graph(graph):
    first = [b.nodes for b in neighbor_batches(graph, 1000, (2,), seed=7)]
    again = [b.nodes for b in neighbor_batches(graph, 1000, (2,), seed=7)]
    assert all(np.array_equal(a, b) for a, b in zip(first, again))
    assert sum(1000 if i < len(first) - 1 else graph.shape[0] - 1000 * (len(first) - 1)
               for i in range(len(first))) == graph.shape[0]


def test_batches_over_given_nodes_seed_each_of_them_once(graph):
    """``nodes``: one rank's share; every batch's seeds come from it, each once, reproducibly;
    by default the batches are those of every node."""
    share = np.random.default_rng(0).permutation(graph.shape[0])[:700]
    batches = list(neighbor_batches(graph, 128, (3, 2), seed=5, nodes=share))
    seeds = np.concatenate([b.nodes[: b.seeds] for b in batches])
    assert [b.seeds for b in batches] == [128] * 5 + [60]
    assert np.array_equal(np.sort(seeds), np.sort(share))
    again = np.concatenate([b.nodes[: b.seeds] for b in neighbor_batches(graph, 128, (3, 2), seed=5, nodes=share)])
    assert np.array_equal(seeds, again)
    in_order = next(neighbor_batches(graph, 128, (3,), shuffle=False, nodes=share))
    assert np.array_equal(in_order.nodes[:128], share[:128])
    everyone = [b.nodes for b in neighbor_batches(graph, 1000, (2,), seed=7, nodes=np.arange(graph.shape[0]))]
    assert all(np.array_equal(a, b.nodes) for a, b in zip(everyone, neighbor_batches(graph, 1000, (2,), seed=7)))
    for bad in (np.array([0, graph.shape[0]]), np.array([[1, 2]]), np.array([0.5])):
        with pytest.raises(ValueError, match=r"neighbor_batches: nodes must be a 1-D array of node indices in \[0, 4096\)"):
            next(neighbor_batches(graph, 10, (2,), nodes=bad))


@pytest.mark.parametrize("bad", ["rectangular", "batch", "fanout"])
def test_bad_arguments_are_named(graph, bad):
    args = {"adjacency": graph, "batch_size": 10, "fanouts": (2,)}
    if bad == "rectangular":
        args["adjacency"] = sp.random(5, 4, density=0.5, format="csr")
    elif bad == "batch":
        args["batch_size"] = 0
    else:
        args["fanouts"] = (3, 0)
    with pytest.raises(ValueError, match="neighbor_batches: expected"):
        next(neighbor_batches(**args))


def test_the_minibatch_example_trains_on_cpu():
    import subprocess
    import sys

    example = REPO / "examples" / "train_sage_minibatch.py"
    done = subprocess.run([sys.executable, str(example), "--epochs", "2", "--hidden", "16", "--device", "cpu"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "epoch 1: loss" in done.stdout and "runtime: {'installs'" in done.stdout
    captured = subprocess.run([sys.executable, str(example), "--epochs", "2", "--hidden", "16", "--device", "cpu",
                               "--capture", "2"], capture_output=True, text=True, timeout=300)
    assert captured.returncode == 0, captured.stderr[-2000:]
    losses = [line.split(",")[0] for line in done.stdout.splitlines() if line.startswith("epoch")]
    # padded batches, the loss over a mask of the seeds: the eager run's losses (the step runs eagerly on the CPU)
    assert [line.split(",")[0] for line in captured.stdout.splitlines() if line.startswith("epoch")] == losses
