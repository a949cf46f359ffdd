"""The JIT runtime on a GPU, end to end: real specializer (the learned policy by default, its
samples evaluated in the sandbox; the autotuner where a test says so), real
installer (lean extension build), the operators routed through it.

Run on the device: ``pytest -m gpu tests/jit/test_runtime_gpu.py``. Correctness is checked
against float64 references with outputs poisoned; speed is taken from the evaluator's
record (measured in the same run as cuSPARSE) — the end-to-end timing is the benchmark's job
(``benchmarks/bench_runtime.py``).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import torch_sparserl as ts
from torch_sparserl import pattern as patterns
from torch_sparserl.abi import DTYPES, KernelSpec
from torch_sparserl.cli import measure
from torch_sparserl.dtypes import assert_close_to_reference
from torch_sparserl.evaluate.record import EvalRecord
from torch_sparserl.jit import runtime as rt
from torch_sparserl.jit import install
from torch_sparserl.jit.cache import CacheEntry, KernelCache
from torch_sparserl.specialize import autotune, families
from torch_sparserl.config import JitOptions

from fakes import FIXED_FAMILIES, fixed_specializer as _fixed_specializer, using_runtime as _using
from helpers import TESTS, UNSORTED_AND_DUPLICATE, make_unsorted_pattern, ref_sddmm, summed_product, to_parts


ADVERSARIAL = TESTS / "adversarial"
BUDGET_S = 6.0


@pytest.fixture(scope="module")
def kernel_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("kernels")


@pytest.fixture(scope="module")
def jit(kernel_dir):
    runtime = rt.Runtime(JitOptions(mode="sync", strict=True, budget_s=BUDGET_S),
                         cache=KernelCache(kernel_dir))
    previous = rt.set_active(runtime)
    yield runtime
    rt.set_active(previous)
    runtime.close()


def _reference(M, X: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(np.asarray(M.astype(np.float64) @ X.double().cpu().numpy()))


@pytest.fixture
def fixed(kernel_dir):
    """A sync runtime on :func:`_fixed_specializer`, active for one test."""
    with _using(JitOptions(mode="sync", strict=True), kernel_dir / "fixed",
                specializer=_fixed_specializer) as runtime:
        yield runtime


def _assert_installed(runtime, op, pattern, n, dtype):
    """``op``'s product on ``pattern`` is served by the kernel the fixed specializer chose."""
    state = runtime.state(op, pattern, n, dtype)
    assert isinstance(state, rt.Installed), runtime.explain(op, pattern, n, dtype)
    assert state.entry.family == FIXED_FAMILIES[op.split("+")[0]], runtime.describe(state)


def _two_products(name: str, n: int):
    """Two float32 products of the shipped matrix ``name`` with an X of width ``n`` (a vector for
    1) through the active runtime, each against float64: the first decides, the second reuses.
    Returns the op and the matrix's pattern."""
    M = ts.load_matrix(name)
    A = ts.csr(M, dtype=torch.float32, device="cuda")
    X = torch.randn(M.shape[1], n, device="cuda")
    operand = X[:, 0] if n == 1 else X
    for _ in range(2):
        Y = A @ operand
        assert_close_to_reference(Y.reshape(M.shape[0], n).cpu(), _reference(M, X), torch.float32)
    return ("spmv" if n == 1 else "spmm"), patterns.lookup(A.crow, A.col, M.shape[1])


@pytest.mark.parametrize("name", ["cora", "citeseer", "rajat01", "dnn_n1024_l1"])
@pytest.mark.parametrize("n", [1, 32])
def test_the_policy_decides_shipped_matrices_and_the_products_are_correct(jit, poison_uninitialized, name, n):
    """The learned policy end to end: each product is decided (a kernel that beat cuSPARSE by the
    margin, or cuSPARSE, decided) and correct either way."""
    op, entry = _two_products(name, n)
    state = jit.state(op, entry, n, torch.float32)
    assert isinstance(state, (rt.Installed, rt.Fallback)), jit.explain(op, entry, n, torch.float32)
    if isinstance(state, rt.Fallback):
        assert state.decided, state.reason  # strict: a failure would have raised already
    else:
        record = EvalRecord.from_dict(jit.cache.get(state.key).record)
        assert record.speedup >= jit.settings.margin  # measured against cuSPARSE in the same run


