"""examples/distributed_gcn.py and benchmarks/bench_distributed.py on the CPU: gloo processes,
the partitioned training checked against one process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from helpers import REPO, load_benchmark


def _env() -> dict:
    # The checkout's package in the launched processes, no GPU, no cache or Inductor state of this one.
    env = {k: v for k, v in os.environ.items() if "TORCHINDUCTOR" not in k and not k.startswith("SPARSERL_CACHE")}
    env.update(CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(REPO))
    return env


@pytest.mark.parametrize("model, order, graph, rows_only", [("gcn", "rcm", "cora", False),
                                                         ("sage", "degree", "rmat:scale=10,edge_factor=8", False),
                                                         ("gcn", "rcm", "cora", True),
                                                         ("sage", "rows", "power_law:nodes=1024,edge_factor=6", True)])
def test_distributed_example_on_cpu(tmp_path, model, order, graph, rows_only):
    """Two gloo processes, each holding half the graph (cora, a power-law R-MAT graph; with
    --rows-only each reads only its rows from a .npz, or generates them and its node data, for a
    power_law graph): 20 steps' losses within 1e-5 of one process's, the summed gradient at the
    start too, and a halo on both ranks."""
    out = tmp_path / "dist.json"
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone",
                             str(REPO / "examples" / "distributed_gcn.py"), "--model", model, "--order", order,
                             "--graph", graph, *(["--rows-only"] if rows_only else []),
                             "--epochs", "20", "--hidden", "16", "--out", str(out)],
                            capture_output=True, text=True, timeout=300, env=_env(), cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["ok"] and report["world_size"] == 2 and report["order"] == order and len(report["losses"]) == 20
    assert report["rows_only"] == rows_only
    assert report["graph"] == graph and report["nodes"] == (2708 if graph == "cora" else 1024)
    assert report["nnz"] == sum(r["local_nnz"] + r["halo_nnz"] for r in report["ranks"])
    assert report["max_rel_loss_diff"] < 1e-5 and report["max_rel_grad_diff_at_start"] < 1e-5
    assert report["losses"][-1] < report["losses"][0]  # it trained
    ranks = report["ranks"]
    assert sum(r["rows"] for r in ranks) == report["nodes"] and all(r["halo_rows"] > 0 for r in ranks)
    assert all(r["halo_bytes_per_product"]["received"] == r["halo_rows"] * 4 * (16 if model == "gcn" else 128)
               for r in ranks)


def test_a_generated_graph_trains_sage_only(tmp_path):
    result = subprocess.run([sys.executable, str(REPO / "examples" / "distributed_gcn.py"), "--model", "gcn",
                             "--rows-only", "--graph", "power_law:nodes=64"], capture_output=True, text=True,
                            timeout=120, env=_env(), cwd=tmp_path)
    assert result.returncode == 2 and "--rows-only with a power_law graph trains --model sage" in result.stderr


def test_bench_distributed_times_every_world_size(tmp_path, monkeypatch):
    for name in set(os.environ) - set(_env()):  # the script sets the rest (the package's path, no GPU)
        monkeypatch.delenv(name)
    bench = load_benchmark("bench_distributed")
    path = tmp_path / "dist.json"
    assert bench.main(["--worlds", "1,2", "--epochs", "3", "--hidden", "8", "--features", "16",
                       "--order", "rcm", "--without-halo", "2", "--out", str(path)]) == 0
    doc = json.loads(path.read_text())
    rows = doc["rows"]
    assert [r["world_size"] for r in rows] == [1, 2] and all(r["status"] == "ok" for r in rows)
    assert rows[0]["max_halo_rows"] == 0 and rows[1]["max_halo_rows"] > 0 and rows[0]["speedup"] == 1.0
    assert rows[1]["max_rows"] < rows[0]["max_rows"] and rows[1]["max_halo_mb_sent"] > 0
    # each world size timed again without the exchange; its cost is the ratio (none for one rank)
    assert all(r["epoch_without_halo_ms"] > 0 for r in rows) and rows[0]["halo_cost"] is None
    assert rows[1]["halo_cost"] == pytest.approx(rows[1]["epoch_ms"] / rows[1]["epoch_without_halo_ms"])
    assert all(len(rank["epoch_s_all"]) == 3 for rank in doc["runs"][1]["ranks"])  # the extra epochs apart
    md = path.with_suffix(".md").read_text()
    assert "| ranks | status | epoch ms |" in md and "| 2 | ok |" in md


def test_bench_distributed_marks_a_failed_world_size_and_refuses_bad_worlds(capsys):
    bench = load_benchmark("bench_distributed")
    doc = {"env": {"gpu": None, "cpu": "C"}, "date": "d", "command": "c",
           "config": {"graph": "cora", "model": "gcn", "order": "rows", "device": "cpu", "epochs": 2, "hidden": 8},
           "rows": [bench.summary_row({"world_size": 4, "status": "failed"}, None)]}
    assert "| 4 | failed | — |" in bench.markdown(doc)
    with pytest.raises(SystemExit) as info:
        bench.main(["--worlds", "1,0"])
    assert info.value.code == 2 and "--worlds: expected positive integers" in capsys.readouterr().err


def test_a_failed_world_size_says_what_its_rank_raised():
    """torchrun's summary ends the output; the rank's own exception comes before it, and is what
    the row and the report name."""
    torchrun = load_benchmark("common.torchrun")
    output = ("[rank0]: Traceback (most recent call last):\n[rank0]:   File \"x.py\", line 1\n"
              "[rank0]: FileNotFoundError: load_matrix: no file 'pubmed'\n"
              "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n  exitcode  : 1\n")
    assert torchrun.first_error(output) == "FileNotFoundError: load_matrix: no file 'pubmed'"
    assert torchrun.first_error("all went well\n") is None
    bench = load_benchmark("bench_distributed")
    row = bench.summary_row({"world_size": 2, "status": "failed", "error": "FileNotFoundError: no file"}, None)
    doc = {"env": {"gpu": None, "cpu": "C"}, "date": "d", "command": "c",
           "config": {"graph": "g", "model": "gcn", "order": "rows", "device": "cpu", "epochs": 2, "hidden": 8},
           "rows": [row]}
    assert "- 2 rank(s): FileNotFoundError: no file" in bench.markdown(doc)


def test_a_shared_matrix_name_reaches_the_example_as_its_file():
    """The example reads the package's shipped matrices, files and generator specs; a benchmark
    name of a shared matrix is handed to it as the file's path, a spec as it is."""
    bench = load_benchmark("bench_distributed")
    assert bench.example_graph("cora").endswith("cora.npz")
    assert bench.example_graph("power_law:nodes=1000,edge_factor=4") == "power_law:nodes=1000,edge_factor=4"
    shared = load_benchmark("common.matrices").shared_matrices_dir()
    if shared is None or not (shared / "pubmed.npz").exists():
        pytest.skip("no shared matrices here")
    assert bench.example_graph("pubmed") == str(shared / "pubmed.npz")
