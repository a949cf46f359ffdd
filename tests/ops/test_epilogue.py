"""Fused epilogues (CPU): the plan key, the rendered kernels, the operator, the post-grad pass
that writes it, and the runtime's fused path with its fallbacks (fake installers)."""

from __future__ import annotations

import copy
import shutil

import numpy as np
import pytest
import scipy.sparse as sp
import torch

import torch_sparserl as ts
from torch_sparserl import pattern as patterns
from torch_sparserl.abi import PlanError, parse_plan
from torch_sparserl.compiler import passes
from torch_sparserl.dtypes import assert_close_to_reference
from torch_sparserl.jit.cache import CacheEntry, KernelCache
from torch_sparserl.jit.runtime import Fallback, Installed, Runtime
from torch_sparserl.config import JitOptions
from torch_sparserl.specialize import families as F

from helpers import make_pattern, to_parts

COMBOS = [(scale, bias, relu) for scale in (False, True) for bias in (False, True) for relu in (False, True)
          if scale or bias or relu]
GROUP_ROW = {"lanes": 8, "vec": 4, "block": 256, "rows": "natural", "unroll": 2}


# --------------------------------------------------------------------------- the plan and the kernels


def test_plan_epilogue_parses_and_formats_back():
    plan = parse_plan("// sparserl: op=spmm dtype=f32 n=32 block=256 grid=rows epilogue=scale+bias+relu")
    assert plan.epilogue == "scale+bias+relu" and plan.epilogue_bits == 7
    assert parse_plan(plan.format()) == plan
    assert parse_plan("op=spmm dtype=f32 block=256 grid=rows").epilogue_bits == 0


@pytest.mark.parametrize("line, words", [
    ("op=spmm dtype=f32 block=256 grid=rows epilogue=relu+bias", "in that order (got 'relu+bias')"),
    ("op=spmm dtype=f32 block=256 grid=rows epilogue=gelu", "subset of scale+bias+relu"),
    ("op=spmm dtype=f32 block=256 grid=rows epilogue=bias+bias", "(got 'bias+bias')"),
    ("op=spmv dtype=f32 block=256 grid=rows epilogue=relu", "unless op=spmm"),
    ("op=spmm dtype=f32 block=256 grid=parts split=nnz(8) init=zero epilogue=bias", "split=none and init=none"),
])
def test_bad_epilogues_are_plan_errors(line, words):
    with pytest.raises(PlanError, match="epilogue") as info:
        parse_plan(line)
    assert words in str(info.value)


def test_only_row_storing_families_render_epilogues():
    spec = F.render("group_row", {**GROUP_ROW, "epilogue": "bias+relu"}, op="spmm", dtype="f32", n=32)
    assert spec.plan.epilogue == "bias+relu" and "#define SR_EPILOGUE 6" in spec.source
    assert ("epilogue", "bias+relu") in spec.params
    plain = F.render("group_row", GROUP_ROW, op="spmm", dtype="f32", n=32)
    assert "SR_EPILOGUE" not in plain.source.split("// ---- sparserl prelude")[0]  # no define, no plan key
    with pytest.raises(ValueError, match=r"family nnz_split: parameter 'epilogue' expected 'none'"):
        F.render("nnz_split", {"epilogue": "relu"}, op="spmm", dtype="f32", n=32)
    with pytest.raises(ValueError, match=r"parameter 'epilogue'.*in that order"):
        F.render("group_row", {"epilogue": "relu+scale"}, op="spmm", dtype="f32", n=32)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
@pytest.mark.parametrize("family", F.EPILOGUE_FAMILIES)
def test_epilogue_kernels_compile_for_sm90_without_spills(family):
    from torch_sparserl.toolchain import nvcc

    for dtype, n, epilogue in (("f32", 128, "scale+bias+relu"), ("bf16", 130, "bias"), ("f16", 64, "relu")):
        params = {"vec": 2, "lanes": 32} if n == 130 else {}
        spec = F.render(family, {**params, "epilogue": epilogue}, op="spmm", dtype=dtype, n=n)
        result = nvcc.compile(spec.source, arch="sm_90")
        assert not result.spill_bytes and not result.stack_bytes, (family, dtype, n, epilogue, result)


# --------------------------------------------------------------------------- the operator


def _reference(M, X, scale, bias, relu):
    out = M.astype(np.float64) @ X.double().numpy()
    if scale is not None:
        out = out * scale.double().reshape(-1, 1).numpy()
    if bias is not None:
        out = out + bias.double().reshape(-1).numpy()
    return torch.from_numpy(np.maximum(out, 0) if relu else out)


