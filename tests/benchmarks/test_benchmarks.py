"""The benchmarks on the CPU: the kernel benchmark's runner and reports with a fake autotuner, the
other scripts' summaries, Markdown, plots and smoke runs, and the folder's rules: every script
imports the common core, never another script, and answers --help; results/ holds only what the
documents quote, under 5 MB."""

from __future__ import annotations

import ast
import dataclasses
import json
import re
import statistics
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse

from helpers import BENCHMARKS, load_benchmark

common = load_benchmark("common")
bench = load_benchmark("bench_kernels")


# ------------------------------------------------------------------------------ a fake tune

@dataclasses.dataclass
class FakeRecord:
    family: str
    params: dict
    compiled: bool
    correct: bool
    runtime_us: float | None
    cusparse_us: float | None
    error_kind: str | None = None

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class FakeResult:
    best: FakeRecord | None
    table: list
    cusparse_us: float
    elapsed_s: float


class FakeTune:
    """Deterministic: cuSPARSE takes nnz/1000 + n µs; the best kernel is 2× faster on spmv,
    0.5× (slower) on spmm for matrices with a row over 1000 long, and absent for n=64."""

    def __init__(self, fail_on: set[str] | None = None, out_of_memory: set[str] | None = None):
        self.calls: list[tuple] = []
        self.fail_on = fail_on or set()
        self.out_of_memory = out_of_memory or set()  # ops whose first candidate found no device memory

    def __call__(self, matrix, *, op, n, dtype, budget_s, sandbox):
        assert dtype in ("f32", "f16", "bf16") and sandbox is None
        key = (matrix.nnz, op, n, dtype)
        self.calls.append(key)
        if (op, n) in {tuple(f.split("|")) for f in self.fail_on if "|" in f} or op in self.fail_on:
            raise RuntimeError("planted failure")
        cusparse = matrix.nnz / 1000 + n
        skewed = np.diff(matrix.indptr).max() > 1000
        factor = 2.0 if op == "spmv" else (0.5 if skewed else 1.5)
        table = [FakeRecord("vector_csr", {"lanes": 4}, True, True, cusparse / factor, cusparse),
                 FakeRecord("warp_row", {"vec": 4}, True, False, cusparse / 9, cusparse, "wrong"),
                 FakeRecord("broken", {}, False, False, None, None, "compile")]
        if op in self.out_of_memory:
            table.append(FakeRecord("lost", {}, True, False, None, None, "device_memory"))
        best = None if n == 64 else table[0]
        if n == 64:
            table = table[1:]
        return FakeResult(best=best, table=table, cusparse_us=cusparse, elapsed_s=0.01)


@pytest.fixture
def two_matrices():
    entries = common.known_matrices()
    return [entries["cora"], entries["rajat01"]]  # shipped with the package: always there


def _run(matrices, tune, path, cells=None, **kwargs):
    cells = cells or bench.grid_cells(matrices, ["spmv", "spmm"], [1, 32], ["f32"])
    kwargs.setdefault("budget_s", 1.0)
    kwargs.setdefault("copy_bandwidth_GBps", 3000.0)
    kwargs.setdefault("env", {"gpu": "Fake GPU", "gpu_slug": "fake-gpu", "torch": "x", "cuda": "y"})
    kwargs.setdefault("progress", False)
    return bench.run_grid(matrices, cells, tune, path, **kwargs)


# --------------------------------------------------------------------------------- formulas

def test_floor_bytes_on_a_tiny_known_matrix():
    # 3×5, nnz 4; columns 0, 3, 3, 4 → 3 distinct columns (1 and 2 never read).
    matrix = scipy.sparse.csr_matrix(
        (np.ones(4, np.float32), np.array([0, 3, 3, 4], np.int32), np.array([0, 2, 2, 4], np.int32)),
        shape=(3, 5))
    assert bench.distinct_columns(matrix) == 3
    # rowptr 4·4 + col 4·4 + val 4·4 + X 4·3·8 + Y 4·3·8
    assert bench.floor_bytes(3, 4, 3, 8, 4) == 16 + 16 + 16 + 96 + 96
    # f16: rowptr 16 + col 16 + val 2·4 + X 2·3·1 + Y 2·3·1
    assert bench.floor_bytes(3, 4, 3, 1, 2) == 16 + 16 + 8 + 6 + 6
    assert bench.floor_us(3_000_000, 3000.0) == pytest.approx(1.0)  # 3 MB at 3 TB/s
    assert bench.floor_us(100, None) is None


def test_cell_metrics_and_fallback():
    m = bench.cell_metrics(cusparse_us=30.0, oracle_us=10.0, floor_time_us=6.0)
    assert m["speedup"] == pytest.approx(3.0) and m["speedup_with_fallback"] == pytest.approx(3.0)
    assert m["oracle_floor_frac"] == pytest.approx(0.6) and m["cusparse_floor_frac"] == pytest.approx(0.2)
    assert m["best_with_fallback_us"] == 10.0
    slow = bench.cell_metrics(10.0, 40.0, None)
    assert slow["speedup"] == pytest.approx(0.25) and slow["speedup_with_fallback"] == 1.0
    assert slow["oracle_floor_frac"] is None and slow["best_with_fallback_us"] == 10.0
    none = bench.cell_metrics(10.0, None, 5.0)
    assert none["speedup"] is None and none["speedup_with_fallback"] == 1.0
    assert none["cusparse_floor_frac"] == pytest.approx(0.5)


def test_geomean():
    assert common.geomean([2.0, 8.0]) == pytest.approx(4.0)
    assert common.geomean([0.5, 2.0, None]) == pytest.approx(1.0)
    assert common.geomean([1.0, 10.0, 100.0]) == pytest.approx(10.0)
    assert common.geomean([]) is None and common.geomean([None, 0.0, float("nan")]) is None