@pytest.mark.parametrize("name", ["cora", "citeseer", "rajat01", "dnn_n1024_l1"])
@pytest.mark.parametrize("n", [1, 32])
def test_installed_kernels_serve_shipped_matrices_correctly(fixed, poison_uninitialized, name, n):
    """The installed kernel, not cuSPARSE, serves every call after the decision, and matches float64."""
    op, entry = _two_products(name, n)
    _assert_installed(fixed, op, entry, n, torch.float32)
    assert fixed.stats["installed_calls"] >= 2 and fixed.stats["fallback_calls"] == 0, fixed.stats


def _cusparse_decided(key, crow, col, ncols):
    return CacheEntry(key, None, reason="decided by the test: cuSPARSE")


@pytest.mark.parametrize("n", [1, 32])
def test_a_product_decided_for_cusparse_is_served_by_cusparse(kernel_dir, poison_uninitialized, n):
    """A specializer's "no kernel" is a decided fallback: strict mode does not raise, cuSPARSE
    serves every call (correctly), and nothing is installed."""
    settings = JitOptions(mode="sync", strict=True)
    with _using(settings, kernel_dir / "cusparse", specializer=_cusparse_decided) as runtime:
        op, entry = _two_products("cora", n)
        state = runtime.state(op, entry, n, torch.float32)
        assert isinstance(state, rt.Fallback) and state.decided, runtime.describe(state)
        assert "decided by the test" in state.reason
        assert runtime.stats["installed_calls"] == 0 and runtime.stats["fallback_calls"] == 2, runtime.stats


def _family_cases():
    """Every family and op it writes, in float32 and bfloat16 where it renders with its defaults."""
    for family, fam in families.FAMILIES.items():
        for op in sorted(fam.ops):
            for dtype in ("f32", "bf16"):
                try:
                    families.render(family, None, op=op, dtype=dtype, n=1 if op == "spmv" else 32)
                except ValueError:  # half SpMV of the families that add a row's pieces atomically
                    continue
                yield pytest.param(family, op, dtype, id=f"{op}-{family}-{dtype}")


@pytest.mark.parametrize("family,op,dtype", list(_family_cases()))
def test_installed_kernels_take_unsorted_and_duplicate_columns(kernel_dir, poison_uninitialized, family, op, dtype):
    """Each family's kernel (its defaults), installed by the runtime and called through the
    operators, serves patterns whose columns are unsorted within rows and whose (row, col)
    entries repeat: twice each (the second call may be the C++ fast path's), against a float64
    reference that adds every entry. Installed by the NVRTC installer: the same plan data and
    binding as a library's, without an nvcc build per family."""
    n = 1 if op == "spmv" else 32
    tdtype = DTYPES[dtype]

    def specializer(key, crow, col, ncols):
        spec = families.render(family, None, op=key.op, dtype=key.dtype, n=key.n)
        return CacheEntry(key, spec.source, family=family, reason="chosen by the test")

    settings = JitOptions(mode="sync", strict=True)
    with _using(settings, kernel_dir / f"unsorted-{family}-{op}-{dtype}", specializer=specializer,
                installer=install.nvrtc_installer) as runtime:
        for seed, name in enumerate(UNSORTED_AND_DUPLICATE):
            A = make_unsorted_pattern(name, seed=seed)
            crow, col, val = to_parts(A, tdtype, torch.int32, "cuda")
            for call in range(2):
                g = torch.Generator().manual_seed(100 * seed + call)
                X = torch.randn(A.shape[1], n, generator=g, dtype=torch.float64).to("cuda", tdtype)
                if op == "sddmm":
                    Y = torch.randn(A.shape[0], n, generator=g, dtype=torch.float64).to("cuda", tdtype)
                    out, want = torch.ops.sparserl.sddmm(crow, col, Y, X), ref_sddmm(crow, col, Y, X)
                else:
                    operand = X[:, 0] if op == "spmv" else X
                    out = getattr(torch.ops.sparserl, op)(crow, col, val, A.shape[1], operand)
                    want = torch.from_numpy(summed_product(A.indptr, A.indices, val.double().cpu().numpy(),
                                                           operand.double().cpu().numpy()))
                assert_close_to_reference(out.cpu(), want, tdtype)
            state = runtime.state(op, patterns.lookup(crow, col, A.shape[1]), n, tdtype)
            assert isinstance(state, rt.Installed) and state.entry.family == family, runtime.describe(state)
        assert runtime.stats["installed_calls"] >= 4 and runtime.stats["fallback_calls"] == 0, runtime.stats


