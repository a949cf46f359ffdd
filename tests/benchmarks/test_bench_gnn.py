"""The GNN epoch-time benchmark and the examples, as CPU smoke runs (timings meaningless here)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest
import torch._inductor.config

from helpers import REPO, load_benchmark

pytest.importorskip("torch_geometric")

ROOT = REPO


def _bench():
    return load_benchmark("bench_gnn")


@pytest.mark.slow
def test_all_four_ways_train_to_the_same_losses(tmp_path, monkeypatch):
    bench = _bench()
    out = tmp_path / "gnn.json"
    monkeypatch.setenv("SPARSERL_CACHE_DIR", str(tmp_path / "cache"))  # main() sets it: restored after
    code = bench.main(["--graphs", "cora", "--models", "gcn,sage", "--hidden", "16", "--out", str(out),
                       "--chunks", "2", "--min-chunk-s", "0.01", "--device", "cpu",
                       "--cache-dir", str(tmp_path / "cache")])
    assert code == 0
    doc = json.loads(out.read_text())
    assert [(r["model"], r["hidden"]) for r in doc["rows"]] == [("gcn", 16), ("sage", 16)]
    for row in doc["rows"]:
        assert set(row["ways"]) == set(bench.WAYS)
        # timed in rounds, without compiling anything again (the compiled ways' code coexists)
        assert row["timing"] == {"recompiled": 0, "worker_stops": 0}, row["timing"]
        assert all(len(w["chunk_ms"]) == 2 for w in row["ways"].values())
        low, high = row["speedup_vs_eager_rounds"]
        assert low <= high and low > 0
        assert all(w["status"] == "ok" for w in row["ways"].values()), row["ways"]
        assert all(len(w["losses"]) == bench.LOSS_EPOCHS for w in row["ways"].values())
        assert row["losses_equal"], row["loss_max_rel_diff"]
        assert row["speedup_vs_eager"] > 0 and row["speedup_vs_best_other"] > 0
        warm = row["ways"]["sparserl"]["warm"]  # the next run's start, on the same disk cache
        assert warm["cache_misses"] == [] and warm["loss"] == pytest.approx(row["ways"]["sparserl"]["losses"][0])
    md = out.with_suffix(".md").read_text()
    assert "| cora | 2,708 |" in md and "Geometric means" in md
    picture = ET.fromstring(out.with_suffix(".svg").read_text())
    bars = [e for e in picture.iter() if (e.get("id") or "").startswith("bar-")]
    assert len(bars) == 2 * 3  # a bar per row and way other than eager (inductor, pyg, sparserl)
    # --resume skips the rows already there; --report re-renders
    assert bench.main(["--graphs", "cora", "--models", "gcn", "--hidden", "16", "--resume", str(out),
                       "--device", "cpu"]) == 0
    assert len(json.loads(out.read_text())["rows"]) == 2
    out.with_suffix(".md").unlink()
    assert bench.main(["--report", str(out)]) == 0 and out.with_suffix(".md").exists()


@pytest.mark.slow
def test_gat_model_trains_to_the_same_losses_in_every_way(tmp_path, monkeypatch):
    """--models gat: PyG's GATConv on a torch sparse adj_t, on edge_index (eager and under
    Inductor) and on the CSRMatrix under the sparserl backend, whole (no graph break)."""
    import torch

    bench = _bench()
    out = tmp_path / "gnn.json"
    monkeypatch.setenv("SPARSERL_CACHE_DIR", str(tmp_path / "cache"))
    breaks = torch._dynamo.utils.counters["graph_break"]
    before = sum(breaks.values())
    assert bench.main(["--graphs", "cora", "--models", "gat", "--hidden", "16", "--out", str(out), "--no-warm",
                       "--ways", "eager,inductor,pyg,sparserl,bound_inductor", "--chunks", "1",
                       "--min-chunk-s", "0.01", "--device", "cpu", "--cache-dir", str(tmp_path / "cache")]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["model"] == "gat" and row["losses_equal"], row.get("loss_max_rel_diff")
    assert all(row["ways"][w]["status"] == "ok" for w in ("eager", "inductor", "pyg", "sparserl")), row["ways"]
    assert "not defined for the gat model" in row["ways"]["bound_inductor"]["error"]
    assert sum(breaks.values()) == before, dict(breaks)
    with pytest.raises(SystemExit):
        bench.main(["--graphs", "cora", "--models", "gin", "--device", "cpu", "--out", str(tmp_path / "x.json")])


def test_graph_lists_keep_generator_specs_whole():
    assert load_benchmark("common").matrix_list("pubmed, rmat:scale=22,edge_factor=16,dblp-2010,rmat:scale=12") == [
        "pubmed", "rmat:scale=22,edge_factor=16", "dblp-2010", "rmat:scale=12"]


def test_losses_that_differ_are_reported():
    bench = _bench()
    ok = {"status": "ok", "epoch_ms": 2.0, "losses": [1.0]}
    row = {"ways": {"eager": dict(ok), "inductor": dict(ok, epoch_ms=1.5), "pyg": dict(ok, losses=[1.1]),
                    "sparserl": dict(ok, epoch_ms=1.0, jit_s=0.5)}}
    metrics = bench.row_metrics(row)
    assert metrics["speedup_vs_eager"] == 2.0 and metrics["speedup_vs_best_other"] == 1.5
    assert metrics["breakeven_epochs_vs_eager"] == pytest.approx(500.0)
    assert not metrics["losses_equal"] and metrics["loss_max_rel_diff"] == pytest.approx(0.1)
    row["ways"]["pyg"] = {"status": "oom", "error": "out of memory"}
    assert bench.row_metrics(row)["losses_equal"]


def test_captured_losses_are_compared_epoch_by_epoch_with_both_adams():
    """A captured way's losses against eager torch's over every epoch (the largest relative
    difference, wherever it falls), and against the eager model with the capturable Adam."""
    bench = _bench()
    ok = {"status": "ok", "epoch_ms": 2.0}
    row = {"ways": {"eager": dict(ok, losses=[2.0, 1.0, 0.5]),
                    "sparserl_captured": dict(ok, epoch_ms=0.5, losses=[2.0, 1.01, 0.5])},
           "eager_capturable_losses": [2.0, 1.01, 0.5005]}
    metrics = bench.row_metrics(row)
    assert metrics["sparserl_captured_loss_rel_diff"] == pytest.approx(0.01)  # the middle epoch, not the last
    assert metrics["sparserl_captured_loss_rel_diff_same_adam"] == pytest.approx(0.0005 / 0.5005)
    row["eager_capturable_losses"] = "OutOfMemoryError: ..."  # the reference failed: no figure
    assert "sparserl_captured_loss_rel_diff_same_adam" not in bench.row_metrics(row)


def test_the_compiled_model_captured_is_compared_and_reaches_the_headline():
    """sparserl_compiled_captured against eager torch and PyG's best, per row, and the headline's
    figures of it over the rows that ran it (each graph one mean)."""
    bench, headline = _bench(), load_benchmark("headline")
    ok = {"status": "ok"}

    def row(graph, both_ms):
        ways = {"eager": dict(ok, epoch_ms=4.0, losses=[1.0]), "pyg": dict(ok, epoch_ms=2.0, losses=[1.0]),
                "sparserl_captured": dict(ok, epoch_ms=0.5, losses=[1.0])}
        if both_ms is not None:
            ways["sparserl_compiled_captured"] = dict(ok, epoch_ms=both_ms, losses=[1.0])
        r = {"graph": graph, "model": "gcn", "hidden": 8, "ways": ways}
        return {**r, **bench.row_metrics(r)}

    rows = [row("cora", 0.25), row("cora", 1.0), row("pubmed", 0.4), row("dblp-2010", None)]
    assert rows[0]["compiled_captured_vs_eager"] == 16.0 and rows[0]["compiled_captured_vs_best_pyg"] == 8.0
    assert "compiled_captured_vs_eager" not in rows[3]
    figures = headline.gnn_figures({"rows": rows})["compiled_captured"]
    assert figures["geomean_vs_torch"] == pytest.approx((8.0 * 10.0) ** 0.5)  # cora: sqrt(16 * 4); pubmed: 10
    assert figures["over_captured_min"] == 0.5 and figures["graphs"] == ["cora", "pubmed"]
    assert "compiled_captured" not in headline.gnn_figures({"rows": rows[3:]})


@pytest.mark.slow
@torch._inductor.config.patch(force_disable_caches=True)  # the pass must run, not a cache hit
def test_the_fused_way_measures_the_fusion(tmp_path, monkeypatch):
    bench = _bench()
    out = tmp_path / "gnn.json"
    monkeypatch.setenv("SPARSERL_CACHE_DIR", str(tmp_path / "cache"))
    from torch_sparserl.compiler import passes

    monkeypatch.setattr(passes, "served_fused", lambda node, out: True)  # CPU: as if kernels could fuse
    assert bench.main(["--graphs", "cora", "--models", "gcn", "--hidden", "16", "--out", str(out),
                       "--ways", "eager,sparserl,sparserl_fused,sparserl_eager,sparserl_cudagraphs,sparserl_subclass,sparserl_python,"
                       "sparserl_captured,sparserl_compiled_captured,bound_inductor",
                       "--chunks", "1",
                       "--min-chunk-s", "0.01",
                       "--device", "cpu", "--cache-dir", str(tmp_path / "cache")]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    # layer 1: the bias and the ReLU; layer 2: the bias (the loss reads the logits)
    assert row["ways"]["sparserl_fused"]["fused_epilogues"] == ["spmm -> add", "spmm -> add -> relu"]
    assert row["ways"]["sparserl"]["fused_epilogues"] == []  # off by default
    assert row["fusion_speedup"] > 0 and row["losses_equal"], row
    assert row["ways"]["sparserl_eager"]["fused_epilogues"] == []  # not compiled: no post-grad pass
    assert row["uncompiled_vs_eager"] > 0 and row["uncompiled_vs_compiled"] > 0
    # the bound: no product, so its losses differ, and they are kept out of the comparison
    assert row["bound_vs_eager"] > 0 and row["ways"]["bound_inductor"]["losses"][-1] != row["ways"]["eager"]["losses"][-1]
    md = out.with_suffix(".md").read_text()
    assert "Fused epilogues" in md and "Without torch.compile" in md and "The bound of a compiled way" in md
    # mode="reduce-overhead" (CUDA graphs on a GPU; Inductor skips them on the CPU), same losses
    assert row["cudagraphs_vs_eager"] > 0 and "Under CUDA graphs" in md
    # the CSRMatrix as a subclass at AOTAutograd's boundary, against the flattened default
    assert row["flatten_speedup"] > 0 and "Flattened CSRMatrix inputs" in md
    # every product through Python (fast_path off), against the default
    assert row["fast_path_speedup"] > 0 and "C++ fast path" in md and row["losses_equal"]
    # the whole epoch through ts.capture_step (eager on the CPU): its losses are in the comparison
    captured = row["ways"]["sparserl_captured"]
    assert captured["status"] == "ok" and len(captured["losses"]) == bench.LOSS_EPOCHS
    assert captured["losses"] == pytest.approx(row["ways"]["sparserl_eager"]["losses"], rel=bench.LOSS_RTOL)
    assert row["captured_vs_eager"] > 0 and row["captured_vs_uncaptured"] > 0 and "Whole step captured" in md
    # the compiled model's whole epoch through ts.capture_step too, against the uncompiled capture
    both = row["ways"]["sparserl_compiled_captured"]
    assert both["status"] == "ok" and both["losses"] == pytest.approx(captured["losses"], rel=bench.LOSS_RTOL)
    assert row["compiled_captured_over_captured"] == pytest.approx(captured["epoch_ms"] / both["epoch_ms"])
    assert "Compiled and captured" in md
    section = md.split("Whole step captured", 1)[1]
    mean = next(line for line in section.splitlines() if line.startswith("| geometric mean over the graphs"))
    header = next(line for line in section.splitlines() if line.startswith("| graph |"))
    assert mean.count("|") == header.count("|")  # the captured section's: one cell per column
    assert mean.split("|")[5].strip().endswith("×")  # its first mean under "vs eager"
    with pytest.raises(SystemExit):
        bench.main(["--ways", "eager,fastest", "--out", str(tmp_path)])


@pytest.mark.slow
def test_ddp_example_on_cpu(tmp_path):
    """Two gloo processes on the CPU: the script's DDP-versus-one-process check holds."""
    out = tmp_path / "ddp.json"
    # Not what this process has picked up: Inductor leaves variables for its own workers
    # (a data pointer among them) that a fresh process must not inherit.
    env = {k: v for k, v in os.environ.items() if "TORCHINDUCTOR" not in k and not k.startswith("SPARSERL_CACHE")}
    env["CUDA_VISIBLE_DEVICES"] = ""
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                             "--standalone", str(ROOT / "examples" / "ddp_gcn.py"), "--epochs", "4",
                             "--hidden", "16", "--out", str(out)],
                            capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["ok"] and report["world_size"] == 2 and len(report["ranks"]) == 2
    assert report["max_rel_loss_diff"] < 1e-4