@pytest.mark.parametrize("scale_on, bias_on, relu", COMBOS)
def test_operator_matches_float64(scale_on, bias_on, relu):
    M = make_pattern("short and huge rows", seed=3)
    crow, col, val = to_parts(M, torch.float32, torch.int64, "cpu")
    X = torch.randn(M.shape[1], 12)
    scale = torch.rand(M.shape[0], 1) if scale_on else None
    bias = torch.randn(12) if bias_on else None
    out = torch.ops.sparserl.spmm_epilogue(crow, col, val, M.shape[1], X, scale, bias, relu)
    M32 = M.copy()
    M32.data = val.double().numpy()
    assert_close_to_reference(out, _reference(M32, X, scale, bias, relu), torch.float32)


def test_operator_names_bad_operands():
    M = make_pattern("random")
    crow, col, val = to_parts(M, torch.float32, torch.int64, "cpu")
    rows, cols = M.shape
    X = torch.randn(cols, 4)
    op = torch.ops.sparserl.spmm_epilogue
    with pytest.raises(ValueError, match=r"^sparserl\.spmm_epilogue: bias must have N = 4 values.*got shape \(5,\)"):
        op(crow, col, val, cols, X, None, torch.randn(5), False)
    with pytest.raises(ValueError, match=rf"scale must have nrows = {rows} values"):
        op(crow, col, val, cols, X, torch.randn(rows + 1), None, False)
    with pytest.raises(ValueError, match=r"bias must be torch\.float32 on cpu, like X \(got torch\.float64"):
        op(crow, col, val, cols, X, None, torch.randn(4, dtype=torch.float64), True)
    with pytest.raises(RuntimeError, match=r"^sparserl\.spmm_epilogue: not differentiable"):
        op(crow, col, val, cols, X.requires_grad_(), None, None, True).sum().backward()


# --------------------------------------------------------------------------- the post-grad pass


class _Layer(torch.nn.Module):
    """GCN-style: relu(D^-1/2 A (X W) + b), a second product, and the pre-activation reused
    when ``reuse`` (then it is read twice and must not be fused away)."""

    def __init__(self, A, reuse=False):
        super().__init__()
        self.lin = torch.nn.Linear(16, 8, bias=False)
        self.bias = torch.nn.Parameter(torch.randn(8))
        self.register_buffer("adj", A)
        self.register_buffer("dinv", torch.rand(A.shape[0]) + 0.5)
        self.reuse = reuse

    def forward(self, x):
        pre = (self.adj @ self.lin(x)) * self.dinv.unsqueeze(1) + self.bias
        h = torch.relu(pre)
        out = (self.adj @ h).square().sum()
        return out + pre.sum() if self.reuse else out


def _square_adjacency():
    M = sp.random(60, 60, density=0.08, format="csr", random_state=4, dtype=np.float64)
    return ts.csr(M, dtype=torch.float32)


def _compiled(model, x, options=None):
    torch._dynamo.reset()
    passes.REPORTS.clear()
    with torch._inductor.config.patch(force_disable_caches=True):
        loss = torch.compile(model, backend="sparserl", options=options)(x)
        loss.backward()
    return loss, [line for report in passes.REPORTS for line in report.fused]


@pytest.fixture
def kernels_can_fuse(monkeypatch):
    """As if the runtime had installed, for every product, a kernel that takes an epilogue."""
    monkeypatch.setattr(passes, "served_fused", lambda node, out: True)


@pytest.mark.parametrize("reuse", [False, True])
def test_pass_fuses_the_layer_tail_and_keeps_gradients(reuse, kernels_can_fuse):
    torch.manual_seed(0)
    A = _square_adjacency()
    model = _Layer(A, reuse)
    x = torch.randn(A.shape[1], 16, requires_grad=True)
    # the reference: the same model and input in float64, eager
    model64 = copy.deepcopy(model).double()
    x64 = x.detach().double().requires_grad_()
    want_loss = model64(x64)
    want_loss.backward()
    loss, fused = _compiled(model, x, options={"fuse_epilogues": True})
    # reused: the pre-activation is read twice, so only the scale and the bias join the product
    assert fused == (["spmm -> mul -> add"] if reuse else ["spmm -> mul -> add -> relu"])
    assert_close_to_reference(loss.detach(), want_loss.detach(), torch.float32)
    for got, want in ((x.grad, x64.grad), (model.lin.weight.grad, model64.lin.weight.grad),
                      (model.bias.grad, model64.bias.grad)):
        assert_close_to_reference(got, want, torch.float32)
    torch._dynamo.reset()


def test_pass_is_off_by_default(kernels_can_fuse):
    A = _square_adjacency()
    _, fused = _compiled(_Layer(A), torch.randn(A.shape[1], 16))
    assert fused == []
    torch._dynamo.reset()


def test_pass_fuses_only_what_an_installed_kernel_will_serve():
    # CPU products have no kernels: the steps stay with Inductor, which fuses them itself
    A = _square_adjacency()
    _, fused = _compiled(_Layer(A), torch.randn(A.shape[1], 16), options={"fuse_epilogues": True})
    assert fused == []
    torch._dynamo.reset()


