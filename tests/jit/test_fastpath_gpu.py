"""The C++ fast path (torch_sparserl.jit.fastpath) on a GPU: what it serves, what it hands back to
the Python implementation, and compiled training through it.

Every result is compared with float64 on fresh random operands, outputs NaN-poisoned. Run on
the device: ``pytest -m gpu tests/jit/test_fastpath_gpu.py`` (the first run builds the library,
about a minute).
"""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
import scipy.sparse as sp
import torch

import torch_sparserl as ts
from torch_sparserl import pattern as patterns
from torch_sparserl.pattern import cache as pattern_table
from torch_sparserl.dtypes import assert_close_to_reference
from torch_sparserl.jit import fastpath
from torch_sparserl.jit import runtime as rt
from torch_sparserl.jit.cache import CacheEntry, KernelCache
from torch_sparserl.specialize import families
from torch_sparserl.config import JitOptions

from helpers import TESTS, as_float64_scipy, make_pattern, to_parts


KERNEL_N = 32  # products of this width get a kernel; others are decided for cuSPARSE
FAST = torch.ops.sparserl_fast


@pytest.fixture(scope="module", autouse=True)
def library():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    assert fastpath.ensure(wait=True), fastpath.unavailable()


def _specializer(key, crow, col, ncols):
    """rowchunks with its defaults for N = KERNEL_N (and spmv); cuSPARSE, decided, otherwise."""
    if key.op == "spmv" or key.n == KERNEL_N:
        spec = families.render("rowchunks", None, op=key.op, dtype=key.dtype, n=key.n)
        return CacheEntry(key, spec.source, family="rowchunks", reason="chosen by the test")
    return CacheEntry(key, None, reason="decided by the test: cuSPARSE")


@pytest.fixture
def runtime(tmp_path):
    runtime = rt.Runtime(JitOptions(mode="sync"), cache=KernelCache(tmp_path), specializer=_specializer)
    previous = rt.set_active(runtime)
    yield runtime
    rt.set_active(previous)
    runtime.close()


def _counts() -> tuple[int, int]:
    return int(fastpath.COUNTS[0]), int(fastpath.COUNTS[1])


def _want(op, crow, col, val, ncols, X):
    A = as_float64_scipy(crow, col, val, ncols)
    A = A.T if op.endswith("_transposed") else A
    return torch.from_numpy(np.asarray(A @ X.detach().cpu().double().numpy()))


def _operand(op, A, n, seed):
    rows = A.shape[0] if op.endswith("_transposed") else A.shape[1]
    g = torch.Generator().manual_seed(seed)
    shape = (rows, n) if op.startswith("spmm") else (rows,)
    return torch.randn(*shape, generator=g, dtype=torch.float64).float().cuda()


def _counted_call(op, A, crow, col, val, seed) -> tuple[int, int]:
    """One ``sparserl_fast::<op>`` product of width KERNEL_N on fresh operands, checked against
    float64; returns the calls C++ served meanwhile (with a kernel, with cuSPARSE)."""
    X = _operand(op, A, KERNEL_N, seed)
    before = _counts()
    got = getattr(FAST, op)(crow, col, val, A.shape[1], X)
    torch.cuda.synchronize()
    assert_close_to_reference(got, _want(op, crow, col, val, A.shape[1], X), torch.float32)
    return tuple(a - b for a, b in zip(_counts(), before))


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("op", fastpath.OPS)
@pytest.mark.parametrize("n", [KERNEL_N, 16])
def test_after_one_python_call_cxx_serves_the_same_call(runtime, poison_uninitialized, op, n, index_dtype):
    if op.startswith("spmv") and n != KERNEL_N:
        pytest.skip("spmv has one width")
    A = make_pattern("random", seed=3)  # 60 x 45: its transpose is another pattern
    crow, col, val = to_parts(A, torch.float32, index_dtype, "cuda")
    kernel = op.startswith("spmv") or n == KERNEL_N
    for seed in range(4):  # the first call runs in Python and records; the others run in C++
        X = _operand(op, A, n, seed)
        before = _counts()
        got = getattr(FAST, op)(crow, col, val, A.shape[1], X)
        torch.cuda.synchronize()
        assert_close_to_reference(got, _want(op, crow, col, val, A.shape[1], X), torch.float32)
        served = tuple(a - b for a, b in zip(_counts(), before))
        assert served == ((0, 0) if seed == 0 else ((1, 0) if kernel else (0, 1))), (seed, served)
    assert fastpath.entries() == 1
    stats = runtime.stats
    assert stats["installed_calls" if kernel else "fallback_calls"] == 4  # C++'s calls folded in


@pytest.mark.parametrize("c", [KERNEL_N, 16])
def test_heads_products_run_through_cxx_after_the_first_call(runtime, poison_uninitialized, c):
    """spmm_heads and spmm_heads_transposed run their product on the block-diagonal form (and
    its transpose) through sparserl_fast::spmm: Python serves and records the first call, C++
    the later ones, with the form's kernel (C = KERNEL_N) or cuSPARSE (decided, C = 16)."""
    A = make_pattern("random", seed=5)  # 60 x 45
    crow, col, _ = to_parts(A, torch.float32, torch.int32, "cuda")
    heads = 3
    g = torch.Generator().manual_seed(7)
    for seed in range(3):
        val = torch.rand(A.nnz, heads, generator=g).cuda()
        X = torch.randn(A.shape[1], heads, c, generator=g).cuda()
        G = torch.randn(A.shape[0], heads, c, generator=g).cuda()
        before = _counts()
        out = torch.ops.sparserl.spmm_heads(crow, col, val, A.shape[1], X)
        out_t = torch.ops.sparserl.spmm_heads_transposed(crow, col, val, A.shape[1], G)
        torch.cuda.synchronize()
        served = tuple(a - b for a, b in zip(_counts(), before))
        assert served == ((0, 0) if seed == 0 else ((2, 0) if c == KERNEL_N else (0, 2))), (seed, served)
        for h in range(heads):
            A_h = sp.csr_matrix((val[:, h].double().cpu().numpy(), A.indices, A.indptr), shape=A.shape)
            assert_close_to_reference(out[:, h], torch.from_numpy(np.asarray(A_h @ X[:, h].double().cpu().numpy())),
                                      torch.float32)
            assert_close_to_reference(out_t[:, h],
                                      torch.from_numpy(np.asarray(A_h.T @ G[:, h].double().cpu().numpy())), torch.float32)
    assert fastpath.entries() == 2  # the form and its transpose


