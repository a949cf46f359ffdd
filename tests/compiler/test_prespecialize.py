"""Compile-time specialization: which products the backend finds, and that it starts them (CPU, fakes)."""

from __future__ import annotations

import pytest
import torch

import torch_sparserl as ts
from torch_sparserl.compiler import prespecialize
from torch_sparserl.jit import runtime as rt
from torch_sparserl.jit.cache import KernelCache
from torch_sparserl.config import JitOptions

from helpers import make_pattern
from fakes import Fakes


class _Model(torch.nn.Module):
    def __init__(self, A):
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)
        self.register_buffer("adj", A)

    def forward(self, x, y, z):
        h = self.adj @ self.lin(x)             # spmm n=16, X requires grad: its backward too
        v = torch.mv(self.adj, y)              # spmv on a plain input: no backward
        r = z.unsqueeze(0) @ self.adj          # dense @ A: the transpose, n = 1 row
        s = torch.sparse.mm(self.adj, x[:, :3])  # n = 3
        return h.sum() + v.sum() + r.sum() + s.sum()


def _capture(model, *args):
    graphs = []

    def backend(gm, example_inputs):
        graphs.append((gm, list(example_inputs)))
        return gm.forward

    torch.compile(model, backend=backend, fullgraph=True)(*args)
    return graphs


def test_plan_graph_finds_each_product_and_its_backward():
    M = make_pattern("random")
    A = ts.csr(M, dtype=torch.float32)
    model = _Model(A)
    (gm, inputs), = _capture(model, torch.randn(M.shape[1], 16), torch.randn(M.shape[1]), torch.randn(M.shape[0]))
    planned = {(p.op, p.n, p.transposed) for p in prespecialize.plan_graph(gm, inputs, devices=("cpu",))}
    assert planned == {("spmm", 16, False), ("spmm", 16, True), ("spmv", 1, False), ("spmm", 1, True),
                       ("spmm", 3, False)}
    assert prespecialize.plan_graph(gm, inputs) == []  # CUDA only by default: the matrix is on the CPU


def test_plan_graph_adds_the_sddmm_of_values_that_require_grad():
    M = make_pattern("random")
    A = ts.csr(M, dtype=torch.float32)
    A = A.with_values(A.values().detach().requires_grad_())
    (gm, inputs), = _capture(_Model(A), torch.randn(M.shape[1], 16), torch.randn(M.shape[1]),
                             torch.randn(M.shape[0]))
    planned = {(p.op, p.n, p.transposed) for p in prespecialize.plan_graph(gm, inputs, devices=("cpu",))}
    assert {("sddmm", 16, False), ("sddmm", 1, False), ("sddmm", 3, False)} <= planned
    assert all(not t for op, _, t in planned if op == "sddmm")  # always on A's own pattern


def test_the_backend_starts_specialization_at_compile_time(tmp_path):
    fakes = Fakes()
    runtime = rt.Runtime(JitOptions(mode="sync"), cache=KernelCache(tmp_path),
                         specializer=fakes.specializer, installer=fakes.installer, devices=("cpu",))
    previous = rt.set_active(runtime)
    try:
        M = make_pattern("random")
        A = ts.csr(M, dtype=torch.float32)
        model = torch.compile(_Model(A), backend="sparserl", fullgraph=True)
        x, y, z = torch.randn(M.shape[1], 16), torch.randn(M.shape[1]), torch.randn(M.shape[0])
        model(x, y, z).backward()
        specialized = sorted((key.op, key.n) for key in fakes.specialized)
        assert specialized == [("spmm", 1), ("spmm", 3), ("spmm", 16), ("spmm", 16), ("spmv", 1)]
        assert runtime.stats["installed_calls"] >= 4  # the compiled products found the installed kernels
    finally:
        rt.set_active(previous)


def test_specialize_names_bad_arguments():
    A = ts.csr(make_pattern("random"), dtype=torch.float32)
    with pytest.raises(ValueError, match="specialize: op must be one of"):
        prespecialize.specialize(A, "spgemm")
    with pytest.raises(ValueError, match="op='spmv' has n=1"):
        prespecialize.specialize(A, "spmv", 4)
    with pytest.raises(ValueError, match="n must be a positive int"):
        prespecialize.specialize(A, "spmm", 0)
    assert prespecialize.specialize(A, "spmm", 8) is None  # the default runtime serves CUDA only


class _Layer(torch.nn.Module):
    def __init__(self, A):
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)
        self.register_buffer("adj", A)

    def forward(self, x):
        return (self.adj @ self.lin(x)).relu().sum()


@pytest.mark.parametrize("mode,recorded_again", [(None, True), ("reduce-overhead", True),
                                                  ("reduce-overhead", False)])
def test_the_backend_waits_for_background_decisions_only_where_graphs_cannot_be_recorded_again(
        tmp_path, monkeypatch, mode, recorded_again):
    """CUDA graphs replay the kernels they recorded. Where the graph can be recorded again once
    its kernels are decided (this torch), compilation does not wait, under CUDA graphs or not,
    and cuSPARSE serves until the decisions are taken; where it cannot, compilation under CUDA
    graphs waits for them."""
    import threading

    from torch_sparserl.compiler import cudagraphs

    if not recorded_again:
        monkeypatch.setattr(cudagraphs, "supported", lambda: False)
    waits = mode is not None and not recorded_again
    torch._dynamo.reset()  # the same model was compiled by the previous case
    gate = threading.Event()
    fakes = Fakes(gate=gate)
    runtime = rt.Runtime(JitOptions(mode="background", admit_age_s=0), cache=KernelCache(tmp_path),
                         specializer=fakes.specializer, installer=fakes.installer, devices=("cpu",))
    previous = rt.set_active(runtime)
    timer = threading.Timer(0.5, gate.set) if waits else None
    try:
        M = make_pattern("random")
        A = ts.csr(M, dtype=torch.float32)
        model = torch.compile(_Layer(A), backend="sparserl", fullgraph=True, mode=mode)
        if timer:
            timer.start()
        model(torch.randn(M.shape[1], 16)).backward()
        decided = runtime.decisions(A.crow, A.col, A.shape[1])
        assert set(decided) == {"A spmm n=16 float32", "At spmm n=16 float32"}, decided
        if waits:  # decided before the graph first ran: the kernels served every product
            assert all(v.startswith("installed") for v in decided.values()), decided
            assert runtime.stats["fallback_calls"] == 0 and runtime.stats["installed_calls"] == 2
        else:
            assert all(v == "specializing in the background" for v in decided.values()), decided
            assert runtime.stats["fallback_calls"] == 2 and runtime.stats["installed_calls"] == 0
        gate.set()
        runtime.wait(10)
    finally:
        gate.set()
        rt.set_active(previous)
        runtime.close()
