"""The evaluator on CPU: records, reward, the sandbox against hostile tasks, the verdict logic
with stand-in kernels, and the compile tier with nvcc on the adversarial sources."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

import torch_sparserl
from torch_sparserl.abi import KernelSpec, check_source
from torch_sparserl.evaluate import (ErrorKind, EvalConfig, EvalRecord, Sandbox, SandboxError, harness,
                                     reward)
from torch_sparserl.evaluate.record import MAX_LOG_CHARS, clip_log, dtype_name

from adversarial import hostile_tasks

from helpers import TESTS

ADVERSARIAL = TESTS / "adversarial"
HAS_NVCC = shutil.which("nvcc") is not None
needs_nvcc = pytest.mark.skipif(not HAS_NVCC, reason="nvcc is not installed")


def task(name: str):
    """A hostile task: a function of tests/adversarial/hostile_tasks.py, which the worker imports."""
    return getattr(hostile_tasks, name)


def source(name: str) -> str:
    return (ADVERSARIAL / name).read_text()


def spec(name: str) -> KernelSpec:
    return KernelSpec(source(name), family=name.removesuffix(".cu"), params=(("file", name),))


# =========================================================================== records

def full_record(**changes) -> EvalRecord:
    record = EvalRecord(key="abc123", family="warp_row", params={"lanes": 32, "vec": 4}, op="spmm", n=32,
                        dtype="f32", matrix="cora", compiled=True, correct=True, runtime_us=10.0,
                        cusparse_us=25.0, error_kind=None, log="ok", registers=40, spill_bytes=0,
                        local_bytes=0, smem_static=0, max_error=1e-7, trials=3, baseline="cusparse",
                        timing={"kernel_us": {"median": 10.0}, "reps": 30}, device="NVIDIA H100",
                        elapsed_s=1.5)
    for key, value in changes.items():
        setattr(record, key, value)
    return record


def test_error_kinds_are_the_closed_set():
    assert {k.value for k in ErrorKind} == {
        "plan", "compile", "resources", "launch", "crash", "timeout", "wrong", "unwritten", "out_of_bounds",
        "input_modified", "nondeterministic", "stale", "suspicious", "device_memory"}
    assert ErrorKind("stale") is ErrorKind.STALE and ErrorKind.STALE == "stale"


@pytest.mark.parametrize("kind", [None, *ErrorKind])
def test_record_json_round_trip(kind):
    record = full_record(error_kind=kind, correct=kind is None)
    text = record.to_json()
    back = EvalRecord.from_json(text)
    assert back == record
    assert back.error_kind is kind
    assert json.loads(text)["error_kind"] == (kind.value if kind else None)
    assert back.speedup == pytest.approx(2.5)


def test_record_from_json_is_strict():
    data = full_record().to_dict()
    with pytest.raises(ValueError, match="unknown field.*bogus"):
        EvalRecord.from_dict({**data, "bogus": 1})
    with pytest.raises(ValueError, match="error_kind must be one of"):
        EvalRecord.from_dict({**data, "error_kind": "slow"})
    with pytest.raises(ValueError, match="'key' is required"):
        EvalRecord.from_dict({k: v for k, v in data.items() if k != "key"})


def test_record_params_pairs_become_a_dict_and_non_finite_timing_is_null():
    record = EvalRecord(key="k", params=(("lanes", 8), ("vec", 2)), timing={"x": float("nan")})
    assert record.params == {"lanes": 8, "vec": 2}
    assert json.loads(record.to_json())["timing"] == {"x": None}


def test_speedup_needs_both_times():
    assert full_record(runtime_us=None).speedup is None
    assert full_record(cusparse_us=None).speedup is None
    assert full_record(runtime_us=0.0).speedup is None
    assert full_record(runtime_us=50.0).speedup == pytest.approx(0.5)


def test_fail_keeps_the_first_reason_and_clips_logs():
    record = EvalRecord(key="k", compiled=True)
    record.fail(ErrorKind.OUT_OF_BOUNDS, "guard changed").fail(ErrorKind.WRONG, "and wrong")
    assert record.error_kind is ErrorKind.OUT_OF_BOUNDS and record.correct is False
    assert "guard changed" in record.log and "and wrong" in record.log
    uncompiled = EvalRecord(key="k").fail(ErrorKind.COMPILE, "nope")
    assert uncompiled.correct is None
    long = "A" * 10 + "x" * (3 * MAX_LOG_CHARS) + "Z" * 10
    clipped = clip_log(long)
    assert len(clipped) < MAX_LOG_CHARS + 100 and clipped.startswith("A" * 10) and clipped.endswith("Z" * 10)


def test_dtype_names():
    assert dtype_name(torch.float16) == "f16" and dtype_name("bf16") == "bf16" and dtype_name(torch.float32) == "f32"
    with pytest.raises(ValueError, match="dtype_name: expected"):
        dtype_name(torch.float64)


def test_config_checks_and_round_trip():
    config = EvalConfig(trials=2, reps=5)
    assert EvalConfig.from_dict(config.to_dict()) == config
    with pytest.raises(ValueError, match="EvalConfig: trials must be >= 1"):
        EvalConfig(trials=0)
    with pytest.raises(ValueError, match="EvalConfig: burst_reps must be >= 0"):
        EvalConfig(burst_reps=-1)
    with pytest.raises(ValueError, match="guard_bytes"):
        EvalConfig(guard_bytes=100)
    with pytest.raises(ValueError, match="unknown field"):
        EvalConfig.from_dict({"trails": 3})


# =========================================================================== reward

@pytest.mark.parametrize("record, expected", [
    (EvalRecord(key="k", compiled=False, error_kind=ErrorKind.PLAN), -0.5),
    (EvalRecord(key="k", compiled=False, error_kind=ErrorKind.COMPILE), -0.5),
    (EvalRecord(key="k", compiled=False), -0.5),
    (full_record(correct=False, error_kind=ErrorKind.WRONG), 0.0),
    (full_record(correct=False, error_kind=ErrorKind.CRASH, runtime_us=None), 0.0),
    (full_record(correct=False, error_kind=ErrorKind.TIMEOUT, runtime_us=None), 0.0),
    (full_record(correct=False, error_kind=ErrorKind.OUT_OF_BOUNDS), 0.0),
    (full_record(correct=False, error_kind=ErrorKind.SUSPICIOUS, runtime_us=1.0), 0.0),
    (full_record(correct=None, runtime_us=None, cusparse_us=None), 0.0),      # compile tier only
    (full_record(runtime_us=10.0, cusparse_us=25.0), 2.5),                     # 1 + (2.5 - 1)
    (full_record(runtime_us=50.0, cusparse_us=25.0), 0.5),                     # slower: still > wrong
    (full_record(runtime_us=None, cusparse_us=None), 1.0),                     # correct, not timed
    (full_record(spill_bytes=64), 2.5 - 0.3),
    (full_record(correct=None, error_kind=ErrorKind.RESOURCES, runtime_us=None), -0.3),
    (full_record(correct=False, error_kind=ErrorKind.RESOURCES, runtime_us=None), -0.3),
    (full_record(correct=False, error_kind=ErrorKind.WRONG, spill_bytes=8), -0.3),
    (EvalRecord(key="k", compiled=False, error_kind=ErrorKind.COMPILE, spill_bytes=8), -0.5),
])
def test_reward_hierarchy(record, expected):
    before = record.to_json()
    assert reward(record) == pytest.approx(expected)
    assert reward(EvalRecord.from_json(before)) == pytest.approx(expected)  # a function of the record alone
    assert record.to_json() == before


# =========================================================================== sandbox

@pytest.fixture(scope="module")
def sandbox():
    with Sandbox(task=task("eval_by_source"), init=task("init"), matrix_loader=task("load_matrix"),
                 health_check=task("healthy"), start_timeout_s=60) as box:
        box.set_matrix("small", np.array([0, 1, 3]), np.array([0, 0, 1]), (2, 2))
        yield box


def test_sandbox_runs_tasks_in_one_persistent_worker(sandbox):
    first = sandbox.run(task("echo"), (1,), timeout_s=5)
    second = sandbox.run(task("echo"), ("two",), timeout_s=5)
    assert first.ok and first.value["value"] == 1
    assert second.value["pid"] == first.value["pid"] != os.getpid()
    assert sandbox.worker_info["kind"] == "cpu-test"


def test_sandbox_passes_cached_matrices(sandbox):
    outcome = sandbox.run(task("echo"), (0,), timeout_s=5, matrix_key="small")
    assert outcome.value["matrix"] == {"rows": 2, "cols": 2, "nnz": 3, "rowptr_sum": 4}
    with pytest.raises(KeyError, match="matrix 'nope' is unknown"):
        sandbox.run(task("echo"), (0,), timeout_s=5, matrix_key="nope")


@pytest.mark.parametrize("name", ["hang", "busy_loop", "ignore_sigterm_and_hang"])
def test_sandbox_kills_a_hang_and_restarts(sandbox, name):
    pid = sandbox.run(task("getpid"), timeout_s=5).value
    start = time.monotonic()
    outcome = sandbox.run(task(name), timeout_s=1.0)
    assert time.monotonic() - start < 5
    assert outcome.status == "timeout" and outcome.restarted
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # the old worker is gone
    after = sandbox.run(task("echo"), ("alive",), timeout_s=5, matrix_key="small")  # matrix re-sent lazily
    assert after.ok and after.value["pid"] != pid and after.value["matrix"]["nnz"] == 3


@pytest.mark.parametrize("name, signal_name, exitcode, words", [
    ("exit_hard", None, 9, "about to exit"),
    ("abort", "SIGABRT", -signal.SIGABRT, ""),
    ("segfault", "SIGSEGV", -signal.SIGSEGV, "Fatal Python error"),  # faulthandler's report
])
def test_sandbox_survives_a_dying_worker(sandbox, name, signal_name, exitcode, words):
    pid = sandbox.run(task("getpid"), timeout_s=5).value
    outcome = sandbox.run(task(name), timeout_s=5)
    assert outcome.status == "crash" and outcome.restarted
    assert outcome.exitcode == exitcode and outcome.signal == signal_name
    assert words in outcome.output_tail
    assert sandbox.run(task("getpid"), timeout_s=5).value != pid


def test_sandbox_release_frees_the_shared_inputs_and_keeps_the_worker(sandbox):
    with Sandbox(task=task("echo"), init=None, matrix_loader=None, health_check=None) as idle:
        assert idle.release() is None and idle.worker_pid is None  # no worker is started to release
    pid = sandbox.run(task("echo"), (1,), timeout_s=5).value["pid"]
    assert sandbox.release() == 0  # no CUDA here: nothing reserved
    assert sandbox.run(task("echo"), (2,), timeout_s=5, matrix_key="small").value["pid"] == pid


def test_release_memory_forgets_the_inputs_of_the_last_problem(monkeypatch):
    monkeypatch.setattr(harness, "_INPUTS", {("m", 1): (torch.zeros(1),) * 4})
    assert harness.release_memory() == 0 and harness._INPUTS == {}


def test_sandbox_reports_exceptions_and_keeps_the_worker(sandbox):
    pid = sandbox.run(task("getpid"), timeout_s=5).value
    raised = sandbox.run(task("raise_error"), timeout_s=5)
    assert raised.status == "error" and "ValueError: hostile task raised on purpose" in raised.error
    assert "raise_error" in raised.traceback and not raised.restarted
    unpicklable = sandbox.run(task("unpicklable"), timeout_s=5)
    assert unpicklable.status == "error" and "cannot send the result" in unpicklable.error
    assert sandbox.run(task("getpid"), timeout_s=5).value == pid


def test_a_task_the_worker_cannot_find_is_the_tasks_error(sandbox, monkeypatch):
    """A function set on a module in this process only: the worker's import of the module has
    no such attribute, which is the task's error, and the worker stays."""
    def ghost():
        return "never"

    ghost.__module__, ghost.__qualname__ = hostile_tasks.__name__, "ghost"
    monkeypatch.setattr(hostile_tasks, "ghost", ghost, raising=False)
    pid = sandbox.run(task("getpid"), timeout_s=5).value
    missing = sandbox.run(ghost, timeout_s=5)
    assert missing.status == "error" and "adversarial.hostile_tasks has no attribute 'ghost'" in missing.error
    assert sandbox.run(task("getpid"), timeout_s=5).value == pid


