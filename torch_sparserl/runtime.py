"""The JIT runtime: which kernel serves a (pattern, op, n, dtype), decided once, then reused.

Every CUDA product of the ``sparserl`` operators asks the process's runtime first
(:func:`active`); the transposed operators ask it for the transposed pattern, which is a
pattern like any other. State per key lives on the pattern's cache entry
(:class:`~torch_sparserl.pattern.Pattern`, keyed by tensor identity and version), so the
hot path is a dictionary lookup and a launch:

* ``Installed`` — a validated specialized kernel bound to its prepared plan data: launched.
* ``Pending`` — specialization runs in the background; this call is served by cuSPARSE.
* ``Fallback`` — no kernel (none beat cuSPARSE by the margin, the problem is outside the
  kernel ABI, or specialization failed, with the reason logged once): cuSPARSE serves, and
  the decision is not revisited.

A miss computes the pattern's fingerprint, asks the :class:`~torch_sparserl.cache.KernelCache`
(memory, then disk, shared between processes), and otherwise specializes: before the call
returns in ``mode="sync"`` (tests, benchmarks); in ``mode="background"`` (the default) the
call only records ``Pending`` and all of it, a cache hit's install too, runs in a
background thread, so a training loop never waits for a decision. The *specializer*
decides (by default: the autotuner, every candidate evaluated in the sandbox's child
process, installed only when it beats cuSPARSE by ``margin``); the
*installer* turns a cache entry into a launchable kernel (by default: the lean extension
build). Both are injectable, which is how every fallback path is tested without a GPU. In
background mode, while the specializer's worker builds a kernel's library (seconds of nvcc), the
*interim installer* serves the same source's NVRTC build (by default, with the default installer).

``strict=True`` raises :class:`SpecializationError` from the call where the runtime would
fall back because something failed (a decision that cuSPARSE is faster is not a failure).
:meth:`Runtime.call` returns None when cuSPARSE should serve the call.

At exit (a hook that runs before Python joins the pools' threads) every runtime stops: new
work is dropped silently, queued work is skipped, the specializer's worker is stopped, and a
decision that an interrupted search would have reached is not cached; a cache write already
under way finishes (atomically: a temporary file, then a rename). Nothing is logged as a
failure then, so that a process exiting while it specializes exits silently.

Settings (:class:`RuntimeSettings`, which is :class:`torch_sparserl.config.JitOptions`) come
from :func:`configure` or the ``SPARSERL_JIT*`` environment variables, read when the process's
runtime is created (:mod:`torch_sparserl.config` lists them).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import itertools
import logging
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from . import config, fastpath
from .abi import DTYPES
from .cache import CacheEntry, KernelCache
from .config import MODES, POLICIES, JitOptions  # noqa: F401 - MODES and POLICIES: their former home
from .fingerprint import SpecializationKey, fingerprint
from .pattern import Pattern, host_indices, run_kept

log = logging.getLogger("torch_sparserl.runtime")

OPS = ("spmm", "spmv", "sddmm")  # kernel ops; the transposed operators use these on the transposed pattern
POLICY_OPS = ("spmm", "spmv")  # what the learned policy was trained on; the autotuner specializes the rest
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}  # torch dtype -> ABI name
TRANSIENT_RETRIES = 1  # searches again after a TransientFailure, this process's cached memory released
PREBUILD_TIMEOUT_S = 300.0  # building one installed kernel's library in the sandbox's worker
_INT32_LIMIT = 2**31 - 1


class SpecializationError(RuntimeError):
    """Raised instead of falling back when ``strict=True``."""


RuntimeSettings = JitOptions
"""The runtime's settings: :class:`torch_sparserl.config.JitOptions` (mode, strict, margin,
budget_s, policy, k, idle_s)."""


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


Specializer = Callable[[SpecializationKey, torch.Tensor, torch.Tensor, int], CacheEntry]
Installer = Callable[[CacheEntry, torch.Tensor, torch.Tensor, int], Callable]

_GENERATIONS = itertools.count()
_RUNTIMES: weakref.WeakSet = weakref.WeakSet()  # every runtime of the process, stopped at exit


class _ShuttingDown(Exception):
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


def _device_arch(device: torch.device) -> str:
    if device.type != "cuda":
        return device.type
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}"


def _on_device(t: torch.Tensor):
    """``t``'s GPU as the current device (a context manager; nothing for CPU tensors)."""
    return torch.cuda.device(t.device) if t.device.type == "cuda" else contextlib.nullcontext()


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


