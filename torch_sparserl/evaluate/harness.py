"""Score one candidate kernel on the GPU: build, check correctness hard, time against cuSPARSE.

Runs in the calling process. Untrusted candidates belong in :class:`~.sandbox.Sandbox`
(a kernel can hang, or leave the CUDA context unusable); this module also provides the
sandbox worker's task, init, matrix loader and health check.

Correctness, per trial (fresh random ``val`` and ``x`` from a seeded generator):

* ``y`` lives inside a larger buffer whose guard regions hold a sentinel bit pattern
  (``out_of_bounds``); the workspace likewise;
* ``y`` is filled with a NaN whose payload no arithmetic produces, so elements still holding
  it were never written (``unwritten``);
* ``rowptr``, ``col``, ``val``, ``x`` and ``aux`` are compared bit for bit with copies
  (``input_modified``);
* the same inputs run twice: outputs that differ beyond tolerance are a race
  (``nondeterministic``); a second call that skips work or replays an earlier call's result
  is ``stale``;
* the float64 reference and :func:`~torch_sparserl.dtypes.close_to_reference` judge the
  values (``wrong``).

Timing: CUDA events, warm-up, median of ``reps`` runs, each after an L2 flush, for the
candidate and for cuSPARSE on the same data; the output of the last timed run is checked
again (``stale``); a speedup above ``suspicious_speedup`` is re-timed interleaved on fresh
data and must hold (``suspicious``).
"""

from __future__ import annotations

import gc
import math
import os
import re
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from ..abi import MAX_SMEM_BYTES, KernelSpec, PlanError, operand_shapes
from ..abi.prepare import Prepared, prepare
from ..dtypes import close_to_reference, max_abs_difference
from ..kernels import reference, vendor
from ..pattern import Pattern
from ..toolchain import CompileError, LaunchError, load_kernel
from .config import EvalConfig
from .record import ErrorKind, EvalRecord, dtype_name

_TORCH_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
_BITS = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16,
         torch.int32: torch.int32}

# Quiet NaNs with payloads that no arithmetic produces (hardware NaNs are canonical):
# an element still holding this pattern was never written.
_UNWRITTEN = {torch.float32: 0x7FC0FFEE, torch.float16: 0x7E5A, torch.bfloat16: 0x7FDA}
_GUARD_WORD = (0xAD, 0xDB, 0xBA, 0x7F)  # little-endian 0x7FBADBAD, repeated over the guards

# Errors after which the CUDA context is unusable: the process must go.
_STICKY = ("illegal memory access", "illegal address", "ILLEGAL_ADDRESS", "LAUNCH_FAILED",
           "unspecified launch failure", "misaligned address", "MISALIGNED_ADDRESS",
           "illegal instruction", "ILLEGAL_INSTRUCTION", "INVALID_PC", "invalid program counter",
           "hardware stack error", "HARDWARE_STACK_ERROR", "device-side assert", "CUDA_ERROR_ASSERT",
           "LAUNCH_TIMEOUT", "the launch timed out", "INVALID_ADDRESS_SPACE", "ECC error")
_RESOURCE = ("OUT_OF_RESOURCES", "too many resources", "threads this kernel can run",
             "dynamic shared memory", "out of memory")

REGISTERS_PER_SM = 65536

_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