def test_what_changed_goes_back_to_python(runtime, poison_uninitialized):
    A = make_pattern("random", seed=5)
    crow, col, val = to_parts(A, torch.float32, torch.int32, "cuda")
    ncols = A.shape[1]
    G = _operand("spmm_transposed", A, KERNEL_N, 0)

    def check(op, X, *, served_in_cxx, values=None):
        before = _counts()
        v = val if values is None else values
        got = getattr(FAST, op)(crow, col, v, ncols, X)
        torch.cuda.synchronize()
        assert_close_to_reference(got, _want(op, crow, col, v, ncols, X), torch.float32)
        assert (_counts() != before) == served_in_cxx

    for _ in range(3):
        check("spmm_transposed", G, served_in_cxx=_ != 0)
    val.mul_(-2.0)  # in place: the transposed values kept in C++ are gathered again
    check("spmm_transposed", G, served_in_cxx=True)
    check("spmm_transposed", G, served_in_cxx=True)
    check("spmm_transposed", G, served_in_cxx=True, values=torch.randn_like(val))  # new values every call
    check("spmm_transposed", G.t().contiguous().t(), served_in_cxx=True)  # a strided operand is copied
    check("spmm_transposed", G[:, : KERNEL_N // 2], served_in_cxx=False)  # another N: Python decides it

    # the pattern changed in place (same indices, a new version): Python validates it again,
    # decides (from the kernel cache), records again
    col.add_(0)
    check("spmm_transposed", G, served_in_cxx=False)
    check("spmm_transposed", G, served_in_cxx=True)

    # a new tensor with the same indices is another pattern: Python first
    crow2 = crow.clone()
    before = _counts()
    got = FAST.spmm_transposed(crow2, col, val, ncols, G)
    assert _counts() == before
    assert_close_to_reference(got, _want("spmm_transposed", crow2, col, val, ncols, G), torch.float32)

    # bad operands raise the operators' errors, from Python
    with pytest.raises(ValueError, match="sparserl.spmm_transposed"):
        FAST.spmm_transposed(crow, col, val, ncols, G[:-1])
    with pytest.raises(TypeError, match="sparserl.spmm_transposed"):
        FAST.spmm_transposed(crow, col, val, ncols, G.double())

    # a new runtime: nothing of the old one's decisions is served
    assert fastpath.entries() >= 1
    other = rt.Runtime(JitOptions(mode="off"))
    previous = rt.set_active(other)
    try:
        assert fastpath.entries() == 0
        check("spmm_transposed", G, served_in_cxx=False)
        check("spmm_transposed", G, served_in_cxx=True)  # mode "off": cuSPARSE, from C++ after one call
    finally:
        rt.set_active(previous)
        other.close()


@pytest.mark.parametrize("op", ["spmm", "spmm_transposed"])
def test_cxx_serves_cusparse_while_pending_then_the_decision(tmp_path, poison_uninitialized, op):
    """While a decision runs in the background C++ serves cuSPARSE; when it lands the registry
    is emptied, one call goes back to Python, and C++ serves the installed kernel after it."""
    import threading

    gate = threading.Event()

    def slow(key, crow, col, ncols):
        assert gate.wait(60)
        return _specializer(key, crow, col, ncols)

    runtime = rt.Runtime(JitOptions(mode="background", admit_age_s=0), cache=KernelCache(tmp_path),
                         specializer=slow)
    previous = rt.set_active(runtime)
    try:
        A = make_pattern("random", seed=11)
        crow, col, val = to_parts(A, torch.float32, torch.int32, "cuda")

        def call(seed):
            return _counted_call(op, A, crow, col, val, seed)

        assert call(0) == (0, 0)  # Python: the decision starts, cuSPARSE serves
        # recorded for C++ by call 0 where the indices' device check was back by then, else by call 1
        assert call(1) in ((0, 0), (0, 1))
        assert call(2) == (0, 1) and call(3) == (0, 1)  # C++ runs cuSPARSE while the decision is pending
        gate.set()
        runtime.wait(60)  # the decision has landed
        assert fastpath.entries() == 0
        assert call(4) == (0, 0)  # Python again: it sees the installed kernel and records it
        assert call(5) == (1, 0) and call(6) == (1, 0)
        assert runtime.stats["installs"] >= 1
    finally:
        gate.set()
        rt.set_active(previous)
        runtime.close()


@pytest.mark.parametrize("op", ["spmm", "spmm_transposed"])
def test_cxx_serves_the_nvrtc_build_while_the_library_is_built(tmp_path, monkeypatch, poison_uninitialized, op):
    """While the worker builds the decided kernel's library, the runtime installs the kernel's
    NVRTC build, and C++ launches its CUfunction; once the library is built its kernel replaces
    it, served by C++ through its C launcher. Results match float64 throughout."""
    import dataclasses
    import threading
    import time

    # A source of this test alone (a comment names its folder), built into that folder: its
    # library is neither on disk nor known to torch's extension builder in this process.
    monkeypatch.setenv("SPARSERL_CACHE_DIR", str(tmp_path / "cache"))
    building, gate = threading.Event(), threading.Event()

    class Specializer:
        def __call__(self, key, crow, col, ncols):
            entry = _specializer(key, crow, col, ncols)
            return dataclasses.replace(entry, spec_source=f"{entry.spec_source}\n// {tmp_path}\n")

        def prebuild(self, entry, arch):
            building.set()
            assert gate.wait(60)

    runtime = rt.Runtime(JitOptions(mode="background", admit_age_s=0), cache=KernelCache(tmp_path / "kernels"),
                         specializer=Specializer())
    previous = rt.set_active(runtime)
    try:
        A = make_pattern("random", seed=13)
        crow, col, val = to_parts(A, torch.float32, torch.int32, "cuda")
        entry = patterns.lookup(crow, col, A.shape[1])
        served = entry.transpose(crow, col)[0] if op.endswith("_transposed") else entry

        def call(seed):
            return _counted_call(op, A, crow, col, val, seed)

        def kernel():
            return runtime.state("spmm", served, KERNEL_N, torch.float32).launch.kernel.kernel

        assert call(0) == (0, 0)  # Python: the decision starts
        assert building.wait(60)  # the library's build starts, and the NVRTC build is installed beside it
        deadline = time.monotonic() + 60
        while runtime.stats["interim_installs"] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert fastpath.entries() == 0 and runtime.stats["interim_installs"] == 1
        assert kernel().backend == "nvrtc" and kernel().function and kernel().launcher is None
        assert call(1) == (0, 0)  # Python records the CUfunction
        assert call(2) == (1, 0) and call(3) == (1, 0)  # C++ launches it
        interim = runtime.state("spmm", served, KERNEL_N, torch.float32).launch
        gate.set()
        runtime.wait(120)  # the library is built here (the test's prebuild built nothing) and installed
        assert kernel().backend == "inline" and kernel().launcher
        library = runtime.state("spmm", served, KERNEL_N, torch.float32).launch
        assert library.plan_data[1][0] is interim.plan_data[1][0]  # the interim's plan data, not prepared again
        assert fastpath.entries() == 0
        assert call(4) == (0, 0)
        assert call(5) == (1, 0)
        assert runtime.stats["installs"] == 1
    finally:
        gate.set()
        rt.set_active(previous)
        runtime.close()


def test_a_dead_pattern_leaves_no_entry(runtime):
    A = make_pattern("random", seed=7)
    crow, col, val = to_parts(A, torch.float32, torch.int32, "cuda")
    X = _operand("spmm", A, KERNEL_N, 0)
    for _ in range(2):
        FAST.spmm(crow, col, val, A.shape[1], X)
    assert fastpath.entries() == 1
    del crow, col
    assert fastpath.entries() == 0


class _GCN(torch.nn.Module):
    def __init__(self, A, features, generator):
        super().__init__()
        self.lin1 = torch.nn.Linear(features, KERNEL_N)
        self.lin2 = torch.nn.Linear(KERNEL_N, 16)
        for p in self.parameters():
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=generator) / p.shape[-1] ** 0.5)
        self.register_buffer("adj", A)

    def forward(self, x):
        h = (self.adj @ self.lin1(x)).relu()
        return (self.adj @ self.lin2(h)).log_softmax(-1)


