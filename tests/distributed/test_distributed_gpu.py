"""``DistributedCSRMatrix`` on GPUs: NCCL between GPUs, gloo with CUDA tensors (the rows staged
through the host), a rank that leaves under NCCL, and the training example on CUDA. Each rank's
results against one process's float64 reference, as tests/distributed/test_distributed_gloo.py
does on the CPU (the same scenarios)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from helpers import REPO
from process_scenarios import HANG_S, TIMEOUT_S, run


def _failures(reports: list[dict]) -> str:
    return "\n".join(f"rank {r}: {rep.get('error')}\n{rep.get('traceback', '')}" for r, rep in enumerate(reports)
                     if not rep["ok"])


def _gpus(count: int):
    if torch.cuda.device_count() < count:
        pytest.skip(f"needs {count} CUDA GPUs (found {torch.cuda.device_count()})")


@pytest.mark.parametrize("world", [2, 4])
def test_nccl_products_and_gradients_match_one_process(tmp_path, world):
    _gpus(world)
    reports = run(world, "products", tmp_path, patience_s=300, backend="nccl", device="cuda")
    assert all(rep["ok"] for rep in reports), _failures(reports)
    assert all(len(rep["checked"]) == 2 * 3 * 3 and rep["halo_rows"] > 0 for rep in reports)


@pytest.mark.parametrize("world", [2, 4])
def test_nccl_ranks_passing_only_their_rows_match_the_whole_matrix(tmp_path, world):
    _gpus(world)
    reports = run(world, "from_local", tmp_path, patience_s=300, backend="nccl", device="cuda")
    assert all(rep["ok"] for rep in reports), _failures(reports)
    assert all(len(rep["checked"]) == 2 * 2 * 2 and rep["halo_rows"] > 0 for rep in reports)


def test_gloo_with_cuda_tensors_stages_the_halo_through_the_host(tmp_path):
    """Two processes on one GPU over gloo: the blocks and operands on the GPU, the exchange on the host."""
    _gpus(1)
    reports = run(2, "products", tmp_path, patience_s=300, backend="gloo", device="cuda")
    assert all(rep["ok"] for rep in reports), _failures(reports)


@pytest.mark.parametrize("how", ["exits", "hangs"])
def test_nccl_rank_that_leaves_before_the_exchange_is_named(tmp_path, how):
    _gpus(2)
    reports = run(2, f"peer_{how}", tmp_path, patience_s=120, backend="nccl", device="cuda")
    rank0 = reports[0]
    assert rank0["ok"] and not rank0["hung"], _failures(reports)
    assert rank0["raised"] is not None and "the halo exchange with " in rank0["raised"], rank0
    assert "rank 1" in rank0["raised"] and rank0["after_s"] < HANG_S + TIMEOUT_S, rank0


@pytest.mark.parametrize("world", [2, 4])
def test_distributed_example_on_gpus(tmp_path, world):
    _gpus(world)
    out = tmp_path / "dist.json"
    # the example's own settings: not the test session's (SPARSERL_JIT=off, its caches)
    env = {k: v for k, v in os.environ.items() if "TORCHINDUCTOR" not in k and not k.startswith(("SPARSERL_CACHE",
                                                                                                  "SPARSERL_JIT"))}
    env["PYTHONPATH"] = str(REPO)
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world),
                             "--standalone", str(REPO / "examples" / "distributed_gcn.py"), "--device", "cuda",
                             "--order", "rcm", "--epochs", "20", "--out", str(out)],
                            capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["ok"] and report["backend"] == "nccl" and report["world_size"] == world
    # the float32 losses equal one process's within 1e-5, or are as close to its float64 ones as its float32 ones are
    assert (report["max_rel_loss_diff"] < 1e-5
            or report["max_rel_loss_error"] <= 2 * report["single_process_max_rel_loss_error"]), report
    assert all(r["device"] != "cpu" for r in report["ranks"])