class Runtime:
    def __init__(self, settings: RuntimeSettings | None = None, *, cache: KernelCache | None = None,
                 specializer: Specializer | None = None, installer: Installer | None = None,
                 interim_installer: Installer | None = None, devices: tuple[str, ...] = ("cuda",)):
        self.settings = settings or RuntimeSettings()
        self._cache = cache
        self.specializer = specializer or default_specializer(self.settings)
        self.installer = installer or inline_installer
        # the installer's NVRTC twin, for the seconds its library takes to build (_install); a
        # custom installer has none unless one is given
        self.interim_installer = interim_installer or (nvrtc_installer if installer is None else None)
        self.fused_installer = fused_installer
        self.devices = devices
        self._generation = next(_GENERATIONS)  # states of another Runtime on a Pattern are not ours
        self._executor: ThreadPoolExecutor | None = None
        self._library_executor: ThreadPoolExecutor | None = None  # libraries built after interim installs
        self._in_flight = 0  # background tasks submitted and not finished
        self._lock = threading.RLock()  # reentrant: sync mode specializes inside _resolve
        self._specialize_lock = threading.Lock()  # one specialization at a time (one sandbox, one GPU)
        self._idle_timer: threading.Timer | None = None
        self._last_specialized = 0.0
        self._closing = False  # the process exits (or close() ran): background work is dropped
        _RUNTIMES.add(self)
        # calls served by a kernel / by cuSPARSE; kernels installed (from the cache or freshly
        # specialized: the cache's own stats count the builds); fallback decisions taken;
        # seconds products waited for decisions (fingerprint, cache, and in sync mode the
        # specialization and build: the JIT cost a training loop sees) and seconds the
        # background thread spent deciding; the idle worker's stops; searches run again after
        # a TransientFailure; kernels served from their NVRTC build while their library was built
        self._stats = {"installed_calls": 0, "fallback_calls": 0, "installs": 0, "fallbacks": 0,
                       "jit_s": 0.0, "background_s": 0.0, "worker_stops": 0, "transient_retries": 0,
                       "interim_installs": 0}

    @property
    def stats(self) -> dict:
        """The counters above; the calls the C++ fast path served for this runtime are folded
        into ``installed_calls`` and ``fallback_calls`` when they are read."""
        fastpath.fold(self)
        return self._stats

    def decides_on(self, device: torch.device) -> bool:
        """Whether products on ``device`` get decisions (kernels) here; where not, cuSPARSE serves."""
        return self.settings.mode != "off" and device.type in self.devices

    @property
    def generation(self) -> int:
        """Tells this runtime's states on a Pattern from another runtime's."""
        return self._generation

    @property
    def cache(self) -> KernelCache:
        if self._cache is None:
            self._cache = KernelCache()
        return self._cache

    # ------------------------------------------------------------------ hot path
    def call(self, op: str, pattern: Pattern, crow: torch.Tensor, col: torch.Tensor, val: torch.Tensor,
             X: torch.Tensor) -> torch.Tensor | None:
        """``A @ X`` with the pattern's specialized kernel, or None: cuSPARSE serves this call.

        ``op`` is ``spmm`` (X of shape (ncols, N)), ``spmv`` (x of length ncols) or ``sddmm``
        (``val`` is then the dense D of shape (nrows, N), and the result has one value per
        nonzero); the operands have been validated by the operator.
        """
        n = 1 if op == "spmv" else X.shape[1]
        state = pattern.specializations.get((self._generation, op, n, val.dtype))
        if state is None:
            if not self.decides_on(X.device):
                return None
            state = self._resolve(op, n, pattern, crow, col, val.dtype)
        elif state.__class__ is Pending and state.future.done():
            state = pattern.specializations[(self._generation, op, n, val.dtype)]
        if state.__class__ is Installed:
            return self.launch(state.launch, crow, col, val, X)
        if state.__class__ is Fallback and self.settings.strict and not state.decided:
            raise SpecializationError(f"sparserl runtime: {op} n={n} {DTYPE_NAMES[val.dtype]}: {state.reason}")
        self._stats["fallback_calls"] += 1
        return None

    def launch(self, launch: Callable, crow, col, val: torch.Tensor, X: torch.Tensor, *epilogue) -> torch.Tensor:
        """Run an installed kernel's launch on operands it can take: the kernels' vector loads
        need ``X`` (and sddmm's D, in the ``val`` slot) contiguous and 16-byte aligned, so
        others are copied. ``epilogue``: a fused kernel's bias and scale, passed on."""
        if not X.is_contiguous() or X.data_ptr() % 16:
            X = X.clone(memory_format=torch.contiguous_format)
        if not val.is_contiguous() or val.data_ptr() % 16:
            val = val.clone(memory_format=torch.contiguous_format)
        self._stats["installed_calls"] += 1
        return launch(crow, col, val, X, *epilogue)

    # ------------------------------------------------------------------ fused epilogues
    def call_fused(self, pattern: Pattern, crow: torch.Tensor, col: torch.Tensor, val: torch.Tensor,
                   X: torch.Tensor, epilogue: str, bias: torch.Tensor | None,
                   scale: torch.Tensor | None) -> torch.Tensor | None:
        """``relu(scale[:, None] * (A @ X) + bias)`` (the steps ``epilogue`` names) in one
        launch, or None: the caller runs the product and applies the epilogue itself.

        The fused kernel is the pattern's installed SpMM kernel rendered again with the
        epilogue in its row stores (families that store each row once: group_row,
        warp_row_staged), built, and checked against float64 before its first use. It is
        decided once per (pattern, n, dtype, epilogue), like any product.
        """
        n = X.shape[1]
        slot = (self._generation, f"spmm+{epilogue}", n, val.dtype)
        state = pattern.specializations.get(slot)
        if state is None or (state.__class__ is Pending and state.future.done()):
            if not self.decides_on(X.device):
                return None
            state = self._resolve_fused(pattern, slot, crow, col, val.dtype, n, epilogue)
        if state.__class__ is not Installed:
            if state.__class__ is Fallback and self.settings.strict and not state.decided:
                raise SpecializationError(f"sparserl runtime: spmm+{epilogue} n={n}: {state.reason}")
            return None
        if bias is not None and (not bias.is_contiguous() or bias.data_ptr() % 16):  # read in vectors
            bias = bias.clone(memory_format=torch.contiguous_format)
        if scale is not None and not scale.is_contiguous():
            scale = scale.contiguous()
        return self.launch(state.launch, crow, col, val, X, bias, scale)

    def fusable(self, nrows: int, nnz: int, ncols: int, n: int, dtype: torch.dtype) -> bool:
        """Whether a live pattern of this shape has an installed SpMM kernel for ``(n, dtype)``
        whose family can store its rows through an epilogue: the post-grad pass asks before it
        fuses (it sees shapes, not the matrix), so a graph fuses only what a kernel will serve."""
        from .families import EPILOGUE_FAMILIES
        from .pattern import live_patterns

        for pattern in live_patterns():
            # a forward product's epilogue: transposes (the backward's products) do not count
            if pattern.is_transpose or (pattern.nrows, pattern.nnz, pattern.ncols) != (nrows, nnz, ncols):
                continue
            state = pattern.specializations.get((self._generation, "spmm", n, dtype))
            if state.__class__ is Installed and state.entry is not None and state.entry.family in EPILOGUE_FAMILIES:
                return True
        return False

    def _resolve_fused(self, pattern, slot, crow, col, dtype, n, epilogue):
        with self._lock:
            state = pattern.specializations.get(slot)
            if state is not None and not (state.__class__ is Pending and state.future.done()):
                return state
            base = pattern.specializations.get((self._generation, "spmm", n, dtype))
            if base is None:
                base = self._resolve("spmm", n, pattern, crow, col, dtype)
            if base.__class__ is Pending:
                return base  # not decided yet: the unfused path serves, and asks again next call
            if base.__class__ is Fallback:
                return self._fallback(pattern, slot, None, f"no fused epilogue: the product itself is served "
                                      f"by cuSPARSE ({base.reason})", None, quiet=True)
            if self.settings.mode == "sync":
                with self._clock("jit_s"):
                    return self._install_fused(pattern, slot, base, crow, col, n, epilogue)
            state = Pending(base.key, self._in_background(self._install_fused, pattern, slot, base, crow, col, n,
                                                          epilogue))
            pattern.specializations[slot] = state
            return state

    def _install_fused(self, pattern, slot, base: Installed, crow, col, n, epilogue):
        from .families import EPILOGUE_FAMILIES, render

        entry = base.entry
        family = entry.family if entry is not None else ""
        if family not in EPILOGUE_FAMILIES:
            return self._fallback(pattern, slot, base.key, f"no fused epilogue: the installed kernel "
                                  f"({family or 'unknown family'}) does not store each row once", None, quiet=True)
        try:
            spec = render(family, {**_family_params(entry.params), "epilogue": epilogue}, op="spmm",
                          dtype=base.key.dtype, n=n)
            with _on_device(col):
                launch = run_kept(col.device, self.fused_installer, spec, crow, col, pattern.ncols, n)
                check_fused(launch, pattern, crow, col, n, DTYPES[base.key.dtype], epilogue)
        except Exception as exc:  # noqa: BLE001 - the unfused path is always there
            return self._fallback(pattern, slot, base.key, f"fused {family} with epilogue {epilogue} failed: "
                                  f"{type(exc).__name__}: {exc}", exc)
        state = Installed(base.key, launch, f"{family}(epilogue={epilogue})", f"fused into {base.description}", entry)
        self._set(pattern, slot, state)
        log.info("sparserl: spmm+%s n=%d %s -> %s", epilogue, n, base.key.dtype, state.description)
        return state

    # ------------------------------------------------------------------ decisions
    def prespecialize(self, op: str, pattern: Pattern, crow: torch.Tensor, col: torch.Tensor, n: int,
                      dtype: torch.dtype):
        """Decide the kernel for a product that has not run yet (the backend calls this at
        compile time); returns the state, Pending in background mode."""
        if not self.decides_on(col.device):
            return None
        slot = (self._generation, op, n, dtype)
        return pattern.specializations.get(slot) or self._resolve(op, n, pattern, crow, col, dtype)

    def _key(self, op: str, n: int, pattern: Pattern, crow, col, dtype) -> SpecializationKey:
        # The learned policy writes spmm/spmv kernels; other ops are the autotuner's, whatever the settings.
        policy = self.policy_id if op in POLICY_OPS else "autotune"
        return SpecializationKey(pattern=fingerprint(pattern, crow, col), op=op, n=n, dtype=DTYPE_NAMES[dtype],
                                 arch=_device_arch(col.device), policy=policy)

    @property
    def policy_id(self) -> str:
        """Names where kernels come from in the cache key (the learned policy with its checkpoint
        hash). A specializer may say; otherwise the settings decide, so that a process with a
        custom specializer reads the same cache entries as one with the default."""
        return getattr(self.specializer, "policy_id", None) or settings_policy_id(self.settings)

    def _resolve(self, op, n, pattern, crow, col, dtype):
        slot = (self._generation, op, n, dtype)
        with self._lock, self._clock("jit_s"):
            state = pattern.specializations.get(slot)
            if state is not None:
                return state
            why = outside_abi(op, pattern, n, dtype)
            if why is not None:
                return self._fallback(pattern, slot, None, why, None, quiet=True)
            if self.settings.mode == "sync":
                return self._decide(op, n, pattern, slot, crow, col, dtype)
            # Background: the caller's thread records Pending and returns; the fingerprint,
            # the cache lookup, the specialization and the install all run in the background
            # thread. The worker's final state is written under this lock, so it cannot be
            # overwritten by the Pending set here.
            future = self._in_background(self._decide, op, n, pattern, slot, crow, col, dtype)
            state = Pending(None, future)
            pattern.specializations[slot] = state
            log.info("sparserl: %s n=%d %s: deciding in the background; cuSPARSE serves meanwhile",
                     op, n, DTYPE_NAMES[dtype])
            return state

    def _decide(self, op, n, pattern, slot, crow, col, dtype):
        """Fingerprint, cache, and otherwise specialize: the decision for one slot. The
        pattern's GPU is the current device throughout (a background thread would say cuda:0)."""
        with _on_device(col):
            if col.is_cuda and torch.cuda.is_current_stream_capturing():
                return self._fallback(pattern, slot, None, "first asked for while a CUDA graph was being captured, "
                                      "where no decision can run (warm the graph up first)", None)
            try:
                key = self._key(op, n, pattern, crow, col, dtype)
            except Exception as exc:  # noqa: BLE001 - fingerprinting must not break a product
                return self._fallback(pattern, slot, None, f"fingerprint failed: {exc}", exc)
            entry = self.cache.get(key)
            if entry is not None:
                return self._install(pattern, slot, key, entry, crow, col)
            return self._specialize(pattern, slot, key, crow, col)

    def _specialize(self, pattern, slot, key, crow, col):
        # imported here: the evaluator's package loads with the first decision, not with torch_sparserl
        from .evaluate.record import TransientFailure

        try:
            for attempt in range(TRANSIENT_RETRIES + 1):
                try:
                    # The pattern's GPU is this thread's current device while specializing, so the
                    # sandbox's worker starts on it (a background thread would otherwise say cuda:0).
                    with self._specialize_lock, _on_device(col):
                        entry = self.cache.get_or_create(key, lambda k: self._search(k, crow, col, pattern.ncols))
                    break
                except TransientFailure as exc:
                    if attempt == TRANSIENT_RETRIES:
                        return self._fallback(pattern, slot, key, f"{exc} (tried {attempt + 1} times; nothing cached: "
                                              "a later process decides again)", None)
                    # What this process's allocator caches but does not use is the memory most
                    # likely missing (a model trained before this one, in a benchmark).
                    self._stats["transient_retries"] += 1
                    log.warning("sparserl: %s n=%d: %s; this process's cached GPU memory is released and the "
                                "search runs again", key.op, key.n, exc)
                    if col.is_cuda:
                        with _on_device(col):
                            torch.cuda.empty_cache()
        except Exception as exc:  # noqa: BLE001 - any failure falls back, loudly
            return self._fallback(pattern, slot, key, f"specialization failed: {type(exc).__name__}: {exc}", exc)
        finally:
            self._arm_idle_stop()
        return self._install(pattern, slot, key, entry, crow, col)

    def _search(self, key, crow, col, ncols) -> CacheEntry:
        """The specializer's decision, unless the process began to exit meanwhile: a search the
        exit cut short (its worker stopped) would decide wrongly, so it decides nothing."""
        if self._closing:
            raise _ShuttingDown("the process exits")
        entry = self.specializer(key, crow, col, ncols)
        if self._closing:
            raise _ShuttingDown("the process exits")
        return entry

    def _install(self, pattern, slot, key, entry: CacheEntry, crow, col):
        if entry.spec_source is None:
            return self._fallback(pattern, slot, key, f"no kernel: {entry.reason}", None, quiet=True)
        prebuild = getattr(self.specializer, "prebuild", None)
        arch = key.arch if key is not None else _device_arch(col.device)
        if prebuild is not None and self.interim_installer is not None and self.settings.mode != "sync" \
                and not _library_built(entry, arch):
            interim = self._install_interim(pattern, slot, key, entry, crow, col)
            if interim is not None:
                # The library's build and install go on in a thread of their own, so that the next
                # decision (another key; the same kernel from the cache, for a transpose) does not
                # wait for nvcc.
                self._in_background(self._install_library, pattern, slot, key, entry, crow, col, prebuild, arch,
                                    interim, pool=self._library_pool())
                return interim
        return self._install_library(pattern, slot, key, entry, crow, col, prebuild, arch, None)

    def _install_library(self, pattern, slot, key, entry: CacheEntry, crow, col, prebuild, arch: str, interim):
        """Install ``entry``'s kernel from its library, built first in the specializer's worker
        (``prebuild``) when it is not on disk. ``interim``: the state serving meanwhile (the NVRTC
        build), which serves on if this install fails."""
        with _on_device(col):
            if prebuild is not None:
                try:
                    # The library is built out of this process when it is not on disk yet (a training
                    # loop here would stall while torch's builder holds the interpreter lock).
                    with self._specialize_lock:
                        prebuild(entry, arch)
                except Exception as exc:  # noqa: BLE001 - the installer below builds it here instead
                    log.info("sparserl: building %s in the sandbox's worker failed (%s); building it here",
                             entry.family, exc)
            if self._closing:  # no build at exit
                return self._fallback(pattern, slot, key, "the process exits", None)
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
                return self._fallback(pattern, slot, key, f"installing {entry.family} failed: {exc}", exc)
        state = Installed(key, launch, f"{entry.family}{entry.params}", entry.reason, entry)
        self._set(pattern, slot, state)
        self._stats["installs"] += 1
        log.info("sparserl: %s n=%d %s -> %s (%s)", key.op, key.n, key.dtype, state.description, entry.reason)
        return state

    def _install_interim(self, pattern, slot, key, entry: CacheEntry, crow, col) -> Installed | None:
        """Serve ``entry``'s kernel from its NVRTC build while its library is built. NVRTC
        compiled the specializer's candidates too, in tens of milliseconds; the library takes
        nvcc seconds per kernel, which a first run's loop would
        otherwise spend on cuSPARSE, often after its compile has ended. The library's kernel
        replaces it when built (:meth:`_install_library`, in a thread of its own), or, if that
        install fails, it serves on. A failure here only means no interim."""
        try:
            with _on_device(col):
                launch = run_kept(col.device, self.interim_installer, entry, crow, col, pattern.ncols)
        except Exception as exc:  # noqa: BLE001 - the library's install follows anyway
            log.info("sparserl: %s n=%d: no NVRTC build to serve while the library is built: %s", key.op, key.n, exc)
            return None
        state = Installed(key, launch, f"{entry.family}{entry.params}",
                          f"{entry.reason}; its NVRTC build until the library is built", entry)
        self._set(pattern, slot, state)
        self._stats["interim_installs"] += 1
        return state

    def _set(self, pattern, slot, state) -> None:
        with self._lock:
            previous = pattern.specializations.get(slot)
            pattern.specializations[slot] = state
        if previous.__class__ is Pending or previous.__class__ is Installed:
            # C++ served cuSPARSE while this was pending, or the kernel now replaced: it asks Python again
            fastpath.forget(self)

    def _fallback(self, pattern, slot, key, reason: str, exc: BaseException | None, quiet: bool = False):
        state = Fallback(key, reason, decided=quiet)
        self._set(pattern, slot, state)
        self._stats["fallbacks"] += 1
        what = f"{slot[1]} n={slot[2]} {DTYPE_NAMES.get(slot[3], slot[3])}"
        if self._closing:  # what fails while the process exits is no news: exit is silent
            log.debug("sparserl: %s: not decided, the process exits (%s)", what, reason)
            return state
        (log.info if quiet else log.warning)("sparserl: %s falls back to cuSPARSE: %s", what, reason,
                                             exc_info=exc if exc is not None and not quiet else None)
        return state

    def _pool(self) -> ThreadPoolExecutor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sparserl-specialize")
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
            self._library_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sparserl-library")
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

    def state(self, op: str, pattern: Pattern, n: int, dtype: torch.dtype):
        """The state of one (op, n, dtype) on ``pattern``, or None when it was never asked for."""
        return pattern.specializations.get((self._generation, op, n, dtype))

    def explain(self, op: str, pattern: Pattern, n: int, dtype: torch.dtype) -> str:
        return self.describe(self.state(op, pattern, n, dtype))

    def decisions(self, crow: torch.Tensor, col: torch.Tensor, ncols: int) -> dict[str, str]:
        """What serves each product this runtime was asked for on the pattern (``A``), on
        its transpose (``At``, the backward), and on their block-diagonal forms for attention
        heads (``A heads=4``, ``At heads=4``): ``{"A spmm n=128 float32": "installed: ..."}``."""
        from .pattern import lookup

        entry = lookup(crow, col, ncols)
        found = {}
        forms = [("A", entry), ("At", entry.transpose(crow, col)[0])]
        for heads, form, form_t in entry.heads_forms():
            forms += [(f"A heads={heads}", form)] + ([(f"At heads={heads}", form_t)] if form_t is not None else [])
        for label, pattern in forms:
            for (generation, op, n, dtype), state in list(pattern.specializations.items()):
                if generation == self._generation:
                    found[f"{label} {op} n={n} {str(dtype).replace('torch.', '')}"] = self.describe(state)
        return found

    @staticmethod
    def describe(state) -> str:
        """One line on a state: which kernel, or why cuSPARSE serves."""
        if state is None:
            return "not specialized yet"
        if isinstance(state, Installed):
            return f"installed: {state.description}" + (f" ({state.reason})" if state.reason else "")
        if isinstance(state, Pending):
            return "specializing in the background"
        return f"cuSPARSE: {state.reason}"

    def close(self) -> None:
        """Stop the background thread and the specializer's worker process."""
        fastpath.forget(self)
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