@pytest.mark.parametrize("fast_path", [True, False])
def test_compiled_training_through_the_fast_path(runtime, fast_path):
    """Two GCN layers on a non-symmetric graph, compiled: losses and gradients of every step
    match float64, and with the fast path on, C++ serves the products after the first step."""
    M = sp.random(300, 300, density=0.03, random_state=np.random.default_rng(0), format="csr")
    M.data[:] = np.random.default_rng(1).standard_normal(M.nnz)
    generator = torch.Generator().manual_seed(0)
    features = 24
    model = _GCN(ts.csr(M, dtype=torch.float32, device="cuda"), features, generator).cuda()
    reference = _GCN(torch.from_numpy(M.toarray()), features, torch.Generator().manual_seed(0)).double()
    labels = torch.randint(0, 16, (300,), generator=generator)
    compiled = torch.compile(model, backend="sparserl", fullgraph=True, options={"fast_path": fast_path})
    torch._dynamo.reset()
    try:
        for step in range(5):
            before = _counts()
            x = torch.randn(300, features, generator=generator)
            loss = torch.nn.functional.nll_loss(compiled(x.cuda()), labels.cuda())
            loss.backward()
            torch.cuda.synchronize()
            want = torch.nn.functional.nll_loss(reference(x.double()), labels)
            want.backward()
            assert_close_to_reference(loss.detach(), want.detach(), torch.float32)
            for p, q in zip(model.parameters(), reference.parameters()):
                assert_close_to_reference(p.grad, q.grad, torch.float32)
                p.grad = None
                q.grad = None
            if step >= 1:
                # forward: A @ (x W1) N=32 kernel, A @ (h W2) N=16 cuSPARSE; backward: the transposes
                assert (_counts() != before) == fast_path, (step, before, _counts())
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("fast_path", [True, False])
def test_a_steady_compiled_training_step_never_waits_for_the_gpu(runtime, fast_path):
    """Once its products are decided, a compiled step (forward, backward, Adam) makes no
    synchronizing CUDA call, with the C++ fast path and without it. A small graph's epoch is
    bound by the CPU; one host-device sync in it would stop the CPU queueing the next kernels
    while the GPU drains, adding the GPU's time to every epoch."""
    M = sp.random(400, 400, density=0.02, random_state=np.random.default_rng(2), format="csr")
    generator = torch.Generator().manual_seed(0)
    model = _GCN(ts.csr(M, dtype=torch.float32, device="cuda"), 24, generator).cuda()
    x = torch.randn(400, 24, generator=generator).cuda()
    labels = torch.randint(0, 16, (400,), generator=generator).cuda()
    compiled = torch.compile(model, backend="sparserl", fullgraph=True, options={"fast_path": fast_path})
    opt = torch.optim.Adam(model.parameters(), lr=0.01)

    def step():
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.nll_loss(compiled(x), labels)
        loss.backward()
        opt.step()
        return loss.detach()

    torch._dynamo.reset()
    try:
        for _ in range(3):  # compiles, decides (sync runtime), records the C++ entries
            step()
        torch.cuda.synchronize()
        A = model.adj
        decisions = runtime.decisions(A.crow, A.col, A.shape[1])
        assert decisions and not any(text.startswith("specializing") for text in decisions.values()), decisions
        before = _counts()
        torch.cuda.set_sync_debug_mode("error")  # a synchronizing call raises
        try:
            loss = step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert torch.isfinite(loss).item()
        assert (_counts() != before) == fast_path  # C++ served the products, where it is on
    finally:
        torch._dynamo.reset()


# ------------------------------------------------------------------ the eager doors


def _csr(name="random", seed=0):
    M = make_pattern(name)
    M.data = np.random.default_rng(seed).standard_normal(M.nnz)
    return M, ts.csr(M, dtype=torch.float32, device="cuda")


# a kernel (KERNEL_N, and spmv's), cuSPARSE as decided (16)
@pytest.mark.parametrize("spelling, n", [(s, n) for s in ("matmul", "mm", "sparse.mm") for n in (KERNEL_N, 16)]
                         + [("matmul", 1), ("mv", 1)])
