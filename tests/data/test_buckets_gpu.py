"""Padded batches on a GPU: the real rows' products on CUDA, and a model compiled with static
shapes, under CUDA graphs, trained over batches that share a bucket's shape but not its pattern
while the runtime installs kernels for those patterns.

Run on the device: ``pytest -m gpu tests/data/test_buckets_gpu.py``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import torch_sparserl as ts
from torch_sparserl.config import JitOptions
from torch_sparserl.data import Buckets, synthetic
from torch_sparserl.data.sampling import neighbor_batches
from torch_sparserl.dtypes import assert_close_to_reference
from torch_sparserl.jit import runtime as rt
from torch_sparserl.jit.cache import CacheEntry, KernelCache
from torch_sparserl.specialize import families

N = 16


@pytest.fixture(scope="module")
def padded():
    A = synthetic.make("rmat:scale=11,edge_factor=8")
    A = ((A + A.T) > 0).astype(np.float32).tocsr()
    batches = list(neighbor_batches(A, 150, (5, 3), seed=2, limit=6))
    buckets = Buckets.fit(batches, count=2)
    return [buckets.pad(b) for b in batches]


def _dense64(batch) -> torch.Tensor:
    return torch.from_numpy(batch.adjacency().astype(np.float64).toarray())


def test_the_real_rows_of_cuda_products_are_the_unpadded_ones(padded, poison_uninitialized):
    for batch in padded[:3]:
        n, rows = batch.real_rows, batch.shape[0]
        g = torch.Generator().manual_seed(n)
        X, G = torch.randn(n, N, generator=g), torch.randn(n, N, generator=g)
        nan = torch.full((rows - n, N), float("nan"))
        A = ts.csr(batch.parts(), batch.shape, device="cuda")
        D = _dense64(batch.unpadded())
        assert_close_to_reference((A @ torch.cat([X, nan]).cuda())[:n], D @ X.double(), torch.float32)
        assert_close_to_reference((A.t() @ torch.cat([G, nan]).cuda())[:n], D.T @ G.double(), torch.float32)


def _rowchunks(key, crow, col, ncols):
    spec = families.render("rowchunks", None, op=key.op, dtype=key.dtype, n=key.n)
    return CacheEntry(key, spec.source, family="rowchunks", reason="chosen by the test")


@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_static_shapes_serve_every_pattern_of_a_bucket(padded, tmp_path, mode, poison_uninitialized):
    """Every step's output and gradient against float64, over passes that compile, record CUDA
    graphs and replay them while kernels are installed for the batches' patterns: a kernel, or
    a transposed pattern, kept from another batch of the same shape would show."""
    runtime = rt.Runtime(JitOptions(mode="background", admit_age_s=0), cache=KernelCache(tmp_path),
                         specializer=_rowchunks)
    previous = rt.set_active(runtime)
    torch._dynamo.reset()
    try:
        generator = torch.Generator().manual_seed(0)
        lin = torch.nn.Linear(N, N).cuda()
        model = torch.compile(lambda A, x: A @ lin(x), backend="sparserl", dynamic=False, mode=mode)
        features = torch.randn(int(max(b.nodes.max() for b in padded)) + 1, N, generator=generator)
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        for number in range(6):
            if number == 3:
                runtime.wait(120)  # the later passes with the installed kernels
            for batch in padded:
                torch.compiler.cudagraph_mark_step_begin()
                # a new gradient every step: under CUDA graphs, accumulating into the last step's
                # (an output of its replay, overwritten by this one) is refused by torch
                lin.zero_grad(set_to_none=True)
                A = ts.csr(batch.parts(), batch.shape, device="cuda")
                x = features[torch.from_numpy(batch.nodes)].cuda().requires_grad_()
                out = model(A, x)
                out[: batch.seeds].square().sum().backward()
                D, x64 = _dense64(batch), features[torch.from_numpy(batch.nodes)].double().requires_grad_()
                w, b = lin.weight.detach().cpu().double(), lin.bias.detach().cpu().double()
                ref = D @ (x64 @ w.t() + b)
                ref[: batch.seeds].square().sum().backward()
                n = batch.real_rows
                assert_close_to_reference(out.detach()[:n].clone(), ref.detach()[:n], torch.float32)
                assert_close_to_reference(x.grad[:n], x64.grad[:n], torch.float32)
        shapes = len({(b.shape, b.nnz) for b in padded})
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs == shapes  # one graph per bucket
        assert runtime.stats["installs"] > 0
    finally:
        rt.set_active(previous)
        runtime.close()
        torch._dynamo.reset()
