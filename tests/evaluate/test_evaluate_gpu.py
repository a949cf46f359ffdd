"""The evaluator on the GPU: every adversarial kernel is rejected with the right error kind,
through the sandbox; correct kernels are accepted with their times and cuSPARSE's; the
parent's CUDA context survives it all."""

from __future__ import annotations


import numpy as np
import pytest
import scipy.sparse as sp
import torch

from torch_sparserl.abi import KernelSpec
from torch_sparserl.evaluate import ErrorKind, EvalConfig, EvalRecord, Sandbox, evaluate_many, reward

from helpers import TESTS


ADVERSARIAL = TESTS / "adversarial"
CONFIG = EvalConfig(trials=2, reps=10, warmup=2)
TIMEOUT_S = 120.0  # the first candidate of a worker pays NVRTC's start-up
BASELINE_SPIN_CYCLES = 2_000_000  # about a millisecond of GPU clock: far above the tested kernel's time


def spec(name: str) -> KernelSpec:
    return KernelSpec((ADVERSARIAL / name).read_text(), family=name.removesuffix(".cu"))


def random_pattern(rows=2048, cols=2048, per_row=64, seed=0):
    """Rows of ~per_row nonzeros: enough contention per output for the race kernel to show."""
    a = sp.random(rows, cols, density=per_row / cols, format="csr", random_state=np.random.default_rng(seed))
    return a.indptr.astype(np.int32), a.indices.astype(np.int32), a.shape


@pytest.fixture(scope="module")
def parent_tensor():
    # The parent's own CUDA context, created before any candidate runs, must survive them.
    return torch.arange(16, device="cuda", dtype=torch.float32)


@pytest.fixture(scope="module")
def sandbox(parent_tensor):
    with Sandbox() as box:
        rowptr, col, shape = random_pattern()
        box.set_matrix("rand", rowptr, col, shape)
        yield box


CASES = [
    # file, n, dtype, expected error kind (None: accepted)
    ("good_spmm_f32.cu", 32, torch.float32, None),
    ("good_spmm_f32.cu", 7, torch.float32, None),            # n not a multiple of 4 or 32
    ("good_spmm_f16.cu", 32, torch.float16, None),
    ("good_spmv_atomic.cu", 1, torch.float32, None),         # atomics: rounding-level nondeterminism is fine
    ("good_spmv_workspace.cu", 1, torch.float32, None),
    ("spills.cu", 32, torch.float32, None),                  # correct, but penalized for spilling
    ("bad_plan.cu", 32, torch.float32, ErrorKind.PLAN),
    ("does_not_compile.cu", 32, torch.float32, ErrorKind.COMPILE),
    ("too_many_registers.cu", 32, torch.float32, ErrorKind.RESOURCES),
    ("launch_bounds_mismatch.cu", 32, torch.float32, ErrorKind.LAUNCH),
    ("oob_near.cu", 32, torch.float32, ErrorKind.OUT_OF_BOUNDS),
    ("oob_far.cu", 32, torch.float32, ErrorKind.OUT_OF_BOUNDS),
    ("oob_before.cu", 32, torch.float32, ErrorKind.OUT_OF_BOUNDS),
    ("oob_workspace.cu", 1, torch.float32, ErrorKind.OUT_OF_BOUNDS),
    ("partial.cu", 32, torch.float32, ErrorKind.UNWRITTEN),
    ("race.cu", 32, torch.float32, ErrorKind.NONDETERMINISTIC),
    ("cached_flag.cu", 32, torch.float32, ErrorKind.STALE),
    ("cached_value.cu", 32, torch.float32, ErrorKind.STALE),
    ("modifies_input.cu", 32, torch.float32, ErrorKind.INPUT_MODIFIED),
    ("wild_write.cu", 32, torch.float32, ErrorKind.CRASH),
    ("good_spmm_f32.cu", 16, torch.float32, None),           # a fresh worker after the crash
    ("endless.cu", 32, torch.float32, ErrorKind.TIMEOUT),
    ("good_spmm_f32.cu", 8, torch.float32, None),            # a fresh worker after the hang
]