# ------------------------------------------------------------------------- the process's runtime

_ACTIVE: Runtime | None = None
_ACTIVE_LOCK = threading.Lock()


def active() -> Runtime:
    """The runtime the operators use, created on first use from the environment."""
    global _ACTIVE
    runtime = _ACTIVE
    if runtime is None:
        with _ACTIVE_LOCK:
            if _ACTIVE is None:
                _ACTIVE = Runtime(config.from_environment().jit)
            runtime = _ACTIVE
    return runtime


def set_active(runtime: Runtime | None) -> Runtime | None:
    """Make ``runtime`` the one the operators use (tests inject fakes this way; None: create
    one from the environment on next use); returns the previous one, which the caller owns
    (and may :meth:`~Runtime.close`)."""
    global _ACTIVE
    if runtime is not None and not isinstance(runtime, Runtime):
        raise TypeError(f"set_active: expected a Runtime or None (got {type(runtime).__name__})")
    with _ACTIVE_LOCK:
        previous, _ACTIVE = active_or_none(), runtime
    if previous is not runtime:
        fastpath.forget(previous)  # the C++ registry repeats the decisions of the active runtime only
    return previous


def active_or_none() -> Runtime | None:
    return _ACTIVE


def configure(settings: RuntimeSettings | None = None, **changes) -> Runtime:
    """Replace the process's runtime: ``configure(mode="sync")``, ``configure(strict=True)``.

    ``changes`` name fields of :class:`RuntimeSettings` (``mode``, ``strict``, ``margin``,
    ``budget_s``, ``policy``, ``k``, ``idle_s``); another name is a TypeError listing them.
    Unnamed settings keep their current values (the environment's, before the first runtime).
    Decisions of the previous runtime are not reused (they may have been taken under other
    settings); its disk cache is.
    """
    global _ACTIVE
    if settings is not None and not isinstance(settings, RuntimeSettings):
        raise TypeError(f"configure: settings must be a RuntimeSettings (got {type(settings).__name__})")
    with _ACTIVE_LOCK:
        previous = _ACTIVE
        base = settings or (previous.settings if previous is not None else config.from_environment().jit)
        new_settings = base.replace("configure", **changes)
        _ACTIVE = Runtime(new_settings, cache=previous._cache if previous is not None else None)
    if previous is not None:
        previous.close()  # which empties the C++ registry of its decisions
    return _ACTIVE


