"""CUDA graphs under a background JIT, on a GPU: ``mode="reduce-overhead"`` does not wait for
the kernels; the graphs are recorded with cuSPARSE, then recorded again with the kernels once
they are decided, and every step is correct against float64.

Run on the device: ``pytest -m gpu tests/compiler/test_cudagraphs_gpu.py``.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager

import numpy as np
import pytest
import torch

import torch_sparserl as ts
from torch_sparserl.dtypes import assert_close_to_reference
from torch_sparserl.jit import runtime as rt
from torch_sparserl.jit.cache import CacheEntry, KernelCache
from torch_sparserl.specialize import families
from torch_sparserl.config import JitOptions


N = 16


class _Layer(torch.nn.Module):
    def __init__(self, A, generator):
        super().__init__()
        self.lin = torch.nn.Linear(N, N)
        with torch.no_grad():
            self.lin.weight.copy_(torch.randn(N, N, generator=generator) / N ** 0.5)
            self.lin.bias.copy_(torch.randn(N, generator=generator))
        self.register_buffer("adj", A)

    def forward(self, x):
        return (self.adj @ self.lin(x)).relu().square().sum()


def _reference(M, weight, bias, x):
    """The loss and the weight's gradient in float64."""
    A = torch.from_numpy(M.astype(np.float64).toarray())
    w = weight.double().cpu().requires_grad_()
    loss = (A @ (x.double().cpu() @ w.t() + bias.double().cpu())).relu().square().sum()
    loss.backward()
    return loss.detach(), w.grad


def _specializer(gate: threading.Event | None = None, decided: list | None = None):
    """A real kernel (rowchunks with its defaults) for every key, once ``gate`` is set."""

    def specializer(key, crow, col, ncols):
        if gate is not None:
            gate.wait(120)
        spec = families.render("rowchunks", None, op=key.op, dtype=key.dtype, n=key.n)
        if decided is not None:
            decided.append(key)
        return CacheEntry(key, spec.source, family="rowchunks", reason="chosen by the test")

    return specializer


@contextmanager
def _training(runtime):
    """``(M, layer, step)``: a layer on cora compiled under CUDA graphs, and a training step that
    checks the loss and the weight's gradient against float64 (the weights change every step)."""
    previous = rt.set_active(runtime)
    torch._dynamo.reset()
    try:
        M = ts.load_matrix("cora")
        generator = torch.Generator().manual_seed(0)
        layer = _Layer(ts.csr(M, dtype=torch.float32, device="cuda"), generator).cuda()
        model = torch.compile(layer, backend="sparserl", mode="reduce-overhead", fullgraph=True)
        x = torch.randn(M.shape[1], N, generator=generator).cuda()
        opt = torch.optim.Adam(layer.parameters(), lr=0.01)

        def step():
            torch.compiler.cudagraph_mark_step_begin()
            opt.zero_grad(set_to_none=True)
            weight, bias = layer.lin.weight.detach().clone(), layer.lin.bias.detach().clone()
            loss = model(x)
            loss.backward()
            got = loss.detach().clone().cpu(), layer.lin.weight.grad.detach().clone().cpu()
            opt.step()
            for g, w in zip(got, _reference(M, weight, bias, x)):
                assert_close_to_reference(g, w, torch.float32)

        yield M, layer, step
    finally:
        rt.set_active(previous)
        runtime.close()
        torch._dynamo.reset()


def test_reduce_overhead_records_cusparse_then_the_kernels(tmp_path, poison_uninitialized):
    gate, decided = threading.Event(), []
    runtime = rt.Runtime(JitOptions(mode="background", admit_age_s=0), cache=KernelCache(tmp_path),
                         specializer=_specializer(gate, decided))
    try:
        with _training(runtime) as (M, layer, step):
            started = time.perf_counter()
            for _ in range(4):  # warm-up, recording, replays: all with cuSPARSE, nothing waited
                step()
            assert time.perf_counter() - started < 110 and not gate.is_set() and not decided
            assert runtime.stats["installed_calls"] == 0 and runtime.stats["fallback_calls"] > 0

            gate.set()
            runtime.wait(120)
            assert decided and all(key.n == N for key in decided)  # cora is symmetric: Aᵀ hits A's entry
            installed = runtime.stats["installed_calls"]
            for _ in range(3):  # warm-up and recording of the new graphs: the kernels run
                step()
            assert runtime.stats["installed_calls"] > installed
            recorded = runtime.stats["installed_calls"]
            fallback = runtime.stats["fallback_calls"]
            for _ in range(5):  # replays: no product runs in Python any more
                step()
            assert runtime.stats["installed_calls"] == recorded and runtime.stats["fallback_calls"] == fallback
            decisions = runtime.decisions(layer.adj.crow, layer.adj.col, M.shape[1])
            assert all(v.startswith("installed: rowchunks") for v in decisions.values()), decisions
    finally:
        gate.set()


def test_kernels_decided_after_the_warm_up_are_recorded_at_once(tmp_path, poison_uninitialized):
    """Decisions that land after the compile's step (the graphs' warm-up) and before the next:
    that step records the graphs with the kernels, and the one after replays them (the graphs
    are not made again, which would cost another warm-up step)."""
    gate, decided = threading.Event(), []
    runtime = rt.Runtime(JitOptions(mode="background", admit_age_s=0), cache=KernelCache(tmp_path),
                         specializer=_specializer(gate, decided))
    try:
        with _training(runtime) as (M, layer, step):
            step()  # the compile and the warm-up, with cuSPARSE
            assert runtime.stats["installed_calls"] == 0
            gate.set()
            runtime.wait(120)
            assert decided
            step()  # recorded with the kernels
            recorded, fallback = runtime.stats["installed_calls"], runtime.stats["fallback_calls"]
            assert recorded > 0
            for _ in range(4):  # replays: no product runs in Python any more
                step()
            assert runtime.stats["installed_calls"] == recorded and runtime.stats["fallback_calls"] == fallback
    finally:
        gate.set()


@pytest.mark.parametrize("jit", ["off", "sync"])
def test_a_pattern_first_used_in_a_graph_warm_up_keeps_its_data_outside_the_graph_pool(
        tmp_path, monkeypatch, poison_uninitialized, jit):
    """With nothing decided at compile time, the first products of the pattern run in the CUDA
    graph's warm-up: its transpose and row indices (and, in sync mode, the decision's kernel
    plans) are kept beyond the step, so they must not come from the graphs' private pool
    (CUDA graph trees refused the warm-up: 'tensors in the cudagraph pool not tracked')."""
    from torch_sparserl.compiler import prespecialize

    monkeypatch.setattr(prespecialize, "plan_graph", lambda *args, **kwargs: [])
    runtime = rt.Runtime(JitOptions(mode=jit, admit_age_s=0), cache=KernelCache(tmp_path),
                         specializer=_specializer())
    with _training(runtime) as (M, layer, step):
        for _ in range(5):
            step()
        decisions = runtime.decisions(layer.adj.crow, layer.adj.col, M.shape[1])
    if jit == "sync":  # decided and installed inside the warm-up, then recorded and replayed
        assert decisions and all(v.startswith("installed: rowchunks") for v in decisions.values()), decisions
        assert runtime.stats["installed_calls"] >= 2
    else:
        assert runtime.stats["installed_calls"] == 0
