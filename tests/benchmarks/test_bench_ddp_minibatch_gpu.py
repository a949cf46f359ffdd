"""examples/ddp_sage_minibatch.py over NCCL on 2 and 4 GPUs, and the world-size sweep on GPUs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from helpers import REPO, load_benchmark


def _gpus(count: int):
    if torch.cuda.device_count() < count:
        pytest.skip(f"needs {count} CUDA GPUs (found {torch.cuda.device_count()})")


@pytest.mark.parametrize("world, buckets", [(2, 0), (4, 3)])
def test_ddp_minibatch_example_on_gpus(tmp_path, world, buckets):
    """The first step's averaged gradient against one process, the same steps on every rank,
    and the young subgraphs served through the runtime on every rank."""
    _gpus(world)
    out = tmp_path / "ddp.json"
    # the example's own settings: not the test session's (SPARSERL_JIT=off, its caches)
    env = {k: v for k, v in os.environ.items() if "TORCHINDUCTOR" not in k and not k.startswith(("SPARSERL_CACHE",
                                                                                                  "SPARSERL_JIT"))}
    env["PYTHONPATH"] = str(REPO)
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world),
                             "--standalone", str(REPO / "examples" / "ddp_sage_minibatch.py"), "--epochs", "3",
                             "--batch-size", "256", "--buckets", str(buckets), "--out", str(out)],
                            capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["ok"] and report["backend"] == "nccl" and report["world_size"] == world
    assert report["check"]["ok"] and report["same_steps_on_every_rank"]
    assert all(r["device"] != "cpu" and r["runtime_stats"]["young_calls"] > 0 for r in report["ranks"])


def test_bench_ddp_minibatch_scales_on_gpus(tmp_path):
    _gpus(4)
    bench = load_benchmark("bench_ddp_minibatch")
    path = tmp_path / "ddp.json"
    assert bench.main(["--device", "cuda", "--worlds", "1,2,4", "--epochs", "3", "--out", str(path)]) == 0
    rows = json.loads(path.read_text())["rows"]
    assert [r["world_size"] for r in rows] == [1, 2, 4] and all(r["status"] == "ok" for r in rows)
    assert rows[2]["speedup"] > 1.0, rows  # more GPUs train more seeds per second
