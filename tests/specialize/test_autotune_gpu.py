"""The autotuner end to end on the GPU: real families, real sandbox, a shipped matrix."""

from __future__ import annotations

import pytest

import torch_sparserl as ts
from torch_sparserl.evaluate.sandbox import Sandbox
from torch_sparserl.specialize.autotune import tune



@pytest.fixture(scope="module")
def sandbox():
    with Sandbox() as box:
        yield box


@pytest.mark.parametrize("op, n, dtype", [("spmv", 1, "f32"), ("spmm", 32, "f32"), ("spmm", 64, "f16"),
                                           ("sddmm", 32, "f32"), ("sddmm", 128, "bf16")])
def test_tune_finds_a_correct_kernel_with_timings(sandbox, op, n, dtype):
    result = tune(ts.load_matrix("cora"), op=op, n=n, dtype=dtype, budget_s=60, top_k=2, sandbox=sandbox)
    assert result.best is not None, [(r.family, r.error_kind, r.log[:200]) for r in result.table]
    assert result.best.correct and result.best.runtime_us > 0 and result.best.cusparse_us > 0
    assert result.best.timing["stage"] == "final"
    failures = [r for r in result.table if not r.ok]
    # The families are meant to be correct everywhere: a failure here is a kernel bug.
    assert not failures, [(r.family, r.params, r.error_kind, r.log[:300]) for r in failures]