def test_an_eager_product_of_a_matrix_is_served_in_cxx_after_the_first(runtime, poison_uninitialized, n, spelling):
    M, A = _csr()
    product = {"matmul": lambda X: A @ X, "mm": lambda X: torch.mm(A, X),
               "sparse.mm": lambda X: torch.sparse.mm(A, X), "mv": lambda X: torch.mv(A, X)}[spelling]
    for call in range(3):
        X = _operand("spmv" if n == 1 else "spmm", A, n, seed=call)
        before = _counts()
        got = product(X)
        torch.cuda.synchronize()
        served = tuple(a - b for a, b in zip(_counts(), before))
        want = torch.from_numpy(np.asarray(M @ X.cpu().double().numpy()))
        assert_close_to_reference(got, want, torch.float32)
        if call == 0:
            assert served == (0, 0)  # the Python path decides and records
        else:  # C++: the installed kernel (KERNEL_N and spmv), else cuSPARSE as decided
            assert served == ((1, 0) if n in (KERNEL_N, 1) else (0, 1))


def test_the_eager_door_declines_what_python_must_see(runtime, poison_uninitialized):
    M, A = _csr()
    A = ts.CSRMatrix(A.crow, A.col, A.val, tuple(A.shape))  # on indices the caller holds, and writes below
    dense = torch.from_numpy(M.toarray()).float().cuda()
    X = _operand("spmm", A, KERNEL_N, seed=1)
    A @ X  # recorded
    before = _counts()

    Xg = X.clone().requires_grad_()
    (A @ Xg).sum().backward()  # autograd sees it: the gradient is right
    torch.testing.assert_close(Xg.grad, dense.t() @ torch.ones(M.shape[0], KERNEL_N, device="cuda"))
    torch.cuda.synchronize()
    # inside autograd's node, grad mode is off: the forward's recorded spmm is C++'s; the backward's
    # spmm_transposed ran in Python for the first time (recorded now)
    assert _counts() == (before[0] + 1, before[1])
    before = _counts()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        assert (A @ X).dtype == torch.bfloat16  # autocast's dtype, as torch.mm gives
    with torch.no_grad():
        A.col[0] = (A.col[0] + 1) % M.shape[1]  # an in-place change of the pattern
    changed = torch.sparse_csr_tensor(A.crow.cpu(), A.col.cpu(), A.val.cpu(), tuple(A.shape)).to_dense().cuda()
    torch.testing.assert_close(A @ X, changed @ X)  # the new pattern, validated and decided again
    torch.cuda.synchronize()
    assert _counts() == before  # both ran through Python

    B = ts.csr(M, dtype=torch.float32, device="cuda")
    B.requires_grad = True
    B @ X
    assert "_door" not in B.__dict__  # a matrix that requires grad never takes the eager door


@pytest.mark.parametrize("op", ["spmm", "spmv", "spmm_transposed", "spmv_transposed"])
def test_the_public_operators_run_their_cuda_calls_in_cxx(runtime, poison_uninitialized, op):
    """``torch.ops.sparserl.<op>`` eager, then under autograd: C++ serves from the second call."""
    M = make_pattern("random")
    crow, col, val = to_parts(M, torch.float32, torch.int32, "cuda")
    public = getattr(torch.ops.sparserl, op)
    served = []
    for call in range(3):
        X = _operand(op, M, KERNEL_N, seed=call).requires_grad_(call == 2)
        before = _counts()
        got = public(crow, col, val, M.shape[1], X)
        torch.cuda.synchronize()
        served.append(sum(a - b for a, b in zip(_counts(), before)))
        assert_close_to_reference(got, _want(op, crow, col, val, M.shape[1], X), torch.float32)
    assert served == [0, 1, 1]
    got.sum().backward()  # the backward's products are right too
    ones = torch.ones(got.shape, dtype=torch.float64)
    want = _want(op.replace("_transposed", "") if op.endswith("_transposed") else op + "_transposed",
                 crow, col, val, M.shape[1], ones.cuda().float())
    assert_close_to_reference(X.grad, want.reshape(X.shape), torch.float32)


def test_cusparse_is_called_directly():
    """Where the runtime decided for cuSPARSE, C++ calls it with descriptors it keeps (the tests
    above check the results); this machine's build found the cuSPARSE header and library."""
    assert fastpath.cusparse_direct(), fastpath.status()


@pytest.mark.parametrize("preprocess", [True, False])
def test_cusparse_spmv_stays_correct_as_values_operands_and_streams_change(tmp_path, poison_uninitialized,
                                                                          preprocess):
    """A vendor SpMV entry preprocesses once (its workspace kept) and then serves calls whose
    values are written in place or replaced, on fresh vectors; a call on another stream or
    under graph capture is served through at::addmv instead, and is as correct."""
    was = torch.ops.sparserl_fastpath.cusparse_preprocess(preprocess)
    runtime = rt.Runtime(JitOptions(mode="off"), cache=KernelCache(tmp_path))
    previous = rt.set_active(runtime)
    try:
        M = sp.random(3000, 2000, density=0.004, random_state=np.random.default_rng(11), format="csr")
        M.data[:] = np.random.default_rng(12).standard_normal(M.nnz)
        A = ts.csr(M, dtype=torch.float32, device="cuda")

        def check(x, stream=None):
            want = torch.from_numpy(np.asarray(as_float64_scipy(A.crow, A.col, A.val, 2000) @ x.cpu().double().numpy()))
            stream = stream or torch.cuda.current_stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                got = A @ x
            torch.cuda.synchronize()
            assert_close_to_reference(got, want, torch.float32)

        check(_operand("spmv", M, 1, seed=0))  # Python serves and records
        served = _counts()[1]
        for call in range(1, 6):
            if call == 2:
                A.val.mul_(-0.5)  # the values written in place
            if call == 4:
                A.val.copy_(torch.randn_like(A.val))
            check(_operand("spmv", M, 1, seed=call))
        assert _counts()[1] - served == 5  # all of them C++'s, through cuSPARSE
        check(_operand("spmv", M, 1, seed=9), stream=torch.cuda.Stream())
        graph_x = _operand("spmv", M, 1, seed=10)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            A @ graph_x  # warm-up on the capture's stream
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = A @ graph_x
        graph_x.copy_(_operand("spmv", M, 1, seed=11))
        graph.replay()
        torch.cuda.synchronize()
        want = as_float64_scipy(A.crow, A.col, A.val, 2000) @ graph_x.cpu().double().numpy()
        assert_close_to_reference(captured, torch.from_numpy(np.asarray(want)), torch.float32)
    finally:
        torch.ops.sparserl_fastpath.cusparse_preprocess(was)
        rt.set_active(previous)
        runtime.close()


