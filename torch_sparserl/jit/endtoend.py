"""What a user's call costs end to end: the install gate that weighs host cost with GPU time.

A specializer ranks candidates by GPU time (every kernel and zero-fill a call launches, timed
in the sandbox), and keeps the best when it beats cuSPARSE by the settings' ``margin``. What
the user sees is more: each call's host path too. Where the C++ fast path serves, a kernel's
call costs the door, an output allocation and one launch per kernel or zero-fill; cuSPARSE's
costs the door and cuSPARSE's own host work (its descriptors pointed at the operands, its
launches). On a small matrix those microseconds are most of the call, and a kernel that
wins on the GPU with two launches can lose to cuSPARSE per call.

:func:`gate` is asked before a kernel is installed. It measures this process's host costs
once per device (:func:`host_costs`, through the C++ library) and models a call two ways:

* alone (a call followed by a wait): host + GPU;
* in a stream of calls (a training loop the GPU keeps up with): max(host, GPU);

and refuses the kernel when either ratio to cuSPARSE's falls under the margin. Where the C++
path is not loaded (the Python path serves both, at a host cost of its own) or the record does
not say how many launches a call makes, the GPU-time decision stands.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time

import torch

from . import fastpath

log = logging.getLogger("torch_sparserl.jit.endtoend")

CALIBRATION_CALLS = 100  # per loop; the best of three loops is kept
GATED_OPS = ("spmm", "spmv")  # the products the C++ door serves (their transposes use the same costs)


@dataclasses.dataclass(frozen=True)
class HostCosts:
    """Host µs per call of the parts of a served product, measured in this process."""

    door_us: float      # the eager door's lookup (Python to C++ and back), paid by every hit
    alloc_us: float     # one output allocation
    launch_us: float    # one launch on the stream (a zero-fill or a kernel)
    cusparse_us: dict   # op -> a cuSPARSE call through a kept entry, allocation included

    def kernel_host_us(self, launches: int) -> float:
        return self.door_us + self.alloc_us + launches * self.launch_us

    def cusparse_host_us(self, op: str) -> float | None:
        us = self.cusparse_us.get(op)
        return None if us is None else self.door_us + us


_COSTS: dict[int, HostCosts | None] = {}
_COSTS_LOCK = threading.Lock()


def host_costs(device: torch.device) -> HostCosts | None:
    """This process's host costs on ``device``, measured on first use (a few milliseconds, on a
    stream of its own); None where the C++ library is not loaded or cannot call cuSPARSE."""
    if not fastpath.loaded or device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _COSTS_LOCK:
        if index not in _COSTS:
            _COSTS[index] = _measure(torch.device("cuda", index))
        return _COSTS[index]


def _measure(device: torch.device) -> HostCosts | None:
    try:
        with torch.cuda.device(device), torch.cuda.stream(torch.cuda.Stream(device)):
            if torch.cuda.is_current_stream_capturing():
                return None
            alloc, launch, spmv, spmm = torch.ops.sparserl_fastpath.host_costs_us(
                torch.empty(0, device=device), CALIBRATION_CALLS)
            door = _door_us(device)
    except Exception as exc:  # noqa: BLE001 - without the costs the GPU-time decision stands
        log.warning("sparserl: host costs could not be measured (%s); kernels are installed on GPU time alone", exc)
        return None
    cusparse = {op: us for op, us in (("spmv", spmv), ("spmm", spmm)) if us >= 0}
    if not cusparse:
        return None
    costs = HostCosts(door_us=door, alloc_us=alloc, launch_us=launch, cusparse_us=cusparse)
    log.info("sparserl: host costs on %s: %s", device, costs)
    return costs


def _door_us(device: torch.device) -> float:
    """Host µs of asking the eager door about operands it has no entry for: the lookup every
    served call makes, from Python."""
    crow = torch.zeros(2, dtype=torch.int32, device=device)
    col = torch.zeros(1, dtype=torch.int32, device=device)
    val = torch.ones(1, device=device)
    x = torch.ones(1, device=device)
    serve, spmv = fastpath.serve, fastpath.OPS.index("spmv")
    best = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        for _ in range(CALIBRATION_CALLS):
            serve(spmv, crow, col, val, 1, x)
        best = min(best, (time.perf_counter() - started) / CALIBRATION_CALLS * 1e6)
    return best


@dataclasses.dataclass(frozen=True)
class Verdict:
    alone: float        # cuSPARSE's call / the kernel's, host + GPU
    streamed: float     # the same, max(host, GPU)
    kernel_host_us: float
    cusparse_host_us: float
    launches: int

    @property
    def speedup(self) -> float:
        return min(self.alone, self.streamed)

    def describe(self) -> str:
        return (f"{self.speedup:.2f}x cuSPARSE per call with host costs ({self.launches} launch"
                f"{'es' if self.launches != 1 else ''}: {self.kernel_host_us:.1f} us of host time against "
                f"cuSPARSE's {self.cusparse_host_us:.1f} us; alone {self.alone:.2f}x, streamed {self.streamed:.2f}x)")


def verdict(record: dict | None, op: str, costs: HostCosts | None) -> Verdict | None:
    """The end-to-end comparison of a kernel's record with cuSPARSE's call, or None where it
    cannot be made (no costs, an op C++ does not serve, a record without GPU times or launches)."""
    base = op.removesuffix("_transposed")
    if costs is None or base not in GATED_OPS or not record:
        return None
    timing = record.get("timing") or {}
    launches, kernel_gpu, cusparse_gpu = timing.get("launches"), record.get("runtime_us"), record.get("cusparse_us")
    cusparse_host = costs.cusparse_host_us(base)
    if launches is None or not kernel_gpu or not cusparse_gpu or cusparse_host is None:
        return None
    kernel_host = costs.kernel_host_us(int(launches))
    return Verdict(alone=(cusparse_host + cusparse_gpu) / (kernel_host + kernel_gpu),
                   streamed=max(cusparse_host, cusparse_gpu) / max(kernel_host, kernel_gpu),
                   kernel_host_us=kernel_host, cusparse_host_us=cusparse_host, launches=int(launches))


def gate(record: dict | None, op: str, dtype: torch.dtype, device: torch.device, margin: float) -> tuple[bool, str]:
    """Whether a kernel with this evaluation record may be installed for ``op`` on ``device``,
    and what to add to its reason. Half-precision products are not gated: cuSPARSE serves them
    through Python, at a host cost above any kernel's."""
    if dtype not in (torch.float32, torch.float64):
        return True, ""
    found = verdict(record, op, host_costs(device))
    if found is None:
        return True, ""
    return found.speedup >= margin, found.describe()