def _nested():
    def inner():
        return 1
    return inner


@pytest.mark.parametrize("bad, error, message", [
    ("adversarial.hostile_tasks:echo", TypeError, r"the task must be a function defined at the top level of a "
                                                  r"module \(got str 'adversarial.hostile_tasks:echo'\)"),
    (lambda: 1, ValueError, r"the task test_evaluate.<lambda> cannot be imported by the worker"),
    (_nested(), ValueError, r"the task test_evaluate._nested.<locals>.inner cannot be imported by the worker"),
    (os.getpid, TypeError, r"the task must be a function .* \(got builtin_function_or_method"),
])
def test_a_task_is_a_function_the_worker_can_import(sandbox, bad, error, message):
    """Tasks are functions named by their module and name, checked before anything is sent."""
    from torch_sparserl.evaluate.sandbox import task_path

    assert task_path(hostile_tasks.echo) == "adversarial.hostile_tasks:echo"
    assert task_path(harness.sandbox_task) == "torch_sparserl.evaluate.harness:sandbox_task"
    with pytest.raises(error, match="Sandbox: " + message):
        sandbox.run(bad, timeout_s=5)
    with pytest.raises(error, match="Sandbox: " + message.replace("the task", "the init", 1)):
        Sandbox(task=hostile_tasks.echo, init=bad)


