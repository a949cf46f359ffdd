"""Admission and the decision flow: what a product's record holds, from its first call on.

A part of :class:`~torch_sparserl.jit.runtime.Runtime` (the :class:`Deciding` mixin). A call whose
record has no state asks :meth:`~Deciding._resolve`, which admits it or not:

* while its thread captures a CUDA graph (:func:`capturing`): not yet, nothing recorded (no
  decision can run inside a capture; the next call outside it asks again);
* outside the kernel ABI (:func:`outside_abi`): a decided ``Fallback`` at once;
* before its ``admit_calls``-th call, while its pattern is younger than ``admit_age_s`` (its
  class's kernel may serve it: :mod:`~torch_sparserl.jit.classes`) or while ``queue``
  decisions wait: not yet (:func:`~torch_sparserl.jit.decisions.not_yet`, nothing recorded);
* otherwise decided: now (``mode="sync"``) or in the background thread (``Pending`` until then).

A decision (:meth:`~Deciding._decide`) fingerprints the pattern, asks the cache, and otherwise
runs the specializer (:meth:`~Deciding._specialize`, searched again once after a
:class:`~torch_sparserl.evaluate.record.TransientFailure`); then it installs the kernel
(:meth:`~Deciding._install`) when the verdict per call allows it
(:func:`~torch_sparserl.evaluate.verdict.end_to_end`, with :mod:`~torch_sparserl.jit.endtoend`'s
host costs), from its NVRTC build first while its library is
built in background mode. Whatever fails falls back (:meth:`~Deciding._fallback`): cuSPARSE
serves, with the reason logged once. It reads the runtime's ``settings``, ``specializer``,
installers, ``cache``, ``_decisions``, ``_lock``, ``_specialize_lock`` and ``_stats``, and uses
its background work (:mod:`~torch_sparserl.jit.workers`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time

import torch

from ..abi import DTYPES
from ..pattern import Pattern, run_kept
from ..pattern.fingerprint import SpecializationKey, fingerprint
from . import endtoend
from .cache import CacheEntry
from .decisions import Decision, Fallback, Installed, Pending, not_yet
from .install import DTYPE_NAMES, device_arch, inline_installer, library_built, on_device
from .specializers import POLICY_OPS, settings_policy_id
from .workers import ShuttingDown

_WARMING = threading.local()  # .since: the start of the warm-up call this thread runs (warming)


@contextlib.contextmanager
def warming():
    """Mark a warm-up call of a step that will be captured (``ts.capture_step``) on this thread:
    while it runs, a call that leaves a product undecided on a pattern older than the call is
    also counted as ``unasked_kept``. Those are the products a graph captured after the call
    would replay with cuSPARSE although a kernel could be decided for them; a pattern the call
    made itself (a mini-batch's ``ts.csr`` inside the step) is new at every call and is served
    in the graph by cuSPARSE whatever is decided, so it does not count."""
    previous = getattr(_WARMING, "since", None)
    _WARMING.since = time.monotonic()
    try:
        yield
    finally:
        _WARMING.since = previous


log = logging.getLogger("torch_sparserl.jit.decide")

OPS = ("spmm", "spmv", "sddmm")  # kernel ops; the transposed operators use these on the transposed pattern
TRANSIENT_RETRIES = 1  # searches again after a TransientFailure, this process's cached memory released
_INT32_LIMIT = 2**31 - 1


def outside_abi(op: str, pattern: Pattern, n: int, dtype: torch.dtype) -> str | None:
    """Why the kernel ABI cannot serve this problem, or None when it can."""
    if op not in OPS:
        return f"no kernel space for {op!r}"
    if dtype not in DTYPE_NAMES:
        return f"{dtype} is not a kernel dtype ({', '.join(DTYPES)})"
    if pattern.nnz == 0 or pattern.nrows == 0 or pattern.ncols == 0 or n == 0:
        return "empty product"
    if max(pattern.nnz, pattern.nrows, pattern.ncols) > _INT32_LIMIT or pattern.ncols * n > _INT32_LIMIT \
            or pattern.nrows * n > _INT32_LIMIT:
        return "sizes beyond the int32 indexing of the kernel ABI"
    return None


def capturing(col: torch.Tensor) -> bool:
    """Whether this thread is capturing a CUDA graph on ``col``'s device type (CUDA)."""
    return col.is_cuda and torch.cuda.is_current_stream_capturing()


class Deciding:
    """Admission and decisions of a :class:`~torch_sparserl.jit.runtime.Runtime` (a mixin)."""

    def _init_deciding(self) -> None:
        self._decisions_in_flight = 0  # background decisions queued or running (the bound: settings.queue)

    def prespecialize(self, op: str, pattern: Pattern, crow: torch.Tensor, col: torch.Tensor, n: int,
                      dtype: torch.dtype):
        """Decide the kernel for a product that has not run yet (the backend calls this at
        compile time); returns the state, Pending in background mode."""
        if not self.decides_on(col.device):
            return None
        return self.state(op, pattern, n, dtype) or self._resolve(op, n, pattern, crow, col, dtype, admitted=True)

    def _key(self, op: str, n: int, pattern: Pattern, crow, col, dtype) -> SpecializationKey:
        # The learned policy writes spmm/spmv kernels; other ops are the autotuner's, whatever the settings.
        policy = self.policy_id if op in POLICY_OPS else "autotune"
        return SpecializationKey(pattern=fingerprint(pattern, crow, col), op=op, n=n, dtype=DTYPE_NAMES[dtype],
                                 arch=device_arch(col.device), policy=policy)

    @property
    def policy_id(self) -> str:
        """Names where kernels come from in the cache key (the learned policy with its checkpoint
        hash). A specializer may say; otherwise the settings decide, so that a process with a
        custom specializer reads the same cache entries as one with the default."""
        return getattr(self.specializer, "policy_id", None) or settings_policy_id(self.settings)

    def young(self, pattern: Pattern) -> bool:
        """Whether ``pattern`` is younger than ``admit_age_s`` in background mode: its calls are
        not admitted, and nothing is recorded about them."""
        settings = self.settings
        return bool(settings.admit_age_s) and settings.mode == "background" and \
            time.monotonic() - pattern.created < settings.admit_age_s

    def _resolve(self, op, n, pattern, crow, col, dtype, *, admitted: bool = False):
        """The state of a product asked for while its record has none: decided now (sync),
        queued for the background thread (Pending), or, before its ``admit_calls``-th call,
        while its pattern is younger than ``admit_age_s`` (background mode) and while ``queue``
        decisions wait (unless ``admitted``: compile time), not yet
        (:func:`~torch_sparserl.jit.decisions.not_yet`: cuSPARSE serves, the next call asks again)."""
        if capturing(col):
            # No decision starts inside a CUDA graph capture: none can run there (host copies,
            # synchronizations), and one queued now would have the background thread do device
            # work while the capture runs, which invalidates a capture in the global mode. Nothing
            # is recorded, so the next call outside the capture asks again (a Fallback recorded
            # here would serve cuSPARSE for good: capture_step warms up first, and re-captures
            # once the decision lands).
            return not_yet()
        if not admitted and self.young(pattern):
            self._left_undecided(pattern)
            served = self._class_state(op, n, pattern, crow, col, dtype) if self.settings.class_after else None
            if served is not None:
                return served
            self._stats["young_calls"] += 1
            return not_yet()  # nothing recorded: a pattern of one training step leaves no trace
        with self._lock, self._clock("jit_s"):
            decision = self._decisions.record(pattern, op, n, dtype)
            state = decision.state
            if state is not None:
                return state
            why = outside_abi(op, pattern, n, dtype)
            if why is not None:
                return self._fallback(pattern, decision, None, why, None, quiet=True)
            decision.calls += 1
            if not admitted and decision.calls < self.settings.admit_calls:
                self._stats["unadmitted_calls"] += 1
                self._left_undecided(pattern)
                return not_yet()
            if self.settings.mode == "sync":
                return self._decide(op, n, pattern, decision, crow, col, dtype)
            if not admitted and self._decisions_in_flight > self.settings.queue:  # one running, `queue` waiting
                self._stats["dropped"] += 1
                self._left_undecided(pattern)
                log.debug("sparserl: %s n=%d %s: %d decisions wait already; cuSPARSE serves and a later call "
                          "asks again", op, n, DTYPE_NAMES[dtype], self._decisions_in_flight - 1)
                return not_yet()
            # Background: the caller's thread records Pending and returns; the fingerprint,
            # the cache lookup, the specialization and the install all run in the background
            # thread. The worker's final state is written under this lock, so it cannot be
            # overwritten by the Pending set here.
            future = self._in_background(self._decide_counted, op, n, pattern, decision, crow, col, dtype)
            if not future.cancelled():
                self._decisions_in_flight += 1
            state = Pending(None, future)
            self._decisions.set(decision, state)
            log.info("sparserl: %s n=%d %s: deciding in the background; cuSPARSE serves meanwhile",
                     op, n, DTYPE_NAMES[dtype])
            return state

    def _left_undecided(self, pattern: Pattern) -> None:
        """Count a call that left ``pattern``'s product undecided as ``unasked_kept`` where it
        happens in a warm-up call (:func:`warming`) on a pattern older than that call."""
        since = getattr(_WARMING, "since", None)
        if since is not None and pattern.created < since:
            self._stats["unasked_kept"] += 1

    def _decide_counted(self, *args):
        """:meth:`_decide` in the background thread, counted while it waits and runs (the queue's bound).
        What it raises (the cache refusing a setting read when it is first made) falls back:
        raised into the thread's future, nobody would see it, and the decision would stay
        pending for good."""
        try:
            return self._decide(*args)
        except Exception as exc:  # noqa: BLE001 - a decision that fails is cuSPARSE's, loudly
            _, _, pattern, decision, *_ = args
            return self._fallback(pattern, decision, None, f"decision failed: {type(exc).__name__}: {exc}", exc)
        finally:
            with self._lock:
                self._decisions_in_flight -= 1

    def _decide(self, op, n, pattern, decision, crow, col, dtype):
        """Fingerprint, cache, and otherwise specialize: the decision for one record. The
        pattern's GPU is the current device throughout (a background thread would say cuda:0)."""
        with on_device(col):
            try:
                pattern.settle(block=True)  # the host reads the indices below: only once they passed
            except ValueError as exc:  # the next product on the pattern raises it to the caller
                return self._fallback(pattern, decision, None, f"its indices failed their check: {exc}", None,
                                      quiet=True)
            try:
                key = self._key(op, n, pattern, crow, col, dtype)
            except Exception as exc:  # noqa: BLE001 - fingerprinting must not break a product
                return self._fallback(pattern, decision, None, f"fingerprint failed: {exc}", exc)
            entry = self.cache.get(key)
            if entry is not None:
                return self._install(pattern, decision, key, entry, crow, col)
            return self._specialize(pattern, decision, key, crow, col)

    def _specialize(self, pattern, decision, key, crow, col):
        # imported here: the evaluator's package loads with the first decision, not with torch_sparserl
        from ..evaluate.record import TransientFailure

        try:
            for attempt in range(TRANSIENT_RETRIES + 1):
                try:
                    # The pattern's GPU is this thread's current device while specializing, so the
                    # sandbox's worker starts on it (a background thread would otherwise say cuda:0).
                    with self._specialize_lock, on_device(col):
                        entry = self.cache.get_or_create(key, lambda k: self._search(k, crow, col, pattern.ncols))
                    break
                except TransientFailure as exc:
                    if attempt == TRANSIENT_RETRIES:
                        return self._fallback(pattern, decision, key, f"{exc} (tried {attempt + 1} times; nothing cached: "
                                              "a later process decides again)", None)
                    # What this process's allocator caches but does not use is the memory most
                    # likely missing (a model trained before this one, in a benchmark).
                    self._stats["transient_retries"] += 1
                    log.warning("sparserl: %s n=%d: %s; this process's cached GPU memory is released and the "
                                "search runs again", key.op, key.n, exc)
                    if col.is_cuda:
                        with on_device(col):
                            torch.cuda.empty_cache()
        except Exception as exc:  # noqa: BLE001 - any failure falls back, loudly
            return self._fallback(pattern, decision, key, f"specialization failed: {type(exc).__name__}: {exc}", exc)
        finally:
            self._arm_idle_stop()
        return self._install(pattern, decision, key, entry, crow, col)

    def _search(self, key, crow, col, ncols) -> CacheEntry:
        """The specializer's decision, unless the process began to exit meanwhile: a search the
        exit cut short (its worker stopped) would decide wrongly, so it decides nothing."""
        if self._closing:
            raise ShuttingDown("the process exits")
        entry = self.specializer(key, crow, col, ncols)
        if self._closing:
            raise ShuttingDown("the process exits")
        return entry

    def _install(self, pattern, decision, key, entry: CacheEntry, crow, col):
        if entry.spec_source is None:
            return self._fallback(pattern, decision, key, f"no kernel: {entry.reason}", None, quiet=True)
        # the kernel won on GPU time; installed only if it also wins per call, host costs included
        from ..evaluate import verdict

        allowed, weighed = verdict.end_to_end(entry.record, decision.op, decision.dtype, self.settings.margin,
                                              lambda: endtoend.host_costs(col.device))
        if not allowed:
            return self._fallback(pattern, decision, key, f"no kernel: {entry.family} ({entry.reason}) is under "
                                  f"the {self.settings.margin}x margin end to end: {weighed}", None, quiet=True)
        if weighed:
            log.info("sparserl: %s n=%d: %s end to end: %s", decision.op, decision.n, entry.family, weighed)
        prebuild = getattr(self.specializer, "prebuild", None)
        arch = key.arch if key is not None else device_arch(col.device)
        if prebuild is not None and self.interim_installer is not None and self.settings.mode != "sync" \
                and not library_built(entry, arch):
            interim = self._install_interim(pattern, decision, key, entry, crow, col)
            if interim is not None:
                # The library's build and install go on in a thread of their own, so that the next
                # decision (another key; the same kernel from the cache, for a transpose) does not
                # wait for nvcc.
                self._in_background(self._install_library, pattern, decision, key, entry, crow, col, prebuild, arch,
                                    interim, pool=self._library_pool())
                return interim
        return self._install_library(pattern, decision, key, entry, crow, col, prebuild, arch, None)

    def _install_library(self, pattern, decision, key, entry: CacheEntry, crow, col, prebuild, arch: str, interim):
        """Install ``entry``'s kernel from its library, built first in the specializer's worker
        (``prebuild``) when it is not on disk. ``interim``: the state serving meanwhile (the NVRTC
        build), which serves on if this install fails."""
        with on_device(col):
            self._prebuild(prebuild, entry, arch)
            if self._closing:  # no build at exit
                return self._fallback(pattern, decision, key, "the process exits", None)
            installer = self.installer
            if interim is not None and installer is inline_installer:
                # the interim's plan data and index copies serve the library's kernel too (the same
                # source): no second host preparation and synchronize in this process
                installer = functools.partial(inline_installer, like=interim.launch)
            try:
                # The plan data and index copies outlive the step: kept out of a CUDA graph's
                # private pool when this runs in its warm-up (sync mode).
                launch = run_kept(col.device, installer, entry, crow, col, pattern.ncols)
            except Exception as exc:  # noqa: BLE001
                if interim is not None and not self._closing:  # the same source, built by NVRTC, serves on
                    log.warning("sparserl: %s n=%d: installing %s from its library failed; its NVRTC build serves "
                                "on: %s", key.op, key.n, entry.family, exc)
                    return interim
                return self._fallback(pattern, decision, key, f"installing {entry.family} failed: {exc}", exc)
        state = Installed(key, launch, f"{entry.family}{entry.params}", entry.reason, entry)
        self._set(pattern, decision, state)
        self._stats["installs"] += 1
        log.info("sparserl: %s n=%d %s -> %s (%s)", key.op, key.n, key.dtype, state.description, entry.reason)
        return state

    def _install_interim(self, pattern, decision, key, entry: CacheEntry, crow, col) -> Installed | None:
        """Serve ``entry``'s kernel from its NVRTC build while its library is built. NVRTC
        compiled the specializer's candidates too, in tens of milliseconds; the library takes
        nvcc seconds per kernel, which a first run's loop would
        otherwise spend on cuSPARSE, often after its compile has ended. The library's kernel
        replaces it when built (:meth:`_install_library`, in a thread of its own), or, if that
        install fails, it serves on. A failure here only means no interim."""
        try:
            with on_device(col):
                launch = run_kept(col.device, self.interim_installer, entry, crow, col, pattern.ncols)
        except Exception as exc:  # noqa: BLE001 - the library's install follows anyway
            log.info("sparserl: %s n=%d: no NVRTC build to serve while the library is built: %s", key.op, key.n, exc)
            return None
        state = Installed(key, launch, f"{entry.family}{entry.params}",
                          f"{entry.reason}; its NVRTC build until the library is built", entry)
        self._set(pattern, decision, state)
        self._stats["interim_installs"] += 1
        return state

    def _set(self, pattern, decision: Decision, state) -> None:
        with self._lock:
            self._decisions.set(decision, state)  # which calls invalidate() when a copy may be stale

    def _fallback(self, pattern, decision, key, reason: str, exc: BaseException | None, quiet: bool = False):
        state = Fallback(key, reason, decided=quiet)
        self._set(pattern, decision, state)
        self._stats["fallbacks"] += 1
        what = f"{decision.op} n={decision.n} {DTYPE_NAMES.get(decision.dtype, decision.dtype)}"
        if self._closing:  # what fails while the process exits is no news: exit is silent
            log.debug("sparserl: %s: not decided, the process exits (%s)", what, reason)
            return state
        (log.info if quiet else log.warning)("sparserl: %s falls back to cuSPARSE: %s", what, reason,
                                             exc_info=exc if exc is not None and not quiet else None)
        return state
