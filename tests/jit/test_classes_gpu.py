"""Class kernels on a GPU (issue 36): a pattern-free kernel built once serves patterns of any
size, and the runtime decides a class of young sampled subgraphs with the real autotuner and
sandbox, then serves new ones with it, checked against float64 references with outputs poisoned.

Run on the device: ``pytest -m gpu tests/jit/test_classes_gpu.py``.
"""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
import torch

import torch_sparserl as ts
from torch_sparserl import pattern as patterns
from torch_sparserl.data.sampling import neighbor_batches
from torch_sparserl.dtypes import assert_close_to_reference
from torch_sparserl.jit import classes
from torch_sparserl.jit import runtime as rt
from torch_sparserl.jit.cache import KernelCache
from torch_sparserl.kernels import reference
from torch_sparserl.specialize.families import render
from torch_sparserl.toolchain import inline
from torch_sparserl.toolchain.kernel import SizedKernel
from torch_sparserl.config import JitOptions

from helpers import ref_spmm, ref_spmm_transposed



def graph(nodes: int = 20000, seed: int = 0) -> sp.csr_matrix:
    """A power-law-ish graph: every node links to a few others, some nodes to many."""
    rng = np.random.default_rng(seed)
    degree = np.minimum(rng.zipf(1.8, nodes), 500)
    rows = np.repeat(np.arange(nodes), degree)
    cols = rng.integers(0, nodes, rows.size)
    A = sp.csr_matrix((np.ones(rows.size, dtype=np.float32), (rows, cols)), shape=(nodes, nodes))
    A = ((A + A.T) > 0).astype(np.float32).tocsr()
    A.sort_indices()
    return A


def sampled(count: int, seed: int = 0):
    return list(neighbor_batches(graph(), batch_size=256, fanouts=(10, 5), seed=seed, limit=count))


@pytest.mark.parametrize("family,params,op,n", [("group_row", {"lanes": 8, "vec": 4}, "spmm", 32),
                                                ("warp_row_staged", {}, "spmm", 128),
                                                ("vector_row", {"lanes": 8}, "spmv", 1)])
def test_one_sized_kernel_serves_patterns_of_every_size(family, params, op, n):
    spec = render(family, params, op=op, dtype="f32", n=n)
    sized = SizedKernel(inline.build([spec])[spec.key])
    stream = torch.cuda.current_stream().cuda_stream
    for batch in sampled(3) + [None]:
        if batch is None:  # an empty matrix: nothing to launch, nothing left unwritten
            crow, col = torch.zeros(5, dtype=torch.int32), torch.zeros(0, dtype=torch.int32)
            shape = (4, 7)
        else:
            crow, col, shape = torch.from_numpy(batch.crow), torch.from_numpy(batch.col), batch.shape
        crow, col = crow.cuda(), col.cuda()
        val = torch.randn(col.numel(), device="cuda")
        X = torch.randn(shape[1], n, device="cuda")
        if op == "spmv":
            X = X[:, 0].contiguous()
        y = torch.full((shape[0],) if op == "spmv" else (shape[0], n), float("nan"), device="cuda")
        out = sized(crow, col, val, X, stream, y)
        assert out is y
        entry = patterns.lookup(crow, col, shape[1])
        want = getattr(reference, op)(entry, crow, col, val.double(), X.double())
        assert_close_to_reference(out, want, torch.float32)


def test_a_class_of_sampled_subgraphs_is_decided_and_serves_new_ones(tmp_path, poison_uninitialized):
    """The default settings but for the class's admission (after 3 patterns) and a short search:
    young patterns are cuSPARSE's until their class is decided in the background (the autotuner's
    pattern-free candidates, in the sandbox), then the class's kernel serves new patterns, right
    on each. A second runtime on the same cache serves the class with no search."""
    settings = JitOptions(mode="background", class_after=3, budget_s=4.0, admit_age_s=60.0)
    batches = sampled(12)
    for attempt in ("searched", "cached"):
        runtime = rt.Runtime(settings, cache=KernelCache(tmp_path))
        previous = rt.set_active(runtime)
        try:
            kept = []
            for batch in batches[:3]:
                A = ts.csr(batch.parts(), batch.shape, device="cuda")
                kept.append(A)
                X = torch.randn(batch.shape[1], 32, device="cuda")
                assert_close_to_reference(A @ X, reference.spmm(*_reference_args(A, X)), torch.float32)
            runtime.wait(600)
            (key, what), *_ = [c for c in runtime.classes() if c[0].op == "spmm"]
            assert classes.is_class(key) and what.startswith("installed:"), what
            served_before = runtime.stats["class_calls"]
            for batch in batches[3:8]:
                A = ts.csr(batch.parts(), batch.shape, device="cuda")
                X = torch.randn(batch.shape[1], 32, device="cuda")
                assert_close_to_reference(A @ X, reference.spmm(*_reference_args(A, X)), torch.float32)
            assert runtime.stats["class_calls"] - served_before == 5
            assert runtime.stats["class_decisions"] >= 1
            if attempt == "cached":  # decided from the cache: no sandbox started, no search
                assert runtime.specializer._sandbox is None
        finally:
            rt.set_active(previous)
            runtime.close()


def test_young_patterns_of_a_class_train_a_sage_step_correctly(tmp_path, poison_uninitialized):
    """Forward and backward of a sampled mini-batch step through a class's kernel: the gradient
    of ``(A @ X).square().sum()``, ``2 Aᵀ (A X)``, matches float64."""
    settings = JitOptions(mode="background", class_after=3, budget_s=4.0, admit_age_s=60.0)
    batches = sampled(8, seed=1)
    runtime = rt.Runtime(settings, cache=KernelCache(tmp_path))
    previous = rt.set_active(runtime)
    try:
        kept = [ts.csr(b.parts(), b.shape, device="cuda") for b in batches[:3]]
        for A in kept:
            A @ torch.randn(A.shape[1], 64, device="cuda")
        runtime.wait(600)
        for batch in batches[3:]:
            A = ts.csr(batch.parts(), batch.shape, device="cuda")
            X = torch.randn(batch.shape[1], 64, device="cuda", requires_grad=True)
            (A @ X).square().sum().backward()
            crow, col, val = batch.parts()
            Y = ref_spmm(crow, col, val, batch.shape[1], X)
            assert_close_to_reference(X.grad, ref_spmm_transposed(crow, col, val, batch.shape[1], 2 * Y), torch.float32)
        assert runtime.stats["class_calls"] >= 5
    finally:
        rt.set_active(previous)
        runtime.close()


def _reference_args(A, X):
    entry = patterns.lookup(A.crow, A.col, A.shape[1])
    return entry, A.crow, A.col, A.val.double(), X.double()
