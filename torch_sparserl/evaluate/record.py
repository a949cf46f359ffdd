"""The evaluation record: one per candidate kernel, the only input of the reward.

Plain data with no torch import, so that records travel between processes (the sandbox
sends them as dicts) and are read back from JSON logs by training code without a GPU.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from enum import Enum
from typing import Any


class ErrorKind(str, Enum):
    """Why a candidate was rejected: a closed set, so rewards and statistics can key on it."""

    PLAN = "plan"                        # the plan line breaks the ABI, or cannot be prepared
    COMPILE = "compile"                  # the compiler rejected the source
    RESOURCES = "resources"              # registers / spills / shared memory over the limits
    LAUNCH = "launch"                    # the driver refused the launch (bad geometry)
    CRASH = "crash"                      # the worker died, or a sticky CUDA error (illegal address)
    TIMEOUT = "timeout"                  # no answer within the time limit (a hang)
    WRONG = "wrong"                      # values outside the tolerance of the float64 reference
    UNWRITTEN = "unwritten"              # output elements still hold the NaN the output was filled with
    OUT_OF_BOUNDS = "out_of_bounds"      # the guard regions around the output or workspace changed
    INPUT_MODIFIED = "input_modified"    # rowptr / col / val / x / aux changed
    NONDETERMINISTIC = "nondeterministic"  # two runs on the same inputs differ beyond tolerance
    STALE = "stale"                      # a later call returned an earlier result or skipped work
    SUSPICIOUS = "suspicious"            # a very large speedup that did not survive re-checking
    DEVICE_MEMORY = "device_memory"      # the device had no memory free for the evaluation's buffers

    def __str__(self) -> str:
        return self.value


# Compile-tier failures: the candidate never became a runnable kernel.
NOT_COMPILED_KINDS = frozenset({ErrorKind.PLAN, ErrorKind.COMPILE})

# Conditions of the device at the time, not verdicts on the candidate: the same candidate may
# pass on the same device later (another process held the memory). A decision reached with
# such failures is not worth keeping (the runtime does not cache it).
TRANSIENT_KINDS = frozenset({ErrorKind.DEVICE_MEMORY})


class TransientFailure(RuntimeError):
    """A specialization left undecided by a condition of the device at the time (no memory free
    for the policy or the evaluations): nothing to cache, since the same search may succeed later."""


# Logs can be megabytes (a kernel that prints, a compiler flood); records stay small.
MAX_LOG_CHARS = 16_000


def clip_log(text: str, limit: int = MAX_LOG_CHARS) -> str:
    """Keep the head and the tail of a long log: the first error and the last words both matter."""
    if len(text) <= limit:
        return text
    head = limit // 4
    tail = limit - head
    return f"{text[:head]}\n[... {len(text) - limit} characters left out ...]\n{text[-tail:]}"


def dtype_name(dtype: Any) -> str:
    """The ABI's name for a value dtype: accepts ``"f32"``/``"f16"``/``"bf16"`` or a torch dtype."""
    names = {"torch.float32": "f32", "torch.float16": "f16", "torch.bfloat16": "bf16",
             "f32": "f32", "f16": "f16", "bf16": "bf16",
             "float32": "f32", "float16": "f16", "bfloat16": "bf16"}
    text = str(dtype)
    if text not in names:
        raise ValueError(f"dtype_name: expected f32, f16, bf16 or the matching torch dtype (got {dtype!r})")
    return names[text]


def _params_dict(params: Any) -> dict:
    if params is None:
        return {}
    if isinstance(params, dict):
        return dict(params)
    return {str(k): v for k, v in params}


@dataclass
class EvalRecord:
    """The outcome of evaluating one candidate on one matrix, op, n and dtype.

    ``correct`` is ``None`` when correctness was not run (the compile tier, CPU only).
    Times are medians in microseconds, the candidate's and cuSPARSE's on the same data in
    the same run (``baseline`` says how cuSPARSE was called, e.g. widened to fp32).
    """

    key: str                          # content hash of the source (KernelSpec.key)
    family: str = ""
    params: dict = field(default_factory=dict)
    op: str | None = None
    n: int | None = None
    dtype: str | None = None
    matrix: str | None = None         # the sandbox's key of the matrix, when there is one
    compiled: bool = False
    correct: bool | None = None
    runtime_us: float | None = None
    cusparse_us: float | None = None
    error_kind: ErrorKind | None = None
    log: str = ""
    registers: int | None = None
    spill_bytes: int | None = None    # None: the builder did not report spills
    local_bytes: int | None = None    # local memory per thread (spills + stack arrays)
    smem_static: int | None = None
    max_error: float | None = None    # max |out - ref| / max(|ref|max, 1) over the trials
    trials: int = 0                   # correctness trials that ran to the end
    baseline: str | None = None       # "cusparse" or "cusparse_fp32_widened"
    timing: dict = field(default_factory=dict)  # samples' spread, reps, flush size, re-check
    device: str | None = None
    elapsed_s: float | None = None    # wall time of the whole evaluation

    def __post_init__(self):
        if self.error_kind is not None and not isinstance(self.error_kind, ErrorKind):
            try:
                self.error_kind = ErrorKind(self.error_kind)
            except ValueError:
                raise ValueError(f"EvalRecord: error_kind must be one of "
                                 f"{', '.join(k.value for k in ErrorKind)} (got {self.error_kind!r})") from None
        self.params = _params_dict(self.params)

    @property
    def speedup(self) -> float | None:
        """t_cuSPARSE / t_kernel, when both were measured."""
        if not self.runtime_us or not self.cusparse_us or self.runtime_us <= 0:
            return None
        return self.cusparse_us / self.runtime_us

    @property
    def ok(self) -> bool:
        return self.compiled and self.correct is True and self.error_kind is None

    def fail(self, kind: ErrorKind, message: str = "") -> EvalRecord:
        """Mark the record rejected (the first reason found wins) and append to the log."""
        if self.error_kind is None:
            self.error_kind = ErrorKind(kind)
        if self.compiled:
            self.correct = False
        if message:
            self.add_log(f"{ErrorKind(kind).value}: {message}")
        return self

    def add_log(self, text: str) -> None:
        self.log = clip_log(f"{self.log}\n{text}" if self.log else text)

    # ------------------------------------------------------------------ serialization
    def to_dict(self) -> dict:
        data = asdict(self)
        data["error_kind"] = self.error_kind.value if self.error_kind is not None else None
        data["params"] = {k: _jsonable(v) for k, v in self.params.items()}
        data["timing"] = _jsonable(self.timing)
        return data

    @classmethod
    def from_dict(cls, data: dict) -> EvalRecord:
        if not isinstance(data, dict):
            raise TypeError(f"EvalRecord.from_dict: expected a dict, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"EvalRecord.from_dict: unknown field(s) {', '.join(unknown)}")
        if "key" not in data:
            raise ValueError("EvalRecord.from_dict: the field 'key' is required")
        return cls(**data)

    def to_json(self) -> str:
        # allow_nan=False: a NaN or infinity here is a bug upstream, and JSON readers differ on it
        return json.dumps(self.to_dict(), sort_keys=True, allow_nan=False)

    @classmethod
    def from_json(cls, text: str) -> EvalRecord:
        return cls.from_dict(json.loads(text))


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)