@dataclass
class Matrix:
    """A sparsity pattern on the GPU, as the kernels take it: int32 ``rowptr`` and ``col``."""

    rowptr: torch.Tensor  # (rows + 1,) int32
    col: torch.Tensor     # (nnz,) int32
    shape: tuple[int, int]

    def __post_init__(self):
        rows, cols = (int(s) for s in self.shape)
        self.shape = (rows, cols)
        if self.rowptr.dim() != 1 or self.rowptr.numel() != rows + 1:
            raise ValueError(f"Matrix: rowptr must have rows + 1 = {rows + 1} entries "
                             f"(got shape {tuple(self.rowptr.shape)})")
        if self.col.dim() != 1:
            raise ValueError(f"Matrix: col must be 1-D (got shape {tuple(self.col.shape)})")
        if self.rowptr.device != self.col.device:
            raise ValueError(f"Matrix: rowptr on {self.rowptr.device}, col on {self.col.device}")
        self.rowptr = self.rowptr.to(torch.int32).contiguous()
        self.col = self.col.to(torch.int32).contiguous()

    @property
    def nnz(self) -> int:
        return self.col.numel()

    @property
    def device(self) -> torch.device:
        return self.col.device

    @classmethod
    def from_numpy(cls, rowptr, col, shape, device="cuda") -> Matrix:
        rowptr = torch.from_numpy(np.ascontiguousarray(rowptr, dtype=np.int32)).to(device)
        col = torch.from_numpy(np.ascontiguousarray(col, dtype=np.int32)).to(device)
        return cls(rowptr, col, tuple(shape))


# ----------------------------------------------------------------------------- sandbox hooks