def _tuned(kernel_dir: Path):
    """A sync runtime on the autotuner, with its decisions under ``kernel_dir / "tuned"``. The
    tests that need cora's N=32 product to get a kernel use it: the autotuner's search of the
    family grid finds one every time, while the policy's 4 samples can all fall under the margin
    (2026-11-24: this module's two such tests failed once in four GPU runs on the policy)."""
    return _using(JitOptions(mode="sync", strict=True, budget_s=BUDGET_S, policy="autotune"),
                  kernel_dir / "tuned")


def test_installed_kernels_exist_and_were_faster(kernel_dir, poison_uninitialized):
    # cora SpMM N=32 was 2.3x cuSPARSE in the kernel benchmark; the runtime must find a kernel.
    with _tuned(kernel_dir) as runtime:
        M = ts.load_matrix("cora")
        A = ts.csr(M, dtype=torch.float32, device="cuda")
        X = torch.randn(M.shape[1], 32, device="cuda")
        for _ in range(2):  # the first call decides, the second runs the installed kernel
            assert_close_to_reference((A @ X).cpu(), _reference(M, X), torch.float32)
        entry = patterns.lookup(A.crow, A.col, M.shape[1])
        state = runtime.state("spmm", entry, 32, torch.float32)
        assert isinstance(state, rt.Installed), runtime.explain("spmm", entry, 32, torch.float32)
        assert EvalRecord.from_dict(runtime.cache.get(state.key).record).speedup >= runtime.settings.margin
        assert runtime.stats["installed_calls"] >= 1


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_through_the_runtime(jit, poison_uninitialized, dtype):
    M = ts.load_matrix("cora")
    A = ts.csr(M, dtype=dtype, device="cuda")
    X = torch.randn(M.shape[1], 32, device="cuda", dtype=dtype)
    Y = A @ X
    assert Y.dtype == dtype
    ref = torch.from_numpy(np.asarray(M.astype(np.float64) @ X.double().cpu().numpy()))
    assert_close_to_reference(Y.cpu(), ref, dtype)


def test_training_step_uses_specialized_forward_and_backward(fixed, poison_uninitialized):
    M = ts.load_matrix("rajat01")  # not symmetric: the backward runs on a transposed pattern
    Md = M.astype(np.float64)
    A = ts.csr(M, dtype=torch.float32, index_dtype=torch.int64, device="cuda")
    X = torch.randn(M.shape[1], 32, device="cuda", requires_grad=True)
    W = torch.randn(M.shape[0], 32, device="cuda")
    loss = ((A @ X) * W).sum()
    loss.backward()
    expected = torch.from_numpy(np.asarray(Md.T @ W.double().cpu().numpy()))
    assert_close_to_reference(X.grad.cpu(), expected, torch.float32)
    entry = patterns.lookup(A.crow, A.col, M.shape[1])
    entry_t = entry.transpose(A.crow, A.col)[0]
    _assert_installed(fixed, "spmm", entry, 32, torch.float32)
    _assert_installed(fixed, "spmm", entry_t, 32, torch.float32)  # Aᵀ was decided on its own pattern
    assert fixed.stats["installed_calls"] >= 2 and fixed.stats["fallback_calls"] == 0, fixed.stats


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_value_gradient_runs_the_specialized_sddmm(fixed, poison_uninitialized, dtype):
    M = ts.load_matrix("citeseer")
    A = ts.csr(M, dtype=dtype, device="cuda")
    val = A.values().detach().clone().requires_grad_()
    A = A.with_values(val)
    X = torch.randn(M.shape[1], 32, device="cuda", dtype=dtype)
    W = torch.randn(M.shape[0], 32, device="cuda", dtype=dtype)
    ((A @ X) * W).sum().backward()  # d/dval[k] = dot(W[row(k)], X[col(k)]): an SDDMM
    rows = np.repeat(np.arange(M.shape[0]), np.diff(M.indptr))
    W64, X64 = W.double().cpu().numpy(), X.double().cpu().numpy()
    expected = torch.from_numpy(np.einsum("kn,kn->k", W64[rows], X64[M.indices]))
    assert_close_to_reference(val.grad.cpu(), expected, dtype)
    entry = patterns.lookup(A.crow, A.col, M.shape[1])
    _assert_installed(fixed, "sddmm", entry, 32, dtype)
    assert fixed.state("sddmm", entry, 32, dtype).key.policy == "autotune"  # the policy writes no SDDMM
    served = fixed.stats["installed_calls"]
    # the operator directly, on a D that is 4 bytes off 16-byte alignment
    base = torch.randn(M.shape[0] * 32 + 1, device="cuda").to(dtype)
    D = base[1:].view(M.shape[0], 32)
    out = torch.ops.sparserl.sddmm(A.crow, A.col, D, X)
    expected = np.einsum("kn,kn->k", D.double().cpu().numpy()[rows], X64[M.indices])
    assert_close_to_reference(out.cpu(), torch.from_numpy(expected), dtype)
    assert fixed.stats["installed_calls"] == served + 1, fixed.stats


