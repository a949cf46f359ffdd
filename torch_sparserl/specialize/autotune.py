"""The exhaustive autotuner: the oracle the learned policy is measured against.

For one (pattern, op, N, dtype) it renders every (family, parameters) point of
:func:`torch_sparserl.specialize.families.space`, screens them all in the evaluator's sandbox with a
cheap configuration (one correctness trial, a few timed runs), then evaluates the fastest
few again with the full configuration (fresh trials, determinism check, cuSPARSE timed in
the same run) and returns the best correct kernel with the whole table
(:mod:`~torch_sparserl.specialize.search`, which the learned policy's candidates go through
too). A time budget bounds the screening; the final stage always runs for what was screened.

Every candidate runs first in the sandbox's child process: a kernel that crashes or
hangs costs its own record and a worker restart, never the caller.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .. import config
from ..abi import KernelSpec
from ..evaluate.config import EvalConfig
from ..evaluate.record import EvalRecord, dtype_name
from ..evaluate.sandbox import Sandbox
from ..pattern.features import window_reuse
from . import search

log = logging.getLogger("torch_sparserl.specialize.autotune")

# The runtime's evaluations share the GPU with the training loop they serve. Timed in bursts
# of N runs with 1 ms gaps, the loop's kernels could run between them instead of waiting
# behind a whole timing loop. Off (0) by default: with bursts of 4 a first run's stalls were
# no fewer, while the kernels took longer to decide. SPARSERL_EVAL_BURST_REPS=N turns them on.


RUNTIME_BURST_REPS = config.read("specializer.eval_burst_reps")
# Screening shares one cuSPARSE timing per problem (taken in the final stage), not one per candidate.
# The runtime's decisions read no spill count: neither configuration builds a kernel again
# with nvcc to count them (training's reward does, through its own configuration).
SCREEN_CONFIG = EvalConfig(trials=1, reps=10, warmup=2, check_determinism=False, baseline=False,
                           burst_reps=RUNTIME_BURST_REPS, count_spills=False)
FINAL_CONFIG = EvalConfig(trials=3, reps=30, warmup=5, check_determinism=True, burst_reps=RUNTIME_BURST_REPS,
                          count_spills=False)
DEFAULT_TOP_K = 4
# Candidates compiled together before they are screened one by one (the policy's K are too).
PREBUILD_CHUNK = 8
DEFAULT_BUDGET_S = 120.0


@dataclass
class TuneResult:
    """The oracle's answer for one (pattern, op, n, dtype): the best kernel and every record."""

    op: str
    n: int
    dtype: str
    features: dict
    best: EvalRecord | None
    best_spec: KernelSpec | None
    table: list[EvalRecord] = field(default_factory=list)
    cusparse_us: float | None = None
    elapsed_s: float = 0.0
    screened: int = 0
    candidates: int = 0
    budget_exhausted: bool = False
    budget_s: float | None = None  # the screening budget applied (max_budget_s lets it grow)

    @property
    def speedup(self) -> float | None:
        return self.best.speedup if self.best is not None else None

    def summary(self) -> str:
        if self.best is None:
            return (f"{self.op} n={self.n} {self.dtype}: no correct candidate among {self.screened} "
                    f"(cuSPARSE {self.cusparse_us} us)")
        return (f"{self.op} n={self.n} {self.dtype}: best {self.best.family}{self.best.params} "
                f"{self.best.runtime_us:.2f} us vs cuSPARSE {self.best.cusparse_us:.2f} us "
                f"({self.best.speedup:.2f}x), {self.screened}/{self.candidates} screened in {self.elapsed_s:.0f} s")


def candidates(op: str, n: int, dtype: str, features: dict, families: list[str] | None = None,
               only: Callable[[KernelSpec], bool] | None = None, opt_in: tuple[str, ...] = ()) -> list[KernelSpec]:
    """Render the families' parameter space for this problem (deduplicated by source);
    ``families`` and ``only`` (a test of the rendered spec) narrow it; ``opt_in`` adds families
    the default space leaves out (``families.OPT_IN_FAMILIES``)."""
    from . import families as fam

    specs: dict[str, KernelSpec] = {}
    for family, params in fam.space(op, dtype, n, features, opt_in=opt_in):
        if families is not None and family not in families:
            continue
        spec = fam.render(family, params, op=op, dtype=dtype, n=n)
        if only is None or only(spec):
            specs.setdefault(spec.key, spec)
    return list(specs.values())


