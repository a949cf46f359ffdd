"""torch_sparserl.data.prefetch: the next batches made on a background thread, in order."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

import torch_sparserl as ts
from torch_sparserl.data import synthetic
from torch_sparserl.data.prefetch import prefetch
from torch_sparserl.data.sampling import neighbor_batches


def test_items_come_in_order_made_on_another_thread_ahead_of_the_consumer():
    consumer = threading.get_ident()
    made, threads = [], set()
    ahead = threading.Event()

    def make(i):
        threads.add(threading.get_ident())
        made.append(i)
        if i == 1:
            ahead.set()
        return i * 10

    got = []
    for value in prefetch(range(5), make):
        if value == 0:  # the consumer holds item 0 while item 1 is made
            assert ahead.wait(10)
        got.append(value)
    assert got == [0, 10, 20, 30, 40] and made == [0, 1, 2, 3, 4]
    assert threads and consumer not in threads


@pytest.mark.parametrize("depth", [1, 3])
def test_no_more_than_depth_items_are_made_ahead(depth):
    started = []

    def make(i):
        started.append(i)
        return i

    iterator = prefetch(range(10), make, depth=depth)
    assert next(iterator) == 0
    threading.Event().wait(0.2)
    assert max(started) <= depth  # item 0 handed over; at most `depth` more submitted
    assert list(iterator) == list(range(1, 10))


def test_an_error_is_raised_at_its_item_and_stops_the_rest():
    made = []

    def make(i):
        made.append(i)
        if i == 2:
            raise ValueError("bad batch 2")
        return i

    got = []
    with pytest.raises(ValueError, match="bad batch 2"):
        for value in prefetch(range(10), make):
            got.append(value)
    assert got == [0, 1] and max(made) <= 3  # depth 1: one item past the failure at most


def test_closing_early_leaves_no_thread_behind():
    before = {t for t in threading.enumerate() if t.name.startswith("sparserl-prefetch")}
    for value in prefetch(range(100), lambda i: i):
        if value == 3:
            break
    after = {t for t in threading.enumerate() if t.name.startswith("sparserl-prefetch")}
    assert not (after - before)


@pytest.mark.parametrize("depth", [0, -1, 1.5, True])
def test_bad_arguments_are_named(depth):
    with pytest.raises(ValueError, match=r"prefetch: depth must be a whole number >= 1"):
        prefetch(range(3), lambda i: i, depth=depth)
    with pytest.raises(TypeError, match=r"prefetch: make must be callable \(got int\)"):
        prefetch(range(3), 5)


def test_prefetched_minibatches_match_the_sampled_ones():
    """A batch's parts made by ts.csr on the prefetch thread are the batch's adjacency."""
    A = synthetic.make("rmat:scale=10,edge_factor=4")
    A = ((A + A.T) > 0).astype(np.float32).tocsr()
    batches = list(neighbor_batches(A, 64, (4, 2), seed=0, limit=3))
    matrices = list(prefetch(batches, lambda b: ts.csr(b.parts(), b.shape)))
    for batch, M in zip(batches, matrices):
        want = torch.from_numpy(batch.adjacency().toarray())
        torch.testing.assert_close(M.to_dense(), want)
        assert tuple(M.shape) == batch.shape


@pytest.mark.gpu
def test_prefetched_cuda_matrices_are_ordered_before_the_consumers_stream():
    """Made on the prefetch thread while the consumer works on a stream of its own: each
    matrix's transfers are enqueued on that stream, so the consumer's products read them whole
    (float64 references; the host arrays are rewritten after each make)."""
    A = synthetic.make("rmat:scale=12,edge_factor=8")
    A = ((A + A.T) > 0).astype(np.float32).tocsr()
    batches = list(neighbor_batches(A, 256, (8, 4), seed=1, limit=6))
    stream = torch.cuda.Stream()

    def make(batch):
        parts = tuple(part.clone() for part in batch.parts())  # the batch's own arrays stay as they are
        M = ts.csr(parts, batch.shape, device="cuda")
        for part in parts:
            part.zero_()  # written right after: the matrix must not see it
        return batch, M

    with torch.cuda.stream(stream):
        busy = torch.randn(4096, 4096, device="cuda")
        for batch, M in prefetch(batches, make, depth=2):
            busy = busy @ busy / 4096  # keeps the stream behind the host
            X = torch.randn(batch.shape[1], 16, device="cuda", dtype=torch.float32)
            got = (M @ X).double().cpu()
            want = batch.adjacency().astype(np.float64) @ X.double().cpu().numpy()
            torch.testing.assert_close(got, torch.from_numpy(want), rtol=1e-5, atol=1e-5)
    torch.cuda.synchronize()