def test_main_module_functions_are_refused(monkeypatch):
    def where():
        return 0

    where.__module__, where.__qualname__ = "__main__", "where"  # as a script's own function
    monkeypatch.setattr(sys.modules["__main__"], "where", where, raising=False)
    with pytest.raises(ValueError, match=r"Sandbox: the task __main__.where cannot be imported by the worker"):
        Sandbox(task=where, init=None, matrix_loader=None, health_check=None)


def test_no_module_of_the_package_names_a_function_by_a_string():
    """Sandbox tasks are passed as functions, so that the layout test sees what a sandbox runs:
    no string of the package's source looks like ``"torch_sparserl.module:function"``."""
    import ast
    import re

    named = re.compile(r"^torch_sparserl(\.\w+)+:\w+$")
    found = []
    for path in Path(torch_sparserl.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and named.match(node.value):
                found.append(f"{path.name}:{node.lineno}: {node.value}")
    assert found == []


def test_sandbox_output_flood_stays_in_the_worker(sandbox, capfd):
    outcome = sandbox.run(task("print_megabytes"), (8,), timeout_s=10)
    assert outcome.ok and outcome.value == "printed"
    out, err = capfd.readouterr()
    assert len(out) + len(err) < 10_000  # nothing reached the parent's terminal


def test_sandbox_replaces_a_poisoned_worker(sandbox):
    pid = sandbox.run(task("getpid"), timeout_s=5).value
    outcome = sandbox.run(task("poison"), timeout_s=5)
    assert outcome.ok and outcome.value == "poisoned" and outcome.restarted
    assert sandbox.run(task("getpid"), timeout_s=5).value != pid


def test_sandbox_kills_the_whole_process_group(sandbox, tmp_path, monkeypatch):
    marker = tmp_path / "grandchild"
    monkeypatch.setenv("SPARSERL_TEST_GRANDCHILD_FILE", str(marker))  # read by the fresh worker
    sandbox.run(task("poison"), timeout_s=5)  # the next task starts a worker with this environment
    outcome = sandbox.run(task("spawn_grandchild_and_hang"), timeout_s=1.0)
    assert outcome.status == "timeout"
    _assert_gone(int(marker.read_text()), "the worker's timeout")


def _assert_gone(pid: int, after: str) -> None:
    """Process ``pid`` ends within 2.5 s."""
    for _ in range(50):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    pytest.fail(f"process {pid} survived {after}")


def test_sandbox_abort_kills_a_running_task_and_starts_no_worker_again(tmp_path, monkeypatch):
    """abort() from another thread (the runtime's exit hook): the task waiting on the worker
    ends at once as a crash by SIGKILL, the worker's whole process group dies with it, and no
    worker starts again."""
    marker = tmp_path / "grandchild"
    monkeypatch.setenv("SPARSERL_TEST_GRANDCHILD_FILE", str(marker))  # read by the worker this test starts
    with Sandbox(task=task("echo"), init=task("init"), matrix_loader=None, health_check=None,
                 start_timeout_s=60) as box:
        with ThreadPoolExecutor(1) as pool:
            running = pool.submit(box.run, task("spawn_grandchild_and_hang"), timeout_s=30)
            deadline = time.monotonic() + 60
            while not (marker.exists() and marker.read_text()):  # the task runs: its grandchild is there
                assert time.monotonic() < deadline and not running.done(), "the task did not start"
                time.sleep(0.02)
            worker, grandchild = box.worker_pid, int(marker.read_text())
            aborted_at = time.monotonic()
            box.abort()
            outcome = running.result(timeout=60)
        assert time.monotonic() - aborted_at < 10, "the task waited for its timeout"
        assert outcome.status == "crash" and outcome.signal == "SIGKILL" and box.aborted
        _assert_gone(grandchild, "abort()")
        _assert_gone(worker, "abort()")
        with pytest.raises(SandboxError, match="aborted"):
            box.run(task("echo"), (1,), timeout_s=5)
        assert box.worker_pid is None and box.starts == 1
        box.abort()  # again, without a worker: nothing to kill, no error


def test_sandbox_aborted_before_its_first_task_never_starts_a_worker():
    with Sandbox(task=task("echo"), init=task("init"), matrix_loader=None, health_check=None) as box:
        box.abort()
        with pytest.raises(SandboxError, match="aborted"):
            box.run(task("echo"), (1,), timeout_s=5)
        assert box.starts == 0 and box.worker_pid is None


def fake_spec(body: str) -> KernelSpec:
    return KernelSpec("// sparserl: op=spmm dtype=f32 block=256 grid=ceil(rows/8)\n"
                      'extern "C" __global__ void sparserl_kernel() {}\n// ' + body,
                      family="fake", params=(("body", body),))


@pytest.mark.parametrize("body, kind, compiled", [
    ("OK", None, True),
    ("HANG", ErrorKind.TIMEOUT, True),
    ("HANG_COMPILING", ErrorKind.TIMEOUT, False),
    ("SEGV", ErrorKind.CRASH, True),
    ("RAISE", ErrorKind.CRASH, False),
    ("POISON", ErrorKind.CRASH, True),
    ("GARBAGE", ErrorKind.CRASH, False),
])
def test_sandbox_evaluate_turns_every_outcome_into_a_record(sandbox, body, kind, compiled):
    record = sandbox.evaluate(fake_spec(body), "small", 32, torch.float32, EvalConfig(trials=2), timeout_s=1.0)
    assert record.error_kind is kind, record.log
    assert record.compiled is compiled
    assert record.key == fake_spec(body).key and record.family == "fake" and record.params == {"body": body}
    assert record.matrix == "small" and record.n == 32 and record.dtype == "f32" and record.op == "spmm"
    assert reward(EvalRecord.from_json(record.to_json())) == pytest.approx(
        2.0 if kind is None else (0.0 if compiled else -0.5))
    if body == "OK":
        assert "nnz=3 trials=2" in record.log
    if body == "SEGV":
        assert "SIGSEGV" in record.log and "launching" in record.log
    if body == "RAISE":
        assert "harness bug on purpose" in record.log


def test_evaluate_many_streams_in_order(sandbox):
    bodies = ["OK", "SEGV", "OK", "HANG", "OK"]
    stream = sandbox.evaluate_many([fake_spec(b) for b in bodies], "small", 32, "f32", timeout_s=1.0)
    first = next(stream)  # a generator: records come one at a time
    assert first.error_kind is None
    kinds = [first.error_kind] + [r.error_kind for r in stream]
    assert kinds == [None, ErrorKind.CRASH, None, ErrorKind.TIMEOUT, None]


def test_sandbox_start_failure_is_the_sandbox_s_error():
    with Sandbox(task=task("eval_ok"), init=task("raise_error"), matrix_loader=None, health_check=None) as box:
        with pytest.raises(SandboxError, match="(?s)did not start.*hostile task raised on purpose"):
            box.run(task("echo"), (1,), timeout_s=5)
    with pytest.raises(SandboxError, match="after close"):
        box.run(task("echo"), (1,), timeout_s=5)
    with pytest.raises(TypeError, match="Sandbox: the task must be a function"):
        Sandbox(task="no_colon")



def test_sandbox_does_not_rerun_a_flat_script(tmp_path):
    """A script without a main guard runs its top level once: the worker never imports it
    (spawn did, and the worker then trained a second time before answering)."""
    marker = tmp_path / "runs"
    script = tmp_path / "flat_script.py"
    script.write_text(textwrap.dedent(f"""\
        import sys
        sys.path.insert(0, {str(ADVERSARIAL.parent)!r})
        from adversarial.hostile_tasks import echo
        from torch_sparserl.evaluate import Sandbox
        with open({str(marker)!r}, "a") as f:
            f.write("top level ran\\n")
        box = Sandbox(task=echo, init=None, matrix_loader=None, health_check=None, start_timeout_s=30)
        print("result:", box.run(echo, ("flat",), timeout_s=30).value["value"])
        box.close()
        """))
    root = str(Path(torch_sparserl.__file__).parents[1])  # the package under test, not another install
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60,
                            env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "result: flat" in result.stdout
    assert marker.read_text().splitlines() == ["top level ran"]


def test_sandbox_without_pidfd_and_with_the_parents_sys_path(tmp_path, monkeypatch):
    """Without os.pidfd_open the parent polls for the worker's death; tasks importable only
    through the parent's sys.path resolve in the worker."""
    (tmp_path / "sandbox_path_task.py").write_text("import os\n\ndef where():\n    return os.getpid()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import importlib.util

    found = importlib.util.spec_from_file_location("sandbox_path_task", tmp_path / "sandbox_path_task.py")
    sandbox_path_task = importlib.util.module_from_spec(found)
    found.loader.exec_module(sandbox_path_task)
    monkeypatch.setitem(sys.modules, "sandbox_path_task", sandbox_path_task)  # forgotten after the test

    def no_pidfd(pid):
        raise OSError("pidfd_open: not here")

    monkeypatch.setattr(os, "pidfd_open", no_pidfd, raising=False)
    with Sandbox(task=task("echo"), init=None, matrix_loader=None, health_check=None) as box:
        pid = box.run(sandbox_path_task.where, timeout_s=5).value
        assert pid == box.worker_pid != os.getpid()
        assert box.run(task("echo"), (1,), timeout_s=5).value["value"] == 1
        crashed = box.run(task("exit_hard"), timeout_s=5)
        assert crashed.status == "crash" and crashed.exitcode == 9 and "about to exit" in crashed.output_tail
        start = time.monotonic()
        hung = box.run(task("hang"), timeout_s=0.5)
        assert hung.status == "timeout" and time.monotonic() - start < 3
        assert box.run(sandbox_path_task.where, timeout_s=5).value not in (pid, None)

# =========================================================================== verdicts, CPU stand-ins

class FakeKernel:
    """A Python stand-in for a built kernel, misbehaving on purpose like the adversarial .cu files."""

    registers, local_bytes, static_smem, max_threads, compile_log = 32, 0, 0, 1024, ""

    def __init__(self, behaviour: str):
        self.behaviour = behaviour
        self.calls = 0
        self.kept = None

    def __call__(self, rowptr, col, val, x, y, prepared, *, work=None, stream=None, check=True):
        self.calls += 1
        rows, cols = prepared.rows, prepared.cols
        with torch.sparse.check_sparse_tensor_invariants(enable=True):
            a = torch.sparse_csr_tensor(rowptr.long(), col.long(), val.double(), (rows, cols)).to_dense()
        out = (a @ x.double()).to(y.dtype)
        b = self.behaviour
        if b == "stale_flag" and self.calls > 1:
            return y
        if b == "stale_value":
            if self.kept is None:
                self.kept = out.clone()
            out = self.kept
        if b == "race":
            out = out + torch.randn_like(out)
        if b == "wrong":
            out = out * 1.01 + 0.1
        if b == "partial":  # the second half of y is left as it was
            y[:rows // 2] = out[:rows // 2]
            return y
        y.copy_(out)
        if b == "oob_after":
            torch.as_strided(y, (y.numel() + 2,), (1,))[-1] = 1.0
        if b == "oob_before":
            torch.as_strided(y, (1,), (1,), y.storage_offset() - 3)[0] = 1.0
        if b == "oob_work":
            torch.as_strided(work, (work.numel() + 1,), (1,))[-1] = 1.0
        if b == "modify_x":
            x.view(-1)[0] += 1.0
        if b == "modify_aux" and prepared.aux is not None:
            prepared.aux[0] += 1
        return y


CPU_PLAN = "// sparserl: op=spmm dtype=f32 rows=sorted_desc block=256 grid=ceil(rows/8) work=rows\n"


@pytest.fixture
def cpu_matrix():
    rng = np.random.default_rng(0)
    import scipy.sparse as sp
    a = sp.random(40, 30, density=0.2, format="csr", random_state=rng)
    return harness.Matrix.from_numpy(a.indptr, a.indices, a.shape, device="cpu")


@pytest.mark.parametrize("behaviour, kind", [
    ("correct", None),
    ("wrong", ErrorKind.WRONG),
    ("partial", ErrorKind.UNWRITTEN),
    ("race", ErrorKind.NONDETERMINISTIC),
    ("stale_flag", ErrorKind.STALE),
    ("stale_value", ErrorKind.STALE),
    ("oob_after", ErrorKind.OUT_OF_BOUNDS),
    ("oob_before", ErrorKind.OUT_OF_BOUNDS),
    ("oob_work", ErrorKind.OUT_OF_BOUNDS),
    ("modify_x", ErrorKind.INPUT_MODIFIED),
    ("modify_aux", ErrorKind.INPUT_MODIFIED),
])
def test_verdicts_with_stand_in_kernels(monkeypatch, cpu_matrix, behaviour, kind):
    fake = FakeKernel(behaviour)
    monkeypatch.setattr(harness, "load_kernel", lambda spec: fake)
    spec_ = KernelSpec(CPU_PLAN + 'extern "C" __global__ void sparserl_kernel() {}\n')
    stages = []
    record = harness.evaluate_candidate(spec_, cpu_matrix, 4, "f32", EvalConfig(trials=3, time=False),
                                        progress=stages.append)
    assert record.error_kind is kind, record.log
    assert record.compiled and record.correct is (kind is None)
    if kind is None:
        assert record.trials == 3 and record.max_error < 1e-6 and stages == ["compiled", "prepared", "correct"]
        assert list(record.timing["stages_s"]) == stages and all(t >= 0 for t in record.timing["stages_s"].values())
        assert record.spill_bytes == 0 and reward(record) == 1.0
    if kind is ErrorKind.OUT_OF_BOUNDS:
        assert "guard bytes" in record.log


def test_plan_problems_are_plan_errors(monkeypatch, cpu_matrix):
    monkeypatch.setattr(harness, "load_kernel", lambda spec: FakeKernel("correct"))
    body = 'extern "C" __global__ void sparserl_kernel() {}\n'
    cases = {
        "// sparserl: op=spmm dtype=f32 block=250 grid=1\n": "block must be",
        "// sparserl: op=spmm dtype=f16 block=256 grid=1\n": "the plan is for dtype=f16",
        "// sparserl: op=spmm dtype=f32 n=8 block=256 grid=1\n": "the plan is for n=8",
        "// sparserl: op=spmm dtype=f32 block=256 grid=rows-1000\n": "grid=",   # fails in prepare
    }
    for plan, words in cases.items():
        record = harness.evaluate_candidate(KernelSpec(plan + body), cpu_matrix, 4, torch.float32,
                                            EvalConfig(trials=1, time=False))
        assert record.error_kind is ErrorKind.PLAN and words in record.log, (plan, record.log)
        assert reward(record) == -0.5


def test_block_over_the_kernel_s_limit(monkeypatch, cpu_matrix):
    fake = FakeKernel("correct")
    fake.max_threads, fake.registers = 512, 128  # 128 registers × 1024 threads > 65536 per SM
    monkeypatch.setattr(harness, "load_kernel", lambda spec: fake)
    spec_ = KernelSpec('// sparserl: op=spmm dtype=f32 block=1024 grid=ceil(rows/32)\n'
                       'extern "C" __global__ void sparserl_kernel() {}\n')
    record = harness.evaluate_candidate(spec_, cpu_matrix, 4, "f32", EvalConfig(trials=1, time=False))
    assert record.error_kind is ErrorKind.RESOURCES and reward(record) == pytest.approx(-0.3)
    fake.max_threads, fake.registers = 128, 32  # few registers: the limit came from __launch_bounds__, the plan's geometry is bad
    record = harness.evaluate_candidate(spec_, cpu_matrix, 4, "f32", EvalConfig(trials=1, time=False))
    assert record.error_kind is ErrorKind.LAUNCH and reward(record) == 0.0


def test_cuda_errors_are_classified():
    from torch_sparserl.toolchain import LaunchError
    classify = harness.classify_cuda_error
    assert classify(RuntimeError("CUDA error: an illegal memory access was encountered")) is ErrorKind.CRASH
    assert classify(LaunchError("cuLaunchKernel failed with CUDA_ERROR_ILLEGAL_ADDRESS (700)")) is ErrorKind.CRASH
    assert classify(RuntimeError("CUDA error: unspecified launch failure")) is ErrorKind.CRASH
    assert classify(LaunchError("failed with CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES (701)")) is ErrorKind.RESOURCES
    assert classify(LaunchError("failed with CUDA_ERROR_INVALID_VALUE (1)")) is ErrorKind.LAUNCH
    assert classify(RuntimeError("CUDA error: invalid configuration argument")) is ErrorKind.LAUNCH
    assert classify(ValueError("a bug in the harness")) is None


def test_out_of_memory_is_the_devices_state_unless_the_request_exceeds_the_device():
    classify = harness.classify_cuda_error
    busy = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.00 GiB. GPU 0 has a total capacity of "
                                  "79.19 GiB of which 1.25 GiB is free. Process 7 has 77.9 GiB memory in use.")
    assert classify(busy) is ErrorKind.DEVICE_MEMORY
    never = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 120.50 GiB. GPU 0 has a total capacity of "
                                   "79.19 GiB of which 78.00 GiB is free.")
    assert classify(never) is ErrorKind.RESOURCES
    assert classify(torch.OutOfMemoryError("CUDA out of memory.")) is ErrorKind.DEVICE_MEMORY
    record = EvalRecord(key="k", compiled=True).fail(ErrorKind.DEVICE_MEMORY, str(busy))
    assert reward(record) == 0.0  # compiled, not judged: no resource penalty for the device's state


# =========================================================================== compile tier

def test_every_adversarial_source_has_a_valid_plan_but_bad_plan():
    sources = sorted(ADVERSARIAL.glob("*.cu"))
    assert len(sources) >= 15
    for path in sources:
        if path.name == "bad_plan.cu":
            continue
        check_source(path.read_text())  # raises PlanError


def test_compile_only_plan_error_needs_no_compiler():
    from torch_sparserl.evaluate import compile_only
    record = compile_only(spec("bad_plan.cu"))
    assert record.error_kind is ErrorKind.PLAN and not record.compiled and record.correct is None
    assert "ceil(rows*n/256" in record.log and reward(record) == -0.5


@needs_nvcc
def test_compile_only_kinds():
    from torch_sparserl.evaluate import compile_only
    names = ["does_not_compile.cu", "spills.cu", "too_many_registers.cu", "good_spmm_f32.cu"]
    with ThreadPoolExecutor(len(names)) as pool:
        records = dict(zip(names, pool.map(lambda n: compile_only(spec(n)), names)))

    broken = records["does_not_compile.cu"]
    assert broken.error_kind is ErrorKind.COMPILE and not broken.compiled and "undeclared_bias" in broken.log
    assert reward(broken) == -0.5

    spilled = records["spills.cu"]
    assert spilled.error_kind is ErrorKind.RESOURCES and spilled.compiled and spilled.spill_bytes > 0
    assert spilled.correct is None and reward(spilled) == pytest.approx(-0.3)

    greedy = records["too_many_registers.cu"]
    assert greedy.error_kind is ErrorKind.RESOURCES and greedy.registers * 1024 > 65536
    assert "registers" in greedy.log

    good = records["good_spmm_f32.cu"]
    assert good.compiled and good.error_kind is None and good.correct is None and good.spill_bytes == 0
    assert good.registers and reward(good) == 0.0
    assert EvalRecord.from_json(good.to_json()) == good


def test_sandbox_worker_follows_the_parents_gpu(monkeypatch):
    """A worker measures on the GPU its parent uses: each DDP rank's own, not cuda:0."""
    from torch_sparserl.evaluate import sandbox as sandbox_module

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert sandbox_module._parent_cuda_device() == "1"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4, 6")
    assert sandbox_module._parent_cuda_device() == "6"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4")
    assert sandbox_module._parent_cuda_device() is None  # an index the parent cannot see: leave it
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert sandbox_module._parent_cuda_device() is None


def test_a_bad_burst_setting_in_the_environment_is_named():
    import subprocess
    import sys

    env = dict(os.environ, SPARSERL_EVAL_BURST_REPS="four")
    result = subprocess.run([sys.executable, "-c", "import torch_sparserl.specialize.autotune"], capture_output=True,
                            text=True, env=env, timeout=120)
    assert result.returncode != 0
    assert ("SPARSERL_EVAL_BURST_REPS: expected a whole number of timed runs >= 0 and <= 100000 (got 'four')"
            in result.stderr)


def test_prebuilding_where_the_worker_cannot_compile_leaves_it_to_the_evaluations(caplog):
    """Sandbox.prebuild is an optimization: a worker without CUDA (its task fails) gives {}
    and a warning, and nothing is lost (each evaluation compiles and records as before)."""
    from torch_sparserl.specialize import families

    specs = [families.render("vector_row", None, op="spmv", dtype="f32", n=1)]
    with Sandbox(init=None, matrix_loader=None, health_check=None) as box:
        assert box.prebuild([]) == {}  # nothing to build: the worker is not even started
        assert box.worker_pid is None
        with caplog.at_level("WARNING", logger="torch_sparserl.evaluate.sandbox"):
            assert box.prebuild(specs) == {}
    assert "prebuilding 1 candidates failed" in caplog.text