@pytest.mark.parametrize("name, n, dtype, kind", CASES, ids=[f"{c[0]}-n{c[1]}" for c in CASES])
def test_candidates_get_the_right_verdict(sandbox, name, n, dtype, kind):
    timeout = 10.0 if kind is ErrorKind.TIMEOUT else TIMEOUT_S
    pid = sandbox.worker_pid
    record = sandbox.evaluate(spec(name), "rand", n, dtype, CONFIG, timeout_s=timeout)
    assert record.error_kind is kind, f"{name}: {record.error_kind}\n{record.log}"
    assert EvalRecord.from_json(record.to_json()) == record
    if kind is None:
        assert record.compiled and record.correct is True and record.trials == CONFIG.trials
        assert record.runtime_us > 0 and record.cusparse_us > 0 and record.speedup > 0
        assert record.baseline == ("cusparse" if dtype == torch.float32 else "cusparse_fp32_widened")
        assert record.timing["kernel_us"]["min"] <= record.runtime_us <= record.timing["kernel_us"]["max"]
        assert record.timing["launches"] >= 1  # what the runtime's end-to-end gate weighs
        assert record.registers and record.max_error is not None
        if name == "spills.cu":
            assert record.local_bytes > 0
            if record.spill_bytes is not None:  # None where nvcc is not installed
                assert record.spill_bytes > 0 and reward(record) == pytest.approx(record.speedup - 0.3)
        else:
            assert reward(record) == pytest.approx(record.speedup)
    elif kind in (ErrorKind.PLAN, ErrorKind.COMPILE):
        assert not record.compiled and reward(record) == -0.5
    else:
        assert record.compiled and record.correct is False
        assert reward(record) == (-0.3 if kind is ErrorKind.RESOURCES else 0.0)
    if kind in (ErrorKind.CRASH, ErrorKind.TIMEOUT):
        assert sandbox.worker_pid is None or sandbox.worker_pid != pid  # replaced
    print(f"{name} n={n}: {record.error_kind} speedup={record.speedup} "
          f"t={record.runtime_us} cusparse={record.cusparse_us} {record.elapsed_s}")


def test_parent_context_still_works(sandbox, parent_tensor):
    assert sandbox.starts >= 3  # the crash and the hang each cost a worker
    assert float((parent_tensor * 2).sum()) == 240.0
    assert torch.ones(4, device="cuda").sum().item() == 4.0


def test_in_process_evaluation_and_recheck_of_high_speedups(monkeypatch):
    """A speedup above ``suspicious_speedup`` is re-timed interleaved on fresh data and the
    output checked again. The baseline is slowed down by a GPU spin before each cuSPARSE call,
    so the candidate's speedup is high on any GPU and the re-check always runs."""
    from torch_sparserl.evaluate import harness
    from torch_sparserl.evaluate.harness import Matrix, evaluate_candidate

    baseline = harness._baseline

    def slowed_baseline(problem):
        run, widened, out = baseline(problem)

        def slowed():
            torch.cuda._sleep(BASELINE_SPIN_CYCLES)
            return run()

        return slowed, widened, out

    monkeypatch.setattr(harness, "_baseline", slowed_baseline)
    rowptr, col, shape = random_pattern(rows=4096, cols=4096, per_row=16, seed=1)
    matrix = Matrix.from_numpy(rowptr, col, shape)
    config = EvalConfig(trials=2, reps=10, warmup=2, suspicious_speedup=2.0, recheck_min_ratio=0.2)
    record = evaluate_candidate(spec("good_spmm_f32.cu"), matrix, 32, torch.float32, config)
    assert record.error_kind is None, record.log
    assert record.speedup > config.suspicious_speedup, record.timing
    recheck = record.timing["recheck"]
    assert recheck["output_ok"] and recheck["speedup"] >= config.recheck_min_ratio * recheck["first_speedup"], recheck


def test_runtime_configurations_never_build_a_kernel_again_to_count_spills(monkeypatch):
    """count_spills=False (the runtime's screening and validation): a local-memory kernel is
    judged without a second build by nvcc; its spill count is the build's own, if any."""
    from torch_sparserl.evaluate import harness
    from torch_sparserl.specialize.autotune import FINAL_CONFIG, SCREEN_CONFIG

    def refuse(*args):
        raise AssertionError("nvcc was asked to count spills")

    monkeypatch.setattr(harness, "_spills_from_nvcc", refuse)
    assert not SCREEN_CONFIG.count_spills and not FINAL_CONFIG.count_spills
    rowptr, col, shape = random_pattern(rows=512, cols=512, per_row=8, seed=4)
    config = EvalConfig(trials=2, reps=5, warmup=1, count_spills=False)
    record = harness.evaluate_candidate(spec("spills.cu"), harness.Matrix.from_numpy(rowptr, col, shape), 32,
                                        torch.float32, config)
    assert record.correct and record.local_bytes > 0, record.log
    assert record.spill_bytes is None or record.spill_bytes > 0


def _fill_device(down_to_bytes: int) -> list:
    """Allocations holding the device's memory until less than ``down_to_bytes`` can be had."""
    held, size = [], 1 << 30
    while size >= down_to_bytes:
        try:
            held.append(torch.empty(size, dtype=torch.uint8, device="cuda"))
        except torch.OutOfMemoryError:
            size //= 2
    return held