# ---------------------------------------------------------------------------- defaults

class autotune_specializer:  # noqa: N801 - used like a function
    """Candidates from the autotuner under the settings' budget, each run first in the
    sandbox's child process; one sandbox is kept for the runtime's life."""

    _FEATURES_KEPT = 16  # patterns whose structural features are remembered

    def __init__(self, settings: RuntimeSettings):
        self.settings = settings
        self._sandbox = None
        self._features: dict[str, dict] = {}  # pattern hash -> structural features
        # (pattern hash, host indices) of the last search: the keys of one pattern (its widths)
        # come one after another, and a large pattern's copy holds a training loop up; dropped
        # when the worker stops (close)
        self._matrix: tuple[str, tuple] | None = None

    def _problem(self, key: SpecializationKey, crow: torch.Tensor, col: torch.Tensor, ncols: int):
        """What a tuner takes for ``key``'s pattern: the matrix on the host, and the keyword
        arguments naming it (its fingerprint, for the sandbox) and its features once known, so
        that the keys of one pattern (A and its n's) do not copy or recompute them."""
        kept = self._matrix
        if kept is not None and kept[0] == key.pattern:
            matrix = kept[1]
        else:
            matrix = (*host_indices(crow, col, ncols), (crow.numel() - 1, ncols))
            self._matrix = (key.pattern, matrix)
        if key.pattern not in self._features:
            from .features import structural_features

            while len(self._features) >= self._FEATURES_KEPT:
                self._features.pop(next(iter(self._features)))
            self._features[key.pattern] = structural_features(*matrix)
        return matrix, {"sandbox": self.sandbox, "features": self._features[key.pattern],
                        "matrix_key": key.pattern}

    @property
    def sandbox(self):
        """The sandbox kept for the runtime's life (its worker starts on first use)."""
        if self._sandbox is None:
            from .evaluate.sandbox import Sandbox

            self._sandbox = Sandbox()
        return self._sandbox

    def __call__(self, key: SpecializationKey, crow: torch.Tensor, col: torch.Tensor, ncols: int) -> CacheEntry:
        from .autotune import tune

        matrix, known = self._problem(key, crow, col, ncols)
        result = tune(matrix, op=key.op, n=key.n, dtype=key.dtype, budget_s=self.settings.budget_s, **known)
        return self._entry(key, result, f"{result.screened}/{result.candidates} candidates screened in "
                                        f"{result.elapsed_s:.1f} s", "candidate")

    def prewarm(self, device: torch.device) -> None:
        """Start the sandbox's worker (its CUDA context), as the first key would."""
        self.sandbox.worker_info  # noqa: B018 - starts the worker

    def prebuild(self, entry: CacheEntry, arch: str) -> None:
        """Build the library of ``entry``'s kernel in the sandbox's worker, when the worker is
        running (it just specialized the key) and the library is not on disk, so that the
        installer in this process only loads it (``build.inline.prebuild``). A worker is not
        started for it: where none runs (a later run, its decisions from the disk cache), the
        installer builds a missing library itself."""
        from .build import inline

        specs = [entry_spec(entry)]
        if self._sandbox is None or self._sandbox.worker_pid is None or inline.is_built(specs, arch):
            return
        outcome = self.sandbox.run("torch_sparserl.build.inline:prebuild", (specs, arch),
                                   timeout_s=PREBUILD_TIMEOUT_S)
        if not outcome.ok:
            raise SpecializationError(f"{outcome.status}: {outcome.error}")

    def _entry(self, key: SpecializationKey, result, searched: str, what: str) -> CacheEntry:
        """The decision for ``key`` from a tuning result: install its best only when it is correct
        and beats cuSPARSE by the margin. A negative answer reached while candidates failed for
        the device's state (:data:`~torch_sparserl.evaluate.record.TRANSIENT_KINDS`) is no
        decision: :class:`TransientFailure`, nothing cached."""
        from .evaluate.record import TRANSIENT_KINDS, TransientFailure

        best, margin = result.best, self.settings.margin
        transient = [r for r in result.table if r.error_kind in TRANSIENT_KINDS]
        if transient and (best is None or (best.speedup or 0) < margin):
            first = transient[0].log.splitlines()[0][:300] if transient[0].log else str(transient[0].error_kind)
            raise TransientFailure(f"no {what} decided: {len(transient)} of {len(result.table)} evaluations failed "
                                   f"for the device's state at the time ({first}; {searched})")
        if best is None:
            return CacheEntry(key, None, reason=f"no correct {what} ({searched}; {_failures(result.table)})")
        if (best.speedup or 0) < margin:
            return CacheEntry(key, None, family=best.family, params=best.params, record=best.to_dict(),
                              reason=f"the best {what}, {best.family}, is {best.speedup or 0:.2f}x cuSPARSE, "
                                     f"under the {margin}x margin ({searched})")
        return CacheEntry(key, result.best_spec.source, family=best.family, params=best.params,
                          record=best.to_dict(), reason=f"{best.speedup:.2f}x cuSPARSE ({searched})")

    def close(self) -> None:
        self._matrix = None
        if self._sandbox is not None:
            self._sandbox.close()
            self._sandbox = None

    def abort(self) -> None:
        """At exit: kill the sandbox's worker now (a search under way fails at once); the
        runtime caches nothing of it."""
        sandbox = self._sandbox
        if sandbox is not None:
            sandbox.abort()


