"""Kernels by pattern class: one decided kernel serves every young pattern of its class.

A pattern younger than ``jit.admit_age_s`` (a sampled mini-batch's subgraph, used for one
training step) gets no decision of its own (:meth:`~torch_sparserl.jit.runtime.Runtime.young`).
Its *class* can have one. A class is one product ``(op, n, dtype, architecture)`` on patterns
of similar structure: the same power-of-two buckets of rows, columns and mean row length, and
int32 indices. Its kernel is a :func:`~torch_sparserl.toolchain.kernel.pattern_free` one (natural
row order, no split): the sizes are its only inputs from the pattern, so one build serves every
pattern of the class with nothing prepared per pattern (:class:`~torch_sparserl.toolchain.kernel.SizedKernel`).

1. **Admission.** A class is decided once ``jit.class_after`` distinct young patterns of it have
   been met (0: never). Until then, and while it is decided, cuSPARSE serves.
2. **Decision** (the background thread). The runtime's specializer searches the class's key
   (:func:`key_of`: the class's buckets in place of a pattern hash) on the latest pattern met,
   screening only pattern-free candidates in the sandbox, with the same correctness check and
   cuSPARSE timing as any key. The decision is kept in the kernel cache under the class's key,
   so a later process installs it without a search.
3. **Checks.** The built kernel runs in this process on two other patterns of the class, on
   fresh random values with its output NaN-filled first, against the float64 reference. A
   difference refuses the class (cuSPARSE serves it for the runtime's life).
4. **Guards.** A young pattern is served by its class's kernel when the pattern is on the
   current device and the launch geometry its sizes give is in range; anything else is
   cuSPARSE's, call by call.

What a class costs: one search per class and process (none when cached), two checks, and the
patterns whose indices the table holds until its decision starts (three at most).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from concurrent.futures import Future
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..pattern import Pattern
from ..pattern.fingerprint import SpecializationKey
from .decisions import Fallback, Installed, Pending, SpecializationError
from .install import DTYPE_NAMES, current_raw_stream, device_arch, entry_spec, on_device
from .workers import ShuttingDown

log = logging.getLogger("torch_sparserl.jit.classes")

PREFIX = "class-v1-"  # SpecializationKey.pattern of a class: a version, then the buckets
OPS = ("spmm", "spmv")
CHECKS = 2  # patterns a class's kernel is checked on in this process, besides the searched one
KEPT = CHECKS + 1  # patterns held (their indices) until the class's decision starts


def is_class(key: SpecializationKey) -> bool:
    """Whether ``key`` names a class (its kernels must be pattern-free), not one pattern."""
    return key.pattern.startswith(PREFIX)


def buckets(pattern: Pattern) -> str:
    """The structural buckets of a class: rows, columns and the mean row length, each by its
    power of two (the bit length of the integer)."""
    rows, cols, nnz = pattern.nrows, pattern.ncols, pattern.nnz
    mean = nnz // rows if rows else 0
    return f"r{rows.bit_length()}-c{cols.bit_length()}-m{mean.bit_length()}"


def key_of(op: str, n: int, dtype: str, pattern: Pattern, arch: str, policy: str) -> SpecializationKey | None:
    """The class key of a young pattern's product (``dtype``: the ABI's name), or None where no
    class serves it: ops other than spmm and spmv, int64 indices (a class kernel reads the
    pattern's int32 indices as they are, with no copy)."""
    if op not in OPS or pattern.index_dtype != torch.int32:
        return None
    return SpecializationKey(pattern=PREFIX + buckets(pattern), op=op, n=n, dtype=dtype, arch=arch, policy=policy)


def accepts(spec) -> bool:
    """Whether a candidate may serve a class: its plan is pattern-free."""
    from ..toolchain.kernel import pattern_free

    return pattern_free(spec.plan)


@dataclass
class Served(Installed):
    """The state that serves a young pattern: its class's kernel. Never in the decision table
    (a young pattern has no record); its launch may decline a call (returns None)."""


@dataclass
class ClassRecord:
    """One class's state: counting its patterns (``state`` None), deciding (Pending), served
    (Installed) or refused (Fallback)."""

    key: SpecializationKey
    state: Installed | Pending | Fallback | None = None
    seen: int = 0  # distinct young patterns met (consecutive calls on one pattern count once)
    last: int = 0  # id() of the last pattern counted
    kept: deque = field(default_factory=lambda: deque(maxlen=KEPT))  # (pattern, crow, col) until decided
    ready: object = None  # a CUDA event after the kept indices, recorded when the decision is asked


class ClassTable:
    """The classes of one runtime. ``meet`` is called on every young call (under no lock of the
    runtime's) and returns the class's Installed state, a record to decide now, or None."""

    def __init__(self):
        self._records: dict[SpecializationKey, ClassRecord] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._records)

    def records(self) -> list[ClassRecord]:
        with self._lock:
            return list(self._records.values())

    def meet(self, key: SpecializationKey, pattern: Pattern, crow: torch.Tensor, col: torch.Tensor,
             after: int) -> Served | ClassRecord | None:
        record = self._records.get(key)
        if record is not None and record.state.__class__ is Served:
            return record.state
        with self._lock:
            record = self._records.get(key)
            if record is None:
                record = self._records[key] = ClassRecord(key)
            if record.state is not None or record.last == id(pattern):
                return None
            record.last = id(pattern)
            record.seen += 1
            record.kept.append((pattern, crow, col))
            if record.seen < after:
                return None
            record.state = Pending(key, _DECIDING)
            if col.is_cuda:  # after the kept indices on the caller's stream: what the search waits for
                record.ready = torch.cuda.Event()
                record.ready.record(torch.cuda.current_stream(col.device))
            return record  # the caller submits its decision

    def settle(self, record: ClassRecord, state, *, recount: bool = False) -> None:
        """Set a decided class's state, and drop the patterns it kept. ``recount``: no decision
        (the search failed for the device's state); the class counts its patterns again."""
        with self._lock:
            record.state = state
            record.kept.clear()
            if recount:
                record.seen = record.last = 0

    def clear(self) -> None:
        with self._lock:
            self._records.clear()