def test_summarize_counts_slower_and_separates_groups():
    def cell(matrix, group, speedup):
        return {"matrix": matrix, "group": group, "op": "spmm", "n": 32, "dtype": "f32",
                "status": "ok" if speedup else "no_kernel", "speedup": speedup,
                "speedup_with_fallback": max(1.0, speedup) if speedup else 1.0}
    rows = bench.summarize([cell("a", "real", 4.0), cell("b", "real", 0.25), cell("c", "real", None),
                             cell("s", "synthetic", 2.0), {"status": "error", "matrix": "e", "group": "real",
                                                           "op": "spmm", "n": 32, "dtype": "f32"}])
    real, synth = rows
    assert (real["group"], real["cells"], synth["group"], synth["cells"]) == ("real", 3, "synthetic", 1)
    assert real["speedup_geomean"] == pytest.approx(1.0)               # over a and b
    assert real["speedup_with_fallback_geomean"] == pytest.approx(4 ** (1 / 3))  # 4, 1, 1
    assert real["slower_than_cusparse"] == 2 and real["no_kernel"] == 1
    assert synth["speedup_geomean"] == pytest.approx(2.0)


# ----------------------------------------------------------------------------------- runner

def test_runner_writes_json_md_svg_and_tables(tmp_path, two_matrices):
    tune = FakeTune()
    path = tmp_path / "kernels-fake-gpu-2026-01-01.json"
    outcome = _run(two_matrices, tune, path)
    assert (outcome.ran, outcome.skipped, outcome.remaining, outcome.exit_code) == (4, 0, 0, 0)
    assert len(tune.calls) == 4

    document = json.loads(path.read_text())
    assert document["schema"] == bench.SCHEMA
    assert document["env"]["gpu"] == "Fake GPU" and document["runs"][0]["copy_bandwidth_GBps"] == 3000.0
    cora = document["matrices"]["cora"]
    assert (cora["rows"], cora["nnz"], cora["group"]) == (2708, 10556, "real")
    assert cora["distinct_cols"] <= cora["cols"] and len(cora["pattern_sha1"]) == 40
    cells = {c["key"]: c for c in document["cells"]}
    assert set(cells) == {"cora|spmv|n=1|f32", "cora|spmm|n=32|f32",
                          "rajat01|spmv|n=1|f32", "rajat01|spmm|n=32|f32"}
    spmm = cells["cora|spmm|n=32|f32"]
    for field in ("cusparse_us", "oracle_us", "speedup", "speedup_with_fallback", "floor_bytes", "floor_us",
                  "oracle_floor_frac", "cusparse_floor_frac", "best", "evaluated", "compiled", "correct"):
        assert field in spmm, field
    assert spmm["speedup"] == pytest.approx(1.5) and spmm["status"] == "ok"
    assert spmm["best"]["family"] == "vector_csr" and spmm["best"]["params"] == {"lanes": 4}
    assert (spmm["evaluated"], spmm["compiled"], spmm["correct"]) == (3, 2, 1)
    expected_bytes = bench.floor_bytes(2708, 10556, cora["distinct_cols"], 32, 4)
    assert spmm["floor_bytes"] == expected_bytes
    assert spmm["floor_us"] == pytest.approx(expected_bytes / 3e12 * 1e6)  # 3000 GB/s
    assert spmm["oracle_floor_frac"] == pytest.approx(spmm["floor_us"] / spmm["oracle_us"])
    slow = cells["rajat01|spmm|n=32|f32"]  # a row of 1442: the fake kernel is 2x slower
    assert slow["speedup"] == pytest.approx(0.5) and slow["speedup_with_fallback"] == 1.0

    tables = [json.loads(line) for line in bench.companion(path, "-tables.jsonl").read_text().splitlines()]
    assert len(tables) == 12 and {t["cell"] for t in tables} == set(cells)
    assert all(t["cell_id"] in {c["cell_id"] for c in cells.values()} for t in tables)

    md = bench.companion(path, ".md").read_text()
    assert "| matrix | group | rows | nnz | spmv | spmm n=32 |" in md
    assert "| cora | real | 2708 | 10556 | **2.00×**" in md
    assert "Geometric means" in md and "| spmm | 32 | f32 | real | 2 | 0.87× | 1.22× | 1 (0) |" in md
    root = ET.fromstring(bench.companion(path, ".svg").read_text())
    assert root.tag.endswith("svg")
    texts = " ".join(t.text or "" for t in root.iter() if t.tag.endswith("text"))
    assert "spmv f32" in texts and "spmm n=32 f32" in texts and "cora" in texts and "1×" in texts
    bars = [e for e in root.iter() if (e.get("id") or "").startswith("speedup-")]
    assert len(bars) == 4  # one per cell with a kernel, no missing-kernel mark
    assert not [e for e in root.iter() if (e.get("id") or "").startswith("missing-")]


def test_resume_skips_done_cells_and_reruns_errors(tmp_path, two_matrices):
    path = tmp_path / "kernels-fake-gpu-2026-01-01.json"
    first = _run(two_matrices, FakeTune(fail_on={"spmm"}), path)
    assert (first.ran, first.errors, first.remaining, first.exit_code) == (4, 2, 2, 3)
    document = json.loads(path.read_text())
    assert sorted(c["status"] for c in document["cells"]) == ["error", "error", "ok", "ok"]
    assert "planted failure" in bench.companion(path, ".md").read_text()

    with pytest.raises(FileExistsError):
        _run(two_matrices, FakeTune(), path)  # never overwrites without resume

    tune = FakeTune()
    cells = bench.grid_cells(two_matrices, ["spmv", "spmm"], [1, 32, 64], ["f32"])
    second = _run(two_matrices, tune, path, cells=cells, resume=True)
    # spmv done: skipped; spmm n=32 errored: run again; n=64 new (no kernel found).
    assert sorted(call[1:3] for call in tune.calls) == [("spmm", 32), ("spmm", 32), ("spmm", 64), ("spmm", 64)]
    assert (second.ran, second.skipped, second.remaining, second.exit_code) == (4, 2, 0, 0)
    document = json.loads(path.read_text())
    assert len(document["runs"]) == 2 and len(document["cells"]) == 6
    statuses = {c["key"]: c["status"] for c in document["cells"]}
    assert statuses["cora|spmm|n=32|f32"] == "ok" and statuses["cora|spmm|n=64|f32"] == "no_kernel"
    no_kernel = next(c for c in document["cells"] if c["key"] == "cora|spmm|n=64|f32")
    assert no_kernel["speedup"] is None and no_kernel["speedup_with_fallback"] == 1.0
    assert "no kernel" in bench.companion(path, ".md").read_text()

    third = FakeTune()
    assert _run(two_matrices, third, path, cells=cells, resume=True).ran == 0 and not third.calls


