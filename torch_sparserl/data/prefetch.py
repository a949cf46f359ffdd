"""Preparing the next mini-batch while the current one trains.

A step of mini-batch training starts by moving its batch to the GPU: for sparserl,
``ts.csr(parts, shape, device="cuda")`` copies the host indices into private pinned memory,
checks the copy and sends it (a few hundred microseconds on large batches; more than the rest
of the library's work in the step). :func:`prefetch` runs that on a background thread for the
next batches while the training thread launches the current step's kernels, as a loader with
``pin_memory=True`` moves batches ahead of the loop. The C++ parts of the work (the copies,
the check, the transfers) release the interpreter lock, so the two threads overlap.

    def to_gpu(batch):
        return ts.csr(batch.parts(), batch.shape, device="cuda"), torch.from_numpy(batch.nodes).cuda()

    for A, nodes in prefetch(neighbor_batches(graph, 1024, (10, 5)), to_gpu):
        out = model(A, features[nodes])
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")
U = TypeVar("U")


def prefetch(items: Iterable[T], make: Callable[[T], U], *, depth: int = 1) -> Iterator[U]:
    """``make(item)`` for each of ``items``, in order, computed on one background thread up to
    ``depth`` items ahead of the consumer.

    On CUDA, ``make`` runs on the CUDA stream that was current on the consumer's thread when the
    iteration started, so what it enqueues (host-to-device copies) is ordered before the
    consumer's later work on that stream. An exception raised by ``make`` is raised by the
    iteration at that item, which then stops: up to ``depth`` items after it may have been made
    already, and no later one is. Closing the iteration early (a ``break``) waits for the item
    being made and makes no more.
    """
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
        raise ValueError(f"prefetch: depth must be a whole number >= 1 (got {depth!r})")
    if not callable(make):
        raise TypeError(f"prefetch: make must be callable (got {type(make).__name__})")
    return _prefetched(iter(items), make, depth)


def _prefetched(items: Iterator[T], make: Callable[[T], U], depth: int) -> Iterator[U]:
    stream = _current_stream()

    def made(item: T) -> U:
        if stream is None:
            return make(item)
        import torch

        with torch.cuda.stream(stream):
            return make(item)

    pending: collections.deque[Future] = collections.deque()
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sparserl-prefetch")
    try:
        for item in items:
            pending.append(executor.submit(made, item))
            if len(pending) > depth:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:  # closed early, or failed: the item being made finishes, no other starts
        for future in pending:
            future.cancel()
        executor.shutdown(wait=True)


def _current_stream():
    """The consumer's current CUDA stream, where CUDA is initialized; else None."""
    import torch

    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    return torch.cuda.current_stream()
