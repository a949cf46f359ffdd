"""Inductor's own options through the ``sparserl`` backend, and its C++ wrapper.

Options that are not the backend's own but name an Inductor config entry are passed on as
Inductor's config patches.

The GPU test runs on the device: ``pytest -m gpu tests/compiler/test_inductor_options.py``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import torch_sparserl as ts
from torch_sparserl.config import BackendOptions
from torch_sparserl.dtypes import assert_close_to_reference
from torch_sparserl.jit import runtime as rt
from torch_sparserl.jit.cache import CacheEntry, KernelCache
from torch_sparserl.specialize import families
from torch_sparserl.config import JitOptions


def test_inductor_options_are_kept_apart_from_the_backends():
    settings = BackendOptions.from_options({"strict": True, "cpp_wrapper": True, "triton.cudagraphs": False})
    assert settings.strict is True
    assert dict(settings.inductor) == {"cpp_wrapper": True, "triton.cudagraphs": False}
    assert BackendOptions.from_options({"strict": True}).inductor == ()


def test_an_inductor_option_of_the_wrong_type_is_named():
    with pytest.raises(TypeError, match=r"Inductor option 'cpp_wrapper' must be a bool \(got 'yes'\)"):
        BackendOptions.from_options({"cpp_wrapper": "yes"})
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['no_such_thing'\].*torch._inductor.config"):
        BackendOptions.from_options({"strict": True, "no_such_thing": 1})


def test_inductor_options_reach_inductor():
    """A post-grad pass given as an option runs, chained before the backend's own pass (it
    sees the differentiable operator, which the backend's pass then retargets)."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    seen = []

    class Recorder(CustomGraphPass):
        def __call__(self, graph):
            seen.append([str(n.target) for n in graph.nodes if n.op == "call_function"])

        def uuid(self):
            return "test-recorder"

    M = ts.load_matrix("cora")
    A = ts.csr(M, dtype=torch.float32)
    x = torch.randn(M.shape[1], 4)
    torch._dynamo.reset()
    try:  # no cached graph: the passes run on fresh compiles only
        with torch._inductor.config.patch(force_disable_caches=True):
            out = torch.compile(lambda x: A @ x, backend="sparserl",
                                options={"post_grad_custom_post_pass": Recorder()})(x)
    finally:
        torch._dynamo.reset()
    dense = torch.from_numpy(M.astype(np.float64).toarray())
    assert_close_to_reference(out, dense @ x.double(), torch.float32)
    assert seen == [["sparserl.spmm.default"]], seen


def _rowchunks(key, crow, col, ncols):
    spec = families.render("rowchunks", None, op=key.op, dtype=key.dtype, n=key.n)
    return CacheEntry(key, spec.source, family="rowchunks", reason="chosen by the test")


def _reference(M, lin, x):
    """``(A @ lin(x)).relu().square().sum()`` and its gradient for ``lin.weight``, in float64."""
    dense = torch.from_numpy(M.astype(np.float64).toarray())
    w = lin.weight.detach().double().cpu().requires_grad_()
    loss = (dense @ (x.double().cpu() @ w.t() + lin.bias.detach().double().cpu())).relu().square().sum()
    loss.backward()
    return loss.detach(), w.grad


def test_cpp_wrapper_training_on_the_cpu(tmp_path):
    """Inductor's C++ wrapper over a graph whose CSRMatrix input the backend flattened into its
    parts: forward and backward match float64. (The flattened graph's placeholders once
    carried fake values for the parts alone, and the C++ wrapper then took the other inputs
    for None.)"""
    M = ts.load_matrix("cora")
    generator = torch.Generator().manual_seed(0)
    A = ts.csr(M, dtype=torch.float32)
    lin = torch.nn.Linear(8, 8)
    x = torch.randn(M.shape[1], 8, generator=generator)
    torch._dynamo.reset()
    try:
        model = torch.compile(lambda x: (A @ lin(x)).relu().square().sum(), backend="sparserl",
                              options={"cpp_wrapper": True})
        loss = model(x)
        loss.backward()
    finally:
        torch._dynamo.reset()
    ref_loss, ref_grad = _reference(M, lin, x)
    assert_close_to_reference(loss.detach(), ref_loss, torch.float32)
    assert_close_to_reference(lin.weight.grad, ref_grad, torch.float32)


@pytest.mark.gpu
def test_cpp_wrapper_inference_matches_float64(tmp_path, poison_uninitialized):
    """Inference compiled with Inductor's C++ wrapper, the products served by installed
    kernels, matches float64. (Training under the C++ wrapper fails in torch 2.11's Inductor
    on the H100 for the backward graph, with backend="inductor" as well: 'CudaKernelParamCache
    not populated' for the backward's first Triton kernel.)"""
    runtime = rt.Runtime(JitOptions(mode="sync", strict=True), cache=KernelCache(tmp_path),
                         specializer=_rowchunks)
    previous = rt.set_active(runtime)
    torch._dynamo.reset()
    try:
        M = ts.load_matrix("cora")
        generator = torch.Generator().manual_seed(0)
        A = ts.csr(M, dtype=torch.float32, device="cuda")
        lin = torch.nn.Linear(16, 16).cuda()
        model = torch.compile(lambda x: (A @ lin(x)).relu().square().sum(), backend="sparserl",
                              options={"cpp_wrapper": True, "strict": True})
        for _ in range(2):
            x = torch.randn(M.shape[1], 16, generator=generator).cuda()
            with torch.no_grad():
                out = model(x)
            assert_close_to_reference(out.cpu(), _reference(M, lin, x)[0], torch.float32)
        decisions = runtime.decisions(A.crow, A.col, M.shape[1])
        assert decisions and all(v.startswith("installed: rowchunks") for v in decisions.values()), decisions
        assert runtime.stats["installed_calls"] >= 2
    finally:
        rt.set_active(previous)
        runtime.close()
        torch._dynamo.reset()