def test_a_cell_whose_evaluation_found_no_device_memory_is_no_label_and_runs_again(tmp_path, two_matrices):
    """Another process holding the GPU's memory is no verdict on a candidate: the cell's best
    may be missing, so the cell is recorded transient, leaves no rows in the tables (the labels'
    source) and runs again on --resume."""
    path = tmp_path / "kernels-fake-gpu-2026-01-01.json"
    first = _run(two_matrices, FakeTune(out_of_memory={"spmm"}), path)
    assert (first.ran, first.errors, first.remaining, first.exit_code) == (4, 0, 2, 3)
    cells = {c["key"]: c for c in json.loads(path.read_text())["cells"]}
    assert cells["cora|spmm|n=32|f32"]["status"] == "transient"
    assert cells["cora|spmm|n=32|f32"]["transient_failures"] == 1 and cells["cora|spmv|n=1|f32"]["status"] == "ok"
    tables = [json.loads(line) for line in bench.companion(path, "-tables.jsonl").read_text().splitlines()]
    assert {t["cell"] for t in tables} == {"cora|spmv|n=1|f32", "rajat01|spmv|n=1|f32"}
    assert "rerun: device memory" in bench.companion(path, ".md").read_text()

    tune = FakeTune()
    second = _run(two_matrices, tune, path, resume=True)
    assert sorted(call[1] for call in tune.calls) == ["spmm", "spmm"]
    assert (second.ran, second.skipped, second.remaining, second.exit_code) == (2, 2, 0, 0)
    statuses = {c["key"]: c["status"] for c in json.loads(path.read_text())["cells"]}
    assert set(statuses.values()) == {"ok"}


def test_max_time_stops_before_a_cell_that_would_not_fit(tmp_path, two_matrices):
    tune = FakeTune()
    outcome = _run(two_matrices, tune, tmp_path / "r.json", budget_s=100.0, max_time_s=60.0)
    assert (outcome.ran, outcome.remaining, outcome.stopped, outcome.exit_code) == (0, 4, "time", 3)
    assert not tune.calls and json.loads((tmp_path / "r.json").read_text())["cells"] == []


def test_results_of_another_gpu_are_not_mixed(tmp_path, two_matrices):
    path = tmp_path / "r.json"
    _run(two_matrices[:1], FakeTune(), path)
    with pytest.raises(ValueError, match="holds results of Fake GPU"):
        _run(two_matrices[:1], FakeTune(), path, resume=True, env={"gpu": "Other GPU", "gpu_slug": "other"})


def test_report_cli_rerenders(tmp_path, two_matrices):
    path = tmp_path / "kernels-fake-gpu-2026-01-01.json"
    _run(two_matrices, FakeTune(), path)
    bench.companion(path, ".md").unlink()
    bench.companion(path, ".svg").unlink()
    assert bench.main(["--report", str(path)]) == 0
    assert bench.companion(path, ".md").exists() and bench.companion(path, ".svg").exists()
    document = json.loads(path.read_text())
    assert bench.plot(document) == bench.companion(path, ".svg").read_text()  # the same plot, drawn again


@pytest.mark.parametrize("content", ['{"schema": "torch_sparserl.bench_gnn/1", "rows": []}', "not json", None])
def test_report_refuses_what_is_not_a_kernel_results_file(tmp_path, capsys, content):
    path = tmp_path / "r.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(SystemExit) as info:
        bench.main(["--report", str(path)])
    err = capsys.readouterr().err
    assert info.value.code == 2 and len(err.strip().splitlines()) == 1 and f"--report {path}" in err


