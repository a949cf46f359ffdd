"""Specializers: the search that decides which kernel serves a key, or that none does.

A specializer is called as ``specializer(key, crow, col, ncols) -> CacheEntry`` by the
runtime (:mod:`~torch_sparserl.jit.runtime`), in its background thread, one search at a time. Its
entry holds the kernel's source when a candidate was correct and beat cuSPARSE by the
settings' ``margin``, and otherwise the reason none serves. Two are shipped:

* :class:`autotune_specializer` — the autotuner's candidates
  (:mod:`~torch_sparserl.specialize.autotune`) under the settings' time budget;
* :class:`learned_specializer` — the K kernels the shipped policy is likeliest to write
  (:mod:`~torch_sparserl.specialize.policy`), the autotuner's where the policy has no kernel space.

Every candidate runs first in the sandbox's child process
(:mod:`~torch_sparserl.evaluate.sandbox`), so a kernel that crashes or hangs costs a search,
never the user's process.
"""

from __future__ import annotations

import logging

import torch

from ..config import JitOptions
from . import classes
from .cache import CacheEntry
from .decisions import SpecializationError
from .install import entry_spec
from ..pattern import host_indices
from ..pattern.fingerprint import SpecializationKey

log = logging.getLogger("torch_sparserl.jit.specializers")

POLICY_OPS = ("spmm", "spmv")  # what the learned policy was trained on; the autotuner specializes the rest
PREBUILD_TIMEOUT_S = 300.0  # building one installed kernel's library in the sandbox's worker


