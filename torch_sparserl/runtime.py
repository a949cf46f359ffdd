"""The JIT runtime: which kernel serves a (pattern, op, n, dtype), decided once, then reused.

State per key lives on the pattern's cache entry (:class:`~torch_sparserl.pattern.Pattern`,
keyed by tensor identity and version), so the hot path is a dictionary lookup:

* ``Installed`` — a validated specialized kernel with its prepared plan data: launched.
* ``Pending`` — specialization runs in the background; this call is served by cuSPARSE.
* ``Fallback`` — no kernel (none beat cuSPARSE by the margin, or specialization failed, with
  the reason logged once): cuSPARSE serves, and the decision is not revisited.

A miss computes the pattern's fingerprint, asks the :class:`~torch_sparserl.cache.KernelCache`
(memory, then disk, shared between processes), and otherwise specializes: at once in
``mode="sync"`` (tests, benchmarks), in a background thread in ``mode="background"``. The
*specializer* decides (by default: the autotuner, every candidate evaluated in the sandbox's
child process, installed only when it beats cuSPARSE by ``margin``); the *installer* turns a
cache entry into a launchable kernel (by default: the lean extension build). Both are
injectable, which is how every fallback path is tested without a GPU.

``strict=True`` raises :class:`SpecializationError` from the call where the runtime would
fall back because something failed (a decision that cuSPARSE is faster is not a failure).
:meth:`Runtime.call` returns None when cuSPARSE should serve the call.

Status: not yet called by the operators — issue 4 connects ``ops._kernels`` to it once the
GPU path has run on the device.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from .abi import DTYPES
from .cache import CacheEntry, KernelCache
from .fingerprint import SpecializationKey, fingerprint
from .pattern import Pattern

log = logging.getLogger("torch_sparserl.runtime")

MODES = ("background", "sync", "off")
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}  # torch dtype -> ABI name


class SpecializationError(RuntimeError):
    """Raised instead of falling back when ``strict=True``."""


@dataclass(frozen=True)
class RuntimeSettings:
    mode: str = "background"
    """``background``: cuSPARSE serves while a kernel is specialized in a thread; ``sync``:
    specialize before returning; ``off``: always cuSPARSE."""
    strict: bool = False
    """Raise instead of falling back (tests)."""
    margin: float = 1.05
    """Install a kernel only when it is at least this much faster than cuSPARSE."""
    budget_s: float = 20.0
    """Autotuning budget per key."""
    policy: str = "autotune"
    """Where candidates come from; part of the cache key."""

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"RuntimeSettings: mode must be one of {MODES} (got {self.mode!r})")
        if self.margin < 1.0:
            raise ValueError(f"RuntimeSettings: margin must be >= 1.0 (got {self.margin})")
        if self.budget_s <= 0:
            raise ValueError(f"RuntimeSettings: budget_s must be > 0 (got {self.budget_s})")


@dataclass
class Installed:
    key: SpecializationKey
    launch: Callable  # launch(val, X) -> Y, on the pattern's device and stream
    description: str = ""


@dataclass
class Pending:
    key: SpecializationKey
    future: Future


@dataclass
class Fallback:
    key: SpecializationKey | None
    reason: str
    decided: bool = False  # True: a decision (no kernel beat cuSPARSE), not a failure


Specializer = Callable[[SpecializationKey, torch.Tensor, torch.Tensor, int], CacheEntry]
Installer = Callable[[CacheEntry, torch.Tensor, torch.Tensor, int], Callable]


def _device_arch(device: torch.device) -> str:
    if device.type != "cuda":
        return device.type
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}"


class Runtime:
    def __init__(self, settings: RuntimeSettings | None = None, *, cache: KernelCache | None = None,
                 specializer: Specializer | None = None, installer: Installer | None = None,
                 devices: tuple[str, ...] = ("cuda",)):
        self.settings = settings or RuntimeSettings()
        self._cache = cache
        self.specializer = specializer or autotune_specializer(self.settings)
        self.installer = installer or inline_installer
        self.devices = devices
        self._executor: ThreadPoolExecutor | None = None
        self._lock = threading.RLock()  # reentrant: sync mode specializes inside _resolve
        self.stats = {"installed_calls": 0, "fallback_calls": 0, "specialized": 0, "fallbacks": 0}

    @property
    def cache(self) -> KernelCache:
        if self._cache is None:
            self._cache = KernelCache()
        return self._cache

    # ------------------------------------------------------------------ hot path
    def call(self, op: str, pattern: Pattern, crow: torch.Tensor, col: torch.Tensor, val: torch.Tensor,
             X: torch.Tensor) -> torch.Tensor | None:
        """``A @ X`` with the pattern's specialized kernel, or None: cuSPARSE serves this call."""
        if self.settings.mode == "off" or X.device.type not in self.devices or val.dtype not in DTYPE_NAMES:
            return None
        n = X.shape[1] if X.dim() == 2 else 1
        state = pattern.specializations.get((op, n, val.dtype))
        if state is None:
            state = self._resolve(op, n, pattern, crow, col, val.dtype)
        elif isinstance(state, Pending) and state.future.done():
            state = pattern.specializations[(op, n, val.dtype)]
        if isinstance(state, Fallback) and self.settings.strict and not state.decided:
            raise SpecializationError(f"sparserl runtime: {op} n={n} {DTYPE_NAMES[val.dtype]}: {state.reason}")
        if isinstance(state, Installed):
            if not (X.is_contiguous() and val.is_contiguous() and X.data_ptr() % 16 == 0):
                # The kernels' vector loads need contiguous, 16-byte-aligned operands.
                self.stats["fallback_calls"] += 1
                return None
            self.stats["installed_calls"] += 1
            return state.launch(val, X)
        self.stats["fallback_calls"] += 1
        return None

    # ------------------------------------------------------------------ decisions
    def _key(self, op: str, n: int, pattern: Pattern, crow, col, dtype) -> SpecializationKey:
        return SpecializationKey(pattern=fingerprint(pattern, crow, col), op=op, n=n, dtype=DTYPE_NAMES[dtype],
                                 arch=_device_arch(col.device), policy=self.settings.policy)

    def _resolve(self, op, n, pattern, crow, col, dtype):
        slot = (op, n, dtype)
        with self._lock:
            state = pattern.specializations.get(slot)
            if state is not None:
                return state
            try:
                key = self._key(op, n, pattern, crow, col, dtype)
            except Exception as exc:  # noqa: BLE001 - fingerprinting must not break a product
                return self._fallback(pattern, slot, None, f"fingerprint failed: {exc}", exc)
            entry = self.cache.get(key)
            if entry is not None:
                return self._install(pattern, slot, key, entry, crow, col)
            if self.settings.mode == "sync":
                return self._specialize(pattern, slot, key, crow, col)
            # The worker's final state is written under this lock, so it cannot be
            # overwritten by the Pending set here.
            future = self._pool().submit(self._specialize, pattern, slot, key, crow, col)
            pattern.specializations[slot] = Pending(key, future)
            return pattern.specializations[slot]

    def _specialize(self, pattern, slot, key, crow, col):
        try:
            entry = self.cache.get_or_create(key, lambda k: self.specializer(k, crow, col, pattern.ncols))
        except Exception as exc:  # noqa: BLE001 - any failure falls back, loudly
            return self._fallback(pattern, slot, key, f"specialization failed: {type(exc).__name__}: {exc}", exc)
        return self._install(pattern, slot, key, entry, crow, col)

    def _install(self, pattern, slot, key, entry: CacheEntry, crow, col):
        if entry.spec_source is None:
            return self._fallback(pattern, slot, key, f"no kernel: {entry.reason}", None, quiet=True)
        try:
            launch = self.installer(entry, crow, col, pattern.ncols)
        except Exception as exc:  # noqa: BLE001
            return self._fallback(pattern, slot, key, f"installing {entry.family} failed: {exc}", exc)
        state = Installed(key, launch, f"{entry.family}{entry.params}")
        self._set(pattern, slot, state)
        self.stats["specialized"] += 1
        log.info("sparserl: %s n=%d %s -> %s (%s)", key.op, key.n, key.dtype, state.description, entry.reason)
        return state

    def _set(self, pattern, slot, state) -> None:
        with self._lock:
            pattern.specializations[slot] = state

    def _fallback(self, pattern, slot, key, reason: str, exc: BaseException | None, quiet: bool = False):
        state = Fallback(key, reason, decided=quiet)
        self._set(pattern, slot, state)
        self.stats["fallbacks"] += 1
        what = f"{slot[0]} n={slot[1]} {DTYPE_NAMES.get(slot[2], slot[2])}"
        (log.info if quiet else log.warning)("sparserl: %s falls back to cuSPARSE: %s", what, reason,
                                             exc_info=exc if exc is not None and not quiet else None)
        return state

    def _pool(self) -> ThreadPoolExecutor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sparserl-specialize")
        return self._executor

    def wait(self, timeout: float | None = None) -> None:
        """Block until background specializations submitted so far are done (tests, benchmarks)."""
        if self._executor is not None:
            self._executor.submit(lambda: None).result(timeout)

    def explain(self, op: str, pattern: Pattern, n: int, dtype: torch.dtype) -> str:
        state = pattern.specializations.get((op, n, dtype))
        if state is None:
            return "not specialized yet"
        if isinstance(state, Installed):
            return f"installed: {state.description}"
        if isinstance(state, Pending):
            return "specializing in the background"
        return f"cuSPARSE: {state.reason}"


