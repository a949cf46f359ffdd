"""examples/ddp_sage_minibatch.py and benchmarks/bench_ddp_minibatch.py on the CPU: gloo
processes, each rank sampling its own share of the seeds, DDP's first step checked against one
process over the union of the ranks' batches."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time

import numpy as np
import torch

from helpers import REPO, load_benchmark


def _env() -> dict:
    # The checkout's package in the launched processes, no GPU, no cache or Inductor state of this one.
    env = {k: v for k, v in os.environ.items() if "TORCHINDUCTOR" not in k and not k.startswith("SPARSERL_CACHE")}
    env.update(CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(REPO))
    return env


def _example():
    spec = importlib.util.spec_from_file_location("ddp_sage_minibatch", REPO / "examples" / "ddp_sage_minibatch.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_ddp_minibatch_example_on_cpu(tmp_path):
    """Two gloo processes with padded batches: the same steps on both ranks, disjoint seeds
    covering the graph, the first step's averaged gradient within float32's tolerance of one
    process's float64 gradient over the union of both ranks' batches."""
    out = tmp_path / "ddp.json"
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone",
                             str(REPO / "examples" / "ddp_sage_minibatch.py"), "--epochs", "2", "--batch-size", "300",
                             "--hidden", "16", "--features", "16", "--buckets", "2", "--out", str(out)],
                            capture_output=True, text=True, timeout=300, env=_env(), cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["ok"] and report["world_size"] == 2 and report["backend"] == "gloo" and len(report["ranks"]) == 2
    assert report["check"]["ok"] and report["check"]["union_seeds"] == 600 and report["check"]["max_rel_grad_diff"] < 1e-5
    assert report["same_steps_on_every_rank"] and report["ranks"][1]["steps_per_epoch"] == [5, 5]  # 1354 seeds / 300
    assert report["seeds_per_epoch"] == [2708, 2708] and report["dropped_seeds_per_epoch"] == 0
    assert report["throughput_seeds_per_s"] > 0 and len(report["buckets"]) >= 2
    assert all(len(r["epoch_s"]) == 2 and "young_calls" in r["runtime_stats"] for r in report["ranks"])


def test_shares_are_disjoint_equal_and_new_each_epoch():
    example = _example()
    nodes = np.arange(1003)
    shares = [example.share_of(nodes, 0, r, 4) for r in range(4)]
    assert all(s.size == 250 for s in shares)
    together = np.concatenate(shares)
    assert np.unique(together).size == 1000  # disjoint; 3 dropped
    assert not np.array_equal(example.share_of(nodes, 1, 0, 4), shares[0])
    assert np.array_equal(example.share_of(nodes, 0, 2, 4), shares[2])  # every rank computes the same cut


def test_the_union_gradient_is_the_mean_over_every_seed():
    """What rank 0 compares DDP with: over two equal batches, the mean of the two batches' own
    gradients; not the gradient of either alone (so a rank left out would be caught)."""
    from torch_sparserl.data.sampling import neighbor_batches
    import torch_sparserl as ts

    example = _example()
    args = type("Args", (), {"features": 6, "hidden": 5, "classes": 3})()
    A = ts.load_matrix("cora")
    A = ((A + A.T) > 0).astype(np.float32).tocsr()
    a, b = list(neighbor_batches(A, 40, (3, 2), seed=1, limit=2))
    g = torch.Generator().manual_seed(4)
    x = torch.randn(A.shape[0], 6, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (A.shape[0],), generator=g)
    torch.manual_seed(0)
    start = example.SAGE(6, 5, 3).state_dict()
    both = example.union_gradients(start, [a, b], x, y, args)
    one, two = (example.union_gradients(start, [batch], x, y, args) for batch in (a, b))
    for k in both:
        assert torch.allclose(both[k], (one[k] + two[k]) / 2, rtol=1e-12, atol=1e-14)
        assert not torch.allclose(both[k], one[k], rtol=1e-3)


def test_bench_ddp_minibatch_sweeps_world_sizes(tmp_path, monkeypatch):
    for name in set(os.environ) - set(_env()):  # the script sets the rest (the package's path, no GPU)
        monkeypatch.delenv(name)
    bench = load_benchmark("bench_ddp_minibatch")
    path = tmp_path / "ddp.json"
    assert bench.main(["--worlds", "1,2", "--epochs", "2", "--batch-size", "400", "--hidden", "8", "--features", "8",
                       "--out", str(path)]) == 0
    doc = json.loads(path.read_text())
    rows = doc["rows"]
    assert [r["world_size"] for r in rows] == [1, 2] and all(r["status"] == "ok" for r in rows)
    assert rows[0]["speedup"] == 1.0 and rows[1]["speedup"] > 0 and rows[1]["efficiency"] == rows[1]["speedup"] / 2
    assert [r["steps_per_epoch"] for r in rows] == [7, 4]  # 2708 / 400; 1354 / 400
    md = path.with_suffix(".md").read_text()
    assert "| ranks | status | seeds/s |" in md and "| 2 | ok |" in md


def test_a_world_size_past_its_time_is_killed_and_reported(tmp_path):
    run_example = load_benchmark("bench_ddp_minibatch").run_example
    example = tmp_path / "sleeps.py"
    example.write_text("import time\ntime.sleep(60)\n")
    started = time.monotonic()
    report = run_example(example, 2, [], "cpu", tmp_path, timeout=3)
    assert time.monotonic() - started < 30
    assert report["status"] == "failed" and report["error"] == "did not finish within 3 s"