def test_a_superseded_results_file_says_so_first():
    bench = _bench()
    md = bench.markdown({"env": {"gpu": "G"}, "rows": [], "runs": [], "superseded": "its baselines were slowed"})
    assert md.splitlines()[:3] == ["# GNN epoch time — G", "", "> **Superseded:** its baselines were slowed"]
    assert "Superseded" not in bench.markdown({"env": {"gpu": "G"}, "rows": [], "runs": []})


def test_the_ways_are_timed_round_by_round():
    """Each round runs one chunk of every way, each round starting one way further on; a way
    that runs out of memory in a round is reported and left out of the later ones."""
    import torch

    bench = _bench()
    calls = []

    def epoch_of(way):
        def epoch():
            calls.append(way)
            if way == "c" and calls.count("c") > 2:
                raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 1 GiB")
        return epoch

    results = {w: {"status": "ok", "epochs_per_chunk": 2} for w in "abc"}
    epochs = {w: epoch_of(w) for w in "abc"}
    bench.time_rounds(epochs, results, torch.device("cpu"), rounds=3)
    assert calls == list("aabbcc") + list("bbc") + list("aa") + list("aabb")  # c fails in round 2
    assert results["c"]["status"] == "oom" and "c" not in epochs
    for w in "ab":
        assert len(results[w]["chunk_ms"]) == 3
        assert results[w]["epoch_ms"] == sorted(results[w]["chunk_ms"])[1]
    assert bench.round_ratios({"a": results["a"], "b": results["b"]}, "a", "b") == [
        x / y for x, y in zip(results["a"]["chunk_ms"], results["b"]["chunk_ms"])]