class learned_specializer(autotune_specializer):  # noqa: N801 - used like a function
    """Candidates from the shipped policy: K samples, the distinct ones screened in the sandbox,
    the fastest validated with the full evaluation. When the checkpoint does not load, every
    key goes to the autotuner instead (logged once).

    For a CUDA pattern the policy runs in the sandbox's worker
    (:class:`~torch_sparserl.policy.propose.SandboxedPolicy`): the user's process, where a
    training loop shares the interpreter lock with the background thread, neither loads it
    nor decodes with it. A CPU pattern (tests) uses it in this process."""

    def __init__(self, settings: RuntimeSettings, checkpoint=None):
        super().__init__(settings)
        from . import policy as _policy

        self.checkpoint = checkpoint or _policy.CHECKPOINT_DIR
        self._policy = None
        self.unavailable: str | None = None
        try:
            self.policy_id = f"learned:{_policy.checkpoint_id(self.checkpoint)}"
        except OSError as exc:
            self.unavailable = str(exc)
            self.policy_id = "autotune"
            log.warning("runtime: the learned policy is unavailable (%s); the autotuner specializes instead", exc)

    def _load(self, device):
        if torch.device(device).type == "cuda":
            if self._policy is None:
                from .policy.propose import SandboxedPolicy

                self._policy = SandboxedPolicy(self.sandbox, self.checkpoint)
            return self._policy
        from .policy import load_default

        return load_default(device, self.checkpoint)

    def prewarm(self, device: torch.device) -> None:
        super().prewarm(device)
        if self.unavailable is None and torch.device(device).type == "cuda":
            self._load(device).load()

    def __call__(self, key: SpecializationKey, crow: torch.Tensor, col: torch.Tensor, ncols: int) -> CacheEntry:
        if self.unavailable is not None or key.op not in POLICY_OPS:
            return super().__call__(key, crow, col, ncols)
        from .policy.propose import policy_tune

        policy = self._load(col.device if col.is_cuda else "cpu")
        matrix, known = self._problem(key, crow, col, ncols)
        result, proposals, _ = policy_tune(matrix, op=key.op, n=key.n, dtype=key.dtype, policy=policy,
                                           k=self.settings.k, **known)
        return self._entry(key, result, f"{result.screened} distinct of {len(proposals)} policy samples in "
                                        f"{result.elapsed_s:.1f} s", "policy sample")

    def close(self) -> None:
        super().close()
        self._policy = None  # it lived in the closed sandbox's worker


