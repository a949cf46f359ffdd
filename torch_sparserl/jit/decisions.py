"""The decision record: which kernel serves one product, ``(pattern, op, n, dtype)``.

A :class:`~torch_sparserl.jit.runtime.Runtime` owns one :class:`DecisionTable`, and every path
that runs a product reads the same :class:`Decision` from it:

* the operators' Python implementations (``sparserl::<op>``, ``sparserl_direct::<op>``, the
  eager doors of :mod:`~torch_sparserl.ops`) through :meth:`Runtime.call`;
* an eager ``A @ X`` on a :class:`~torch_sparserl.tensor.csr_matrix.CSRMatrix`, which keeps a
  reference to the record (not a copy of its kernel), so that a kernel replaced later (the
  library's build after the interim NVRTC build) serves the next call;
* the C++ fast path (:mod:`~torch_sparserl.jit.fastpath`), whose registry entries repeat a
  record's state; :attr:`Decision.fast` says which entries were handed over, in which of the
  registry's epochs.

A record's state is written in one place, :meth:`DecisionTable.set`. When a state that a
copy may repeat is replaced (a ``Pending`` decision lands, an ``Installed`` kernel is
replaced), the table calls its one invalidation hook, which the runtime points at the C++
registry and at its :attr:`~torch_sparserl.jit.runtime.Runtime.epoch` (what a captured CUDA graph
compares, :mod:`torch_sparserl.train.capture`). Records die with their pattern (the table holds
it weakly) or with their runtime.

The states:

* :class:`Installed` — a validated specialized kernel bound to its prepared plan data.
* :class:`Pending` — specialization runs in the background; cuSPARSE serves meanwhile. A
  Pending that is not in the table (:func:`not_yet`) answers a call whose product is not
  decided yet (not admitted, or the background queue was full): the next call asks again.
* :class:`Fallback` — no kernel: cuSPARSE serves, and the decision is not revisited.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from ..pattern.fingerprint import SpecializationKey
from .cache import CacheEntry


class SpecializationError(RuntimeError):
    """Raised instead of falling back when ``strict=True``."""


@dataclass
class Installed:
    key: SpecializationKey
    launch: Callable  # launch(crow, col, val, X) -> Y, on the current stream
    description: str = ""
    reason: str = ""
    entry: CacheEntry | None = None  # the decision it was built from (family and parameters)


@dataclass
class Pending:
    key: SpecializationKey | None  # None until the background thread has fingerprinted the pattern
    future: Future


@dataclass
class Fallback:
    key: SpecializationKey | None
    reason: str
    decided: bool = False  # True: a decision (no kernel beat cuSPARSE), not a failure


State = Installed | Pending | Fallback


def not_yet() -> Pending:
    """The answer for a product whose decision has not started: cuSPARSE serves this call, and
    the record stays empty, so that the next call asks again. One shared answer (its future
    cancelled, never set): a one-off pattern's calls ask for it every time."""
    return _NOT_YET


def _cancelled() -> Future:
    future: Future = Future()
    future.cancel()
    return future


_NOT_YET = Pending(None, _cancelled())


class Decision:
    """The record of one ``(op, n, dtype)`` on one pattern. ``state`` is None until the
    product is first asked for; only :meth:`DecisionTable.set` writes it."""

    __slots__ = ("op", "n", "dtype", "state", "fast", "calls")

    def __init__(self, op: str, n: int, dtype: torch.dtype):
        self.op, self.n, self.dtype = op, n, dtype
        self.state: State | None = None
        self.calls = 0  # calls that asked while no state was set (the runtime's admission counts them)
        # (registry epoch, operator) pairs the C++ registry was given for this record: an
        # entry of an older epoch was dropped with the registry (fastpath.record reads this)
        self.fast: set = set()

    def __repr__(self) -> str:
        return f"Decision({self.op} n={self.n} {str(self.dtype).replace('torch.', '')}: {self.state!r})"


class DecisionTable:
    """The decisions of one runtime, per pattern. Patterns are held weakly: a pattern's
    records go when it does. ``invalidate`` is the hook called after a state that the C++
    registry may repeat was replaced."""

    def __init__(self, invalidate: Callable[[], None] | None = None):
        # id(pattern) -> (weak reference to it, {(op, n, dtype): Decision})
        self._patterns: dict[int, tuple[weakref.ref, dict]] = {}
        self._lock = threading.Lock()
        self._invalidate = invalidate

    def get(self, pattern, op: str, n: int, dtype: torch.dtype) -> Decision | None:
        """The record, or None when this product was never asked for on ``pattern``."""
        found = self._patterns.get(id(pattern))
        return None if found is None else found[1].get((op, n, dtype))

    def record(self, pattern, op: str, n: int, dtype: torch.dtype) -> Decision:
        """The record, created (undecided) when missing."""
        key = id(pattern)
        found = self._patterns.get(key)
        if found is None or found[0]() is not pattern:
            with self._lock:
                found = self._patterns.get(key)
                if found is None or found[0]() is not pattern:
                    found = (weakref.ref(pattern, self._dropper(key)), {})
                    self._patterns[key] = found
        records = found[1]
        decision = records.get((op, n, dtype))
        if decision is None:
            with self._lock:
                decision = records.setdefault((op, n, dtype), Decision(op, n, dtype))
        return decision

    def _dropper(self, key: int):
        table = weakref.ref(self)

        def drop(ref: weakref.ref) -> None:
            owner = table()
            if owner is not None:
                with owner._lock:
                    found = owner._patterns.get(key)
                    if found is not None and found[0] is ref:
                        del owner._patterns[key]
        return drop

    def set(self, decision: Decision, state: State) -> None:
        """Write ``decision``'s state. Replacing a ``Pending`` or ``Installed`` state calls the
        invalidation hook: the C++ registry served cuSPARSE while it was pending, or holds the
        kernel now replaced, and must ask Python again."""
        previous = decision.state
        decision.state = state
        if self._invalidate is not None and (previous.__class__ is Pending or previous.__class__ is Installed):
            self._invalidate()

    def of(self, pattern) -> list[Decision]:
        """The records of ``pattern``."""
        found = self._patterns.get(id(pattern))
        return [] if found is None or found[0]() is not pattern else list(found[1].values())

    def items(self) -> Iterator[tuple[object, Decision]]:
        """``(pattern, record)`` for every live pattern's records."""
        for ref, records in list(self._patterns.values()):
            pattern = ref()
            if pattern is not None:
                for decision in list(records.values()):
                    yield pattern, decision

    def __len__(self) -> int:
        return sum(len(records) for _, records in list(self._patterns.values()))
