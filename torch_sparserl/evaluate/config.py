"""Settings of one evaluation; plain data, sent to the sandbox worker as a dict."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

DEFAULT_TRIALS = 3
DEFAULT_REPS = 30
DEFAULT_WARMUP = 5
DEFAULT_FLUSH_BYTES = 128 << 20   # ≥ 2× the H100/H200 L2 (50 / 60 MB)
DEFAULT_GUARD_BYTES = 1 << 20     # a write up to 256 Ki fp32 elements past y still lands in a guard
DEFAULT_SUSPICIOUS_SPEEDUP = 20.0
DEFAULT_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class EvalConfig:
    trials: int = DEFAULT_TRIALS            # correctness trials, each with fresh random val and x
    seed: int = 0                           # trial t uses generator seed (seed, t)
    time: bool = True                       # False: correctness only, no timing
    baseline: bool = True                   # False: skip timing cuSPARSE (screening many candidates)
    reps: int = DEFAULT_REPS                # timed runs per kernel; the median is reported
    warmup: int = DEFAULT_WARMUP            # untimed runs before timing
    flush_bytes: int = DEFAULT_FLUSH_BYTES  # L2 flush buffer (raised to 2× L2 when L2 is larger)
    guard_bytes: int = DEFAULT_GUARD_BYTES  # sentinel-filled bytes before and after y and work
    check_determinism: bool = True          # run each trial's inputs twice and compare
    suspicious_speedup: float = DEFAULT_SUSPICIOUS_SPEEDUP  # re-check speedups above this
    recheck_min_ratio: float = 0.5          # the re-timed speedup must keep this fraction
    # Timed runs enqueued back to back before the harness waits for them and then leaves the
    # GPU idle for burst_gap_ms; 0: all of them at once. A process training on the same GPU
    # (the JIT's case) can run in the gaps instead of waiting behind a whole timing loop.
    burst_reps: int = 0
    burst_gap_ms: float = 1.0
    # A kernel with local memory may hold stack arrays or spills; where the build's log does
    # not say which, True builds it again with nvcc to count the spill bytes (the RL reward's
    # penalty, hundreds of milliseconds). False leaves spill_bytes None then (no decision of
    # the runtime reads it).
    count_spills: bool = True

    def __post_init__(self):
        def bad(name, expected):
            raise ValueError(f"EvalConfig: {name} must be {expected} (got {getattr(self, name)!r})")
        if self.trials < 1:
            bad("trials", ">= 1")
        if self.reps < 1:
            bad("reps", ">= 1")
        if self.warmup < 0:
            bad("warmup", ">= 0")
        if self.guard_bytes < 256 or self.guard_bytes % 256:
            bad("guard_bytes", "a positive multiple of 256 (keeps y 256-byte aligned)")
        if self.flush_bytes < 0:
            bad("flush_bytes", ">= 0")
        if self.suspicious_speedup <= 1:
            bad("suspicious_speedup", "> 1")
        if not 0 < self.recheck_min_ratio <= 1:
            bad("recheck_min_ratio", "in (0, 1]")
        if self.burst_reps < 0:
            bad("burst_reps", ">= 0")
        if self.burst_gap_ms < 0:
            bad("burst_gap_ms", ">= 0")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict | None) -> EvalConfig:
        if data is None:
            return cls()
        if isinstance(data, cls):
            return data
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"EvalConfig.from_dict: unknown field(s) {', '.join(unknown)}")
        return cls(**data)