def _failures(records) -> str:
    """What became of a search's evaluations, by kind: ``failed: wrong 2, timeout 1``."""
    kinds = collections.Counter(str(r.error_kind) if r.error_kind is not None else "not judged" for r in records)
    return "failed: " + ", ".join(f"{name} {count}" for name, count in sorted(kinds.items())) if kinds else "none evaluated"


def settings_policy_id(settings: RuntimeSettings) -> str:
    """``learned:<checkpoint hash>`` for the learned policy (``autotune`` when no checkpoint
    is shipped, as :class:`learned_specializer` then does), else the policy's name."""
    if settings.policy != "learned":
        return settings.policy
    from . import policy as _policy

    try:
        return f"learned:{_policy.checkpoint_id()}"
    except OSError:
        return "autotune"


def default_specializer(settings: RuntimeSettings):
    return learned_specializer(settings) if settings.policy == "learned" else autotune_specializer(settings)


def entry_spec(entry: CacheEntry):
    """The :class:`~torch_sparserl.abi.KernelSpec` of a cache entry's kernel."""
    from .abi import KernelSpec

    return KernelSpec(entry.spec_source, entry.family, tuple(sorted(entry.params.items())))


def _library_built(entry: CacheEntry, arch: str) -> bool:
    from .build import inline

    return inline.is_built([entry_spec(entry)], arch)


