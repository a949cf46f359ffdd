"""The library's background threads do not invalidate a capture made in CUDA's global mode."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from torch_sparserl.pattern import streams


@pytest.fixture(autouse=True)
def cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")


def test_this_torch_has_the_runtime_function():
    with ThreadPoolExecutor(1) as pool:
        assert pool.submit(streams.relax_capture_mode).result() is True


def test_a_library_thread_allocating_and_synchronizing_leaves_a_global_capture_whole():
    """What a decision does in the background (a fresh cudaMalloc, an event query, a copy to the
    host and its stream's synchronization) while the user's thread captures in the default mode."""
    capturing, worked = threading.Event(), threading.Event()

    def decision_like():
        assert capturing.wait(60)
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            fresh = torch.ones(7_654_321, device="cuda")  # a size the caching allocator has not seen
            event = torch.cuda.Event()
            event.record()
            event.query()
            fresh.sum().cpu()
        side.synchronize()
        worked.set()

    x = torch.zeros(64, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with ThreadPoolExecutor(1, initializer=streams.relax_capture_mode) as pool:
        done = pool.submit(decision_like)
        with torch.cuda.graph(graph):  # capture_error_mode="global", torch's default
            y = x + 1
            capturing.set()
            assert worked.wait(60)
        done.result()
    for value in (1.0, 5.0):
        x.fill_(value - 1)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, torch.full_like(y, value))