@pytest.mark.parametrize("vector", [False, True])
def test_eager_products_with_the_transpose_are_served_in_cxx_on_a_square_matrix(runtime, poison_uninitialized,
                                                                                 vector):
    """``X @ A`` runs Aᵀ's product: on a square matrix its operands fit A's own product too, and
    C++ must serve the transposed entry, not A's."""
    M = sp.random(64, 64, density=0.1, random_state=np.random.default_rng(5), format="csr")
    M.data[:] = np.random.default_rng(6).standard_normal(M.nnz)
    A = ts.csr(M, dtype=torch.float32, device="cuda")
    A @ _operand("spmv" if vector else "spmm", M, KERNEL_N, seed=0)  # A's own product recorded first
    for call in range(3):
        G = _operand("spmv" if vector else "spmm", M, KERNEL_N, seed=call + 1)
        before = _counts()
        got = G @ A if vector else G.t() @ A
        torch.cuda.synchronize()
        want = (M.T @ G.cpu().double().numpy()).T
        assert_close_to_reference(got, torch.from_numpy(np.asarray(want)), torch.float32)
        assert (sum(_counts()) - sum(before)) == (0 if call == 0 else 1)


@pytest.mark.parametrize("admit_calls", [1, 3])
def test_a_host_sampled_matrix_is_multiplied_without_waiting_for_the_gpu(tmp_path, poison_uninitialized,
                                                                        admit_calls):
    """A mini-batch step: ``ts.csr`` of host indices (checked on the host, sent pinned) and its
    first product, served by cuSPARSE while the product is not admitted or its decision runs in
    the background, make no synchronizing call."""
    runtime = rt.Runtime(JitOptions(mode="background", admit_calls=admit_calls, admit_age_s=0),
                         cache=KernelCache(tmp_path), specializer=_specializer)
    previous = rt.set_active(runtime)
    try:
        X = _operand("spmm", make_pattern("random"), 16, seed=0)
        ts.csr(make_pattern("random", seed=1), dtype=torch.float32, device="cuda") @ X  # warm-up
        runtime.wait()
        M = make_pattern("random", seed=2)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")  # a synchronizing call raises
        try:
            A = ts.csr(M, dtype=torch.float32, device="cuda")
            got = A @ X
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        assert_close_to_reference(got, torch.from_numpy(np.asarray(as_float64_scipy(
            A.crow, A.col, A.val, M.shape[1]) @ X.cpu().double().numpy())), torch.float32)
        runtime.wait()
    finally:
        rt.set_active(previous)
        runtime.close()


def test_host_costs_are_measured_through_the_library():
    """What the runtime's end-to-end gate weighs: this process's host µs per call of the door,
    an allocation, a launch and a cuSPARSE call of each product, all measured."""
    from torch_sparserl.jit import endtoend

    costs = endtoend.host_costs(torch.device("cuda", torch.cuda.current_device()))
    assert costs is not None
    assert 0 < costs.door_us < 100 and 0 < costs.alloc_us < 100 and 0 < costs.launch_us < 100
    assert set(costs.cusparse_us) == {"spmv", "spmm"}
    assert all(costs.launch_us < us < 1000 for us in costs.cusparse_us.values())
    assert endtoend.host_costs(torch.device("cuda", torch.cuda.current_device())) is costs  # once per device