def test_attention_heads_run_specialized_kernels_on_the_block_diagonal_form(fixed, poison_uninitialized):
    """spmm_heads (a GAT layer's message sum) forward and backward: one product for every
    head, decided on the pattern's block-diagonal form, against float64 per head."""
    M = ts.load_matrix("citeseer")
    A = ts.csr(M, device="cuda")
    heads, c = 4, 16
    alpha = torch.rand(A.nnz, heads, device="cuda", requires_grad=True)
    X = torch.randn(M.shape[1], heads, c, device="cuda", requires_grad=True)
    out = torch.ops.sparserl.spmm_heads(A.crow, A.col, alpha, M.shape[1], X)
    W = torch.randn_like(out)
    (out * W).sum().backward()
    rows = np.repeat(np.arange(M.shape[0]), np.diff(M.indptr))
    a64, x64, w64 = (t.detach().double().cpu().numpy() for t in (alpha, X, W))
    for h in range(heads):
        A_h = type(M)((a64[:, h], M.indices, M.indptr), shape=M.shape)
        assert_close_to_reference(out[:, h].detach().cpu(), _reference(A_h, X[:, h].detach()))
        assert_close_to_reference(X.grad[:, h].cpu(), torch.from_numpy(np.asarray(A_h.T @ w64[:, h])))
        assert_close_to_reference(alpha.grad[:, h].cpu(),
                                  torch.from_numpy(np.einsum("kn,kn->k", w64[rows, h], x64[M.indices, h])))
    kernels = fixed.decisions(A.crow, A.col, M.shape[1])
    for label in (f"A heads={heads} spmm n={c} float32", f"At heads={heads} spmm n={c} float32",
                  f"A heads={heads} sddmm n={c} float32"):
        assert label in kernels and kernels[label].startswith("installed: "), kernels
    assert fixed.stats["installed_calls"] >= 3 and fixed.stats["fallback_calls"] == 0, fixed.stats


@pytest.mark.parametrize("scale_on, bias_on, relu", [(True, True, True), (False, True, False), (False, False, True)])
def test_fused_epilogue_matches_float64(fixed, poison_uninitialized, scale_on, bias_on, relu):
    M = ts.load_matrix("cora")
    A = ts.csr(M, dtype=torch.float32, device="cuda")
    X = torch.randn(M.shape[1], 32, device="cuda")
    scale = torch.rand(M.shape[0], 1, device="cuda") if scale_on else None
    bias = torch.randn(32, device="cuda") if bias_on else None
    out = torch.ops.sparserl.spmm_epilogue(A.crow, A.col, A.val, M.shape[1], X, scale, bias, relu)
    ref = M.astype(np.float64) @ X.double().cpu().numpy()
    ref = ref * scale.double().cpu().numpy() if scale_on else ref
    ref = ref + bias.double().cpu().numpy() if bias_on else ref
    ref = np.maximum(ref, 0.0) if relu else ref
    assert_close_to_reference(out.cpu(), torch.from_numpy(np.asarray(ref)), torch.float32)
    entry = patterns.lookup(A.crow, A.col, M.shape[1])
    steps = "+".join(s for s, on in (("scale", scale_on), ("bias", bias_on), ("relu", relu)) if on)
    assert FIXED_FAMILIES["spmm"] in families.EPILOGUE_FAMILIES
    _assert_installed(fixed, "spmm", entry, 32, torch.float32)
    _assert_installed(fixed, f"spmm+{steps}", entry, 32, torch.float32)  # the epilogue in the kernel's row stores
    assert fixed.stats["installed_calls"] >= 1 and fixed.stats["fallback_calls"] == 0, fixed.stats