_DECIDING: Future = Future()  # the future of a class being decided (never set: the record's state says)


def check(launch: Callable, pattern: Pattern, crow: torch.Tensor, col: torch.Tensor, op: str, n: int,
          dtype: torch.dtype) -> None:
    """Run a class's launch once on ``pattern`` with fresh random values and operand, its output
    NaN-filled first, against the float64 reference; raise SpecializationError where they differ
    (:func:`~torch_sparserl.evaluate.verdict.launch_check`)."""
    from ..evaluate.verdict import launch_check

    shape = (pattern.nrows,) if op == "spmv" else (pattern.nrows, n)

    def run(val, X, bias, scale):
        return launch(crow, col, val, X, torch.full(shape, float("nan"), dtype=dtype, device=col.device))

    why = launch_check(run, pattern, crow, col, op=op, n=n, dtype=dtype, seed=pattern.nnz * 31 + n)
    if why is not None:
        raise SpecializationError(f"the class kernel {why}")


def sized_installer(entry) -> Callable:
    """The default class installer: the entry's kernel from its library (built, or loaded from
    disk), launched with the sizes of each call's operands on the current stream:
    ``launch(crow, col, val, X, y=None) -> Y``, or None for operands on a device other than the
    current one (cuSPARSE serves them)."""
    from ..toolchain import inline
    from ..toolchain.kernel import SizedKernel

    spec = entry_spec(entry)
    sized = SizedKernel(inline.build([spec])[spec.key])
    current_device = torch.cuda.current_device

    def launch(crow: torch.Tensor, col: torch.Tensor, val: torch.Tensor, X: torch.Tensor,
               y: torch.Tensor | None = None) -> torch.Tensor | None:
        index = X.device.index
        if index != current_device():
            return None
        return sized(crow, col, val, X, current_raw_stream(index), y)

    launch.kernel = sized
    return launch


