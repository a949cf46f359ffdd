"""The runtime's background work: its thread pools, the specializer's worker, and the exit.

A part of :class:`~torch_sparserl.jit.runtime.Runtime` (the :class:`Workers` mixin), with the
state it owns (:meth:`Workers._init_workers`) and what it reads of the runtime's (``settings``,
``specializer``, ``_lock``, ``_specialize_lock``, ``_stats``):

* two single-thread pools: decisions (``sparserl-specialize``) and the library builds that
  replace an interim NVRTC build (``sparserl-library``), whose work is counted while it waits
  and runs (:attr:`~Workers.busy`, :meth:`~Workers.wait`);
* the specializer's worker (the sandbox's child process): started ahead by
  :meth:`~Workers.prewarm`, used to build an installed kernel's library
  (:meth:`~Workers._prebuild`), stopped once ``idle_s`` pass without a specialization;
* the exit: a hook that runs before Python joins the pools' threads stops every runtime (new
  work dropped, queued work skipped, the worker killed, so that a search cut short decides
  nothing: :class:`ShuttingDown`).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from ..pattern.streams import relax_capture_mode
from . import fastpath
from .cache import CacheEntry

log = logging.getLogger("torch_sparserl.jit.workers")

_RUNTIMES: weakref.WeakSet = weakref.WeakSet()  # every runtime of the process, stopped at exit


class ShuttingDown(Exception):
    """The process exits: a search cut short decides nothing (nothing is cached)."""


def _at_exit() -> None:
    """Stop every runtime before the interpreter joins the thread pools' workers."""
    for runtime in list(_RUNTIMES):
        try:
            runtime._stop_for_exit()
        except Exception:  # noqa: BLE001 - exit stays silent
            pass


# threading's exit hooks run before it joins non-daemon threads (atexit's run after), last
# registered first: this one runs before concurrent.futures' own, which refuses new work.
_register_exit = getattr(threading, "_register_atexit", None)
if _register_exit is not None:
    _register_exit(_at_exit)
else:  # pragma: no cover - every supported Python has it
    import atexit

    atexit.register(_at_exit)


