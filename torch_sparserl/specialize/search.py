"""The search both tuners run: candidates screened in the sandbox, the fastest validated.

The exhaustive autotuner (:func:`~torch_sparserl.specialize.autotune.tune`) and the learned
policy (:func:`~torch_sparserl.specialize.policy.propose.policy_tune`) differ in where their
candidates come from; what they do with them is this module's:

1. :func:`problem`: the pattern on the host, its features and its key, registered with the
   sandbox (not sent again when the sandbox holds it under that key);
2. :func:`screen`: each candidate evaluated once with a cheap configuration (stage
   ``"screen"``), compiled ahead a chunk at a time where the sandbox can, within a time budget;
3. :func:`validate`: the fastest screened ones evaluated again with the full configuration
   (stage ``"final"``: fresh trials, determinism, cuSPARSE timed in the same run), and the
   fastest of those kept (:mod:`~torch_sparserl.evaluate.verdict`'s best pick).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from ..abi import KernelSpec
from ..evaluate import verdict
from ..evaluate.config import EvalConfig
from ..evaluate.record import EvalRecord
from ..pattern.features import structural_features
from ..pattern.fingerprint import pattern_hash


def pattern_arrays(matrix) -> tuple[np.ndarray, np.ndarray, tuple[int, int]]:
    """(rowptr, col, shape) as numpy int32 arrays from a SciPy matrix, a torch CSR tensor,
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


@dataclass
class Problem:
    """One product to tune: its pattern, registered with ``box`` under ``matrix_key``."""

    box: object  # a Sandbox, or what has its set_matrix / has_matrix / evaluate / prebuild
    rowptr: np.ndarray
    col: np.ndarray
    shape: tuple[int, int]
    features: dict
    matrix_key: str
    n: int
    dtype: str
    timeout_s: float

    def evaluate(self, spec: KernelSpec, config: EvalConfig, stage: str) -> EvalRecord:
        """One evaluation of ``spec`` in the sandbox, its record marked with ``stage``."""
        record = self.box.evaluate(spec, self.matrix_key, self.n, self.dtype, config, self.timeout_s)
        record.timing["stage"] = stage
        return record


def problem(matrix, box, *, n: int, dtype: str, timeout_s: float, features: dict | None = None,
            matrix_key: str | None = None) -> Problem:
    """The tuning problem of ``matrix``, registered with ``box``. A caller that already has the
    pattern's features and hash (the runtime, which specializes several keys of one pattern)
    passes them: on a graph of tens of millions of nonzeros each costs seconds on the host; a
    matrix the sandbox already holds is not sent again."""
    rowptr, col, shape = pattern_arrays(matrix)
    if features is None:
        features = structural_features(rowptr, col, shape)
    key = matrix_key or pattern_hash(torch.from_numpy(rowptr), torch.from_numpy(col), shape[1])
    if matrix_key is None or not box.has_matrix(key):
        box.set_matrix(key, rowptr, col, shape)
    return Problem(box, rowptr, col, shape, features, key, n, dtype, timeout_s)


@dataclass
class Screening:
    """What :func:`screen` did: the ``(record, spec)`` pairs screened, in order; the budget it
    applied; whether the budget stopped it; the seconds spent compiling ahead."""

    screened: list[tuple[EvalRecord, KernelSpec]]
    budget_s: float
    budget_exhausted: bool
    prebuild_s: float


def screen(problem: Problem, specs: list[KernelSpec], config: EvalConfig, *, start: float,
           budget_s: float = math.inf, max_budget_s: float | None = None, chunk: int = 0,
           progress: Callable[[int, int], None] | None = None) -> Screening:
    """Evaluate ``specs`` one by one with ``config`` (stage ``"screen"``).

    ``chunk``: where the sandbox can prebuild, the next ``chunk`` candidates are compiled
    together (``chunk`` at once) before the first of them is screened (0: none are).
    ``budget_s`` bounds the screening, counted from ``start`` (``time.monotonic()``); at least
    one candidate is screened. With ``max_budget_s`` the budget scales with the problem: once
    the first candidate is screened, it becomes what screening every candidate at that pace
    would take (its compile share included), a quarter more, between ``budget_s`` and
    ``max_budget_s``. ``progress(done, total)`` is called after each candidate.
    """
    screened: list[tuple[EvalRecord, KernelSpec]] = []
    limit, exhausted, prebuild_s = budget_s, False, 0.0
    prebuild = getattr(problem.box, "prebuild", None) if chunk else None
    for i, spec in enumerate(specs):
        if time.monotonic() - start > limit and screened:
            exhausted = True
            break
        build_share = 0.0  # of a chunk's compile time, this candidate's part
        if prebuild is not None and i % chunk == 0:  # the next chunk on several cores at once
            part = specs[i:i + chunk]
            built = time.monotonic()
            prebuild(part, workers=chunk)
            took = time.monotonic() - built
            prebuild_s += took
            build_share = took / len(part)
        began = time.monotonic()
        screened.append((problem.evaluate(spec, config, "screen"), spec))
        if max_budget_s is not None and len(screened) == 1:
            pace = time.monotonic() - began + build_share
            limit = min(max_budget_s, max(budget_s, (began - start) + 1.25 * pace * len(specs)))
        if progress is not None:
            progress(len(screened), len(specs))
    return Screening(screened, limit, exhausted, prebuild_s)


def validate(problem: Problem, screened: list[tuple[EvalRecord, KernelSpec]], config: EvalConfig, result, *,
             finalists: int, until_one_passes: bool = False,
             done: dict[str, EvalRecord] | None = None) -> None:
    """Evaluate the fastest correct screened candidates again with ``config`` (stage
    ``"final"``), fastest first: ``finalists`` of them, and with ``until_one_passes`` the next
    ones too while none has passed. ``done``: final records already taken, by spec key (not
    evaluated again). Each new final record is appended to ``result.table``; cuSPARSE's
    fastest time goes to ``result.cusparse_us``, and the fastest correct final record with
    its spec to ``result.best`` and ``result.best_spec`` (:func:`~torch_sparserl.evaluate.verdict.better`)."""
    best: tuple[EvalRecord, KernelSpec] | None = None
    validated = 0
    for _, spec in verdict.ranked(screened):
        if validated >= finalists and (best is not None or not until_one_passes):
            break
        final = (done or {}).get(spec.key)
        if final is None:
            final = problem.evaluate(spec, config, "final")
            result.table.append(final)
        validated += 1
        if final.cusparse_us:
            result.cusparse_us = min(result.cusparse_us or math.inf, final.cusparse_us)
        if verdict.better(final, best[0] if best is not None else None):
            best = (final, spec)
    if best is not None:
        result.best, result.best_spec = best