# ---------------------------------------------------------------------------- defaults

def autotune_specializer(settings: RuntimeSettings) -> Specializer:
    """Candidates from the exhaustive autotuner, each run first in the sandbox's child process."""

    def specialize(key: SpecializationKey, crow: torch.Tensor, col: torch.Tensor, ncols: int) -> CacheEntry:
        from .autotune import tune

        op = "spmv" if key.op == "spmv" else "spmm"
        rows = crow.numel() - 1
        result = tune((crow.cpu(), col.cpu(), (rows, ncols)), op=op, n=key.n, dtype=key.dtype,
                      budget_s=settings.budget_s)
        best = result.best
        if best is None:
            return CacheEntry(key, None, reason=f"no correct candidate among {result.screened}")
        if (best.speedup or 0) < settings.margin:
            return CacheEntry(key, None, family=best.family, params=best.params, record=best.to_dict(),
                              reason=f"best {best.family} is {best.speedup:.2f}x cuSPARSE, "
                                     f"under the {settings.margin}x margin")
        return CacheEntry(key, result.best_spec.source, family=best.family, params=best.params,
                          record=best.to_dict(), reason=f"{best.speedup:.2f}x cuSPARSE")

    return specialize


def inline_installer(entry: CacheEntry, crow: torch.Tensor, col: torch.Tensor, ncols: int) -> Callable:
    """Build (or load from disk) the entry's kernel and prepare its plan data once."""
    from .abi import KernelSpec
    from .build import inline
    from .prepare import prepare

    spec = KernelSpec(entry.spec_source, entry.family, tuple(sorted(entry.params.items())))
    kernel = inline.build([spec])[spec.key]
    rowptr32, col32 = crow.to(torch.int32).contiguous(), col.to(torch.int32).contiguous()
    rows = rowptr32.numel() - 1
    op, n = spec.plan.op, entry.key.n
    prepared = prepare(spec.plan, rowptr32, col32, (rows, ncols), n)

    def launch(val: torch.Tensor, X: torch.Tensor) -> torch.Tensor:
        y = torch.empty((rows, n) if X.dim() == 2 else (rows,), dtype=val.dtype, device=val.device)
        kernel(rowptr32, col32, val, X, y, prepared, check=False)
        return y

    return launch
