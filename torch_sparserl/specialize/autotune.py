"""The exhaustive autotuner: the oracle the learned policy is measured against.

For one (pattern, op, N, dtype) it renders every (family, parameters) point of
:func:`torch_sparserl.specialize.families.space`, screens them all in the evaluator's sandbox with a
cheap configuration (one correctness trial, a few timed runs), then evaluates the fastest
few again with the full configuration (fresh trials, determinism check, cuSPARSE timed in
the same run) and returns the best correct kernel with the whole table. A time budget
bounds the screening; the final stage always runs for what was screened.

Every candidate runs first in the sandbox's child process: a kernel that crashes or
hangs costs its own record and a worker restart, never the caller.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from .. import config
from ..abi import KernelSpec
from ..evaluate.config import EvalConfig
from ..evaluate.record import EvalRecord, dtype_name
from ..evaluate.sandbox import Sandbox
from ..pattern.features import structural_features, window_reuse
from ..pattern.fingerprint import pattern_hash

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


def _pattern_arrays(matrix):
    """(rowptr, col, shape) as numpy int arrays from a SciPy matrix, a torch CSR tensor,
    a CSRMatrix or a (rowptr, col, shape) triple."""
    if isinstance(matrix, tuple) and len(matrix) == 3:
        rowptr, col, shape = matrix
    elif hasattr(matrix, "indptr"):
        csr = matrix.tocsr()
        rowptr, col, shape = csr.indptr, csr.indices, csr.shape
    elif hasattr(matrix, "crow_indices"):
        rowptr, col, shape = matrix.crow_indices(), matrix.col_indices(), tuple(matrix.shape)
    elif hasattr(matrix, "crow"):
        rowptr, col, shape = matrix.crow, matrix.col, tuple(matrix.shape)
    else:
        raise TypeError(f"tune: expected a SciPy sparse matrix, a torch CSR tensor, a CSRMatrix or "
                        f"(rowptr, col, shape) (got {type(matrix).__name__})")
    to_np = (lambda a: a.detach().cpu().numpy()) if hasattr(rowptr, "detach") else np.asarray
    rowptr, col = to_np(rowptr).astype(np.int64), to_np(col).astype(np.int64)
    if rowptr[-1] >= 2**31 or (len(col) and col.max() >= 2**31):
        raise ValueError("tune: the kernel ABI takes int32 indices; this pattern does not fit")
    return rowptr.astype(np.int32), col.astype(np.int32), (int(shape[0]), int(shape[1]))


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


def _runtime(record: EvalRecord) -> float:
    return record.runtime_us if record.ok and record.runtime_us else math.inf


def _problem(matrix, box: Sandbox, features: dict | None, matrix_key: str | None):
    """``(rowptr, col, shape, features, key)`` of a tuning problem, the matrix registered with
    ``box`` under ``key``. A caller that already has the pattern's features and hash (the
    runtime, which specializes several keys of one pattern) passes them: on a graph of tens of
    millions of nonzeros each costs seconds on the host; a matrix the sandbox already holds is
    not sent again."""
    rowptr, col, shape = _pattern_arrays(matrix)
    if features is None:
        features = structural_features(rowptr, col, shape)
    key = matrix_key or pattern_hash(torch.from_numpy(rowptr), torch.from_numpy(col), shape[1])
    if matrix_key is None or not box.has_matrix(key):
        box.set_matrix(key, rowptr, col, shape)
    return rowptr, col, shape, features, key


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
        rowptr, col, shape, features, key = _problem(matrix, box, features, matrix_key)
        if "tc_tiles" in opt_in and "window_reuse" not in features:  # what only its grid reads
            features = {**features, "window_reuse": window_reuse(rowptr, col)}
        specs = candidates(op, n, dtype, features, families, only, tuple(opt_in))
        result = TuneResult(op=op, n=n, dtype=dtype, features=features, best=None, best_spec=None,
                            candidates=len(specs))
        screened: list[tuple[EvalRecord, KernelSpec]] = []
        limit = budget_s
        prebuild = getattr(box, "prebuild", None)
        for i, spec in enumerate(specs):
            if time.monotonic() - start > limit and screened:
                result.budget_exhausted = True
                break
            build_share = 0.0  # of a chunk's compile time, this candidate's part
            if prebuild is not None and i % PREBUILD_CHUNK == 0:  # the next chunk on several cores at once
                chunk = specs[i:i + PREBUILD_CHUNK]
                built = time.monotonic()
                prebuild(chunk, workers=PREBUILD_CHUNK)
                build_share = (time.monotonic() - built) / len(chunk)
            began = time.monotonic()
            record = box.evaluate(spec, key, n, dtype, screen_config, timeout_s)
            record.timing["stage"] = "screen"
            screened.append((record, spec))
            if max_budget_s is not None and len(screened) == 1:
                pace = time.monotonic() - began + build_share
                limit = min(max_budget_s, max(budget_s, (began - start) + 1.25 * pace * len(specs)))
            result.table.append(record)
            if progress is not None:
                progress(len(screened), len(specs))
        result.screened = len(screened)
        result.budget_s = limit
        finalists = sorted((pair for pair in screened if math.isfinite(_runtime(pair[0]))),
                           key=lambda pair: _runtime(pair[0]))[:top_k]
        best: tuple[EvalRecord, KernelSpec] | None = None
        for _, spec in finalists:
            record = box.evaluate(spec, key, n, dtype, final_config, timeout_s)
            record.timing["stage"] = "final"
            result.table.append(record)
            if record.cusparse_us:
                result.cusparse_us = min(result.cusparse_us or math.inf, record.cusparse_us)
            if math.isfinite(_runtime(record)) and (best is None or _runtime(record) < _runtime(best[0])):
                best = (record, spec)
        if best is not None:
            result.best, result.best_spec = best
    finally:
        if own:
            box.close()
        else:
            box.release()  # the problem's inputs and references; the matrix stays for the next key
    result.elapsed_s = time.monotonic() - start
    log.info("tune: %s", result.summary())
    return result
