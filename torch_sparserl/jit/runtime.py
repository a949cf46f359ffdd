"""The JIT runtime: which kernel serves a (pattern, op, n, dtype), decided once, then reused.

Every CUDA product of the ``sparserl`` operators asks the process's runtime first
(:func:`active`); the transposed operators ask it for the transposed pattern, which is a
pattern like any other. Each (pattern, op, n, dtype) has one record in the runtime's
:class:`~torch_sparserl.jit.decisions.DecisionTable`, which the eager path, the operators and the
C++ fast path all read, so the hot path is a dictionary lookup and a launch:

* ``Installed`` — a validated specialized kernel bound to its prepared plan data: launched.
* ``Pending`` — specialization runs in the background; this call is served by cuSPARSE.
* ``Fallback`` — no kernel (none beat cuSPARSE by the margin, in GPU time or per call with the
  host's costs (:mod:`~torch_sparserl.jit.endtoend`), the problem is outside the
  kernel ABI, or specialization failed, with the reason logged once): cuSPARSE serves, and
  the decision is not revisited.

A miss computes the pattern's fingerprint, asks the :class:`~torch_sparserl.jit.cache.KernelCache`
(memory, then disk, shared between processes), and otherwise specializes: before the call
returns in ``mode="sync"`` (tests, benchmarks); in ``mode="background"`` (the default) the
call only records ``Pending`` and all of it, a cache hit's install too, runs in a
background thread, so a training loop never waits for a decision. The *specializer*
decides (by default: the autotuner, every candidate evaluated in the sandbox's child
process, chosen when it beats cuSPARSE by ``margin`` in GPU time, and installed only when it does
so per call too, host costs included); the
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

import contextlib
import functools
import logging
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from .. import config
from ..abi import DTYPES
from ..config import MODES, POLICIES, JitOptions  # noqa: F401 - MODES and POLICIES: their former home
from ..pattern import Pattern, run_kept
from ..pattern.fingerprint import SpecializationKey, fingerprint
from .specializers import POLICY_OPS, default_specializer, settings_policy_id
from .specializers import autotune_specializer, learned_specializer  # noqa: F401 - their former home
from . import classes, endtoend, fastpath
from .cache import CacheEntry, KernelCache
from .decisions import Decision, DecisionTable, Fallback, Installed, Pending, SpecializationError, not_yet
from .install import check_fused
from .install import family_params, fused_installer, inline_installer, library_built, nvrtc_installer

log = logging.getLogger("torch_sparserl.jit.runtime")

OPS = ("spmm", "spmv", "sddmm")  # kernel ops; the transposed operators use these on the transposed pattern
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}  # torch dtype -> ABI name
TRANSIENT_RETRIES = 1  # searches again after a TransientFailure, this process's cached memory released
_INT32_LIMIT = 2**31 - 1


RuntimeSettings = JitOptions
"""The runtime's settings: :class:`torch_sparserl.config.JitOptions` (mode, strict, margin,
budget_s, policy, k, idle_s, admit_calls, admit_age_s, queue)."""


Specializer = Callable[[SpecializationKey, torch.Tensor, torch.Tensor, int], CacheEntry]
Installer = Callable[[CacheEntry, torch.Tensor, torch.Tensor, int], Callable]

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


def _invalidator(runtime: "Runtime") -> Callable[[], None]:
    """``runtime.invalidate``, holding the runtime weakly (its decision table calls it)."""
    ref = weakref.ref(runtime)

    def invalidate() -> None:
        owner = ref()
        if owner is not None:
            owner.invalidate()
    return invalidate


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
                 interim_installer: Installer | None = None, devices: tuple[str, ...] = ("cuda",),
                 class_installer: Callable | None = None):
        self.settings = settings or RuntimeSettings()
        self._cache = cache
        self.specializer = specializer or default_specializer(self.settings)
        self.installer = installer or inline_installer
        # the installer's NVRTC twin, for the seconds its library takes to build (_install); a
        # custom installer has none unless one is given
        self.interim_installer = interim_installer or (nvrtc_installer if installer is None else None)
        self.fused_installer = fused_installer
        # a decided class's kernel as a launch on any pattern of the class: class_installer(entry)
        self.class_installer = class_installer or classes.sized_installer
        self.devices = devices
        self._classes = classes.ClassTable()  # young patterns' classes (jit/classes.py)
        self._arches: dict = {}  # device -> architecture name, for class keys
        # one record per (pattern, op, n, dtype): what serves it, read by every door
        self._decisions = DecisionTable(_invalidator(self))
        self._executor: ThreadPoolExecutor | None = None
        self._library_executor: ThreadPoolExecutor | None = None  # libraries built after interim installs
        self._in_flight = 0  # background tasks submitted and not finished
        self._decisions_in_flight = 0  # of them, decisions (the bounded queue: settings.queue)
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
        # calls served by cuSPARSE before their product was admitted (unadmitted: before its
        # admit_calls-th call; young: its pattern younger than admit_age_s); products not queued
        # because the queue was full; calls of young patterns served by their class's kernel (also
        # counted as installed calls) and classes decided (served or refused)
        self._stats = {"installed_calls": 0, "fallback_calls": 0, "installs": 0, "fallbacks": 0,
                       "jit_s": 0.0, "background_s": 0.0, "worker_stops": 0, "transient_retries": 0,
                       "interim_installs": 0, "unadmitted_calls": 0, "young_calls": 0, "dropped": 0,
                       "class_calls": 0, "class_decisions": 0}

    @property
    def stats(self) -> dict:
        """The counters above; the calls the C++ fast path served for this runtime are folded
        into ``installed_calls`` and ``fallback_calls`` when they are read."""
        fastpath.fold(self)
        return self._stats

    def decides_on(self, device: torch.device) -> bool:
        """Whether products on ``device`` get decisions (kernels) here; where not, cuSPARSE serves."""
        return self.settings.mode != "off" and device.type in self.devices

    def invalidate(self) -> None:
        """The one invalidation hook: drop every copy of this runtime's decisions (the C++
        registry's entries), so that the next call reads the decision records again. Called when
        a state a copy may repeat is replaced, and when the runtime stops being the active one."""
        fastpath.forget(self)

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
        decision = self._decisions.get(pattern, op, n, val.dtype)
        state = None if decision is None else decision.state
        if state is None:
            if X.is_cuda and not fastpath.loaded:
                fastpath.start()  # once per process: C++ serves the calls Python has served
            if not self.decides_on(X.device):
                return None
            state = self._resolve(op, n, pattern, crow, col, val.dtype)
        if state.__class__ is Installed:
            return self.launch(state.launch, crow, col, val, X)
        if state.__class__ is classes.Served:
            out = self._launch_class(state.launch, crow, col, val, X)
            if out is not None:
                return out
        elif state.__class__ is Fallback and self.settings.strict and not state.decided:
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

    def _launch_class(self, launch: Callable, crow, col, val: torch.Tensor, X: torch.Tensor) -> torch.Tensor | None:
        """A young pattern's product by its class's kernel (operands made contiguous and aligned
        as :meth:`launch` makes them), or None where the launch declines it."""
        if not X.is_contiguous() or X.data_ptr() % 16:
            X = X.clone(memory_format=torch.contiguous_format)
        if not val.is_contiguous() or val.data_ptr() % 16:
            val = val.clone(memory_format=torch.contiguous_format)
        out = launch(crow, col, val, X)
        if out is not None:
            stats = self._stats
            stats["installed_calls"] += 1
            stats["class_calls"] += 1
        return out

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
        decision = self._decisions.get(pattern, f"spmm+{epilogue}", n, val.dtype)
        state = None if decision is None else decision.state
        if state is None or (state.__class__ is Pending and state.future.done()):
            if not self.decides_on(X.device):
                return None
            state = self._resolve_fused(pattern, crow, col, val.dtype, n, epilogue)
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
        from ..specialize.families import EPILOGUE_FAMILIES

        for pattern, decision in self._decisions.items():
            # a forward product's epilogue: transposes (the backward's products) do not count
            if (decision.op, decision.n, decision.dtype) != ("spmm", n, dtype) or pattern.is_transpose \
                    or (pattern.nrows, pattern.nnz, pattern.ncols) != (nrows, nnz, ncols):
                continue
            state = decision.state
            if state.__class__ is Installed and state.entry is not None and state.entry.family in EPILOGUE_FAMILIES:
                return True
        return False

    def _resolve_fused(self, pattern, crow, col, dtype, n, epilogue):
        with self._lock:
            decision = self._decisions.record(pattern, f"spmm+{epilogue}", n, dtype)
            state = decision.state
            if state is not None and not (state.__class__ is Pending and state.future.done()):
                return state
            base = self.state("spmm", pattern, n, dtype)
            if base is None:
                base = self._resolve("spmm", n, pattern, crow, col, dtype)
            if base.__class__ is Pending:
                return base  # not decided yet: the unfused path serves, and asks again next call
            if base.__class__ is Fallback:
                return self._fallback(pattern, decision, None, f"no fused epilogue: the product itself is served "
                                      f"by cuSPARSE ({base.reason})", None, quiet=True)
            if self.settings.mode == "sync":
                with self._clock("jit_s"):
                    return self._install_fused(pattern, decision, base, crow, col, n, epilogue)
            state = Pending(base.key, self._in_background(self._install_fused, pattern, decision, base, crow, col, n,
                                                          epilogue))
            self._decisions.set(decision, state)
            return state

    def _install_fused(self, pattern, decision, base: Installed, crow, col, n, epilogue):
        from ..specialize.families import EPILOGUE_FAMILIES, render

        entry = base.entry
        family = entry.family if entry is not None else ""
        if family not in EPILOGUE_FAMILIES:
            return self._fallback(pattern, decision, base.key, f"no fused epilogue: the installed kernel "
                                  f"({family or 'unknown family'}) does not store each row once", None, quiet=True)
        try:
            spec = render(family, {**family_params(entry.params), "epilogue": epilogue}, op="spmm",
                          dtype=base.key.dtype, n=n)
            with _on_device(col):
                launch = run_kept(col.device, self.fused_installer, spec, crow, col, pattern.ncols, n)
                check_fused(launch, pattern, crow, col, n, DTYPES[base.key.dtype], epilogue)
        except Exception as exc:  # noqa: BLE001 - the unfused path is always there
            return self._fallback(pattern, decision, base.key, f"fused {family} with epilogue {epilogue} failed: "
                                  f"{type(exc).__name__}: {exc}", exc)
        state = Installed(base.key, launch, f"{family}(epilogue={epilogue})", f"fused into {base.description}", entry)
        self._set(pattern, decision, state)
        log.info("sparserl: spmm+%s n=%d %s -> %s", epilogue, n, base.key.dtype, state.description)
        return state

    # ------------------------------------------------------------------ decisions
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
                                 arch=_device_arch(col.device), policy=policy)

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
        if not admitted and self.young(pattern):
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
                return not_yet()
            if self.settings.mode == "sync":
                return self._decide(op, n, pattern, decision, crow, col, dtype)
            if not admitted and self._decisions_in_flight > self.settings.queue:  # one running, `queue` waiting
                self._stats["dropped"] += 1
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

    # ------------------------------------------------------------------ classes (jit/classes.py)
    def _class_state(self, op, n, pattern, crow, col, dtype) -> classes.Served | None:
        """The state serving a young pattern's call: its class's kernel, or None (cuSPARSE). The
        call is counted for its class, whose decision starts in the background once
        ``class_after`` of its patterns have been met."""
        device = col.device
        arch = self._arches.get(device)
        if arch is None:
            arch = self._arches[device] = _device_arch(device)
        dtype_name = DTYPE_NAMES.get(dtype)
        key = None if dtype_name is None else classes.key_of(op, n, dtype_name, pattern, arch, self.policy_id)
        if key is None:
            return None
        met = self._classes.meet(key, pattern, crow, col, self.settings.class_after)
        if met is None or met.__class__ is classes.Served:
            return met
        log.info("sparserl: %s n=%d %s: deciding the class %s of young patterns in the background",
                 op, n, dtype_name, key.pattern)
        self._in_background(self._decide_class, met, dtype)
        return None

    def _decide_class(self, record: classes.ClassRecord, dtype: torch.dtype):
        """Decide a class (the background thread): its kernel from the cache, or searched on the
        latest of its kept patterns; built; checked on the others. The record's state is set to
        the outcome: Served, or Fallback (refused). A search that failed for the device's state
        sets the class back to counting."""
        from ..evaluate.record import TransientFailure

        key = record.key
        kept = list(record.kept)
        pattern, crow, col = kept[-1]
        checks = kept[:-1][-classes.CHECKS:] or kept[-1:]
        try:
            with _on_device(col):
                if col.is_cuda:  # the kept patterns' indices were sent on the caller's streams
                    torch.cuda.synchronize(col.device)
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
                        raise _ShuttingDown("the process exits")
                    launch = self.class_installer(entry)
                    for other, other_crow, other_col in checks:
                        classes.check(launch, other, other_crow, other_col, key.op, key.n, dtype)
                    state = classes.Served(key, launch, f"{entry.family}{entry.params} for the class {key.pattern}",
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
        if state.__class__ is classes.Served:
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
        with _on_device(col):
            if col.is_cuda and torch.cuda.is_current_stream_capturing():
                return self._fallback(pattern, decision, None, "first asked for while a CUDA graph was being captured, "
                                      "where no decision can run (warm the graph up first)", None)
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
                    with self._specialize_lock, _on_device(col):
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
                        with _on_device(col):
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
            raise _ShuttingDown("the process exits")
        entry = self.specializer(key, crow, col, ncols)
        if self._closing:
            raise _ShuttingDown("the process exits")
        return entry

    def _install(self, pattern, decision, key, entry: CacheEntry, crow, col):
        if entry.spec_source is None:
            return self._fallback(pattern, decision, key, f"no kernel: {entry.reason}", None, quiet=True)
        # the kernel won on GPU time; installed only if it also wins per call, host costs included
        allowed, weighed = endtoend.gate(entry.record, decision.op, decision.dtype, col.device, self.settings.margin)
        if not allowed:
            return self._fallback(pattern, decision, key, f"no kernel: {entry.family} ({entry.reason}) is under "
                                  f"the {self.settings.margin}x margin end to end: {weighed}", None, quiet=True)
        if weighed:
            log.info("sparserl: %s n=%d: %s end to end: %s", decision.op, decision.n, entry.family, weighed)
        prebuild = getattr(self.specializer, "prebuild", None)
        arch = key.arch if key is not None else _device_arch(col.device)
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
        with _on_device(col):
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

    def _install_interim(self, pattern, decision, key, entry: CacheEntry, crow, col) -> Installed | None:
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
        decision = self._decisions.get(pattern, op, n, dtype)
        return None if decision is None else decision.state

    def decision(self, op: str, pattern: Pattern, n: int, dtype: torch.dtype) -> Decision:
        """The record of one (op, n, dtype) on ``pattern`` (created undecided when missing): what
        the eager path and the C++ fast path hold on to, to read its latest state."""
        return self._decisions.record(pattern, op, n, dtype)

    def explain(self, op: str, pattern: Pattern, n: int, dtype: torch.dtype) -> str:
        return self.describe(self.state(op, pattern, n, dtype))

    def decisions(self, crow: torch.Tensor, col: torch.Tensor, ncols: int) -> dict[str, str]:
        """What serves each product this runtime was asked for on the pattern (``A``), on
        its transpose (``At``, the backward), and on their block-diagonal forms for attention
        heads (``A heads=4``, ``At heads=4``): ``{"A spmm n=128 float32": "installed: ..."}``."""
        from ..pattern import lookup

        entry = lookup(crow, col, ncols)
        found = {}
        forms = [("A", entry), ("At", entry.transpose(crow, col)[0])]
        for heads, form, form_t in entry.heads_forms():
            forms += [(f"A heads={heads}", form)] + ([(f"At heads={heads}", form_t)] if form_t is not None else [])
        for label, pattern in forms:
            for decision in self._decisions.of(pattern):
                if decision.state is not None:
                    found[f"{label} {decision.op} n={decision.n} {str(decision.dtype).replace('torch.', '')}"] = \
                        self.describe(decision.state)
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
        self.invalidate()
        self._classes.clear()
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
    if previous is not runtime and previous is not None:
        previous.invalidate()  # the C++ registry repeats the decisions of the active runtime only
    return previous


def active_or_none() -> Runtime | None:
    return _ACTIVE


def configure(settings: RuntimeSettings | None = None, **changes) -> Runtime:
    """Replace the process's runtime: ``configure(mode="sync")``, ``configure(strict=True)``.

    ``changes`` name fields of :class:`RuntimeSettings` (``mode``, ``strict``, ``margin``,
    ``budget_s``, ``policy``, ``k``, ``idle_s``, ``admit_calls``, ``admit_age_s``, ``queue``); another name is a TypeError listing them.
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