def test_the_environment_names_the_checkout_and_its_commit():
    import subprocess

    env = common.environment()
    head = subprocess.run(["git", "-C", str(BENCHMARKS), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
    assert env["commit"] is None if not head else env["commit"].rstrip("+") == head  # None outside a checkout
    assert env["gpu_slug"] == common.gpu_slug(env["gpu"])


# -------------------------------------------------------------------------------- grid, CLI

def test_grid_and_selection(monkeypatch, tmp_path):
    assert bench.op_n_pairs(["spmv", "spmm"], [32, 1, 16]) == [("spmv", 1), ("spmm", 16), ("spmm", 32)]
    assert bench.op_n_pairs(["spmm"], [1]) == []
    assert common.gpu_slug("NVIDIA H100 80GB HBM3") == "h100-80gb-hbm3" and common.gpu_slug(None) == "cpu"
    assert common.matrix_list("cora,rmat:scale=12,edge_factor=4,ca-*") == ["cora", "rmat:scale=12,edge_factor=4", "ca-*"]

    monkeypatch.setenv("SPARSERL_SHARED", str(tmp_path / "absent"))  # no shared matrices: skipped cleanly
    assert common.shared_matrices_dir() is None
    entries = common.known_matrices()
    real = [e for e in entries.values() if e.group == "real"]
    assert real and all(e.origin == "package" for e in real)
    default = common.select_matrices(None, entries)
    assert [e.name for e in default if e.group == "synthetic"] == list(common.SYNTHETIC)
    picked = common.select_matrices(["c*", "rmat:scale=6,edge_factor=2", "synthetic"], entries)
    assert [e.name for e in picked][:2] == ["citeseer", "cora"]
    spec_entry = next(e for e in picked if e.source == "rmat:scale=6,edge_factor=2")
    assert spec_entry.load().shape == (64, 64)
    with pytest.raises(SystemExit):
        common.select_matrices(["nosuch*"], entries)

    shared = tmp_path / "shared" / "matrices"
    shared.mkdir(parents=True)
    np.savez(shared / "tiny.npz", indptr=np.array([0, 1, 2]), indices=np.array([1, 0], np.int32),
             data=np.ones(2, np.float32), shape=np.array([2, 2]))
    monkeypatch.setenv("SPARSERL_SHARED", str(tmp_path / "shared"))
    assert common.shared_matrices_dir() == shared
    tiny = common.known_matrices()["tiny"]
    assert (tiny.origin, tiny.group) == ("shared", "real") and tiny.load().nnz == 2


def test_cli_list_and_quick_run_with_a_fake_tune(tmp_path, capsys):
    assert bench.main(["--list", "--quick"]) == 0
    listed = capsys.readouterr().out
    assert "cora|spmv|n=1|f32" in listed and "rmat-s12-ef8|spmm|n=32|f32" in listed
    with pytest.raises(SystemExit) as info:
        bench.main(["--list", "--ops", "spmx"])
    assert info.value.code == 2

    args = ["--quick", "--matrices", "cora,rmat:scale=8,edge_factor=4", "--out", str(tmp_path), "--no-progress"]
    assert bench.main(args, tune_fn=FakeTune()) == 0
    written = sorted(p.name for p in tmp_path.iterdir())
    assert len(written) == 4 and all(name.startswith("kernels-cpu-") for name in written)
    written = [name for name in written if name.endswith(".json")]
    document = json.loads((tmp_path / written[0]).read_text())
    assert {c["matrix"] for c in document["cells"]} == {"cora", "rmat-scale8-edge_factor4"}
    tune = FakeTune()
    assert bench.main(args + ["--resume"], tune_fn=tune) == 0 and not tune.calls

    # Resuming a file from elsewhere continues a copy in --out (how device chunks chain).
    elsewhere = tmp_path / "next"
    assert bench.main(args[:3] + ["--out", str(elsewhere), "--no-progress", "--resume", str(tmp_path / written[0]),
                                  "--n", "1,32,16"], tune_fn=tune) == 0
    assert len(tune.calls) == 2  # only the new n=16 cells
    again = json.loads((elsewhere / written[0]).read_text())
    assert len(again["cells"]) == 6 and len(again["runs"]) == 3
    assert (elsewhere / written[0].replace(".json", "-tables.jsonl")).exists()


def test_bench_runtime_summary_and_markdown():
    runtime_bench = load_benchmark("bench_runtime")
    cell = dict(op="spmm", n=32, rows=10, cols=10, nnz=30, correct=True, installed=True, cold_s=3.0, hot_us=5.0,
                op_us=20.0, torch_sparse_us=10.0, decision="installed: group_row{}")
    document = {"env": {"gpu": "H100", "torch": "2.11"}, "command": "python benchmarks/bench_runtime.py", "budget_s": 8,
                "cells": [dict(cell, matrix="a", speedup=2.0), dict(cell, matrix="b", speedup=0.5, installed=False),
                          {"matrix": "c", "op": "spmm", "n": 32, "failure": "RuntimeError: boom"}],
                "warm": {"cells": [{"matrix": "a", "op": "spmm", "n": 32, "warm_ms": 42.0}]}}
    document["summary"] = runtime_bench._summary(document)
    s = document["summary"]["spmm n=32"]
    assert s["cells"] == 2 and abs(s["geomean_speedup"] - 1.0) < 1e-12 and s["installed"] == 1
    assert s["slower_than_cusparse"] == 1
    text = runtime_bench.markdown(document)
    assert "| spmm n=32 | 2 | 1.00x | 1 | 2 | 1 | 3.0 s |" in text
    assert "| a | spmm n=32 | 10 | 30 | 3.0 | 42 | 5.0 | 20.0 | 10.0 | 2.00x | installed: group_row{} |" in text
    assert "failed: RuntimeError: boom" in text


def test_bench_intercept_times_every_state_and_leaves_nothing_installed(tmp_path):
    from torch_sparserl.tensor import intercept

    bench_intercept = load_benchmark("bench_intercept")
    out = tmp_path / "intercept.json"
    assert bench_intercept.main(["--devices", "cpu", "--calls", "3", "--repeats", "1", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert {(r["product"], r["state"]) for r in doc["rows"]} == {
        (p, s) for p in ("torch.sparse.mm(A, X)", "A @ X", "torch.addmm(B, A, X)", "torch.mv(A, x)")
        for s in bench_intercept.STATES}
    assert all(r["us_per_call"] > 0 for r in doc["rows"])
    assert "| cpu | torch.mv(A, x) |" in out.with_suffix(".md").read_text()
    assert not intercept.installed() and intercept._delegate is not bench_intercept._old_delegate


def test_bench_cpu_times_the_operator_torch_and_the_reference(tmp_path):
    bench_cpu = load_benchmark("bench_cpu")
    out = tmp_path / "cpu.json"
    assert bench_cpu.main(["--matrices", "cora", "--dtypes", "float32,bfloat16", "--n", "1,8", "--repeats", "2",
                           "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert [(r["dtype"], r["op"], r["n"]) for r in doc["rows"]] == [
        ("float32", "spmm", 1), ("float32", "spmm", 8), ("float32", "sddmm", 64), ("bfloat16", "spmm", 1),
        ("bfloat16", "spmm", 8)]
    assert all(r["operator_ms"] > 0 and r["reference_ms"] > 0 for r in doc["rows"])
    assert doc["rows"][0]["torch_ms"] > 0 and doc["rows"][3]["torch_ms"] is None  # torch has no bf16 CSR kernel
    assert "| cora | 10,556 | float32 | spmm | 8 |" in out.with_suffix(".md").read_text()


def test_bench_eager_summary_markdown_and_plot():
    eager = load_benchmark("bench_eager")
    cell = dict(rows=10, cols=10, nnz=30, correct=True, served_by_cpp=True, first_s=0.1, error=None,
                gpu_us=4.0, torch_gpu_us=6.0, host_us=5.0, torch_host_us=20.0)
    cells = [dict(cell, matrix="a", n=32, mode="off", decision="not specialized yet", wall_us=10.0,
                  torch_wall_us=20.0, speedup=2.0, gpu_speedup=1.0),
             dict(cell, matrix="b", n=32, mode="off", decision="not specialized yet", wall_us=20.0,
                  torch_wall_us=10.0, speedup=0.5, gpu_speedup=1.0, correct=False),
             dict(cell, matrix="a", n=1, mode="default", decision="installed: rowchunks{}", wall_us=5.0,
                  torch_wall_us=15.0, speedup=3.0, gpu_speedup=1.5, bare_launch_us=2.5, cpp_us=4.0),
             dict(cell, matrix="a", n=32, mode="off", dtype="bfloat16", decision="not specialized yet", wall_us=8.0,
                  torch_wall_us=10.0, speedup=1.25, gpu_speedup=1.1)]
    doc = {"env": {"gpu": "H100", "torch": "2.11"}, "runs": [{"command": "python benchmarks/bench_eager.py",
                                                             "started": "now"}], "cells": cells}
    doc["summary"] = eager.summary(doc)
    off = doc["summary"]["off float32 spmm n=32"]  # a cell with no dtype: float32
    assert off["cells"] == 2 and abs(off["geomean"] - 1.0) < 1e-12 and off["min"] == 0.5
    assert off["below_0.97"] == 1 and off["correct"] == 1 and off["installed"] == 0
    assert doc["summary"]["default float32 spmv"]["installed"] == 1
    assert doc["summary"]["off bfloat16 spmm n=32"]["cells"] == 1
    text = eager.markdown(doc)
    assert "| off float32 spmm n=32 | 2 | 1.00× | 0.50× | 1 | 1.00× | 5.0 (20.0) | – | – | 0 | 1/2 |" in text
    assert "| default float32 spmv | 1 | 3.00× | 3.00× | 0 | 1.50× | 5.0 (20.0) | 2.5, 2.5 µs | 1.5 µs | 1 | 1/1 |" in text
    assert "| b | 32 | float32 | off | 0.50× | 20.0 (10.0) |" in text
    assert "| a | 32 | bfloat16 | off | 1.25× | 8.0 (10.0) |" in text
    picture = ET.fromstring(eager.plot(doc))
    columns = {e.get("id"): e for e in picture.iter() if (e.get("id") or "").startswith("points-")}
    # a column per (dtype, product, runtime) that ran, a point per cell
    assert sorted(len([u for u in g.iter() if u.tag.endswith("use")]) for g in columns.values()) == [1, 1, 2]
    texts = " ".join(t.text or "" for t in picture.iter() if t.tag.endswith("text"))
    assert "spmv default" in texts and "n=32 off" in texts and "n=32 off bf16" in texts


def test_bench_minibatch_trains_every_way_on_the_same_batches(tmp_path):
    """On the CPU, at a tiny size: the ways' losses agree, dynamic shapes compile no graph per
    batch, and the report says what each way left behind."""
    bench = load_benchmark("bench_minibatch")
    out = tmp_path / "m.json"
    assert bench.main(["--graph", "cora", "--device", "cpu", "--epochs", "2", "--batches", "3", "--batch-size",
                       "128", "--hidden", "16", "--features", "8", "--ways", "torch,sparserl,sparserl_compiled",
                       "--breakdown", "--rounds", "2", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    rows = {row["way"]: row for row in doc["summary"]}
    assert set(rows) == {"torch", "sparserl", "sparserl_compiled"} and all(r["status"] == "ok" for r in rows.values())
    assert all(r["loss_max_diff"] < 1e-4 for r in rows.values())
    assert rows["sparserl_compiled"]["graphs"] <= 2  # not one per batch
    assert doc["setup"]["batches"] == 3 and doc["setup"]["mean_nnz"] > 0
    assert doc["setup"]["warmup_steps"] == 3  # an epoch of torch's way, untimed, before the first way
    assert all(len(doc["ways"][w]["rounds_epoch_s"]) == 2 for w in rows)  # fresh runtimes each round
    assert all(r["first_epoch_s"] == statistics.median(r["first_epochs_s"]) for r in rows.values())
    # per step: the steady wall time; the device time is the profiler's on CUDA only
    assert all(r["steady_step_ms"] == pytest.approx(r["steady_epoch_s"] * 1e3 / 3) for r in rows.values())
    assert all(r["gpu_step_ms"] is None and r["wall_over_gpu"] is None for r in rows.values())
    assert all(len(doc["ways"][w]["losses"]) == 2 for w in rows)  # the profiled epoch is not recorded
    text = out.with_suffix(".md").read_text()
    assert "| sparserl_compiled |" in text and "after 3 untimed steps of torch's way" in text
    assert "in 2 round(s)" in text and "| 1.00× / 1.00× |" in text  # torch against itself
    picture = ET.fromstring(out.with_suffix(".svg").read_text())
    def points(prefix):
        return sum(len([u for u in g.iter() if u.tag.endswith("use")]) for g in picture.iter()
                   if (g.get("id") or "").startswith(prefix))
    assert (points("first-"), points("later-")) == (3 * 2, 3 * 2)  # ways x rounds, each round's first and second
    # --breakdown: the sparserl ways' per-pattern host work, one ts.csr and its check per step
    parts = doc["ways"]["sparserl"]["host_ms_per_step"]
    assert parts["ts.csr"]["calls"] == 1 and parts["index check"]["calls"] == 1 and parts["index check"]["ms"] > 0
    assert doc["ways"]["torch"]["host_ms_per_step"] is None
    import torch_sparserl as ts
    from torch_sparserl.pattern import Pattern
    assert ts.csr.__name__ == "csr" and Pattern.transpose.__name__ == "transpose"  # restored
    # --prefetch: each way's next batch moved on a background thread; the same training
    again = tmp_path / "p.json"
    assert bench.main(["--graph", "cora", "--device", "cpu", "--epochs", "2", "--batches", "3", "--batch-size",
                       "128", "--hidden", "16", "--features", "8", "--ways", "torch,sparserl", "--prefetch",
                       "--out", str(again)]) == 0
    prefetched = json.loads(again.read_text())
    assert prefetched["setup"]["prefetch"] is True and "(`--prefetch`)" in again.with_suffix(".md").read_text()
    for way in ("torch", "sparserl"):
        assert prefetched["ways"][way]["losses"] == doc["ways"][way]["losses"]


def test_bench_minibatch_buckets_repeat_the_shapes_and_keep_the_losses(tmp_path):
    """--buckets 3: every way trains on batches padded to at most 3 sizes, with the losses of the
    unpadded batches (the loss over the seed rows only); the compiled way, static, compiles one
    graph per bucket where the 6 batches have 6 sizes; the report gives the padding's overhead."""
    import torch

    from torch_sparserl.dtypes import tolerance

    bench = load_benchmark("bench_minibatch")
    common = ["--graph", "cora", "--device", "cpu", "--epochs", "2", "--batches", "6", "--batch-size", "96",
              "--hidden", "16", "--features", "8", "--ways", "torch,sparserl,sparserl_compiled"]
    plain, padded = tmp_path / "plain.json", tmp_path / "padded.json"
    assert bench.main(common + ["--out", str(plain)]) == 0
    assert bench.main(common[:-1] + [common[-1] + ",sparserl_captured", "--buckets", "3", "--out", str(padded)]) == 0
    plain, padded = json.loads(plain.read_text()), json.loads(padded.read_text())
    tol = tolerance(torch.float32)
    for way in ("torch", "sparserl", "sparserl_compiled", "sparserl_captured"):
        assert padded["ways"][way]["status"] == "ok"
        np.testing.assert_allclose(padded["ways"][way]["losses"], plain["ways"]["torch" if way == "sparserl_captured"
                                                                                else way]["losses"],
                                   rtol=tol.rtol, atol=tol.atol)
    setup = padded["setup"]
    assert setup["buckets"] == 3 and plain["setup"]["buckets"] == 0 and plain["setup"]["padding"] is None
    assert (setup["mean_rows"], setup["mean_nnz"]) == (plain["setup"]["mean_rows"], plain["setup"]["mean_nnz"])
    sizes = setup["padding"]["sizes"]
    assert len(sizes) == 3 and 1.0 < setup["padding"]["rows"] < 2.0 and 1.0 <= setup["padding"]["nnz"] < 2.0
    assert padded["ways"]["sparserl_compiled"]["graphs"] == 3  # one static graph per bucket, over both epochs
    text = (tmp_path / "padded.md").read_text()
    assert (f"padded rows / real rows {setup['padding']['rows']:.3f}, padded nonzeros / real nonzeros "
            f"{setup['padding']['nnz']:.3f}") in text and "compiled with static shapes" in text
    assert "(`--buckets`" not in (tmp_path / "plain.md").read_text()
    limit = torch._dynamo.config.recompile_limit
    with bench.recompiles_allowed(limit + 5):  # more buckets than Dynamo recompiles by default: compiled too
        assert torch._dynamo.config.recompile_limit == limit + 5
    assert torch._dynamo.config.recompile_limit == limit
    with pytest.raises(SystemExit):
        bench.main(common + ["--buckets", "-1", "--out", str(tmp_path / "bad.json")])
    with pytest.raises(SystemExit):  # the captured way replays a graph per bucket: it needs buckets
        bench.main(common[:-1] + ["sparserl_captured", "--out", str(tmp_path / "bad.json")])

def test_bench_host_summary_and_markdown():
    host = load_benchmark("bench_host")
    cell = dict(n=32, correct=True, alloc=1.0, launch=1.0, empty=2.0)
    cells = [dict(cell, matrix="a", part="default", decision="installed: group_row{}", bare=3.0, cpp=5.0, python=7.5),
             dict(cell, matrix="b", part="off", decision="cuSPARSE", bare=None, cpp=9.0, python=11.0),
             dict(cell, matrix="a", part="once", decision="installed: rowchunks{}", bare=3.0, cpp=5.0, python=7.0),
             dict(cell, matrix="a", part="zero", decision="installed: rowchunks{}", bare=3.0, cpp=9.0, python=12.0)]
    doc = {"env": {"gpu": "H100", "torch": "2.11"}, "command": "python benchmarks/bench_host.py", "started": "now",
           "cells": cells}
    doc["summary"] = host.summary(doc)
    assert set(doc["summary"]) == {"default", "once", "zero"}  # no bare launch with the runtime off
    assert doc["summary"]["zero"]["cpp_over_bare_us"] == 6.0 and doc["summary"]["once"]["door_us"] == 2.0
    text = host.markdown(doc)
    assert "| default | 1 | 2.00 | 4.50 | 2.50 | 2.00 |" in text
    assert "| b | 32 | off | – | 9.00 | 11.00 | 1.00 | 1.00 | 2.00 | True | cuSPARSE |" in text


def test_bench_churn_keeps_the_state_of_many_patterns_bounded(tmp_path):
    """Patterns made and dropped one after another, each decided and cached: the disk cache stays
    under its cap (entries evicted), the lock files under their 256 stripes, and nothing of a
    dropped matrix stays in the pattern or decision tables."""
    bench = load_benchmark("bench_churn")
    out = tmp_path / "churn.json"
    assert bench.main(["--patterns", "30", "--every", "10", "--rows", "256", "--nnz", "1024",
                       "--cache-max-mb", "0.2", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    s = doc["summary"]
    assert s["patterns"] == 30 and s["within_cap"] and s["evicted"] > 0
    assert s["max_pattern_table"] == 0 and s["max_decision_table"] == 0
    assert doc["result"]["runtime"]["installs"] == 31  # every pattern decided (and the warm-up's)
    assert all(p["lock_files"] <= 256 for p in doc["result"]["points"])
    assert "within the cap at every checkpoint" in out.with_suffix(".md").read_text()


def test_bench_classes_markdown_and_refusal_without_a_gpu(monkeypatch):
    classes_bench = load_benchmark("bench_classes")
    doc = {"env": {"gpu": "H100"}, "runs": [{"command": "python benchmarks/bench_classes.py", "started": "now"}],
           "setup": {"graph": "dblp-2010", "batch_size": 1024, "fanouts": [10, 5], "batches": 40,
                     "mean_rows": 11400.0, "mean_nnz": 20000.0},
           "widths": [{"n": 128, "host_us": {"torch": 30.0, "young": 50.0, "class": 52.0},
                       "gpu_us": {"torch": 21.0, "young": 21.0, "class": 5.25}, "class_calls": 120,
                       "decision_wait_s": 4.0, "max_abs_diff": 2e-7,
                       "classes": [{"class": "class-v1-r14-c14-m1", "op": "spmm", "n": 128,
                                    "served_by": "installed: group_row"}]}]}
    text = classes_bench.markdown(doc)
    assert "| 128 | 30.0 / 50.0 / 52.0 | 21.0 / 21.0 / 5.2 | 4.00× | 120 | 4.0 | 2.0e-07 |" in text
    assert "`class-v1-r14-c14-m1` spmm n=128: installed: group_row" in text
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit):
        classes_bench.main(["--out", "/nonexistent/x.json"])


def test_profile_cell_refuses_without_a_gpu(monkeypatch, capsys):
    profile = load_benchmark("probes/profile_cell")
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit):
        profile.main(["results.json", "cora", "spmm", "32"])
    assert "no CUDA device here" in capsys.readouterr().err


# ------------------------------------------------------------------------- the folder's rules

# The evaluator's kernel timing has no public name: common/timing.py is the one place that
# reaches it (the probes time kernels as the evaluator times candidates).
PRIVATE_IMPORTS_ALLOWED = {("common/timing.py", "torch_sparserl.evaluate.harness"): {"_flush_buffer", "_time"}}


def _benchmark_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.py") if "results" not in p.relative_to(root).parts)


def import_violations(root: Path) -> list[str]:
    """Imports under ``root`` (a benchmarks folder) of another script, or of a private name."""
    scripts = {p.stem for p in _benchmark_files(root) if p.relative_to(root).parts[0] != "common"}
    found = []
    for path in _benchmark_files(root):
        where = path.relative_to(root).as_posix()
        for node in ast.walk(ast.parse(path.read_text(), filename=where)):
            if isinstance(node, ast.Import):
                imported = [(alias.name, []) for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module != "__future__":
                imported = [(node.module, [alias.name for alias in node.names])]
            else:
                continue
            for module, names in imported:
                top = module.split(".")[0]
                if top in scripts and top != path.stem:
                    found.append(f"{where}:{node.lineno}: imports the script {top}")
                private = {name for name in names if name.startswith("_")}
                private -= PRIVATE_IMPORTS_ALLOWED.get((where, module), set())
                if private:
                    found.append(f"{where}:{node.lineno}: imports {', '.join(sorted(private))} from {module}")
    return found


def test_scripts_share_code_through_the_common_core_only():
    """No script imports another script (the shared code is in benchmarks/common), and nothing
    imports a private name of another module."""
    assert import_violations(BENCHMARKS) == []


def test_the_rule_finds_a_sibling_and_a_private_import(tmp_path):
    (tmp_path / "probes").mkdir()
    (tmp_path / "bench_a.py").write_text("import sys\nfrom common import geomean\n")
    (tmp_path / "bench_b.py").write_text("def main():\n    from bench_a import _helper\n")
    (tmp_path / "probes" / "probe_c.py").write_text("import bench_a\nfrom torch_sparserl.evaluate.harness import _time\n")
    assert import_violations(tmp_path) == [
        "bench_b.py:2: imports the script bench_a", "bench_b.py:2: imports _helper from bench_a",
        "probes/probe_c.py:1: imports the script bench_a",
        "probes/probe_c.py:2: imports _time from torch_sparserl.evaluate.harness"]


SCRIPTS = [p.relative_to(BENCHMARKS).with_suffix("").as_posix() for p in _benchmark_files(BENCHMARKS)
           if p.relative_to(BENCHMARKS).parts[0] != "common"]


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_script_imports_and_answers_help(script, capsys):
    module = load_benchmark(script)
    with pytest.raises(SystemExit) as info:
        module.main(["--help"])
    assert info.value.code == 0
    assert "-h, --help" in capsys.readouterr().out


# ------------------------------------------------------------------------------------ results

REPO = BENCHMARKS.parent
RESULTS = BENCHMARKS / "results"
RESULTS_MAX_BYTES = 5 * 2**20
# The documents that quote results: a file in benchmarks/results that none of them names is a
# run nobody reads (older runs belong to the git history).
DOCS = [REPO / "README.md", BENCHMARKS / "README.md", REPO / "training" / "README.md",
        *sorted((REPO / "docs").glob("*.md"))]
FILE_NAME = re.compile(r"[\w.+-]+\.(?:md|json|svg|jsonl)\b")


def quoted_names(docs: list[Path]) -> set[str]:
    return set(FILE_NAME.findall("\n".join(p.read_text() for p in docs)))


def unquoted_results(results: Path, docs: list[Path]) -> list[str]:
    """Files under ``results`` that no document names; a named summary (``x.md``) covers its run's
    JSON and plot (``x.json``, ``x.svg``)."""
    quoted = quoted_names(docs)
    summaries = {Path(name).stem for name in quoted if name.endswith(".md")}
    return sorted(p.name for p in results.rglob("*") if p.is_file()
                  and p.name not in quoted and p.stem not in summaries)


def test_results_hold_only_quoted_summaries_under_5_mb():
    size = sum(p.stat().st_size for p in RESULTS.rglob("*") if p.is_file())
    assert size <= RESULTS_MAX_BYTES, f"benchmarks/results holds {size / 2**20:.1f} MB (at most 5 MB)"
    assert unquoted_results(RESULTS, DOCS) == []


def test_an_unquoted_result_is_found(tmp_path):
    (tmp_path / "results").mkdir()
    for name in ("gnn-x-2026-01-01.json", "gnn-x-2026-01-01.md", "gnn-x-2026-01-01.svg", "old-2025-01-01.json",
                 "eager-2026-01-02.json"):
        (tmp_path / "results" / name).write_text("{}")
    (tmp_path / "README.md").write_text("See `results/gnn-x-2026-01-01.md` and results/eager-2026-01-02.json.")
    assert unquoted_results(tmp_path / "results", [tmp_path / "README.md"]) == ["old-2025-01-01.json"]


def test_the_docs_quote_results_that_exist():
    dated = {name for name in quoted_names(DOCS) if re.search(r"-20\d\d-\d\d-\d\d", name)}
    places = [RESULTS, REPO / "training" / "labels", REPO / "training" / "results"]
    assert sorted(name for name in dated if not any((place / name).exists() for place in places)) == []


def test_bench_intake_times_ts_csr_per_batch_and_feeds_the_headline(tmp_path):
    bench = load_benchmark("bench_intake")
    out = tmp_path / "i.json"
    assert bench.main(["--graph", "cora", "--device", "cpu", "--batches", "3", "--batch-size", "64",
                       "--rounds", "2", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    (way,) = doc["ways"]
    assert way == "cpu_parts" and doc["ways"][way]["intake_us"] > 0 and len(doc["ways"][way]["intake_rounds_us"]) == 2
    assert doc["ways"][way]["syncs"] is None  # the sync check is CUDA's
    assert "| cpu_parts |" in out.with_suffix(".md").read_text()
    assert doc["ways"][way]["breakdown_us"] is None
    assert "Where a `ts.csr` spends" not in out.with_suffix(".md").read_text()
    broken = tmp_path / "b.json"  # --breakdown: the intake's parts, timed in one more loop
    assert bench.main(["--graph", "cora", "--device", "cpu", "--batches", "3", "--batch-size", "64",
                       "--rounds", "1", "--breakdown", "--out", str(broken)]) == 0
    parts = json.loads(broken.read_text())["ways"]["cpu_parts"]["breakdown_us"]
    assert parts["index copies"]["calls"] == 2 and parts["pattern lookup"]["calls"] == 1  # per matrix
    assert parts["copy and check, in all"]["calls"] == 1  # asked first; host indices: the copies above
    assert 0 < parts["index copies"]["us"] < parts["ts.csr, in all"]["us"]
    assert "| index copies | " in broken.with_suffix(".md").read_text()
    with pytest.raises(SystemExit):
        bench.main(["--rounds", "0", "--out", str(out)])
    minibatch = tmp_path / "m.json"
    assert load_benchmark("bench_minibatch").main(
        ["--graph", "cora", "--device", "cpu", "--epochs", "2", "--batches", "2", "--batch-size", "64", "--hidden", "8",
         "--features", "8", "--ways", "torch,sparserl", "--out", str(minibatch)]) == 0
    headline = load_benchmark("headline")
    assert headline.main(["--minibatch", str(minibatch), "--intake", str(out), "--out", str(tmp_path / "h.json")]) == 0
    head = json.loads((tmp_path / "h.json").read_text())
    rows = {r["way"]: r for r in json.loads(minibatch.read_text())["summary"]}
    assert head["minibatch"]["steady_vs_best"] == pytest.approx(rows["torch"]["steady_epoch_s"]
                                                                / rows["sparserl"]["steady_epoch_s"])
    assert head["minibatch"]["first_vs_torch"] == pytest.approx(rows["torch"]["first_epoch_s"]
                                                                / rows["sparserl"]["first_epoch_s"])
    assert head["intake_us"] is None and head["gnn_full_graph"] is None  # no CUDA way, no full-graph file
    with pytest.raises(SystemExit):
        headline.main(["--out", str(tmp_path / "h.json")])


def test_the_transposed_probes_scatter_is_the_transposed_product():
    """probes/probe_transposed_in_graph's scatter way (run on the CPU here, outside a graph)
    against the float64 transposed product, on a matrix with empty rows and repeated columns."""
    import torch

    from torch_sparserl.dtypes import assert_close_to_reference

    probe = load_benchmark("probes/probe_transposed_in_graph")
    g = torch.Generator().manual_seed(11)
    dense = (torch.rand(30, 20, generator=g) < 0.15) * torch.randn(30, 20, generator=g)
    dense[::4] = 0  # empty rows
    A = dense.to_sparse_csr()
    G = torch.randn(30, 6, generator=g)
    out = probe.scatter(A.crow_indices(), A.col_indices(), A.values(), 20, G)
    assert_close_to_reference(out, dense.double().t() @ G.double(), torch.float32)
    assert out.shape == (20, 6)