class autotune_specializer:  # noqa: N801 - used like a function
    """Candidates from the autotuner under the settings' budget, each run first in the
    sandbox's child process; one sandbox is kept for the runtime's life."""

    _FEATURES_KEPT = 16  # patterns whose structural features are remembered

    def __init__(self, settings: JitOptions):
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
        if kept is not None and kept[0] == key.pattern and not classes.is_class(key):
            matrix, name = kept[1], key.pattern
        else:
            matrix = (*host_indices(crow, col, ncols), (crow.numel() - 1, ncols))
            name = key.pattern
            if classes.is_class(key):  # the class's pattern searched on: named by its own hash
                from ..pattern.fingerprint import pattern_hash

                name = pattern_hash(matrix[0], matrix[1], ncols)
            self._matrix = (name, matrix)
        if name not in self._features:
            from ..pattern.features import structural_features

            while len(self._features) >= self._FEATURES_KEPT:
                self._features.pop(next(iter(self._features)))
            self._features[name] = structural_features(*matrix)
        return matrix, {"sandbox": self.sandbox, "features": self._features[name], "matrix_key": name}

    @property
    def sandbox(self):
        """The sandbox kept for the runtime's life (its worker starts on first use)."""
        if self._sandbox is None:
            from ..evaluate.sandbox import Sandbox

            self._sandbox = Sandbox()
        return self._sandbox

    def __call__(self, key: SpecializationKey, crow: torch.Tensor, col: torch.Tensor, ncols: int) -> CacheEntry:
        from ..specialize.autotune import tune

        matrix, known = self._problem(key, crow, col, ncols)
        # a class's kernel serves patterns it was not searched on: pattern-free candidates only
        only = classes.accepts if classes.is_class(key) else None
        result = tune(matrix, op=key.op, n=key.n, dtype=key.dtype, budget_s=self.settings.budget_s, only=only,
                      **known)
        return self._entry(key, result, f"{result.screened}/{result.candidates} candidates screened in "
                                        f"{result.elapsed_s:.1f} s", "candidate")

    def prewarm(self, device: torch.device) -> None:
        """Start the sandbox's worker (its CUDA context), as the first key would."""
        self.sandbox.worker_info  # noqa: B018 - starts the worker

    def prebuild(self, entry: CacheEntry, arch: str) -> None:
        """Build the library of ``entry``'s kernel in the sandbox's worker, when the worker is
        running (it just specialized the key) and the library is not on disk, so that the
        installer in this process only loads it (``toolchain.inline.prebuild``). A worker is not
        started for it: where none runs (a later run, its decisions from the disk cache), the
        installer builds a missing library itself."""
        from ..toolchain import inline

        specs = [entry_spec(entry)]
        if self._sandbox is None or self._sandbox.worker_pid is None or inline.is_built(specs, arch):
            return
        outcome = self.sandbox.run(inline.prebuild, (specs, arch), timeout_s=PREBUILD_TIMEOUT_S)
        if not outcome.ok:
            raise SpecializationError(f"{outcome.status}: {outcome.error}")

    def _entry(self, key: SpecializationKey, result, searched: str, what: str) -> CacheEntry:
        """The decision for ``key`` from a tuning result, as the verdict has it
        (:func:`~torch_sparserl.evaluate.verdict.judge`): its best installs when it is correct
        and beats cuSPARSE by the margin. A negative answer reached while candidates failed for
        the device's state raises :class:`~torch_sparserl.evaluate.record.TransientFailure`:
        nothing is cached."""
        from ..evaluate import verdict

        found = verdict.judge(result.best, result.table, self.settings.margin, searched, what)
        if found.record is None:
            return CacheEntry(key, None, reason=found.reason)
        best = found.record
        return CacheEntry(key, result.best_spec.source if found.serves else None, family=best.family,
                          params=best.params, record=best.to_dict(), reason=found.reason)

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
    """Candidates from the shipped policy: the K kernels it is likeliest to write, compiled
    together and screened in the sandbox, the fastest validated with the full evaluation.
    When the checkpoint does not load, every key goes to the autotuner instead (logged once).

    For a CUDA pattern the policy runs in the sandbox's worker
    (:class:`~torch_sparserl.specialize.policy.propose.SandboxedPolicy`): the user's process, where a
    training loop shares the interpreter lock with the background thread, neither loads it
    nor runs it. A CPU pattern (tests) uses it in this process."""

    def __init__(self, settings: JitOptions, checkpoint=None):
        super().__init__(settings)
        from ..specialize import policy as _policy

        self.checkpoint = checkpoint or _policy.CHECKPOINT_DIR
        self._policy = None
        self.unavailable: str | None = None
        try:
            self.policy_id = learned_id(self.checkpoint)
        except OSError as exc:
            self.unavailable = str(exc)
            self.policy_id = "autotune"
            log.warning("runtime: the learned policy is unavailable (%s); the autotuner specializes instead", exc)

    def _load(self, device):
        if torch.device(device).type == "cuda":
            if self._policy is None:
                from ..specialize.policy.propose import SandboxedPolicy

                self._policy = SandboxedPolicy(self.sandbox, self.checkpoint)
            return self._policy
        from ..specialize.policy import load_default

        return load_default(device, self.checkpoint)

    def prewarm(self, device: torch.device) -> None:
        super().prewarm(device)
        if self.unavailable is None and torch.device(device).type == "cuda":
            self._load(device).load()

    def __call__(self, key: SpecializationKey, crow: torch.Tensor, col: torch.Tensor, ncols: int) -> CacheEntry:
        if self.unavailable is not None or key.op not in POLICY_OPS or classes.is_class(key):
            # the policy writes kernels for one pattern; a class's are the autotuner's pattern-free ones
            return super().__call__(key, crow, col, ncols)
        from ..specialize.policy.propose import policy_tune

        policy = self._load(col.device if col.is_cuda else "cpu")
        matrix, known = self._problem(key, crow, col, ncols)
        result, proposals, _ = policy_tune(matrix, op=key.op, n=key.n, dtype=key.dtype, policy=policy,
                                           k=self.settings.k, **known)
        return self._entry(key, result, f"{result.screened} distinct of {len(proposals)} policy kernels in "
                                        f"{result.elapsed_s:.1f} s", "policy kernel")

    def close(self) -> None:
        super().close()
        self._policy = None  # it lived in the closed sandbox's worker


def learned_id(checkpoint=None) -> str:
    """``learned:<checkpoint hash>/rank``: the weights and how candidates are drawn from them.
    Decisions cached under another proposer (``/rank`` was absent while the runtime sampled
    the policy) are not read: the kernels are decided again."""
    from ..specialize import policy as _policy

    return f"learned:{_policy.checkpoint_id(checkpoint or _policy.CHECKPOINT_DIR)}/rank"


def settings_policy_id(settings: JitOptions) -> str:
    """:func:`learned_id` for the learned policy (``autotune`` when no checkpoint
    is shipped, as :class:`learned_specializer` then does), else the policy's name."""
    if settings.policy != "learned":
        return settings.policy
    try:
        return learned_id()
    except OSError:
        return "autotune"


def default_specializer(settings: JitOptions):
    return learned_specializer(settings) if settings.policy == "learned" else autotune_specializer(settings)
