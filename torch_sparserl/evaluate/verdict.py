"""The verdict on a candidate kernel: from its evaluation records to "it serves" or why not.

Every rule that decides whether a kernel serves a product, in the order they apply:

1. **Best pick** (:func:`runtime_us`, :func:`ranked`, :func:`better`): a correct, timed record
   is worth its GPU time, anything else nothing; the tuners screen candidates, validate the
   fastest, and keep the fastest validated one.
2. **Margin** (:func:`judge`): the best serves when it beats cuSPARSE by the settings'
   ``margin`` in GPU time. A negative answer reached while evaluations failed for the device's
   state (:data:`~torch_sparserl.evaluate.record.TRANSIENT_KINDS`) is no answer:
   :class:`~torch_sparserl.evaluate.record.TransientFailure`, nothing cached.
3. **Per call** (:func:`per_call`, :func:`end_to_end`): before it is installed, the kernel
   must beat cuSPARSE by the margin per call too, host costs included (:class:`HostCosts`,
   measured by :mod:`torch_sparserl.jit.endtoend` in the user's process).
4. **In the user's process** (:func:`launch_check`): a kernel built there and launched on a
   pattern it was not evaluated on (a class's kernel, a fused epilogue) is checked once
   against the float64 reference first.

Functions of records and numbers, except :func:`launch_check`, which runs the launch it is given.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Callable, Iterable

import torch

from .record import TRANSIENT_KINDS, EvalRecord, TransientFailure

GATED_OPS = ("spmm", "spmv")  # the products the C++ door serves (their transposes use the same costs)
GATED_DTYPES = (torch.float32, torch.float64)  # cuSPARSE serves the half types through Python: never gated


# ----------------------------------------------------------------------------- 1. best pick

def runtime_us(record: EvalRecord) -> float:
    """What a record is worth to the pick: its GPU µs when it is correct and timed, else infinity."""
    return record.runtime_us if record.ok and record.runtime_us else math.inf


def ranked(pairs: Iterable[tuple[EvalRecord, object]]) -> list[tuple[EvalRecord, object]]:
    """The ``(record, spec)`` pairs whose record is correct and timed, fastest first (ties in
    their given order)."""
    return sorted((pair for pair in pairs if math.isfinite(runtime_us(pair[0]))), key=lambda pair: runtime_us(pair[0]))


def better(record: EvalRecord, than: EvalRecord | None) -> bool:
    """Whether ``record`` is correct, timed and faster than ``than`` (None: than nothing)."""
    us = runtime_us(record)
    return math.isfinite(us) and (than is None or us < runtime_us(than))


# ----------------------------------------------------------------------------- 2. margin

@dataclasses.dataclass(frozen=True)
class Verdict:
    """The verdict of a search: its best record (None: no candidate was correct), whether that
    kernel serves, and why, in words."""

    record: EvalRecord | None
    serves: bool
    reason: str


def judge(best: EvalRecord | None, table: list[EvalRecord], margin: float, searched: str, what: str) -> Verdict:
    """The verdict of a search whose best record is ``best`` among ``table``'s evaluations:
    it serves when it beats cuSPARSE by ``margin``. ``searched`` says what the search did
    (``"12/40 candidates screened in 3.1 s"``), ``what`` names a candidate (``"candidate"``,
    ``"policy kernel"``); both go into the reason. Raises
    :class:`~torch_sparserl.evaluate.record.TransientFailure` for a negative answer reached
    while evaluations failed for the device's state."""
    transient = [r for r in table if r.error_kind in TRANSIENT_KINDS]
    if transient and (best is None or (best.speedup or 0) < margin):
        first = transient[0].log.splitlines()[0][:300] if transient[0].log else str(transient[0].error_kind)
        raise TransientFailure(f"no {what} decided: {len(transient)} of {len(table)} evaluations failed "
                               f"for the device's state at the time ({first}; {searched})")
    if best is None:
        return Verdict(None, False, f"no correct {what} ({searched}; {failures(table)})")
    if (best.speedup or 0) < margin:
        return Verdict(best, False, f"the best {what}, {best.family}, is {best.speedup or 0:.2f}x cuSPARSE, "
                                    f"under the {margin}x margin ({searched})")
    return Verdict(best, True, f"{best.speedup:.2f}x cuSPARSE ({searched})")


def failures(records: Iterable[EvalRecord]) -> str:
    """What became of a search's evaluations, by kind: ``failed: wrong 2, timeout 1``."""
    kinds = collections.Counter(str(r.error_kind) if r.error_kind is not None else "not judged" for r in records)
    return "failed: " + ", ".join(f"{name} {count}" for name, count in sorted(kinds.items())) if kinds else "none evaluated"


# ----------------------------------------------------------------------------- 3. per call