def test_an_eager_process_takes_the_door_without_asking(tmp_path):
    """A process that only runs eager products (no compile, no prewarm) loads the built library
    with its first CUDA product, and C++ serves from the call after the one Python recorded."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent("""
        import torch, torch_sparserl as ts
        from helpers import make_pattern
        from torch_sparserl.jit import fastpath
        A = ts.csr(make_pattern("random"), dtype=torch.float32, device="cuda")
        X = torch.randn(A.shape[1], 16, device="cuda")
        A @ X  # loads the library, then Python serves and records
        before = fastpath.COUNTS.clone()
        A @ X
        print("served", int((fastpath.COUNTS - before).sum()), fastpath.loaded)
    """)
    env = {**os.environ, "SPARSERL_JIT": "off",  # no decision lands between the two calls
           "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "served 1 True" in done.stdout, done.stdout + done.stderr[-2000:]


def test_bare_launches_of_a_served_kernel_are_timed_and_nothing_else_is(runtime):
    """The benchmarks' floor: host µs per bare launch of the kernel C++ serves these operands with;
    operands no kernel entry serves are refused by name."""
    M = make_pattern("random")
    crow, col, val = to_parts(M, torch.float32, torch.int32, "cuda")
    bare = torch.ops.sparserl_fastpath.bare_launch_us
    X = _operand("spmm", M, KERNEL_N, seed=0)
    FAST.spmm(crow, col, val, M.shape[1], X)  # recorded: the kernel of KERNEL_N
    us = bare(crow, col, val, M.shape[1], X, fastpath.OPS.index("spmm"), 100)
    assert 0 < us < 1000
    X16 = _operand("spmm", M, 16, seed=0)
    FAST.spmm(crow, col, val, M.shape[1], X16)  # recorded: cuSPARSE
    with pytest.raises(RuntimeError, match="no kernel entry serves these operands"):
        bare(crow, col, val, M.shape[1], X16, fastpath.OPS.index("spmm"), 100)


def test_eager_training_steps_run_their_products_in_cxx(runtime):
    """An eager step on a matrix whose values train: the forward's spmm and the values' sddmm
    are served in C++ from the second step, the backward's spmm_transposed from the third (the
    first runs on cuSPARSE without a transpose, the second computes it and records); the
    gradients match float64."""
    M = make_pattern("random")
    val = torch.tensor(M.data, dtype=torch.float32, device="cuda", requires_grad=True)
    A = ts.CSRMatrix(torch.tensor(M.indptr, device="cuda"), torch.tensor(M.indices, device="cuda"), val, M.shape)
    served = []
    for step in range(3):
        X = _operand("spmm", M, KERNEL_N, seed=step).requires_grad_()
        before = _counts()
        (A @ X).sum().backward()
        torch.cuda.synchronize()
        served.append(sum(_counts()) - sum(before))
        ones = np.ones((M.shape[0], KERNEL_N))
        assert_close_to_reference(X.grad, torch.from_numpy(M.T @ ones), torch.float32)
        val.grad = None
    assert served == [0, 2, 3]


def _small_segments(key, crow, col, ncols):
    """rowchunks cut into segments of at most 3 nonzeros: most rows of the test pattern are hubs,
    stored from the kept workspace (work_init=once)."""
    spec = families.render("rowchunks", {"seg": 3}, op=key.op, dtype=key.dtype, n=key.n)
    return CacheEntry(key, spec.source, family="rowchunks", reason="chosen by the test")


@pytest.mark.parametrize("n", [1, KERNEL_N])
def test_a_kept_workspace_serves_call_after_call_on_its_stream_and_a_fresh_one_elsewhere(tmp_path,
                                                                                        poison_uninitialized, n):
    """A kernel whose hub rows meet in a workspace it leaves zero (rowchunks) is launched from C++
    with no zero-fill: one workspace, zeroed once, kept on the stream it was made on. Every call
    stays right, on that stream, on another (a fresh workspace) and back; empty rows are written."""
    runtime = rt.Runtime(JitOptions(mode="sync"), cache=KernelCache(tmp_path), specializer=_small_segments)
    previous = rt.set_active(runtime)
    try:
        M = make_pattern("short and huge rows", seed=5)  # rows of 0, 1-3, 150 and 300 nonzeros
        assert (np.diff(M.indptr) == 0).any() and (np.diff(M.indptr) > 3).sum() >= 2
        A = ts.csr(M, dtype=torch.float32, device="cuda")
        plan = None
        side = torch.cuda.Stream()
        for seed, stream in enumerate([None] * 5 + [side] * 3 + [None] * 2):
            X = _operand("spmv" if n == 1 else "spmm", A, n, seed)
            before = _counts()
            with torch.cuda.stream(stream or torch.cuda.current_stream()):
                if stream is not None:
                    stream.wait_stream(torch.cuda.default_stream())
                got = A @ X
            torch.cuda.synchronize()
            assert_close_to_reference(got.cpu(), _want("spmv" if n == 1 else "spmm", A.crow, A.col, A.val,
                                                       M.shape[1], X), torch.float32)
            if seed:
                assert _counts() == (before[0] + 1, before[1]), seed  # the kernel, from C++
            plan = plan or runtime.explain("spmv" if n == 1 else "spmm", patterns.lookup(A.crow, A.col, M.shape[1]),
                                           n, torch.float32)
        assert "rowchunks" in plan
    finally:
        rt.set_active(previous)
        runtime.close()


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n", [1, KERNEL_N])
@pytest.mark.parametrize("transposed", [False, True])
def test_cusparse_once_multiplies_by_a_and_its_transpose(poison_uninitialized, index_dtype, dtype, n, transposed):
    """A @ X and Aᵀ @ X by cuSPARSE on A's own arrays, with nothing kept (no transpose computed);
    the half types as they lie, summed in float32."""
    M = make_pattern("short and huge rows", seed=8)
    crow, col, val = to_parts(M, dtype, index_dtype, "cuda")
    A = as_float64_scipy(crow, col, val, M.shape[1])
    A = A.T if transposed else A
    G = torch.randn(A.shape[1], n, dtype=dtype, device="cuda")
    G = G[:, 0].contiguous() if n == 1 else G
    got = fastpath.cusparse_once(crow, col, val, M.shape[1], G, transposed)
    torch.cuda.synchronize()
    assert_close_to_reference(got.cpu(), torch.from_numpy(np.asarray(A @ G.double().cpu().numpy())), dtype)
    # not here: Python's (a type cuSPARSE is not called with; wrong sizes are the operators' to name)
    assert fastpath.cusparse_once(crow, col, val.to(torch.int32), M.shape[1], G.to(torch.int32), transposed) is None
    wrong = torch.zeros(A.shape[1] + 1, *G.shape[1:], dtype=dtype, device="cuda")
    assert fastpath.cusparse_once(crow, col, val, M.shape[1], wrong, transposed) is None


@pytest.mark.parametrize("vector", [False, True])
def test_a_one_off_patterns_backward_runs_without_its_transpose(runtime, poison_uninitialized, vector):
    """The first transposed product of a pattern (a sampled mini-batch's backward) is cuSPARSE's
    on the pattern itself; the second computes the transpose; deterministic mode always does."""
    M = make_pattern("short and huge rows", seed=9)
    dense = torch.from_numpy(M.toarray()).double()
    for deterministic in (False, True):
        A = ts.csr(M, dtype=torch.float32, device="cuda")
        before = patterns.stats()
        torch.use_deterministic_algorithms(deterministic, warn_only=True)
        for call in range(2):
            X = torch.randn(M.shape[1], *(() if vector else (KERNEL_N,)), device="cuda", requires_grad=True)
            (A @ X).sum().backward()
            torch.cuda.synchronize()
            ones = torch.ones(M.shape[0], *(() if vector else (KERNEL_N,)), dtype=torch.float64)
            assert_close_to_reference(X.grad.cpu(), dense.t() @ ones, torch.float32)
            stats = patterns.stats()
            avoided = stats["transposes_avoided"] - before["transposes_avoided"]
            computed = stats["transposes"] - before["transposes"]
            assert (avoided, computed) == ((0, 1) if deterministic else (1, call)), (deterministic, call)


@pytest.mark.parametrize("n", [KERNEL_N, 16])
def test_sddmm_is_served_in_cxx_after_the_first_call(runtime, poison_uninitialized, n):
    """sparserl::sddmm's CUDA calls: Python serves and records the first, C++ the later ones where
    a kernel is installed (C = KERNEL_N); cuSPARSE's SDDMM (C = 16) stays in Python."""
    from helpers import ref_sddmm

    A = make_pattern("short and huge rows", seed=3)
    crow, col, _ = to_parts(A, torch.float32, torch.int32, "cuda")
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        Y = torch.randn(A.shape[0], n, generator=g).cuda()
        X = torch.randn(A.shape[1], n, generator=g).cuda()
        before = _counts()
        out = torch.ops.sparserl.sddmm(crow, col, Y, X)
        torch.cuda.synchronize()
        served = tuple(a - b for a, b in zip(_counts(), before))
        assert served == ((1, 0) if seed and n == KERNEL_N else (0, 0)), (seed, served)
        assert_close_to_reference(out.cpu(), ref_sddmm(crow, col, Y, X), torch.float32)
    # a changed Y shape (other rows) is not the entry's: Python raises the operator's error
    with pytest.raises((ValueError, RuntimeError), match="sddmm"):
        torch.ops.sparserl.sddmm(crow, col, Y[:-1], X)


def test_patterns_younger_than_admit_age_leave_nothing_behind(tmp_path, poison_uninitialized):
    """Mini-batch training with admit_age_s: every step's new pattern is served by cuSPARSE,
    forward and backward, correct against float64, with no decision, no C++ entry and nothing
    queued (two young calls per step: the forward and the backward's transposed product, which
    computes the transpose under poison_uninitialized's deterministic mode); a pattern old enough
    is decided and served from C++ after that."""
    runtime = rt.Runtime(JitOptions(mode="background", admit_age_s=60.0), cache=KernelCache(tmp_path),
                         specializer=_specializer)
    previous = rt.set_active(runtime)
    try:
        fastpath.forget()
        for seed in range(3):
            M = make_pattern("random", seed=20 + seed)
            A = ts.csr(M, dtype=torch.float32, device="cuda")
            X = torch.randn(M.shape[1], KERNEL_N, device="cuda", requires_grad=True)
            (A @ X).sum().backward()
            torch.cuda.synchronize()
            ones = np.ones((M.shape[0], KERNEL_N))
            assert_close_to_reference(X.grad.cpu(), torch.from_numpy(M.T @ ones), torch.float32)
        assert fastpath.entries() == 0 and runtime.stats["young_calls"] == 6 and runtime.stats["installs"] == 0
        entry = patterns.lookup(A.crow, A.col, A.shape[1])
        entry.created -= 61.0  # as if it had lived a minute
        A @ X.detach()
        runtime.wait(60)
        assert runtime.stats["installs"] == 1
        A @ X.detach()  # recorded by this call, served in C++ from the next
        before = sum(_counts())
        Y = A @ X.detach()
        assert sum(_counts()) == before + 1
        assert_close_to_reference(Y.cpu(), _want("spmm", A.crow, A.col, A.val, A.shape[1], X.detach()), torch.float32)
    finally:
        rt.set_active(previous)
        runtime.close()


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_large_host_arrays_are_checked_on_several_threads(index_dtype):
    """Indices past stage_csr's threading threshold (2^18 elements) arrive intact, and a bad
    value is found wherever it lies: a column at either end, a row pointer that decreases inside
    a block or across the boundary of two blocks or two threads' chunks."""
    rows, nnz, ncols = 150_000, 450_000, 70_000
    rng = np.random.default_rng(5)
    crow = np.sort(rng.integers(0, nnz + 1, rows + 1))
    crow[0], crow[-1] = 0, nnz
    col = rng.integers(0, ncols, nnz)
    make = lambda c, k: ts.csr((torch.tensor(c, dtype=index_dtype).pin_memory(),
                                torch.tensor(k, dtype=index_dtype).pin_memory(),
                                torch.ones(nnz).pin_memory()), (rows, ncols), device="cuda")
    A = make(crow, col)
    assert torch.equal(A.crow.cpu(), torch.tensor(crow, dtype=index_dtype))
    assert torch.equal(A.col.cpu(), torch.tensor(col, dtype=index_dtype))
    for where in (0, nnz - 1, nnz // 2):
        bad = col.copy()
        bad[where] = ncols if where else -1
        with pytest.raises(ValueError, match=rf"torch_sparserl.csr: col must be .* \(got col\[{where}\]"):
            make(crow, bad)
    threads = torch.get_num_interop_threads()
    chunk = -(-(rows + 1 + nnz) // max(1, min((rows + 1 + nnz) >> 17, threads)))
    for at in sorted({8192, 8193, 5 * 8192, 77_777, chunk, chunk + 1} & set(range(1, rows))):
        bad = crow.copy()
        bad[at] = bad[at - 1] - 1  # a decrease from at - 1 to at
        with pytest.raises(ValueError, match=rf"crow must be non-decreasing \(got crow\[{at - 1}\]"):
            make(bad, col)


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_host_arrays_travel_checked_in_one_pass(poison_uninitialized, monkeypatch, index_dtype):
    """ts.csr of pinned host arrays bound for CUDA, the library loaded: C++ copies and checks the
    indices in one pass (Python's check is not called) into tensors of their own; the products
    read what was checked whatever the caller writes afterwards; bad indices are named as in
    Python; a compiled step finds the pattern validated (no device check per batch)."""
    from torch_sparserl.tensor import construct

    python_checks = []
    real = construct.check_csr_values
    monkeypatch.setattr(construct, "check_csr_values", lambda *a: python_checks.append(1) or real(*a))
    M = make_pattern("random", seed=3)
    crow = torch.tensor(M.indptr, dtype=index_dtype).pin_memory()
    col = torch.tensor(M.indices, dtype=index_dtype).pin_memory()
    val = torch.tensor(M.data, dtype=torch.float32).pin_memory()
    A = ts.csr((crow, col, val), M.shape, device="cuda")
    assert python_checks == [] and A._crow._base is None and A._col._base is None
    assert patterns.validated(A._crow, A._col, M.shape[1]) is not None
    crow.zero_()  # the caller's arrays, rewritten
    col.fill_(M.shape[1] + 5)
    val.fill_(float("nan"))
    X = torch.randn(M.shape[1], 8, device="cuda")
    want = as_float64_scipy(torch.tensor(M.indptr), torch.tensor(M.indices), torch.tensor(M.data, dtype=torch.float32),
                            M.shape[1]) @ X.double().cpu().numpy()
    assert_close_to_reference((A @ X).cpu(), torch.from_numpy(np.asarray(want)), torch.float32)
    bad = torch.tensor(M.indices, dtype=index_dtype)
    bad[-1] = M.shape[1]
    with pytest.raises(ValueError, match=r"torch_sparserl.csr: col must be < ncols"):
        ts.csr((torch.tensor(M.indptr, dtype=index_dtype), bad, torch.ones(M.nnz)), M.shape, device="cuda")
    assert python_checks == [1]  # declined by C++, named by Python
    device_checks = []
    monkeypatch.setattr(pattern_table, "check_csr_values", lambda *a: device_checks.append(1))
    step = torch.compile(lambda A, X: A @ X, backend="sparserl", dynamic=True)
    for seed in range(3):  # a new matrix each step, as in mini-batch training
        B = ts.csr(make_pattern("random", seed=10 + seed), dtype=torch.float32, device="cuda")
        step(B, torch.randn(B.shape[1], 8, device="cuda"))
    assert device_checks == []


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_a_staged_young_pattern_is_served_by_cusparse_in_cxx(tmp_path, monkeypatch, poison_uninitialized,
                                                              index_dtype):
    """ts.csr's short path, background mode: while the pattern is younger than admit_age_s, C++
    serves its products (the eager door, the operators, sparserl_fast) and its first transposed
    product by cuSPARSE, with no call of the Python runtime, right against float64 (outputs
    NaN-filled where allocated) and counted as young calls. A transposed product under
    deterministic algorithms or after the first, a write to the indices and the deadline passed
    go to Python, as does everything with class kernels on."""
    runtime = rt.Runtime(JitOptions(mode="background", admit_age_s=60.0), cache=KernelCache(tmp_path),
                         specializer=_specializer)
    previous = rt.set_active(runtime)
    asked = []
    real_call = rt.Runtime.call
    monkeypatch.setattr(rt.Runtime, "call", lambda self, op, *a: asked.append(op) or real_call(self, op, *a))
    try:
        fastpath.forget()
        M = make_pattern("random", seed=31)
        crow, col, val = to_parts(M, torch.float32, index_dtype, "cpu")
        A = ts.csr((crow, col, val), M.shape, device="cuda")
        assert torch.ops.sparserl_fastpath.young_patterns() == 1
        ncols = M.shape[1]
        X = _operand("spmm", M, 16, 0)
        G = _operand("spmm_transposed", M, 16, 1)
        before = fastpath.COUNTS.clone()
        # the operators on the matrix's own parts, as a compiled graph of it passes them
        got = {"A @ X": (A @ X, "spmm", X), "A @ x": (A @ X[:, 0].contiguous(), "spmv", X[:, 0]),
               "sparserl::spmm": (torch.ops.sparserl.spmm(A._crow, A._col, A.val, ncols, X), "spmm", X),
               "sparserl_fast::spmv": (FAST.spmv(A._crow, A._col, A.val, ncols, X[:, 1].contiguous()), "spmv",
                                       X[:, 1])}
        torch.cuda.synchronize()
        for name, (out, op, operand) in got.items():
            assert_close_to_reference(out, _want(op, A.crow, A.col, A.val, ncols, operand), torch.float32), name
        assert asked == [] and (fastpath.COUNTS - before).tolist() == [0, 4, 4]
        assert runtime.stats["young_calls"] == 4 and runtime.stats["fallback_calls"] == 4
        transposed = lambda: FAST.spmm_transposed(A._crow, A._col, A.val, ncols, G)  # noqa: E731
        want_t = _want("spmm_transposed", A.crow, A.col, A.val, ncols, G)
        torch.use_deterministic_algorithms(False)  # cuSPARSE's transposed products are not deterministic
        assert_close_to_reference(transposed(), want_t, torch.float32)  # the first: C++
        assert (fastpath.COUNTS - before).tolist() == [0, 5, 5]
        assert_close_to_reference(transposed(), want_t, torch.float32)  # the second: Python's
        assert (fastpath.COUNTS - before).tolist() == [0, 5, 5]
        B = ts.csr((crow, col, val), M.shape, device="cuda")
        B._col.add_(0)  # a write to the staged indices themselves (no caller reaches them: defence in depth)
        assert_close_to_reference(B @ X, _want("spmm", B.crow, B.col, B.val, ncols, X), torch.float32)
        assert asked == ["spmm"] and (fastpath.COUNTS - before).tolist() == [0, 5, 5]
    finally:
        rt.set_active(previous)
        runtime.close()
    for settings in ({"admit_age_s": 0.05}, {"admit_age_s": 60.0, "class_after": 16}):
        runtime = rt.Runtime(JitOptions(mode="background", **settings), cache=KernelCache(tmp_path),
                             specializer=_specializer)
        previous = rt.set_active(runtime)
        try:
            asked.clear()
            A = ts.csr((crow, col, val), M.shape, device="cuda")
            time.sleep(0.1)
            before = fastpath.COUNTS.clone()
            assert_close_to_reference(A @ X, _want("spmm", A.crow, A.col, A.val, ncols, X), torch.float32)
            assert asked == ["spmm"] and int((fastpath.COUNTS - before)[2]) == 0, settings
        finally:
            rt.set_active(previous)
            runtime.close()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 16, 64])
def test_half_products_by_cusparse_are_served_in_cxx_with_float32_sums(poison_uninitialized, dtype, n):
    """A half-type product the runtime leaves to cuSPARSE (here: the runtime off) is served from
    C++ after the first call, with cuSPARSE summing in float32 on the half operands as they lie:
    no widened copies. A row of 4096 ones sums to 4096 exactly (a float16 sum stops at 2048, and
    torch's own float16 product through cuSPARSE does not get there), and every row is within
    the half type's tolerance of float64."""
    rng = np.random.default_rng(7)
    rows, cols = 300, 5000
    rest = sp.random(rows - 1, cols, density=0.01, format="csr", random_state=rng)
    rest.data = rng.standard_normal(rest.nnz)
    ones = sp.csr_matrix((np.ones(4096), np.arange(4096), [0, 4096]), shape=(1, cols))
    M = sp.vstack([ones, rest]).tocsr()  # row 0: 4096 ones
    runtime = rt.Runtime(JitOptions(mode="off"))
    previous = rt.set_active(runtime)
    try:
        A = ts.csr(M, dtype=dtype, device="cuda")
        for call in range(3):
            shape = (cols, n) if n > 1 else (cols,)
            X = torch.randn(*shape, generator=torch.Generator().manual_seed(call), dtype=torch.float64)
            X[:4096] = 1.0
            X = X.to(dtype).cuda()
            before = _counts()
            Y = A @ X
            torch.cuda.synchronize()
            served = tuple(a - b for a, b in zip(_counts(), before))
            assert Y.dtype == dtype and Y.shape == ((rows, n) if n > 1 else (rows,))
            want = _want("spmm", A._crow, A._col, A.val, cols, X)
            assert_close_to_reference(Y.cpu(), want.reshape(Y.shape), dtype)
            assert bool((Y.reshape(rows, -1)[0].float() == 4096).all()), Y.reshape(rows, -1)[0]
            assert served == ((0, 0) if call == 0 else (0, 1)), (call, served)
    finally:
        rt.set_active(previous)
        runtime.close()