def tune(matrix, *, op: str, n: int = 1, dtype="f32", budget_s: float = DEFAULT_BUDGET_S,
         top_k: int = DEFAULT_TOP_K, sandbox: Sandbox | None = None, families: list[str] | None = None,
         screen_config: EvalConfig = SCREEN_CONFIG, final_config: EvalConfig = FINAL_CONFIG,
         timeout_s: float = 60.0, progress=None, features: dict | None = None,
         matrix_key: str | None = None, only: Callable[[KernelSpec], bool] | None = None,
         max_budget_s: float | None = None, opt_in: tuple[str, ...] = ()) -> TuneResult:
    """Search the kernel space for the fastest correct kernel of ``op`` on ``matrix``.

    ``progress(done, total)`` is called after each screened candidate, if given.
    ``features`` (:func:`~torch_sparserl.pattern.features.structural_features`) and ``matrix_key`` (a
    hash naming the pattern, as :func:`~torch_sparserl.pattern.fingerprint.pattern_hash`) may be
    passed when known; they are computed otherwise. ``only``: screen only the candidates it
    accepts (class kernels take :func:`~torch_sparserl.toolchain.kernel.pattern_free` plans).
    ``opt_in``: families screened besides the default space (``families.OPT_IN_FAMILIES``).

    The candidates are compiled :data:`PREBUILD_CHUNK` at a time, in parallel, ahead of their
    screening (where the sandbox can, :meth:`~torch_sparserl.evaluate.sandbox.Sandbox.prebuild`).
    ``budget_s`` bounds the screening. With ``max_budget_s``, the budget scales with the
    problem: once the first candidate is screened, it becomes what screening every candidate at
    that pace would take, a quarter more, between ``budget_s`` and ``max_budget_s`` (a large
    matrix at a large N, whose evaluations take seconds, is then screened whole where the cap
    allows). The finalists' full evaluation comes on top of either.
    """
    if op not in ("spmm", "spmv", "sddmm"):
        raise ValueError(f"tune: op must be 'spmm', 'spmv' or 'sddmm' (got {op!r})")
    if op == "spmv" and n != 1:
        raise ValueError(f"tune: op='spmv' has n=1 (got n={n})")
    if n < 1:
        raise ValueError(f"tune: n must be >= 1 (got {n})")
    dtype = dtype_name(dtype)
    start = time.monotonic()
    own = sandbox is None
    box = Sandbox() if own else sandbox
    try:
        tuning = search.problem(matrix, box, n=n, dtype=dtype, timeout_s=timeout_s, features=features,
                                matrix_key=matrix_key)
        features = tuning.features
        if "tc_tiles" in opt_in and "window_reuse" not in features:  # what only its grid reads
            features = {**features, "window_reuse": window_reuse(tuning.rowptr, tuning.col)}
        specs = candidates(op, n, dtype, features, families, only, tuple(opt_in))
        result = TuneResult(op=op, n=n, dtype=dtype, features=features, best=None, best_spec=None,
                            candidates=len(specs))
        screening = search.screen(tuning, specs, screen_config, start=start, budget_s=budget_s,
                                  max_budget_s=max_budget_s, chunk=PREBUILD_CHUNK, progress=progress)
        result.table.extend(record for record, _ in screening.screened)
        result.screened, result.budget_s = len(screening.screened), screening.budget_s
        result.budget_exhausted = screening.budget_exhausted
        search.validate(tuning, screening.screened, final_config, result, finalists=top_k)
    finally:
        if own:
            box.close()
        else:
            box.release()  # the problem's inputs and references; the matrix stays for the next key
    result.elapsed_s = time.monotonic() - start
    log.info("tune: %s", result.summary())
    return result
