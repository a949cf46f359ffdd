"""The shipped policy on a GPU: its validated kernels are correct, and both specializers
(learned, the default, and the autotuner) install correct kernels through the runtime.

Run on the device: ``pytest -m gpu tests/specialize/test_policy_gpu.py``."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import torch_sparserl as ts
from torch_sparserl.dtypes import assert_close_to_reference
from torch_sparserl.jit import runtime as rt
from torch_sparserl.jit.cache import KernelCache
from torch_sparserl.config import JitOptions



@pytest.fixture(scope="module")
def policy():
    from torch_sparserl.specialize.policy import load_default

    return load_default("cuda")


@pytest.mark.parametrize("strategy", ["rank", "sample"])
@pytest.mark.parametrize("name", ["cora", "citeseer", "rajat01"])
@pytest.mark.parametrize("op,n", [("spmv", 1), ("spmm", 32), ("spmm", 128)])
def test_policy_tune_validates_a_correct_kernel(policy, name, op, n, strategy):
    from torch_sparserl.specialize.policy.propose import policy_tune

    M = ts.load_matrix(name)
    result, proposals, records = policy_tune(M, op=op, n=n, policy=policy, k=4, strategy=strategy)
    assert len(proposals) == len(records) == 4
    if strategy == "rank":
        assert len({p.spec.key for p in proposals}) == 4
    assert all(r.compiled for r in records), [r.log[-500:] for r in records if not r.compiled]
    assert result.best is not None and result.best.correct, result.table
    assert result.best.timing["stage"] == "final" and result.best.trials == 3
    assert result.best.speedup and result.best.speedup > 0


@pytest.mark.parametrize("policy_name", ["learned", "autotune"])
def test_runtime_installs_correct_kernels_with_either_specializer(tmp_path, poison_uninitialized, policy_name):
    # the autotuner's budget counts its sandbox's start (CUDA, NVRTC: ~10 s on a fresh worker)
    settings = JitOptions(mode="sync", strict=True, budget_s=60.0, policy=policy_name)
    runtime = rt.Runtime(settings, cache=KernelCache(tmp_path))
    previous = rt.set_active(runtime)
    try:
        M = ts.load_matrix("cora")
        A = ts.csr(M, dtype=torch.float32, device="cuda")
        X = torch.randn(M.shape[1], 32, device="cuda")
        for _ in range(2):
            Y = A @ X
            ref = torch.from_numpy(np.asarray(M.astype(np.float64) @ X.double().cpu().numpy()))
            assert_close_to_reference(Y.cpu(), ref, torch.float32)
        assert runtime.stats["installed_calls"] >= 1, (runtime.stats, runtime.decisions(A.crow, A.col, M.shape[1]))
        assert runtime.policy_id.startswith("learned:" if policy_name == "learned" else "autotune")
    finally:
        rt.set_active(previous)
        runtime.close()
