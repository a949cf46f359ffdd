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

The runtime is one class made of parts, each in its own module: this one holds the hot
path (:meth:`Runtime.call`, :meth:`Runtime.launch`), what a runtime reports, and the process's
runtime (:func:`active`, :func:`configure`); admission and the decision flow are
:mod:`~torch_sparserl.jit.decide`'s, class kernels :mod:`~torch_sparserl.jit.classes`', fused
epilogues :mod:`~torch_sparserl.jit.fused`', and the background thread, the specializer's worker
and the exit :mod:`~torch_sparserl.jit.workers`'.

Settings (:class:`torch_sparserl.config.JitOptions`) come
from :func:`configure` or the ``SPARSERL_JIT*`` environment variables, read when the process's
runtime is created (:mod:`torch_sparserl.config` lists them).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable

import torch

from .. import config
from ..config import JitOptions
from ..pattern import Pattern
from ..pattern.fingerprint import SpecializationKey
from .specializers import default_specializer, settings_policy_id  # noqa: F401 - settings_policy_id: the CLI's
from . import classes, fastpath
from .cache import CacheEntry, KernelCache
from .classes import ClassKernels
from .decide import OPS, Deciding  # noqa: F401 - OPS: the ops the compiler prespecializes
from .decisions import Decision, DecisionTable, Fallback, Installed, Pending, SpecializationError
from .fused import FusedInstalls
from .install import DTYPE_NAMES, fused_installer, inline_installer, nvrtc_installer
from .workers import Workers


Specializer = Callable[[SpecializationKey, torch.Tensor, torch.Tensor, int], CacheEntry]
Installer = Callable[[CacheEntry, torch.Tensor, torch.Tensor, int], Callable]


def _invalidator(runtime: "Runtime") -> Callable[[], None]:
    """``runtime.invalidate``, holding the runtime weakly (its decision table calls it)."""
    ref = weakref.ref(runtime)

    def invalidate() -> None:
        owner = ref()
        if owner is not None:
            owner.invalidate()
    return invalidate


class Runtime(Deciding, ClassKernels, FusedInstalls, Workers):
    """The JIT runtime of a process (or of a test): one decision record per product, read by
    every door. Its parts: :class:`~torch_sparserl.jit.decide.Deciding`,
    :class:`~torch_sparserl.jit.classes.ClassKernels`, :class:`~torch_sparserl.jit.fused.FusedInstalls`,
    :class:`~torch_sparserl.jit.workers.Workers`."""

    def __init__(self, settings: JitOptions | None = None, *, cache: KernelCache | None = None,
                 specializer: Specializer | None = None, installer: Installer | None = None,
                 interim_installer: Installer | None = None, devices: tuple[str, ...] = ("cuda",),
                 class_installer: Callable | None = None):
        self.settings = settings or JitOptions()
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
        # one record per (pattern, op, n, dtype): what serves it, read by every door
        self._decisions = DecisionTable(_invalidator(self))
        # Bumped by every invalidation (a pending decision landed, a kernel was replaced, the
        # runtime closed or stopped being the active one): a copy of the decisions made when
        # it had another value may be stale. One int: a captured step compares it per replay.
        self.epoch = 0
        self.closed = False  # close() ran
        self._lock = threading.RLock()  # reentrant: sync mode specializes inside _resolve
        self._specialize_lock = threading.Lock()  # one specialization at a time (one sandbox, one GPU)
        # calls served by a kernel / by cuSPARSE; kernels installed (from the cache or freshly
        # specialized: the cache's own stats count the builds); fallback decisions taken;
        # seconds products waited for decisions (fingerprint, cache, and in sync mode the
        # specialization and build: the JIT cost a training loop sees) and seconds the
        # background thread spent deciding; the idle worker's stops; searches run again after
        # a TransientFailure; kernels served from their NVRTC build while their library was built
        # calls served by cuSPARSE before their product was admitted (unadmitted: before its
        # admit_calls-th call; young: its pattern younger than admit_age_s); products not queued
        # because the queue was full; calls of young patterns served by their class's kernel (also
        # counted as installed calls) and classes decided (served or refused); unasked_kept: those of
        # the first three during a capture_step warm-up, on patterns older than the call (decide.warming)
        self._stats = {"installed_calls": 0, "fallback_calls": 0, "installs": 0, "fallbacks": 0,
                       "jit_s": 0.0, "background_s": 0.0, "worker_stops": 0, "transient_retries": 0,
                       "interim_installs": 0, "unadmitted_calls": 0, "young_calls": 0, "dropped": 0,
                       "class_calls": 0, "class_decisions": 0, "unasked_kept": 0}
        self._init_deciding()
        self._init_classes()
        self._init_workers()

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
        a state a copy may repeat is replaced, and when the runtime stops being the active one or
        closes. Bumps :attr:`epoch`, which what copied the decisions elsewhere (the CUDA graph of
        :func:`torch_sparserl.capture_step`) compares."""
        self.epoch += 1
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


    def state(self, op: str, pattern: Pattern, n: int, dtype: torch.dtype):
        """The state of one (op, n, dtype) on ``pattern``, or None when it was never asked for."""
        decision = self._decisions.get(pattern, op, n, dtype)
        return None if decision is None else decision.state

    def decision(self, op: str, pattern: Pattern, n: int, dtype: torch.dtype) -> Decision:
        """The record of one (op, n, dtype) on ``pattern`` (created undecided when missing): what
        the eager path and the C++ fast path hold on to, to read its latest state."""
        return self._decisions.record(pattern, op, n, dtype)

    def records(self) -> list[tuple[object, object]]:
        """``(owner, record)`` for every record whose state may serve a product now: the decision
        records of the live patterns (owner: the pattern) and the class records (owner: the
        class's key, :mod:`~torch_sparserl.jit.classes`). What a CUDA graph captured now may
        launch is among their states: :func:`torch_sparserl.capture_step` keeps those and their
        patterns alive while its graph lives, and compares the states when :attr:`epoch` moves."""
        return list(self._decisions.items()) + [(record.key, record) for record in self._classes.records()]

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
        self.closed = True
        self.invalidate()
        self._classes.clear()
        self._stop_workers()


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


def configure(settings: JitOptions | None = None, **changes) -> Runtime:
    """Replace the process's runtime: ``configure(mode="sync")``, ``configure(strict=True)``.

    ``changes`` name fields of :class:`JitOptions` (``mode``, ``strict``, ``margin``,
    ``budget_s``, ``policy``, ``k``, ``idle_s``, ``admit_calls``, ``admit_age_s``, ``queue``); another name is a TypeError listing them.
    Unnamed settings keep their current values (the environment's, before the first runtime).
    Decisions of the previous runtime are not reused (they may have been taken under other
    settings); its disk cache is.
    """
    global _ACTIVE
    if settings is not None and not isinstance(settings, JitOptions):
        raise TypeError(f"configure: settings must be a JitOptions (got {type(settings).__name__})")
    with _ACTIVE_LOCK:
        previous = _ACTIVE
        base = settings or (previous.settings if previous is not None else config.from_environment().jit)
        new_settings = base.replace("configure", **changes)
        _ACTIVE = Runtime(new_settings, cache=previous._cache if previous is not None else None)
    if previous is not None:
        previous.close()  # which empties the C++ registry of its decisions
    return _ACTIVE
