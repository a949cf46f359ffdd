"""What a user's call costs end to end: this process's host costs, for the install gate.

A specializer ranks candidates by GPU time (every kernel and zero-fill a call launches, timed
in the sandbox), and keeps the best when it beats cuSPARSE by the settings' ``margin``. What
the user sees is more: each call's host path too. Where the C++ fast path serves, a kernel's
call costs the door, an output allocation and one launch per kernel or zero-fill; cuSPARSE's
costs the door and cuSPARSE's own host work (its descriptors pointed at the operands, its
launches). On a small matrix those microseconds are most of the call, and a kernel that
wins on the GPU with two launches can lose to cuSPARSE per call.

Before a kernel is installed, the runtime asks the verdict per call
(:func:`torch_sparserl.evaluate.verdict.end_to_end`) with this process's host costs, measured
once per device (:func:`host_costs`, through the C++ library). The verdict models a call alone
(host + GPU) and in a stream of calls (max(host, GPU)) and refuses the kernel when either ratio
to cuSPARSE's falls under the margin. Where the C++ path is not loaded (the Python path serves
both, at a host cost of its own) or the record does not say how many launches a call makes,
the GPU-time decision stands."""

from __future__ import annotations

import logging
import threading
import time

from typing import TYPE_CHECKING

import torch

from . import fastpath

if TYPE_CHECKING:  # the evaluator's package loads with the first decision, not with torch_sparserl
    from ..evaluate.verdict import HostCosts

log = logging.getLogger("torch_sparserl.jit.endtoend")

CALIBRATION_CALLS = 100  # per loop; the best of three loops is kept


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
    from ..evaluate.verdict import HostCosts

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