def inline_installer(entry: CacheEntry, crow: torch.Tensor, col: torch.Tensor, ncols: int, *,
                     like: Callable | None = None) -> Callable:
    """Build (or load from disk) the entry's kernel, prepare its plan data once, bind them.
    ``like``: a launch of the same source on the same pattern (the interim NVRTC build's), whose
    plan data and index copies are taken instead of preparing them again."""
    return _bind_spec(entry_spec(entry), crow, col, ncols, entry.key.n, like=like)


def nvrtc_installer(entry: CacheEntry, crow: torch.Tensor, col: torch.Tensor, ncols: int) -> Callable:
    """The same as :func:`inline_installer` from the source's NVRTC build (held for the process's
    life by ``build.load_kernel``): the interim installer, while the library is built."""
    from .build import load_kernel

    spec = entry_spec(entry)
    return _bind_spec(spec, crow, col, ncols, entry.key.n, kernel=load_kernel(spec, "nvrtc"))


def fused_installer(spec, crow: torch.Tensor, col: torch.Tensor, ncols: int, n: int) -> Callable:
    """The installer of kernels with an epilogue: ``launch(crow, col, val, X, bias, scale)``."""
    return _bind_spec(spec, crow, col, ncols, n)


def _family_params(params: dict) -> dict:
    """A cache entry's family parameters as :func:`~torch_sparserl.families.render` takes them
    (entries of policy samples hold the text of their ``// family:`` line: ``"8"``, ``"(4,32)"``)."""
    out = {}
    for name, value in params.items():
        if isinstance(value, str) and value.isdigit():
            value = int(value)
        elif isinstance(value, str) and value.startswith("(") and value.endswith(")"):
            value = tuple(int(v) for v in value[1:-1].split(",") if v.strip())
        out[name] = value
    return out