def test_repeated_runs_are_compared(tmp_path):
    bench = _bench()
    ok = {"status": "ok", "losses": [1.0]}

    def row(graph, eager, ours, graphs=None):
        ways = {"eager": dict(ok, epoch_ms=eager), "inductor": dict(ok, epoch_ms=eager), "sparserl": dict(ok, epoch_ms=ours)}
        if graphs is not None:
            ways["sparserl_cudagraphs"] = dict(ok, epoch_ms=graphs)
        return {"graph": graph, "model": "gcn", "hidden": 128, "ways": ways}

    runs = []
    for i, rows in enumerate([[row("g1", 2.0, 1.0, 0.5), row("g2", 3.0, 2.0, 1.0)],
                              [row("g1", 2.0, 1.6, 0.5), row("g2", 3.0, 2.0, 1.0), row("g3", 1.0, 1.0)]]):
        path = tmp_path / f"run{i}.json"
        path.write_text(json.dumps({"rows": rows}))
        runs.append(path)
    out = tmp_path / "runs.md"
    assert bench.main(["--compare", *map(str, runs), "--out", str(out)]) == 0
    md = out.read_text()
    assert "Rows present in every run: 2." in md and "g3" not in md  # only rows that both runs have
    assert "| g1 | gcn | 128 | 2.00× | 1.25× | 1.60 |" in md
    assert "| **over the graphs** | | | 1.73× | 1.37× | 1.26 |" in md  # sqrt(2 * 1.5), sqrt(1.25 * 1.5)
    assert "## sparserl_cudagraphs vs eager" in md and "| g2 | gcn | 128 | 3.00× | 3.00× | 1.00 |" in md


