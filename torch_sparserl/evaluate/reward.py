"""The hierarchical reward of the SparseRL method (compiles → correct → fast): a pure function of
an :class:`EvalRecord`."""

from __future__ import annotations

from .record import NOT_COMPILED_KINDS, ErrorKind, EvalRecord

NOT_COMPILED = -0.5
COMPILED_NOT_CORRECT = 0.0
CORRECT = 1.0
RESOURCE_PENALTY = 0.3


def reward(record: EvalRecord, baseline: float | None = None) -> float:
    """−0.5 if it does not compile; 0 if it compiles but is not correct (or was not run);
    1 + (t_cuSPARSE / t_kernel − 1) if correct; minus 0.3 for resource overuse
    (spilled registers, or rejected for resources). ``baseline``: the speedup over cuSPARSE to
    beat (the grid oracle's on the cell); the correct tier is then 1 + (speedup / baseline − 1),
    1 at the oracle's speed and above it only for a faster kernel."""
    if baseline is not None and not baseline > 0:
        raise ValueError(f"reward: baseline must be a speedup > 0 (got {baseline!r})")
    if not record.compiled or record.error_kind in NOT_COMPILED_KINDS:
        return NOT_COMPILED
    if record.correct is True and record.error_kind is None:
        speedup = record.speedup
        if speedup is not None and baseline is not None:
            speedup = speedup / baseline
        value = CORRECT + (speedup - 1.0 if speedup is not None else 0.0)
    else:
        value = COMPILED_NOT_CORRECT
    if (record.spill_bytes or 0) > 0 or record.error_kind == ErrorKind.RESOURCES:
        value -= RESOURCE_PENALTY
    return value