class ClassKernels:
    """The class kernels of a :class:`~torch_sparserl.jit.runtime.Runtime` (a mixin): each young
    pattern's call counted for its class (:meth:`_class_state`), a class decided in the
    background thread once ``class_after`` of its patterns were met (:meth:`_decide_class`).
    The runtime's hot path launches a served class's kernel (``Runtime._launch_class``)."""

    def _init_classes(self) -> None:
        self._classes = ClassTable()  # young patterns' classes
        self._arches: dict = {}  # device -> architecture name, for class keys

    def _class_state(self, op, n, pattern, crow, col, dtype) -> Served | None:
        """The state serving a young pattern's call: its class's kernel, or None (cuSPARSE). The
        call is counted for its class, whose decision starts in the background once
        ``class_after`` of its patterns have been met."""
        device = col.device
        arch = self._arches.get(device)
        if arch is None:
            arch = self._arches[device] = device_arch(device)
        dtype_name = DTYPE_NAMES.get(dtype)
        key = None if dtype_name is None else key_of(op, n, dtype_name, pattern, arch, self.policy_id)
        if key is None:
            return None
        met = self._classes.meet(key, pattern, crow, col, self.settings.class_after)
        if met is None or met.__class__ is Served:
            return met
        log.info("sparserl: %s n=%d %s: deciding the class %s of young patterns in the background",
                 op, n, dtype_name, key.pattern)
        self._in_background(self._decide_class, met, dtype)
        return None

    def _decide_class(self, record: ClassRecord, dtype: torch.dtype):
        """Decide a class (the background thread): its kernel from the cache, or searched on the
        latest of its kept patterns; built; checked on the others. The record's state is set to
        the outcome: Served, or Fallback (refused). A search that failed for the device's state
        sets the class back to counting."""
        from ..evaluate.record import TransientFailure

        key = record.key
        kept = list(record.kept)
        pattern, crow, col = kept[-1]
        checks = kept[:-1][-CHECKS:] or kept[-1:]
        try:
            with on_device(col):
                if record.ready is not None:  # the kept indices were sent on the caller's stream; not a
                    record.ready.synchronize()  # device-wide wait, which breaks another thread's capture
                entry = self.cache.get(key)
                if entry is None:
                    with self._specialize_lock:
                        entry = self.cache.get_or_create(key, lambda k: self._search(k, crow, col, pattern.ncols))
                    self._arm_idle_stop()
                if entry.spec_source is None:
                    state = Fallback(key, f"no class kernel: {entry.reason}", decided=True)
                else:
                    self._prebuild(getattr(self.specializer, "prebuild", None), entry, key.arch)
                    if self._closing:
                        raise ShuttingDown("the process exits")
                    launch = self.class_installer(entry)
                    for other, other_crow, other_col in checks:
                        check(launch, other, other_crow, other_col, key.op, key.n, dtype)
                    state = Served(key, launch, f"{entry.family}{entry.params} for the class {key.pattern}",
                                           f"{entry.reason}; checked on {len(checks)} more pattern(s)", entry)
        except TransientFailure as exc:
            log.warning("sparserl: the class %s was not decided (%s); it is counted again", key.pattern, exc)
            self._classes.settle(record, None, recount=True)
            return None
        except Exception as exc:  # noqa: BLE001 - a class that fails is cuSPARSE's
            state = Fallback(key, f"class {key.pattern} refused: {type(exc).__name__}: {exc}")
            if not self._closing:
                log.warning("sparserl: %s n=%d %s: %s", key.op, key.n, key.dtype, state.reason)
        self._classes.settle(record, state)
        self._stats["class_decisions"] += 1
        if state.__class__ is Served:
            log.info("sparserl: %s n=%d %s: young patterns of the class %s -> %s (%s)", key.op, key.n, key.dtype,
                     key.pattern, state.description, state.reason)
        return state

    def classes(self) -> list[tuple[SpecializationKey, str]]:
        """The classes met so far: each one's key and what serves it."""
        out = []
        for record in self._classes.records():
            state = record.state
            what = (f"counting ({record.seen} patterns met)" if state is None else
                    "deciding" if state.__class__ is Pending else self.describe(state))
            out.append((record.key, what))
        return out