def test_compiled_gcn_layer_fuses_its_tail(fixed, poison_uninitialized):
    from torch_sparserl.compiler import passes

    M = ts.load_matrix("cora")
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 32, bias=False).cuda()
    b = torch.randn(32, device="cuda")
    dinv = torch.rand(M.shape[0], device="cuda") + 0.5
    A = ts.csr(M, dtype=torch.float32, device="cuda")
    x = torch.randn(M.shape[1], 64, device="cuda")

    def layer(x):
        return torch.relu((A @ lin(x)) * dinv.unsqueeze(1) + b)

    passes.REPORTS.clear()
    torch._dynamo.reset()
    with torch._inductor.config.patch(force_disable_caches=True):
        out = torch.compile(layer, backend="sparserl", options={"fuse_epilogues": True})(x)
    # decided at compile time, before the post-grad pass asked: an epilogue family is installed
    assert fixed.fusable(M.shape[0], M.nnz, M.shape[1], 32, torch.float32)
    assert [line for r in passes.REPORTS for line in r.fused] == ["spmm -> mul -> add -> relu"]
    with torch.no_grad():
        H = x.double() @ lin.weight.double().t()
    ref = np.maximum((M.astype(np.float64) @ H.cpu().numpy()) * dinv.double().cpu().numpy()[:, None]
                     + b.double().cpu().numpy(), 0.0)
    assert_close_to_reference(out.detach().cpu(), torch.from_numpy(np.asarray(ref)), torch.float32)
    torch._dynamo.reset()


def test_odd_operands_are_served_correctly(jit, poison_uninitialized):
    M = ts.load_matrix("cora")
    A = ts.csr(M, dtype=torch.float32, device="cuda")
    base = torch.randn(M.shape[1] * 32 + 1, device="cuda")
    shifted = base[1:].view(M.shape[1], 32)  # contiguous but 4 bytes off 16-byte alignment
    transposed = torch.randn(32, M.shape[1], device="cuda").t()  # not contiguous
    stream = torch.cuda.Stream()
    for X in (shifted, transposed):
        with torch.cuda.stream(stream):
            Y = A @ X
        stream.synchronize()
        assert_close_to_reference(Y.cpu(), _reference(M, X), torch.float32)


def test_background_mode_serves_cusparse_first_then_the_kernel(kernel_dir, poison_uninitialized):
    """At the default admission, a new pattern's calls are cuSPARSE's and decide nothing until it
    is admit_age_s old; then a call queues its decision, and what it decides serves after that."""
    settings = JitOptions(mode="background", budget_s=BUDGET_S)
    assert settings.admit_age_s > 0
    with _using(settings, kernel_dir / "background") as runtime:
        M = ts.load_matrix("rajat01")
        A = ts.csr(M, dtype=torch.float32, device="cuda")
        X = torch.randn(M.shape[1], 32, device="cuda")
        first = A @ X  # returns at once with cuSPARSE's result
        entry = patterns.lookup(A.crow, A.col, M.shape[1])
        assert runtime.state("spmm", entry, 32, torch.float32) is None  # young: nothing recorded
        time.sleep(settings.admit_age_s)
        A @ X  # old enough: queued
        assert isinstance(runtime.state("spmm", entry, 32, torch.float32), (rt.Pending, rt.Installed, rt.Fallback))
        runtime.wait(300)
        second = A @ X
        for Y in (first, second):
            assert_close_to_reference(Y.cpu(), _reference(M, X), torch.float32)
        assert not isinstance(runtime.state("spmm", entry, 32, torch.float32), rt.Pending)


def _adversarial(name: str) -> KernelSpec:
    return KernelSpec((ADVERSARIAL / name).read_text(), "adversarial", (("file", name),))