def test_runtime_says_which_shapes_a_fusable_kernel_serves(tmp_path):
    install, _ = _fake_fused()
    M = make_pattern("random")
    crow, col, val, X, bias, scale = _operands(M)
    entry = patterns.lookup(crow, col, M.shape[1])
    shape = (M.shape[0], M.nnz, M.shape[1], 8, torch.float32)
    for family, expected in (("group_row", True), ("nnz_split", False)):
        runtime = _runtime(tmp_path / family, install, family=family)
        assert not runtime.fusable(*shape)  # nothing decided yet
        runtime.call("spmm", entry, crow, col, val, X)
        assert runtime.fusable(*shape) is expected
        assert not runtime.fusable(*shape[:3], 16, torch.float32)  # another N


# --------------------------------------------------------------------------- the runtime's fused path


def _runtime(tmp_path, fused_installer, family="group_row"):
    def specializer(key, crow, col, ncols):
        return CacheEntry(key, "// sparserl: op=spmm dtype=f32 block=32 grid=1\n", family=family,
                          params={k: str(v) for k, v in GROUP_ROW.items()}, reason="2.0x cuSPARSE")

    def installer(entry, crow, col, ncols):
        return lambda crow, col, val, X: torch.sparse_csr_tensor(crow, col, val, (crow.numel() - 1, ncols)) @ X

    runtime = Runtime(JitOptions(mode="sync"), cache=KernelCache(tmp_path), specializer=specializer,
                      installer=installer, devices=("cpu",))
    runtime.fused_installer = fused_installer
    return runtime


def _fake_fused(wrong=False):
    built = []

    def install(spec, crow, col, ncols, n):
        built.append(spec)

        def launch(crow, col, val, X, bias, scale):
            y = torch.sparse_csr_tensor(crow, col, val, (crow.numel() - 1, ncols)) @ X
            y = y * scale.unsqueeze(1) if scale is not None else y
            y = y + bias if bias is not None else y
            y = y.relu() if "relu" in spec.plan.epilogue else y
            return y + 1.0 if wrong else y

        return launch

    return install, built


def _operands(M):
    crow, col, val = to_parts(M, torch.float32, torch.int64, "cpu")
    return crow, col, val, torch.randn(M.shape[1], 8), torch.randn(8), torch.rand(M.shape[0])


def test_runtime_fuses_into_the_installed_family_after_checking_it(tmp_path):
    install, built = _fake_fused()
    runtime = _runtime(tmp_path, install)
    M = make_pattern("random")
    crow, col, val, X, bias, scale = _operands(M)
    entry = patterns.lookup(crow, col, M.shape[1])
    out = runtime.call_fused(entry, crow, col, val, X, "scale+bias+relu", bias, scale)
    assert out is not None and len(built) == 1
    spec = built[0]  # the installed family's parameters (read back from their text), with the epilogue
    assert spec.family == "group_row" and spec.plan.epilogue == "scale+bias+relu" and spec.plan.n == 8
    M32 = M.copy()
    M32.data = val.double().numpy()
    assert_close_to_reference(out, _reference(M32, X, scale, bias, True), torch.float32)
    state = runtime.state("spmm+scale+bias+relu", entry, 8, torch.float32)
    assert isinstance(state, Installed) and state.description == "group_row(epilogue=scale+bias+relu)"
    runtime.call_fused(entry, crow, col, val, X, "scale+bias+relu", bias, scale)
    assert len(built) == 1  # decided once


def test_a_wrong_fused_kernel_is_refused_and_the_product_serves(tmp_path, caplog):
    install, built = _fake_fused(wrong=True)
    runtime = _runtime(tmp_path, install)
    M = make_pattern("random")
    crow, col, val, X, bias, scale = _operands(M)
    entry = patterns.lookup(crow, col, M.shape[1])
    assert runtime.call_fused(entry, crow, col, val, X, "bias", bias, None) is None
    state = runtime.state("spmm+bias", entry, 8, torch.float32)
    assert isinstance(state, Fallback) and not state.decided and "differs from the float64 reference" in state.reason
    assert "fused group_row with epilogue bias failed" in caplog.text


def test_families_that_sum_rows_atomically_are_not_fused(tmp_path):
    install, built = _fake_fused()
    runtime = _runtime(tmp_path, install, family="nnz_split")
    M = make_pattern("random")
    crow, col, val, X, bias, scale = _operands(M)
    entry = patterns.lookup(crow, col, M.shape[1])
    assert runtime.call_fused(entry, crow, col, val, X, "relu", None, None) is None and built == []
    state = runtime.state("spmm+relu", entry, 8, torch.float32)
    assert isinstance(state, Fallback) and state.decided and "does not store each row once" in state.reason