def worker_init() -> dict:
    """Sandbox worker start: create the CUDA context once and import the build stage."""
    if not torch.cuda.is_available():
        raise RuntimeError("sandbox worker: CUDA is not available in the worker process")
    torch.zeros(1, device="cuda").add_(1)
    torch.cuda.synchronize()
    from ..toolchain import driver  # noqa: F401 - loaded once, not on the first candidate's clock
    return {"pid": os.getpid(), "device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "cuda": torch.version.cuda}


def load_matrix(rowptr, col, shape) -> Matrix:
    return Matrix.from_numpy(rowptr, col, shape, device="cuda")


def release_memory() -> int:
    """Sandbox task: forget the shared inputs and flush buffer, return cached blocks to the
    device; the bytes still reserved (the matrices the worker holds, for the next key)."""
    _INPUTS.clear()
    _FLUSH.clear()
    gc.collect()
    # What survives a collection here is the worker's lasting state (torch, the policy, the
    # loaded kernels): frozen, the next collection scans only what came since (milliseconds
    # instead of tens). Frozen objects are still freed by reference counting.
    gc.freeze()
    if not torch.cuda.is_available():
        return 0
    torch.cuda.empty_cache()
    return int(torch.cuda.memory_reserved())


def cuda_context_ok() -> bool:
    """False after a sticky CUDA error (every later CUDA call fails): the worker must go."""
    try:
        torch.cuda.synchronize()
        return torch.ones(1, device="cuda").add_(1).item() == 2.0
    except Exception:  # noqa: BLE001
        return False


def sandbox_task(spec: dict, matrix: Matrix, n: int, dtype: str, config: dict,
                 progress: Callable[[str], None] | None = None) -> dict:
    """The sandbox's evaluation task: plain data in, a record dict out."""
    return evaluate_candidate(_spec(spec), matrix, n, dtype, EvalConfig.from_dict(config),
                              progress=progress).to_dict()


def prebuild_task(specs: list[dict], workers: int = 4) -> dict[str, float]:
    """Sandbox task: compile candidates concurrently ahead of their evaluations (see
    :func:`~torch_sparserl.toolchain.prebuild_nvrtc`); each built key's compile seconds."""
    from ..toolchain import prebuild_nvrtc

    return prebuild_nvrtc([_spec(s) for s in specs], workers=workers)


def _spec(fields: dict) -> KernelSpec:
    return KernelSpec(source=fields["source"], family=fields.get("family", ""),
                      params=tuple(tuple(p) for p in fields.get("params", ())))


# ----------------------------------------------------------------------------- helpers

class _Fail(Exception):
    """A verdict reached inside the evaluation: stop and record it."""

    def __init__(self, kind: ErrorKind, message: str):
        super().__init__(message)
        self.kind = kind


def classify_cuda_error(exc: BaseException) -> ErrorKind | None:
    """The error kind of an exception raised while launching or syncing, or None (not CUDA's)."""
    text = f"{type(exc).__name__}: {exc}"
    if any(s in text for s in _STICKY):
        return ErrorKind.CRASH
    if isinstance(exc, LaunchError):
        return ErrorKind.RESOURCES if any(s in text for s in _RESOURCE) else ErrorKind.LAUNCH
    if isinstance(exc, torch.OutOfMemoryError):
        return ErrorKind.RESOURCES if _beyond_capacity(text) else ErrorKind.DEVICE_MEMORY
    if isinstance(exc, RuntimeError) and ("CUDA" in text or "cuda" in text):
        # e.g. "invalid configuration argument", reported at the next sync
        return ErrorKind.LAUNCH if "invalid" in text else ErrorKind.CRASH
    return None


_SIZE = r"([0-9.]+) (B|KiB|MiB|GiB|TiB)"
_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


def _beyond_capacity(text: str) -> bool:
    """Whether torch's out-of-memory message asks for more than the device has in all: the
    candidate's plan can never fit (resources). Otherwise other allocations held the memory
    at the time (device memory, transient); also when the message does not say."""
    wanted = re.search(r"Tried to allocate " + _SIZE, text)
    total = re.search(r"total capacity of " + _SIZE, text)
    if wanted is None or total is None:
        return False
    return float(wanted[1]) * _UNITS[wanted[2]] > float(total[1]) * _UNITS[total[2]]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(_BITS[t.dtype])


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(_bits(a), _bits(b))


class _Guarded:
    """``numel`` elements of ``dtype`` with sentinel-filled guard regions on both sides."""

    def __init__(self, numel: int, dtype: torch.dtype, shape: tuple, guard_bytes: int, device):
        nbytes = numel * torch.empty(0, dtype=dtype).element_size()
        padded = -(-nbytes // 256) * 256
        self.guard = guard_bytes
        self.raw = torch.empty(guard_bytes + padded + guard_bytes, dtype=torch.uint8, device=device)
        self.tensor = self.raw[guard_bytes:guard_bytes + nbytes].view(dtype).view(shape)
        self._end = guard_bytes + nbytes
        word = torch.tensor(_GUARD_WORD, dtype=torch.uint8, device=device)
        self.before = word.repeat(guard_bytes // 4)
        self.after = word.repeat(-(-(self.raw.numel() - self._end) // 4))[:self.raw.numel() - self._end]
        self.raw[:guard_bytes].copy_(self.before)
        self.raw[self._end:].copy_(self.after)

    def check(self, name: str) -> str | None:
        """None, or where the first changed byte of a guard is."""
        for where, region, expected in (("before", self.raw[:self.guard], self.before),
                                        ("after", self.raw[self._end:], self.after)):
            if not torch.equal(region, expected):
                changed = (region != expected).nonzero()
                first = int(changed[0 if where == "after" else -1])
                offset = first - self.guard if where == "before" else first
                return (f"{int(changed.numel())} guard bytes {where} {name} changed "
                        f"(nearest at byte {offset:+d} from the {'start' if where == 'before' else 'end'})")
        return None


_FLUSH: dict[tuple, torch.Tensor] = {}


def _flush_buffer(nbytes: int, device: torch.device) -> torch.Tensor:
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0)
    nbytes = max(nbytes, 2 * l2)
    key = (str(device), nbytes)
    if key not in _FLUSH:
        _FLUSH.clear()
        _FLUSH[key] = torch.empty(nbytes, dtype=torch.uint8, device=device)
    return _FLUSH[key]


def _stats(samples: list[float]) -> dict:
    ordered = sorted(samples)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return {"median": statistics.median(ordered), "min": ordered[0], "max": ordered[-1],
            "p10": pick(0.1), "p90": pick(0.9)}


_HIDE_HOST_CYCLES = 200_000  # ~100 us of GPU clock: longer than any host-side launch path


def _time(functions: list[Callable[[], object]], reps: int, warmup: int, flush: torch.Tensor,
          burst: int = 0, gap_ms: float = 0.0) -> list[list[float]]:
    """Microseconds per run of each function, interleaved run by run, each run after an L2 flush.

    The flush (a memset far larger than L2) and then a GPU-side spin run on the stream just
    before the start event, so the GPU is still busy when the host has enqueued the event and
    the launch: what is timed is the GPU's work, never the host's launch path. Without the
    spin, the flush alone did not always cover a Python launch, and the events then timed a
    short kernel's launch path with it (well above what a profiler gives the kernel).

    With ``burst``, every ``burst`` runs the host waits for the GPU and sleeps ``gap_ms``: each
    run is timed on its own, so the gaps change no sample, and another process's kernels get
    the GPU between bursts (the 30 runs of a final validation with its cuSPARSE baseline are
    otherwise back-to-back GPU work, which a training step on the same GPU may wait behind).
    """
    for _ in range(warmup):
        for fn in functions:
            fn()
    events = [[(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
               for _ in range(reps)] for _ in functions]
    for i in range(reps):
        if burst and i and i % burst == 0:
            torch.cuda.synchronize()
            time.sleep(gap_ms / 1e3)
        for fn, pairs in zip(functions, events):
            flush.zero_()
            torch.cuda._sleep(_HIDE_HOST_CYCLES)
            pairs[i][0].record()
            fn()
            pairs[i][1].record()
    torch.cuda.synchronize()
    return [[start.elapsed_time(end) * 1000.0 for start, end in pairs] for pairs in events]


_INPUTS: dict[tuple, tuple] = {}  # key -> (val, x, float64 reference, matrix)
_INPUTS_MAX_BYTES = 6 << 30


def _remember_inputs(key: tuple, entry: tuple) -> None:
    size = lambda e: sum(t.numel() * t.element_size() for t in e[:3])  # noqa: E731
    while _INPUTS and sum(map(size, _INPUTS.values())) + size(entry) > _INPUTS_MAX_BYTES:
        _INPUTS.pop(next(iter(_INPUTS)))  # oldest first
    _INPUTS[key] = entry


class _Problem:
    """Everything one evaluation launches with, and the checks around a launch."""

    def __init__(self, kernel, prepared: Prepared, matrix: Matrix, n: int, op: str, dtype: torch.dtype,
                 config: EvalConfig):
        self.kernel, self.prepared, self.matrix = kernel, prepared, matrix
        self.n, self.op, self.dtype, self.config = n, op, dtype, config
        rows, cols = matrix.shape
        device = matrix.device
        self.device = device
        shapes = operand_shapes(op, rows, cols, matrix.nnz, n)
        self.val_shape, self.x_shape, self.y_shape = shapes["val"], shapes["x"], shapes["y"]
        self.y_buf = _Guarded(math.prod(self.y_shape), dtype, self.y_shape, config.guard_bytes, device)
        self.y = self.y_buf.tensor
        self.work_buf = (_Guarded(prepared.work_numel, torch.float32, (prepared.work_numel,),
                                  config.guard_bytes, device) if prepared.work_numel else None)
        self.work = self.work_buf.tensor if self.work_buf is not None else None
        if self.work is not None and prepared.work_once:
            self.work.zero_()  # once: the kernel must leave it zero (check_side_effects)
        self.pattern = Pattern(matrix.rowptr, matrix.col, cols)
        # Copies of what the kernel must not write, taken before its first launch.
        self.rowptr0 = matrix.rowptr.clone()
        self.col0 = matrix.col.clone()
        self.aux0 = prepared.aux.clone() if prepared.aux is not None else None
        self.val = self.x = self.val0 = self.x0 = self.ref = None

    def new_inputs(self, seed: int) -> None:
        # Inputs are a pure function of the seed, so candidates screened on the same matrix
        # share them and their float64 reference (the most expensive part on large matrices).
        # Each candidate still sees fresh inputs from trial to trial.
        key = (id(self.matrix), self.matrix.shape, self.matrix.nnz, self.n, self.op, self.dtype, seed)
        if key not in _INPUTS:
            generator = torch.Generator(device=self.device).manual_seed(seed)
            val = torch.randn(self.val_shape, generator=generator, device=self.device).to(self.dtype)
            x = torch.randn(self.x_shape, generator=generator, device=self.device).to(self.dtype)
            # The entry holds the matrix too, so that its id cannot be reused while cached.
            _remember_inputs(key, (val, x, self.reference(val.double(), x.double()), self.matrix))
        val, x, self.ref, _ = _INPUTS[key]  # ref: float64
        self.val, self.x = val.clone(), x.clone()  # the kernel may scribble on its copies
        self.val0, self.x0 = val, x

    def reference(self, val64: torch.Tensor, x64: torch.Tensor) -> torch.Tensor:
        """The float64 result of the op on these operands (``val`` is D for sddmm)."""
        m = self.matrix
        if self.op == "sddmm":
            return reference.sddmm(self.pattern, m.rowptr, m.col, val64, x64)
        if self.op == "spmv":
            return reference.spmv(self.pattern, m.rowptr, m.col, val64, x64)
        return reference.spmm(self.pattern, m.rowptr, m.col, val64, x64)

    def fill_unwritten(self) -> None:
        _bits(self.y).fill_(_UNWRITTEN[self.dtype])

    def launch(self, check: bool = True) -> None:
        m = self.matrix
        self.kernel(m.rowptr, m.col, self.val, self.x, self.y, self.prepared, work=self.work, check=check)

    def run_checked(self) -> torch.Tensor:
        """One launch on NaN-filled y; raises _Fail for writes it must not make. Returns a copy of y."""
        self.fill_unwritten()
        self.launch()
        if self.device.type == "cuda":  # errors of this launch surface here, not in a later op
            torch.cuda.synchronize(self.device)
        self.check_side_effects()
        return self.y.clone()

    def check_side_effects(self) -> None:
        m = self.matrix
        for name, now, before in (("rowptr", m.rowptr, self.rowptr0), ("col", m.col, self.col0),
                                  ("aux", self.prepared.aux, self.aux0), ("val", self.val, self.val0),
                                  ("x", self.x, self.x0)):
            if now is not None and not _same_bits(now, before):
                changed = int((_bits(now) != _bits(before)).sum())
                raise _Fail(ErrorKind.INPUT_MODIFIED, f"the kernel wrote into {name} ({changed} elements changed)")
        for name, buf in (("y", self.y_buf), ("work", self.work_buf)):
            where = buf.check(name) if buf is not None else None
            if where:
                raise _Fail(ErrorKind.OUT_OF_BOUNDS, where)
        if self.prepared.work_once and self.work is not None:
            left = int(self.work.count_nonzero())
            if left:
                raise _Fail(ErrorKind.STALE, f"the plan says work_init=once, but the kernel left {left} of "
                                             f"{self.work.numel()} workspace elements non-zero: the next "
                                             f"launch would start from them")

    def unwritten(self, out: torch.Tensor) -> int:
        return int((_bits(out) == _UNWRITTEN[self.dtype]).sum())

    def judge(self, out: torch.Tensor) -> tuple[bool, str, int]:
        """(ok, reason, unwritten elements) against the float64 reference."""
        missing = self.unwritten(out)
        if missing:
            return False, f"{missing} of {out.numel()} output elements were never written", missing
        ok, reason = close_to_reference(out, self.ref, self.dtype, self.prepared.plan.math)
        return ok, reason, 0

    def max_error(self, out: torch.Tensor) -> float:
        if out.numel() == 0:
            return 0.0
        scale = max(float(self.ref.abs().max()), 1.0)
        value = max_abs_difference(out, self.ref) / scale
        return value if value == value else float("inf")  # NaN → inf

    def close(self, a: torch.Tensor, b: torch.Tensor) -> bool:
        return _same_bits(a, b) or close_to_reference(a, b.double(), self.dtype, self.prepared.plan.math)[0]


# ----------------------------------------------------------------------------- evaluation

def evaluate_candidate(spec: KernelSpec, matrix: Matrix, n: int, dtype, config: EvalConfig | dict | None = None,
                       progress: Callable[[str], None] | None = None) -> EvalRecord:
    """Build, check and time ``spec`` on ``matrix`` for ``n`` dense columns of ``dtype``.

    Returns a record for every fault of the candidate; raises only for faults of the
    harness itself. ``progress(stage)`` is called with ``"compiled"``, ``"prepared"``,
    ``"correct"`` and ``"timed"`` as the evaluation gets there; ``record.timing["stages_s"]``
    holds the seconds each stage reached took (where a large matrix's JIT time goes).
    """
    start = time.perf_counter()
    config = config if isinstance(config, EvalConfig) else EvalConfig.from_dict(config)
    if not isinstance(matrix, Matrix):
        raise TypeError(f"evaluate_candidate: matrix must be a harness.Matrix (got {type(matrix).__name__})")
    # (The verdict logic also runs on CPU tensors, with a stand-in kernel: that is how it is tested.)
    device = torch.cuda.get_device_name(matrix.device) if matrix.device.type == "cuda" else str(matrix.device)
    record = EvalRecord(key=spec.key, family=spec.family, params=spec.params, n=int(n), dtype=dtype_name(dtype),
                        device=device)
    stages: dict[str, float] = {}  # seconds from the previous stage (the first: from the start)
    last = [start]

    def report(stage: str) -> None:
        now = time.perf_counter()
        stages[stage] = round(now - last[0], 4)
        last[0] = now
        if progress is not None:
            progress(stage)

    try:
        _evaluate(record, spec, matrix, int(n), config, report)
    except _Fail as verdict:
        record.fail(verdict.kind, str(verdict))
    except Exception as exc:
        kind = classify_cuda_error(exc)
        if kind is None:
            raise
        record.fail(kind, f"{type(exc).__name__}: {exc}")
    if record.error_kind is None and record.compiled:
        record.correct = True
    record.elapsed_s = time.perf_counter() - start
    record.timing["stages_s"] = stages
    return record


def _evaluate(record: EvalRecord, spec: KernelSpec, matrix: Matrix, n: int, config: EvalConfig, report) -> None:
    try:
        plan = spec.plan
    except PlanError as exc:
        raise _Fail(ErrorKind.PLAN, str(exc)) from None
    record.op = plan.op
    if plan.dtype != record.dtype:
        raise _Fail(ErrorKind.PLAN, f"the plan is for dtype={plan.dtype}, the evaluation for dtype={record.dtype}")
    if plan.n is not None and plan.n != n:
        raise _Fail(ErrorKind.PLAN, f"the plan is for n={plan.n}, the evaluation for n={n}")
    if plan.op == "spmv" and n != 1:
        raise _Fail(ErrorKind.PLAN, f"op=spmv is evaluated with n=1 (got n={n})")

    try:
        kernel = load_kernel(spec)
    except CompileError as exc:
        record.fail(ErrorKind.COMPILE, str(exc))
        if exc.log and exc.log not in record.log:
            record.add_log(exc.log)
        return
    record.compiled = True
    record.registers = kernel.registers
    record.local_bytes = kernel.local_bytes
    record.smem_static = kernel.static_smem
    compile_log = getattr(kernel, "compile_log", "") or ""
    spills = _SPILLS.findall(compile_log)
    if spills:  # only when the builder asked ptxas for its report (-Xptxas -v)
        record.spill_bytes = sum(int(a) + int(b) for a, b in spills)
    elif kernel.local_bytes:
        record.spill_bytes = (_spills_from_nvcc(spec, matrix.device)
                              if config.count_spills and matrix.device.type == "cuda" else None)
    else:
        record.spill_bytes = 0  # no local memory at all: nothing can have spilled
    report("compiled")
    if plan.block > kernel.max_threads:
        # Registers decide unless the kernel's own __launch_bounds__ is smaller than its plan.
        kind = (ErrorKind.RESOURCES if (kernel.registers or 0) * plan.block > REGISTERS_PER_SM
                else ErrorKind.LAUNCH)
        raise _Fail(kind, f"block={plan.block} but the kernel can run at most {kernel.max_threads} threads "
                          f"per block ({kernel.registers} registers per thread)")

    try:
        prepared = prepare(plan, matrix.rowptr, matrix.col, matrix.shape, n)
    except PlanError as exc:
        raise _Fail(ErrorKind.PLAN, str(exc)) from None
    if prepared.smem + kernel.static_smem > MAX_SMEM_BYTES:
        raise _Fail(ErrorKind.RESOURCES, f"shared memory {kernel.static_smem} static + {prepared.smem} dynamic "
                                         f"bytes exceeds the {MAX_SMEM_BYTES} bytes per block of sm_90")
    report("prepared")

    problem = _Problem(kernel, prepared, matrix, n, plan.op, plan.torch_dtype, config)
    _check_correctness(record, problem, config)
    report("correct")
    if config.time and problem.device.type == "cuda":
        _check_timing(record, problem, config)
        report("timed")


def _spills_from_nvcc(spec: KernelSpec, device) -> int | None:
    """Spill bytes from ptxas's report: the driver only says how much local memory a kernel
    uses (spills and stack arrays alike). None when nvcc is not installed."""
    from ..toolchain import nvcc
    if nvcc.nvcc_path() is None:
        return None
    major, minor = torch.cuda.get_device_capability(device)
    try:
        return nvcc.compile(spec.source, arch=f"sm_{major}{minor}").spill_bytes
    except Exception:  # noqa: BLE001 - NVRTC built it; an nvcc failure only loses the spill count
        return None


def _check_correctness(record: EvalRecord, problem: _Problem, config: EvalConfig) -> None:
    earlier_ok: list[torch.Tensor] = []  # outputs of trials that passed
    max_error = 0.0
    for trial in range(config.trials):
        problem.new_inputs(_seed(config, trial))
        first = problem.run_checked()
        ok, reason, missing = problem.judge(first)
        if config.check_determinism:
            second = problem.run_checked()
            ok2, reason2, missing2 = problem.judge(second)
            if ok and missing2:
                raise _Fail(ErrorKind.STALE, f"trial {trial}: the first call was correct, the second call on "
                                             f"the same inputs left {missing2} elements unwritten")
            if not problem.close(second, first):
                raise _Fail(ErrorKind.NONDETERMINISTIC,
                            f"trial {trial}: two calls on the same inputs differ beyond tolerance "
                            f"({'both wrong' if not (ok or ok2) else 'one matches the reference'}; "
                            f"first: {reason}; second: {reason2})")
        if not ok:
            replayed = any(problem.close(first, earlier) for earlier in earlier_ok)
            if earlier_ok and (missing or replayed):
                raise _Fail(ErrorKind.STALE, f"trial {trial}: earlier calls were correct, this one "
                                             f"{'returned an earlier result' if replayed else 'skipped work'}: {reason}")
            record.max_error = problem.max_error(first) if not missing else None
            raise _Fail(ErrorKind.UNWRITTEN if missing else ErrorKind.WRONG, f"trial {trial}: {reason}")
        max_error = max(max_error, problem.max_error(first))
        earlier_ok.append(first)
        record.trials = trial + 1
        record.max_error = max_error


def _seed(config: EvalConfig, trial: int) -> int:
    return (config.seed * 1_000_003 + trial) & 0x7FFF_FFFF_FFFF


def _baseline(problem: _Problem):
    """cuSPARSE on the same data (as kernels/vendor.py calls it): half types widened to fp32."""
    rows, cols = problem.matrix.shape
    widened = problem.dtype != torch.float32
    val = problem.val.float() if widened else problem.val
    x = problem.x.float() if widened else problem.x
    out = torch.empty(problem.y_shape, dtype=torch.float32, device=problem.device)
    if problem.matrix.nnz == 0 or rows == 0 or cols == 0:
        return out.zero_, widened, out  # vendor.py returns zeros without calling cuSPARSE
    if problem.op == "sddmm":  # val holds D: cuSPARSE's SDDMM through torch.sparse.sampled_addmm
        m = problem.matrix
        out.zero_()
        return (lambda: vendor.sddmm_out(problem.pattern, m.rowptr, m.col, val, x, out)), widened, out
    a = vendor.as_torch_csr(problem.pattern, problem.matrix.rowptr, problem.matrix.col, val)
    if problem.op == "spmm":
        return (lambda: torch.addmm(out, a, x, beta=0, alpha=1, out=out)), widened, out
    return (lambda: torch.addmv(out, a, x, beta=0, alpha=1, out=out)), widened, out


def _check_timing(record: EvalRecord, problem: _Problem, config: EvalConfig) -> None:
    flush = _flush_buffer(config.flush_bytes, problem.device)
    problem.new_inputs(_seed(config, config.trials))
    base_fn, widened, base_out = _baseline(problem)
    record.baseline = "cusparse_fp32_widened" if widened else "cusparse"
    cand_fn = lambda: problem.launch(check=False)  # noqa: E731 - operands were checked above
    problem.fill_unwritten()
    bursts = (config.burst_reps, config.burst_gap_ms)
    (cand_us,) = _time([cand_fn], config.reps, config.warmup, flush, *bursts)
    (base_us,) = _time([base_fn], config.reps, config.warmup, flush, *bursts) if config.baseline else ([],)
    problem.check_side_effects()
    ok, reason, _ = problem.judge(problem.y.clone())
    if not ok:
        raise _Fail(ErrorKind.STALE, f"after {config.warmup + config.reps} timed calls the output no longer "
                                     f"matches the reference: {reason}")
    record.runtime_us = statistics.median(cand_us)
    prepared = problem.prepared
    # what a call issues from the host, zero-fills included (the runtime weighs their host cost)
    launches = (prepared.grid > 0) + bool(prepared.init_zero) + bool(prepared.work_numel and not prepared.work_once)
    record.timing = {"kernel_us": _stats(cand_us), "reps": config.reps,
                     "warmup": config.warmup, "flush_bytes": flush.numel(), "launches": launches}
    if not config.baseline:
        record.baseline = None
        return
    record.cusparse_us = statistics.median(base_us)
    record.timing.update({"cusparse_us": _stats(base_us), "baseline": record.baseline})
    speedup = record.speedup or 0.0
    if speedup <= config.suspicious_speedup:
        return

    # Too good to be true until shown again: interleaved timing on fresh data, then the output.
    problem.new_inputs(_seed(config, config.trials + 1))
    base_fn, _, _ = _baseline(problem)
    problem.fill_unwritten()
    cand2, base2 = _time([cand_fn, base_fn], config.reps, config.warmup, flush, *bursts)
    problem.check_side_effects()
    ok, reason, _ = problem.judge(problem.y.clone())
    speedup2 = statistics.median(base2) / max(statistics.median(cand2), 1e-9)
    record.timing["recheck"] = {"kernel_us": _stats(cand2), "cusparse_us": _stats(base2), "speedup": speedup2,
                                "first_speedup": speedup, "output_ok": ok}
    if not ok:
        raise _Fail(ErrorKind.SUSPICIOUS, f"speedup {speedup:.1f}x, but the output on fresh data after "
                                          f"re-timing is wrong: {reason}")
    if speedup2 < config.recheck_min_ratio * speedup:
        raise _Fail(ErrorKind.SUSPICIOUS, f"speedup {speedup:.1f}x did not hold when re-timed interleaved "
                                          f"on fresh data ({speedup2:.1f}x)")
    if speedup2 < speedup:  # report the more conservative of the two measurements
        record.runtime_us, record.cusparse_us = statistics.median(cand2), statistics.median(base2)