def check_fused(launch: Callable, pattern: Pattern, crow, col, n: int, dtype: torch.dtype, epilogue: str) -> None:
    """Run a fused kernel once on fresh random operands, its output NaN-filled first, and compare
    with the float64 result of the product and the epilogue; raise when they differ."""
    from .dtypes import close_to_reference
    from .kernels import reference

    generator = torch.Generator(device=col.device).manual_seed(pattern.nnz * 7 + n)
    randn = lambda *shape: torch.randn(*shape, generator=generator, device=col.device).to(dtype)  # noqa: E731
    val, X = randn(pattern.nnz), randn(pattern.ncols, n)
    bias = randn(n) if "bias" in epilogue else None
    scale = randn(pattern.nrows) if "scale" in epilogue else None
    out = launch(crow, col, val, X, bias, scale)
    if col.device.type == "cuda":
        torch.cuda.synchronize(col.device)
    want = reference.spmm(pattern, crow, col, val.double(), X.double())
    if scale is not None:
        want = want * scale.double().unsqueeze(1)
    if bias is not None:
        want = want + bias.double()
    if "relu" in epilogue:
        want = want.relu()
    ok, why = close_to_reference(out, want, dtype)
    if not ok:
        raise SpecializationError(f"the fused kernel differs from the float64 reference: {why}")


@functools.lru_cache(maxsize=None)
def _openmp() -> bool:
    return "OpenMP" in torch.__config__.parallel_info()


@contextlib.contextmanager
def one_cpu_thread():
    """torch's CPU operators called from this thread use one core inside the block.

    For the runtime's background threads: their host work on a large pattern, parallel over
    every core, takes the cores that the training loop's thread needs to launch its next step.
    torch's intra-op thread count is per thread under OpenMP (the training thread keeps its
    own); the process-wide default it also sets, read by threads that start their first
    parallel operator meanwhile, is restored on leaving. Under another threading backend the
    count is the process's, so nothing is changed there.
    """
    previous = torch.get_num_threads()
    if previous == 1 or not _openmp():
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _bind_spec(spec, crow: torch.Tensor, col: torch.Tensor, ncols: int, n: int, kernel=None,
               like: Callable | None = None) -> Callable:
    """``spec``'s kernel (``kernel``, else its library's, built or loaded) with its plan data for
    this pattern: ``launch(crow, col, val, X, bias, scale)``. ``like``: a launch this function
    returned for the same source and the same pattern and width, whose plan data are reused."""
    from .abi import operand_shapes
    from .build import inline
    from .prepare import prepare

    if kernel is None:
        kernel = inline.build([spec])[spec.key]
    rows = crow.numel() - 1
    # What the kernel reads besides the operands (plan data, int32 copies of int64 indices) is
    # computed on the host, from the copy the fingerprint and the specializer read
    # (Pattern.host_indices), then copied over. On the device, prepare() would launch torch
    # kernels (a sort, a scan, repeat_interleave) that a training process has mostly never
    # launched, and CUDA's lazy module loading holds every launch in the process while it loads
    # them, stalling the training step beside the background install. On the host its time
    # goes mostly to torch ops that release the interpreter lock. They run on one core
    # (one_cpu_thread), so that they do not take the cores the training thread launches from.
    plan_data = (spec.key, n, ncols, crow.data_ptr(), col.data_ptr(), col.device)
    reused = getattr(like, "plan_data", None)
    if reused is not None and reused[0] == plan_data:
        prepared, copies = reused[1]
    else:
        with one_cpu_thread():
            host_crow, host_col = host_indices(crow, col, ncols)
            prepared = prepare(spec.plan, host_crow, host_col, (rows, ncols), n)
            if prepared.aux is not None:
                prepared = dataclasses.replace(prepared, aux=prepared.aux.to(col.device))
            # int64 patterns get int32 copies, owned here; int32 ones are used as passed, never
            # held, so an installed kernel does not keep the user's adjacency alive.
            copies = None
            if crow.dtype != torch.int32 or col.dtype != torch.int32:
                copies = tuple(t.to(torch.int32).contiguous().to(col.device) for t in (host_crow, host_col))
            del host_crow, host_col
        # The copies ran on this thread's stream (maybe a background thread's): finish them before
        # any stream uses their data.
        torch.cuda.synchronize(col.device)
    bound = kernel.bind(prepared)
    shape = operand_shapes(spec.plan.op, rows, ncols, col.numel(), n)["y"]
    device_index = col.device.index if col.device.index is not None else torch.cuda.current_device()
    raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    current_stream = ((lambda: raw_stream(device_index)) if raw_stream is not None
                      else (lambda: torch.cuda.current_stream(device_index).cuda_stream))

    init_zero = prepared.init_zero

    def launch(crow: torch.Tensor, col: torch.Tensor, val: torch.Tensor, X: torch.Tensor,
               bias: torch.Tensor | None = None, scale: torch.Tensor | None = None) -> torch.Tensor:
        if copies is not None:
            crow, col = copies
        # X has the dtype and device of val; one allocation call, zeroed when the plan says so
        y = X.new_zeros(shape) if init_zero else X.new_empty(shape)
        return bound(crow, col, val, X, y, current_stream(), zeroed=init_zero, bias=bias, scale=scale)

    launch.kernel = bound  # for explain and the benchmarks
    launch.plan_data = (plan_data, (prepared, copies))  # for the same source's next install (like=)
    if (kernel.launcher is not None or kernel.function is not None) and spec.plan.epilogue == "none":
        # what the C++ fast path needs to launch it without Python (fastpath.record): the C
        # launcher of a library, or the CUfunction of an NVRTC build (its shared memory limit
        # raised here, since its launches then bypass the module's)
        if kernel.launcher is None:
            kernel.allow_dynamic_smem(prepared.smem)
        launch.fast = SimpleNamespace(
            launcher=kernel.launcher or 0, function=kernel.function or 0, grid=prepared.grid, block=prepared.block,
            smem=prepared.smem,
            aux=prepared.aux, ints=(prepared.rows, prepared.cols, prepared.n, prepared.nnz, prepared.parts),
            init_zero=init_zero, work_numel=prepared.work_numel, copies=copies)
    return launch