@pytest.mark.parametrize("policy", ["autotune", "learned"])
def test_a_hostile_candidate_never_reaches_the_user(kernel_dir, monkeypatch, poison_uninitialized, policy):
    """Every candidate but one is broken in a way that could look fast (half the rows, a
    value cached from the first trial, an input written, out-of-bounds writes, a race); the
    runtime installs the correct one or none, and the result is right either way -- whether
    the candidates come from the autotuner's space or from the policy's samples."""
    from torch_sparserl.specialize.policy import propose as proposing
    from torch_sparserl.specialize.policy.model import Sample

    hostile = ["partial.cu", "cached_value.cu", "modifies_input.cu", "oob_near.cu", "race.cu", "wild_write.cu"]
    specs = [_adversarial(name) for name in hostile] + [_adversarial("good_spmm_f32.cu")]
    monkeypatch.setattr(autotune, "candidates", lambda *args, **kwargs: list(specs))
    monkeypatch.setattr(proposing, "propose", lambda *args, **kwargs: [
        proposing.Proposal(Sample(s.source, [], 0.0, True), s.source, s) for s in specs])
    settings = JitOptions(mode="sync", budget_s=120, margin=1.0, policy=policy, k=len(specs))
    with _using(settings, kernel_dir / f"hostile-{policy}") as runtime:
        M = ts.load_matrix("cora")
        A = ts.csr(M, dtype=torch.float32, device="cuda")
        X = torch.randn(M.shape[1], 16, device="cuda")
        X_before = X.clone()
        Y = A @ X
        assert_close_to_reference(Y.cpu(), _reference(M, X), torch.float32)
        assert torch.equal(X, X_before)
        entry = patterns.lookup(A.crow, A.col, M.shape[1])
        state = runtime.state("spmm", entry, 16, torch.float32)
        if isinstance(state, rt.Installed):
            assert runtime.cache.get(state.key).params == {"file": "good_spmm_f32.cu"}
        else:
            assert isinstance(state, rt.Fallback) and state.decided, state


def test_a_new_process_starts_warm_from_the_disk_cache(kernel_dir):
    """A runtime's decisions are on disk: a new process installs cora's kernel without
    specializing (its specializer refuses), and its first product is correct."""
    with _tuned(kernel_dir):
        M = ts.load_matrix("cora")
        A = ts.csr(M, dtype=torch.float32, device="cuda")
        A @ torch.randn(M.shape[1], 32, device="cuda")  # decided here, or already on disk
    warm = measure.warm_start([("cora", "spmm", 32)], str(kernel_dir / "tuned"), timeout_s=300, policy="autotune")
    cell, = warm["cells"]
    assert cell["from_disk"] and warm["cache"]["builds"] == 0 and warm["cache"]["disk_hits"] == 1
    assert cell["max_abs_err"] < 1e-3
    print("warm start, first product in a new process:", round(cell["warm_ms"], 1), "ms")


def test_the_first_run_builds_its_libraries_out_of_the_training_process(tmp_path):
    """A first run (fresh caches) specializes in the sandbox's worker and has the installed
    kernel's library built there too: the training process never imports torch's extension
    builder (whose import and build hold the interpreter lock for hundreds of milliseconds,
    stalling a training loop's steps). The product is served
    by the installed kernel and matches float64."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import sys, numpy as np, torch
        import torch_sparserl as ts
        from torch_sparserl.jit import runtime as rt
        runtime = rt.configure(mode="sync", strict=True, policy="autotune", budget_s=4.0)
        M = ts.load_matrix("cora")
        A = ts.csr(M, dtype=torch.float32, device="cuda")
        X = torch.randn(M.shape[1], 32, device="cuda")
        out = A @ X
        want = torch.from_numpy(np.asarray(M.astype(np.float64) @ X.double().cpu().numpy()))
        err = float((out.double().cpu() - want).abs().max())
        print(runtime.stats["installs"], runtime.stats["installed_calls"],
              "torch.utils.cpp_extension" in sys.modules, err)
        runtime.close()
    """)
    env = {**os.environ, "SPARSERL_CACHE_DIR": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    installs, calls, imported, err = result.stdout.split()[-4:]
    assert int(installs) == 1 and int(calls) == 1, result.stdout
    assert imported == "False", "the training process imported torch.utils.cpp_extension"
    assert float(err) < 1e-3
    assert list(tmp_path.glob("build/*/*.ok")), "no library was built"