@pytest.mark.slow
@pytest.mark.parametrize("options", [["--mode", "default"], ["--mode", "reduce-overhead"], ["--capture"]])
def test_train_gcn_example_on_cpu(tmp_path, options):
    """The user-facing example runs on the shipped cora in both compile modes (CUDA graphs are
    skipped by Inductor on the CPU) and with its step captured (run eagerly on the CPU), and its
    two models end with the same loss."""
    env = {k: v for k, v in os.environ.items() if "TORCHINDUCTOR" not in k and not k.startswith("SPARSERL_CACHE")}
    env["CUDA_VISIBLE_DEVICES"] = ""
    env["SPARSERL_CACHE_DIR"] = str(tmp_path / "cache")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])  # this checkout's package
    result = subprocess.run([sys.executable, str(ROOT / "examples" / "train_gcn.py"), "--epochs", "4", "--hidden", "16",
                             "--device", "cpu", *options],
                            capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    lines = result.stdout.splitlines()
    assert lines[0].startswith("pyg") and lines[1].startswith("sparserl"), result.stdout
    # each phase says on stderr what it starts, and the epochs' progress
    assert "pyg: 4 epochs on PyG's default path" in result.stderr and "sparserl: epoch 4/4, " in result.stderr
    assert "sparserl: one eager forward" in result.stderr, result.stderr
    assert ("ts.capture_step" in result.stderr) == (options == ["--capture"]), result.stderr
    diff = float(lines[2].split("differ by ")[1])
    assert diff < 1e-4, result.stdout


def test_pyg_ways_and_the_captured_one_compare_with_pygs_best(tmp_path, monkeypatch):
    """PyG's model eager, compiled by Inductor and captured whole; the captured sparserl way
    against the best of them, and compiled sparserl against the same model uncompiled."""
    pytest.importorskip("torch_geometric")
    bench = _bench()
    out = tmp_path / "gnn.json"
    monkeypatch.setenv("SPARSERL_CACHE_DIR", str(tmp_path / "cache"))
    assert bench.main(["--graphs", "cora", "--models", "gcn", "--hidden", "16", "--out", str(out),
                       "--ways", "eager,pyg,pyg_inductor,pyg_captured,sparserl,sparserl_eager,sparserl_captured",
                       "--chunks", "1", "--min-chunk-s", "0.01", "--no-warm",
                       "--device", "cpu", "--cache-dir", str(tmp_path / "cache")]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert all(w["status"] == "ok" for w in row["ways"].values()), row["ways"]
    assert row["losses_equal"], row["loss_max_rel_diff"]
    pyg = {w: row["ways"][w]["epoch_ms"] for w in ("pyg", "pyg_inductor", "pyg_captured")}
    assert row["best_pyg_way"] == min(pyg, key=pyg.get)
    assert row["captured_vs_best_pyg"] == pytest.approx(min(pyg.values()) / row["ways"]["sparserl_captured"]["epoch_ms"])
    assert row["compiled_over_eager"] == pytest.approx(row["ways"]["sparserl_eager"]["epoch_ms"]
                                                       / row["ways"]["sparserl"]["epoch_ms"])
    assert "gpu_ms" not in row["ways"]["sparserl"] and "wall_over_gpu" not in row  # device time: CUDA only
    assert "vs PyG's best" in out.with_suffix(".md").read_text()
    # the headline's full-graph figures are this file's rows, as measured
    figures = load_benchmark("headline").main(["--gnn", str(out), "--out", str(tmp_path / "headline.json")])
    assert figures == 0
    head = json.loads((tmp_path / "headline.json").read_text())["gnn_full_graph"]
    assert head["geomean_vs_torch"] == pytest.approx(row["captured_vs_eager"])
    assert head["geomean_vs_best_pyg"] == pytest.approx(row["captured_vs_best_pyg"])
    assert head["compiled_over_eager_min"] == pytest.approx(row["compiled_over_eager"])
    assert head["max_wall_over_gpu"] is None and head["graphs"] == ["cora"]  # no device time on the CPU