class Workers:
    """The background work of a :class:`~torch_sparserl.jit.runtime.Runtime` (a mixin)."""

    def _init_workers(self) -> None:
        self._executor: ThreadPoolExecutor | None = None
        self._library_executor: ThreadPoolExecutor | None = None  # libraries built after interim installs
        self._in_flight = 0  # background tasks submitted and not finished
        self._idle_timer: threading.Timer | None = None
        self._last_specialized = 0.0
        self._closing = False  # the process exits (or close() ran): background work is dropped
        _RUNTIMES.add(self)

    def _pool(self) -> ThreadPoolExecutor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sparserl-specialize",
                                                initializer=relax_capture_mode)
        return self._executor

    @contextlib.contextmanager
    def _clock(self, stat: str):
        started = time.perf_counter()
        try:
            yield
        finally:
            self._stats[stat] += time.perf_counter() - started

    def _library_pool(self) -> ThreadPoolExecutor:
        if self._library_executor is None:
            self._library_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sparserl-library",
                                                        initializer=relax_capture_mode)
        return self._library_executor

    def _in_background(self, fn: Callable, *args, pool: ThreadPoolExecutor | None = None) -> Future:
        def timed():
            try:
                if self._closing:  # queued before the exit began: dropped
                    return None
                with self._clock("background_s"):
                    return fn(*args)
            finally:
                with self._lock:
                    self._in_flight -= 1
        with self._lock:
            self._in_flight += 1
        future = self._submit(pool or self._pool(), timed)
        if future.cancelled():
            with self._lock:
                self._in_flight -= 1
        return future

    def _submit(self, pool: ThreadPoolExecutor, fn: Callable) -> Future:
        """``pool.submit(fn)``, or, once the runtime closes, a cancelled future: new work is dropped."""
        if not self._closing:
            try:
                return pool.submit(fn)
            except RuntimeError as exc:  # the pool (close()) or the interpreter shut down meanwhile
                log.debug("sparserl runtime: background work dropped: %s", exc)
        dropped: Future = Future()
        dropped.cancel()
        return dropped

    def _stop_for_exit(self) -> None:
        """The process exits: drop new and queued work, stop the specializer's worker (a search
        under way then fails and caches nothing), let a cache write under way finish."""
        self._closing = True
        with self._lock:
            if self._idle_timer is not None:
                self._idle_timer.cancel()
                self._idle_timer = None
        abort = getattr(self.specializer, "abort", None)
        if abort is not None:
            abort()

    # ------------------------------------------------------------------ the worker's life
    def _arm_idle_stop(self) -> None:
        """After a specialization: stop the specializer's worker once ``idle_s`` pass without another."""
        self._last_specialized = time.monotonic()
        if self.settings.idle_s <= 0 or getattr(self.specializer, "close", None) is None:
            return
        timer = threading.Timer(self.settings.idle_s, self._stop_if_idle)
        timer.daemon = True
        with self._lock:
            if self._idle_timer is not None:
                self._idle_timer.cancel()
            self._idle_timer = timer
        timer.start()

    def _stop_if_idle(self) -> None:
        if not self._specialize_lock.acquire(blocking=False):
            return  # a specialization is running: it arms the timer again when it ends
        try:
            if time.monotonic() - self._last_specialized < self.settings.idle_s:
                return  # another one ended since: its own timer decides
            self.specializer.close()
            self._stats["worker_stops"] += 1
            log.info("sparserl: no specialization for %.0f s: the specializer's worker is stopped (it starts "
                     "again with the next one)", self.settings.idle_s)
        except Exception as exc:  # noqa: BLE001 - a worker that will not stop is closed with the runtime
            log.warning("sparserl runtime: stopping the idle worker failed: %s", exc)
        finally:
            self._specialize_lock.release()

    def prewarm(self, device=None, *, background: bool = False) -> float | None:
        """Start now what the first specialization of a process waits for: the sandbox's
        worker and the learned policy, which take seconds to start. In ``background``, a training
        script overlaps it with loading its data; specializations queue behind it. Returns the
        seconds it took (None in background, or without CUDA). Failures are logged: the first
        specialization then tries again and falls back as usual."""
        if device is None and torch.cuda.is_available():
            device = torch.device("cuda", torch.cuda.current_device())
        prewarm = getattr(self.specializer, "prewarm", None)
        if self.settings.mode == "off" or device is None or prewarm is None:
            return None
        device = torch.device(device)
        on_device = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()

        def work() -> float | None:
            started = time.perf_counter()
            try:
                if device.type == "cuda":
                    fastpath.ensure(wait=True)  # built once per machine (about a minute), then loaded
                with self._specialize_lock, on_device:
                    prewarm(device)
            except Exception as exc:  # noqa: BLE001 - the first key will try again
                log.warning("sparserl runtime: prewarm failed: %s", exc)
                return None
            finally:
                self._arm_idle_stop()
            return time.perf_counter() - started

        if background:
            self._submit(self._pool(), work)
            return None
        return work()

    @property
    def busy(self) -> bool:
        """Whether background work is under way: a decision, or the library build that replaces a
        kernel's interim NVRTC build (benchmarks time the steady state after it)."""
        return self._in_flight > 0

    def wait(self, timeout: float | None = None) -> None:
        """Block until background specializations submitted so far are done, with the library
        builds they started (tests, benchmarks)."""
        for executor in (self._executor, self._library_executor):  # decisions first: they submit builds
            if executor is not None:
                marker = self._submit(executor, lambda: None)
                if not marker.cancelled():
                    marker.result(timeout)

    def _prebuild(self, prebuild: Callable | None, entry: CacheEntry, arch: str) -> None:
        """Build ``entry``'s library with the specializer's ``prebuild`` (in its worker), one build
        or search at a time. The library is built out of this process when it is not on disk yet
        (a training loop here would stall while torch's builder holds the interpreter lock); a
        failure only means the installer builds it here."""
        if prebuild is None:
            return
        try:
            with self._specialize_lock:
                prebuild(entry, arch)
        except Exception as exc:  # noqa: BLE001 - the installer builds it here instead
            log.info("sparserl: building %s in the sandbox's worker failed (%s); building it here", entry.family, exc)

    def _stop_workers(self) -> None:
        """Stop the idle timer, the pools (after their work) and the specializer's worker."""
        with self._lock:
            if self._idle_timer is not None:
                self._idle_timer.cancel()
                self._idle_timer = None
        for executor in (self._executor, self._library_executor):
            if executor is not None:
                executor.shutdown(wait=True)
        self._executor = self._library_executor = None
        closer = getattr(self.specializer, "close", None)
        if closer is not None:
            closer()

