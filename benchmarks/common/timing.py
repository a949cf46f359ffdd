"""How the benchmarks time a call.

* :func:`compare_us` — wall time per call of several contenders, interleaved round by round
  (the CLI's ``sparserl measure`` times with it): host cost and GPU time together, as a
  training loop sees them;
* :func:`host_us` — host microseconds of issuing calls, no synchronization inside the loop;
* :func:`gpu_us` — device microseconds per call of everything a call launches (profiler);
* :func:`device_ms` — the same for one call of a longer run (an epoch), None off CUDA;
* :func:`wall_us` — wall time per call of a loop, the median of repeated loops, on any device;
* :func:`kernel_us` — a kernel alone as the evaluator times candidates: CUDA events, the L2
  flushed and the GPU kept busy before each run;
* :class:`HostBreakdown` — host seconds inside named library functions while a loop runs.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Callable

HOST_CALLS = 200  # under the GPU's launch queue: issuing is not held up by the device


def compare_us(contenders: dict[str, Callable[[], object]], **options) -> dict[str, float]:
    """Median over rounds of the mean time per call of each contender, interleaved:
    ``torch_sparserl.cli.measure.compare_us`` (``rounds``, ``target_ms``)."""
    from torch_sparserl.cli.measure import compare_us as interleaved

    return interleaved(contenders, **options)


def host_us(fn: Callable[[], object], calls: int = HOST_CALLS, repeats: int = 5) -> float:
    """CPU microseconds per call of issuing ``fn``: the best of ``repeats`` loops of ``calls``
    calls, the device synchronized before each loop and after the last (CUDA)."""
    import torch

    best = math.inf
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    torch.cuda.synchronize()
    return best


def gpu_us(fn: Callable[[], object], calls: int = 20) -> float:
    """Device microseconds per call of everything ``fn`` launches (kernels, memsets, copies),
    from the profiler over ``calls`` calls after one untimed call (CUDA)."""
    fn()
    return _device_us(fn, calls) / calls


def device_ms(fn: Callable[[], object], device) -> float | None:
    """Device milliseconds of everything one call of ``fn`` launches (kernels, memsets, copies,
    summed; the profiler), with no untimed call first: for a whole epoch or step sequence that
    cannot be repeated as it was. None where ``device`` is not CUDA (there is no device time to
    tell apart from the host's)."""
    import torch

    if torch.device(device).type != "cuda":
        return None
    return _device_us(fn, 1) / 1e3


def _device_us(fn: Callable[[], object], calls: int) -> float:
    """Device microseconds of ``calls`` calls of ``fn`` in all (the profiler's CUDA activity)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return sum(e.device_time_total for e in prof.key_averages() if e.device_time_total > 0
               and not e.key.startswith("ProfilerStep"))


def wall_us(fn: Callable[[], object], *, calls: int = 1, repeats: int, warmup: int = 1, device=None) -> float:
    """Wall microseconds per call: the median of ``repeats`` loops of ``calls`` calls after
    ``warmup`` untimed calls; on a CUDA ``device`` each loop runs from a synchronized device
    to a synchronized device."""
    def sync():
        if device is not None and device.type == "cuda":
            import torch

            torch.cuda.synchronize(device)

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        times.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(times)


def kernel_us(fn: Callable[[], object], reps: int, warmup: int = 3) -> float:
    """Median device microseconds of ``fn`` timed as the evaluator times a candidate
    (``torch_sparserl.evaluate.harness``): each of ``reps`` runs between CUDA events, after an
    L2 flush and a GPU-side spin that hides the host's launch path; ``warmup`` runs first."""
    import torch

    # The evaluator's timing has no public name: this is the one place that reaches it.
    from torch_sparserl.evaluate.config import DEFAULT_FLUSH_BYTES
    from torch_sparserl.evaluate.harness import _flush_buffer, _time

    flush = _flush_buffer(DEFAULT_FLUSH_BYTES, torch.device("cuda"))
    return statistics.median(_time([fn], reps, warmup, flush)[0])


class HostBreakdown:
    """Host seconds spent in each of ``targets``' functions while active: ``(module, attribute,
    label)`` triples (``attribute`` may be ``Class.method``), patched in place by a timing
    wrapper and restored on exit. The wrappers add a microsecond or so per call."""

    def __init__(self, targets):
        self.targets = tuple(targets)
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self._saved = []

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()

    def __enter__(self):
        import importlib

        for module_name, attribute, label in self.targets:
            owner = importlib.import_module(module_name)
            *path, name = attribute.split(".")
            for part in path:
                owner = getattr(owner, part)
            original = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
            self._saved.append((owner, name, original))
            setattr(owner, name, self._timed(label, original))
        return self

    def __exit__(self, *exc) -> None:
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)
        self._saved.clear()

    def _timed(self, label: str, fn):
        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[label] = self.seconds.get(label, 0.0) + time.perf_counter() - started
                self.calls[label] = self.calls.get(label, 0) + 1
        return timed

    def per_step(self, steps: int) -> dict:
        return {label: {"ms": self.seconds[label] / steps * 1e3, "calls": self.calls[label] / steps}
                for label in self.seconds}