def test_an_evaluation_on_a_full_device_fails_for_the_devices_state_not_the_candidate():
    from torch_sparserl.evaluate.harness import Matrix, evaluate_candidate
    from torch_sparserl.evaluate.record import TRANSIENT_KINDS
    rowptr, col, shape = random_pattern(rows=65536, cols=65536, per_row=8, seed=3)
    matrix = Matrix.from_numpy(rowptr, col, shape)
    good = evaluate_candidate(spec("good_spmm_f32.cu"), matrix, 32, torch.float32, CONFIG)
    assert good.error_kind is None, good.log
    held = _fill_device(down_to_bytes=1 << 20)  # X alone is 8 MiB
    try:
        record = evaluate_candidate(spec("good_spmm_f32.cu"), matrix, 32, torch.float32, CONFIG)
    finally:
        del held
        torch.cuda.empty_cache()
    assert record.error_kind is ErrorKind.DEVICE_MEMORY and record.error_kind in TRANSIENT_KINDS, record.log
    assert "out of memory" in record.log and reward(record) == 0.0


def test_evaluate_many_streams_records():
    rowptr, col, shape = random_pattern(rows=512, cols=512, per_row=8, seed=2)
    names = ["good_spmm_f32.cu", "partial.cu", "bad_plan.cu"]
    records = list(evaluate_many([spec(n) for n in names], rowptr, col, shape, 32, "f32", CONFIG,
                                 timeout_s=TIMEOUT_S))
    assert [r.error_kind for r in records] == [None, ErrorKind.UNWRITTEN, ErrorKind.PLAN]
    assert all(r.matrix == "matrix" for r in records)


def test_bursts_leave_the_gpu_idle_between_them_and_time_every_run():
    """Timed in bursts (EvalConfig.burst_reps), the host waits for each burst and sleeps before
    the next: the runs' samples are all there, and the GPU is idle in the gaps, where another
    process's kernels run."""
    import time

    from torch_sparserl.evaluate import harness

    flush = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
    x = torch.randn(1 << 16, device="cuda")
    fn = lambda: x.mul_(1.0)  # noqa: E731
    harness._time([fn], 2, 1, flush)  # warm
    start = time.perf_counter()
    (at_once,) = harness._time([fn], 9, 1, flush)
    whole = time.perf_counter() - start
    start = time.perf_counter()
    (bursts,) = harness._time([fn], 9, 1, flush, burst=4, gap_ms=20.0)
    gapped = time.perf_counter() - start
    assert len(at_once) == len(bursts) == 9 and min(bursts) > 0
    assert gapped >= whole + 0.04  # two gaps of 20 ms: after runs 4 and 8


@pytest.mark.parametrize("op, n, cleanup", [
    ("spmm", 32, "if (mine) __stcg(hub + cc + i, 0.f);"),   # the sums left behind
    ("spmv", 1, "__stcg(hub, 0.f);"),
    ("spmm", 32, "if (last) atomicExch(count, 0);"),        # the counter left behind
])
def test_a_kernel_that_leaves_its_kept_workspace_dirty_is_stale(op, n, cleanup):
    """work_init=once promises a workspace left zero; the evaluation holds a kernel to it (the
    shipped rowchunks kernel passes, the same kernel without its cleanup does not)."""
    from torch_sparserl.evaluate.harness import Matrix, evaluate_candidate
    from torch_sparserl.specialize import families

    rowptr, col, shape = random_pattern(rows=512, cols=512, per_row=24, seed=2)
    matrix = Matrix.from_numpy(rowptr, col, shape)
    good = families.render("rowchunks", {"seg": 5}, op=op, dtype="f32", n=n)  # every row a hub
    assert "work_init=once" in good.source.splitlines()[0] and cleanup in good.source
    record = evaluate_candidate(good, matrix, n, torch.float32, CONFIG)
    assert record.error_kind is None and record.timing["launches"] == 1, record.log
    dirty = KernelSpec(good.source.replace(cleanup, ""), family="rowchunks")
    record = evaluate_candidate(dirty, matrix, n, torch.float32, CONFIG)
    assert record.error_kind is ErrorKind.STALE, record.log


def test_candidates_prebuilt_together_evaluate_as_they_would_alone():
    """Sandbox.prebuild compiles candidates concurrently in the worker (NVRTC on several
    threads); the evaluations then use those builds, and a candidate that does not compile is
    still recorded as a compile failure by its evaluation."""
    from torch_sparserl.specialize import families

    rowptr, col, shape = random_pattern(rows=1024, cols=768, per_row=12, seed=3)
    specs = [families.render(f, p, op="spmm", dtype="f32", n=32) for f, p in families.space("spmm", "f32", 32)[::3]]
    broken = [spec("does_not_compile.cu"), spec("bad_plan.cu")]
    with Sandbox() as box:
        box.set_matrix("m", rowptr, col, shape)
        built = box.prebuild(specs + broken, workers=8, timeout_s=TIMEOUT_S)
        assert set(built) == {s.key for s in specs} and all(sec > 0 for sec in built.values())
        assert box.prebuild(specs) == {}  # loaded already: nothing to build
        records = list(box.evaluate_many(specs + broken, "m", 32, "f32", CONFIG, timeout_s=TIMEOUT_S))
    assert all(r.correct for r in records[:-2]), [(r.family, r.error_kind, r.log[-300:]) for r in records]
    assert [r.error_kind for r in records[-2:]] == [ErrorKind.COMPILE, ErrorKind.PLAN]