@dataclasses.dataclass(frozen=True)
class HostCosts:
    """Host µs per call of the parts of a served product, measured in the user's process."""

    door_us: float      # the eager door's lookup (Python to C++ and back), paid by every hit
    alloc_us: float     # one output allocation
    launch_us: float    # one launch on the stream (a zero-fill or a kernel)
    cusparse_us: dict   # op -> a cuSPARSE call through a kept entry, allocation included

    def kernel_host_us(self, launches: int) -> float:
        return self.door_us + self.alloc_us + launches * self.launch_us

    def cusparse_host_us(self, op: str) -> float | None:
        us = self.cusparse_us.get(op)
        return None if us is None else self.door_us + us


@dataclasses.dataclass(frozen=True)
class PerCall:
    """A kernel's call against cuSPARSE's, host costs included, modelled two ways."""

    alone: float        # cuSPARSE's call / the kernel's, host + GPU (a call followed by a wait)
    streamed: float     # the same, max(host, GPU) (a stream of calls the GPU keeps up with)
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


def per_call(record: dict | None, op: str, costs: HostCosts | None) -> PerCall | None:
    """The per-call comparison of a kernel's record (as a dict) with cuSPARSE's call, or None
    where it cannot be made (no costs, an op C++ does not serve, a record without GPU times or
    launches)."""
    base = op.removesuffix("_transposed")
    if costs is None or base not in GATED_OPS or not record:
        return None
    timing = record.get("timing") or {}
    launches, kernel_gpu, cusparse_gpu = timing.get("launches"), record.get("runtime_us"), record.get("cusparse_us")
    cusparse_host = costs.cusparse_host_us(base)
    if launches is None or not kernel_gpu or not cusparse_gpu or cusparse_host is None:
        return None
    kernel_host = costs.kernel_host_us(int(launches))
    return PerCall(alone=(cusparse_host + cusparse_gpu) / (kernel_host + kernel_gpu),
                   streamed=max(cusparse_host, cusparse_gpu) / max(kernel_host, kernel_gpu),
                   kernel_host_us=kernel_host, cusparse_host_us=cusparse_host, launches=int(launches))


def end_to_end(record: dict | None, op: str, dtype: torch.dtype, margin: float,
               costs: Callable[[], HostCosts | None]) -> tuple[bool, str]:
    """Whether a kernel with this record may be installed for ``op``, and what to add to its
    reason: refused when it is under ``margin`` per call. ``costs()`` gives the host costs
    (measured on first use: it is called only for the types it applies to). Where nothing
    can be weighed, the GPU-time verdict stands: ``(True, "")``."""
    if dtype not in GATED_DTYPES:
        return True, ""
    found = per_call(record, op, costs())
    if found is None:
        return True, ""
    return found.speedup >= margin, found.describe()


# ----------------------------------------------------------------------------- 4. in the user's process

def launch_check(run: Callable, pattern, crow: torch.Tensor, col: torch.Tensor, *, op: str, n: int,
                 dtype: torch.dtype, seed: int, epilogue: str = "none") -> str | None:
    """Run a kernel once on fresh random values and dense operand (and the epilogue's bias and
    scale), and compare its output with the float64 result of the product and the epilogue.
    Returns None when they agree, else why not (``"declined ..."``, ``"differs from the float64
    reference on ..."``). ``run(val, X, bias, scale)`` returns the output, or None where it
    declines the pattern; a caller that passes the output buffer fills it with NaN first, so
    unwritten elements fail."""
    from ..dtypes import close_to_reference
    from ..kernels import reference

    device = col.device
    generator = torch.Generator(device=device).manual_seed(seed)
    randn = lambda *shape: torch.randn(*shape, generator=generator, device=device).to(dtype)  # noqa: E731
    val, X = randn(pattern.nnz), randn(pattern.ncols, n)
    if op == "spmv":
        X = X[:, 0].contiguous()
    bias = randn(n) if "bias" in epilogue else None
    scale = randn(pattern.nrows) if "scale" in epilogue else None
    out = run(val, X, bias, scale)
    where = f"a pattern of {pattern.nrows} rows and {pattern.nnz} nonzeros"
    if out is None:
        return f"declined {where}"
    if device.type == "cuda":  # this thread's stream: a device-wide wait breaks another thread's capture
        torch.cuda.current_stream(device).synchronize()
    want = getattr(reference, op)(pattern, crow, col, val.double(), X.double())
    if scale is not None:
        want = want * scale.double().unsqueeze(1)
    if bias is not None:
        want = want + bias.double()
    if "relu" in epilogue:
        want = want.relu()
    ok, why = close_to_reference(out, want, dtype)
    return None if ok else f"differs from the float64 reference on {where}: {why}"
