"""torch.compile: the backend, CSRMatrix traced whole, raw sparse inputs, torch_sparserl.compile."""

import logging
import re
import subprocess
import sys
import textwrap

import pytest
import torch

import torch_sparserl as ts
from torch_sparserl.compiler import passes
from torch_sparserl.dtypes import assert_close_to_reference
from torch_sparserl.tensor import intercept

from helpers import make_pattern

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("fresh_dynamo")]


class GCN(torch.nn.Module):
    def __init__(self, features=12, hidden=16, classes=5):
        super().__init__()
        self.lin1 = torch.nn.Linear(features, hidden)
        self.lin2 = torch.nn.Linear(hidden, classes)

    def forward(self, x, adj):
        h = torch.relu(adj @ self.lin1(x))
        return torch.sparse.mm(adj, self.lin2(h))


def _graph_data(device, dtype=torch.float32):
    A = make_pattern("cora (real)", seed=51)
    x = torch.randn(A.shape[0], 12, dtype=dtype, device=device)
    return A, x


def _grads(model):
    return {name: p.grad.detach().clone() for name, p in model.named_parameters()}


def test_gcn_fullgraph_matches_eager(device):
    A, x = _graph_data(device)
    adj = ts.csr(A, dtype=torch.float32, device=device)
    model = GCN().to(device)
    eager = model(x, adj)
    eager.square().mean().backward()
    eager_grads = _grads(model)
    model.zero_grad()

    compiled = torch.compile(model, backend="sparserl", fullgraph=True)
    for _ in range(2):  # the second call runs the cached graph
        model.zero_grad()
        out = compiled(x, adj)
        out.square().mean().backward()
    assert sum(torch._dynamo.utils.counters["graph_break"].values()) == 0
    assert_close_to_reference(out, eager.double())
    for name, grad in _grads(model).items():
        assert_close_to_reference(grad, eager_grads[name].double())


def test_explain_reports_no_graph_break():
    A, x = _graph_data("cpu")
    explanation = torch._dynamo.explain(GCN())(x, ts.csr(A, dtype=torch.float32))
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1


def test_value_gradients_compiled(device):
    A, x = _graph_data(device)
    adj = ts.csr(A, dtype=torch.float32, device=device)
    w = torch.rand(adj.nnz, device=device, requires_grad=True)

    def loss(weights, features):
        return (adj.with_values(weights) @ features).square().sum()

    loss(w, x).backward()
    eager = w.grad.clone()
    w.grad = None
    torch.compile(loss, backend="sparserl", fullgraph=True)(w, x).backward()
    assert_close_to_reference(w.grad, eager.double())

    w.grad = None
    weighted = adj.with_values(w)
    torch.compile(lambda a, f: (a @ f).square().sum(), backend="sparserl", fullgraph=True)(weighted, x).backward()
    assert_close_to_reference(w.grad, eager.double())


def test_post_grad_pass_sees_sparse_ops():
    A, x = _graph_data("cpu")
    model = GCN()
    passes.REPORTS.clear()
    with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
        out = torch.compile(model, backend="sparserl", fullgraph=True)(x, ts.csr(A, dtype=torch.float32))
        out.sum().backward()
    seen = [op for report in passes.REPORTS for op in report.ops()]
    assert seen.count("spmm") == 2, seen  # forward: both layers
    assert "spmm_transposed" in seen, seen  # backward: Aᵀ @ dY on the cached transposed pattern
    forward = next(r for r in passes.REPORTS if "spmm" in r.ops())
    assert any("relu" in c for site in forward.sites for c in site.consumers)


@pytest.mark.parametrize("options,namespace", [({}, "sparserl_fast"), ({"fast_path": False}, "sparserl_direct"),
                                               ({"direct_ops": False}, "sparserl")])
def test_compiled_graphs_call_the_implementation_twins(options, namespace):
    """The post-grad pass points the differentiated graphs' products at sparserl_fast::* (the
    C++ fast path's operators), or with fast_path off at sparserl_direct::* (no autograd
    layers either); gradients are those of float64 every way."""
    from torch._inductor.utils import run_and_get_code

    A, x = _graph_data("cpu", torch.float64)
    model = GCN().double()
    adj = ts.csr(A, dtype=torch.float64)
    model(x, adj).square().sum().backward()
    want = _grads(model)
    model.zero_grad()
    compiled = torch.compile(model, backend="sparserl", fullgraph=True, options=options)

    def step():
        compiled(x, adj).square().sum().backward()

    with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
        _, codes = run_and_get_code(step)
    code = "\n".join(codes)
    calls = set(re.findall(r"torch\.ops\.(sparserl\w*)\.(spmm\w*)\.default", code))
    assert calls == {(namespace, "spmm"), (namespace, "spmm_transposed")}, code  # the backward graph's too
    for name, grad in _grads(model).items():
        assert_close_to_reference(grad, want[name])


def test_backend_found_by_name_without_import():
    code = textwrap.dedent("""
        import sys, torch
        assert "torch_sparserl" not in sys.modules
        assert "sparserl" in torch._dynamo.list_backends()
        f = torch.compile(lambda x: torch.sin(x) * 2, backend="sparserl")
        x = torch.randn(8)
        assert torch.allclose(f(x), torch.sin(x) * 2)
        print("ok", "torch_sparserl" in sys.modules)
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["ok", "True"]


def test_never_installed_at_import():
    code = "import torch, torch_sparserl; from torch_sparserl.tensor import intercept; print(intercept.installed())"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert result.stdout.strip() == "False", result.stderr


def _raw_csr(A, device):
    return torch.sparse_csr_tensor(torch.from_numpy(A.indptr), torch.from_numpy(A.indices),
                                   torch.from_numpy(A.data).float(), A.shape).to(device)


def test_raw_csr_under_backend(device, fresh_intercept, caplog):
    A, x = _graph_data(device)
    raw = _raw_csr(A, device)
    model = GCN().to(device)
    eager = model(x, raw)
    before = intercept.stats()["routed"]
    compiled = torch.compile(model, backend="sparserl")
    with caplog.at_level(logging.WARNING, logger="torch_sparserl"):
        for _ in range(3):
            out = compiled(x, raw)
    warnings = [r for r in caplog.records if "Dynamo cannot trace" in r.getMessage()]
    assert len(warnings) == 1
    assert "torch_sparserl.csr(A)" in warnings[0].getMessage()
    assert intercept.stats()["routed"] - before == 6  # two products, three calls
    assert_close_to_reference(out, eager.double())
    # Outside the compiled model torch's own kernel runs, and nothing more is logged.
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="torch_sparserl"):
        routed = intercept.stats()["routed"]
        assert_close_to_reference(torch.sparse.mm(raw, x), torch.from_numpy(A.toarray()) @ x.double().cpu())
        assert intercept.stats()["routed"] == routed and not caplog.records


def test_intercept_respects_options(fresh_intercept):
    A, x = _graph_data("cpu")
    raw = _raw_csr(A, "cpu")
    before = intercept.stats()["routed"]
    torch.compile(GCN(), backend="sparserl", options={"intercept_sparse": False})(x, raw)
    assert intercept.stats()["routed"] == before


def test_intercept_context_manager(device):
    A, x = _graph_data(device)
    raw = _raw_csr(A, device)
    dense = torch.from_numpy(A.toarray()).double()
    assert not intercept.installed()
    with ts.intercept_sparse({"strict": True}):
        assert intercept.installed()
        before = intercept.stats()["routed"]
        y = raw @ x
        v = torch.mv(raw, x[:, 0])
        z = torch.addmm(torch.ones(5, device=device), raw, x[:, :5], beta=0.5)
        # sparse @ sparse is not ours: torch's own kernel answers, with the same result.
        delegated = intercept.stats()["delegated"]
        w = torch.sparse.mm(raw, x.to_sparse_csr()).to_dense()
        assert intercept.stats()["routed"] == before + 3
        assert intercept.stats()["delegated"] > delegated
    assert not intercept.installed()
    xd = x.double().cpu()
    assert_close_to_reference(y, dense @ xd)
    assert_close_to_reference(v, dense @ xd[:, 0])
    assert_close_to_reference(z, 0.5 + dense @ xd[:, :5])
    assert_close_to_reference(w, dense @ xd)


def _eager_sparse_products(raw, x):
    """Eager products torch answers itself while the override is installed (outside a
    compiled model and any intercept_sparse block), with a gradient through them."""
    xg = x.detach().clone().requires_grad_()
    y = torch.sparse.mm(raw, xg)
    y.square().sum().backward()
    csc = raw.to_sparse_csc()
    return [y.detach(), xg.grad, raw @ x, torch.mv(raw, x[:, 0]), torch.addmv(x[:, 1], raw, x[:, 0], beta=0.5, alpha=2),
            torch.addmm(torch.ones(5, device=x.device), raw, x[:, :5], beta=0.5), csc @ x, x.t() @ raw,
            torch.sparse.mm(raw, x.to_sparse_csr()).to_dense()]


def test_products_the_override_leaves_to_torch_match_and_keep_it_installed(device, fresh_intercept):
    """After the backend is named, every eager CSR product of the process passes through the
    override. Those it does not route reach torch's own kernel through the ``out=`` overloads
    (same kernels, equal results), not by taking the override out and putting it back around
    each call (benchmarks/bench_intercept.py times both)."""
    A, x = _graph_data(device)
    raw = _raw_csr(A, device)
    expected = _eager_sparse_products(raw, x)
    intercept.activate_for_backend()
    library = intercept._library
    delegated = intercept.stats()["delegated"]
    got = _eager_sparse_products(raw, x)
    assert intercept._library is library  # never unregistered on the way
    assert intercept.stats()["delegated"] - delegated >= len(expected) - 1
    exact = {"rtol": 0, "atol": 0} if device.type == "cpu" else {}  # cuSPARSE may pick another algorithm
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, **exact)


def test_sparserl_compile_converts_buffers_and_arguments(device, fresh_intercept, caplog):
    A, x = _graph_data(device)
    raw = _raw_csr(A, device)

    class WithBuffer(GCN):
        def __init__(self, adj):
            super().__init__()
            self.register_buffer("adj", adj)

        def forward(self, x):
            return super().forward(x, self.adj)

    model = WithBuffer(raw).to(device)
    eager = model(x)
    compiled = ts.compile(model, fullgraph=True)
    assert isinstance(model.adj, ts.CSRMatrix)
    assert_close_to_reference(compiled(x), eager.double())

    plain = GCN().to(device)
    eager = plain(x, raw)
    with caplog.at_level(logging.WARNING, logger="torch_sparserl"):
        out = ts.compile(plain, fullgraph=True)(x, raw)  # fullgraph would fail on a raw sparse input
    assert_close_to_reference(out, eager.double())
    assert not [r for r in caplog.records if "Dynamo cannot trace" in r.getMessage()]


def test_unknown_option_is_named():
    with pytest.raises(Exception, match=r"unknown option\(s\) \['fast'\]"):
        torch.compile(lambda x: x + 1, backend="sparserl", options={"fast": True})(torch.ones(2))


def test_interception_keeps_nothing_alive():
    import gc
    import weakref

    from torch_sparserl.pattern import cache as pattern_table

    raw = torch.eye(6).to_sparse_csr()
    ref = weakref.ref(raw)
    with ts.intercept_sparse():
        raw @ torch.randn(6, 2)
    del raw
    gc.collect()
    assert ref() is None and len(intercept._views) == 0
    assert all(entry.nrows != 6 for entry in pattern_table._CACHE.values())


def test_a_transpose_under_compile_breaks_the_graph_with_a_reason_and_stays_correct(device):
    """A.t() computes the transposed pattern once and caches it, outside any graph: fullgraph
    refuses it with a message saying what to write instead; without fullgraph it is a graph
    break and the result is right, gradients of the values included; the in-graph form
    (X.t() @ A).t() compiles whole."""
    M = make_pattern("random", seed=7)
    A = ts.csr(M, dtype=torch.float64, device=device)
    w = A.values().detach().clone().requires_grad_()
    X = torch.randn(M.shape[0], 5, dtype=torch.float64, device=device)
    rows = torch.repeat_interleave(torch.arange(M.shape[0], device=device), A.crow.diff().long())
    w_ref = w.detach().clone().requires_grad_()
    dense = torch.zeros(M.shape, dtype=torch.float64, device=device).index_put((rows, A.col.long()), w_ref)
    want = dense.t() @ X
    want.square().sum().backward()

    def transposed(w, X):
        return A.with_values(w).t() @ X

    with pytest.raises(torch._dynamo.exc.Unsupported, match=r"CSRMatrix\.t\(\): .*\(X\.t\(\) @ A\)\.t\(\)"):
        torch.compile(transposed, backend="sparserl", fullgraph=True)(w, X)
    torch._dynamo.reset()
    out = torch.compile(transposed, backend="sparserl")(w, X)
    assert_close_to_reference(out.detach(), want.detach(), torch.float64)
    out.square().sum().backward()
    assert_close_to_reference(w.grad, w_ref.grad, torch.float64)
    torch._dynamo.reset()
    whole = torch.compile(lambda X: (X.t() @ A).t(), backend="sparserl", fullgraph=True)(X)
    assert_close_to_reference(whole, want.detach(), torch.float64)


def test_compiled_code_cache_tells_matrices_of_other_sizes_apart(tmp_path):
    """Inductor's and AOTAutograd's on-disk caches key a CSRMatrix by its shape and its parts'
    sizes: a matrix of the same structure with another nnz gets code of its own, not code
    whose size assertions (or kernels) are those of the first."""
    from torch._inductor.utils import fresh_cache

    def product_of(A, x):
        compiled = torch.compile(lambda f: (A @ f).square().sum(), backend="sparserl", fullgraph=True)
        return compiled(x)

    shape = (40, 40)
    with fresh_cache(dir=str(tmp_path)), torch._functorch.config.patch(enable_autograd_cache=True):
        for density in (0.1, 0.2):
            torch._dynamo.reset()  # no in-memory code: the second matrix goes to the disk caches
            M = torch.rand(shape).lt(density).double() * torch.randn(shape, dtype=torch.float64)
            A, x = ts.csr(M.to_sparse_csr()), torch.randn(40, 3, dtype=torch.float64)
            assert_close_to_reference(product_of(A, x), (M @ x).square().sum())
    first, second = (ts.csr(torch.eye(4).to_sparse_csr()), ts.csr((torch.eye(4) + torch.eye(4).roll(1, 0)).to_sparse_csr()))
    assert first._stable_hash_for_caching() != second._stable_hash_for_caching()
    assert first._stable_hash_for_caching() == ts.csr(torch.eye(4).to_sparse_csr())._stable_hash_for_caching()


@pytest.mark.parametrize("flatten", [True, False])
def test_matrix_inputs_reach_aotautograd_as_their_parts(device, flatten, monkeypatch):
    """With ``flatten_matrices`` (the default) Inductor is handed a CSRMatrix input as its
    crow, col and val (no subclass for AOTAutograd to unwrap per call); each call passes the
    parts of the matrix it was given, also a new matrix on the same code, or of another nnz."""
    import torch._inductor.compile_fx as compile_fx_module

    handed = []
    real = compile_fx_module.compile_fx

    def spy(gm, inputs, **kwargs):
        handed.append([type(t).__name__ for t in inputs])
        return real(gm, inputs, **kwargs)

    monkeypatch.setattr(compile_fx_module, "compile_fx", spy)
    model = GCN().double().to(device)
    compiled = torch.compile(model, backend="sparserl", options={"flatten_matrices": flatten})
    n = 60
    for density, seed in ((0.1, 1), (0.1, 2), (0.25, 3)):  # the second reuses the code, the third has another nnz
        g = torch.Generator().manual_seed(seed)
        M = (torch.rand(n, n, generator=g) < density).double() * torch.randn(n, n, generator=g, dtype=torch.float64)
        adj = ts.csr(M.to_sparse_csr()).to(device)
        x = torch.randn(n, 12, generator=g, dtype=torch.float64).to(device)
        model.zero_grad()
        out = compiled(x, adj)
        out.square().sum().backward()
        got = _grads(model)
        model.zero_grad()
        want = _dense_gcn(model, x, M.to(device))
        want.square().sum().backward()
        assert_close_to_reference(out, want.detach())
        for name, grad in _grads(model).items():
            assert_close_to_reference(got[name], grad)
    assert handed and all(("CSRMatrix" in types) != flatten for types in handed), handed


def _dense_gcn(model, x, M):
    h = torch.relu(M @ model.lin1(x))
    return M @ model.lin2(h)


def test_matrices_whose_values_need_a_gradient_keep_the_subclass_path():
    from torch_sparserl.compiler.flatten import flatten_matrix_inputs

    A, x = _graph_data("cpu", torch.float64)
    adj = ts.csr(A, dtype=torch.float64)
    weighted = adj.with_values(adj.val.clone().requires_grad_())
    seen = {}

    def backend(gm, inputs):
        seen["plain"] = flatten_matrix_inputs(gm, inputs)
        seen["weighted"] = flatten_matrix_inputs(gm, [weighted if t is adj else t for t in inputs])
        return gm

    torch.compile(lambda a, f: a @ f, backend=backend, fullgraph=True)(adj, x)
    flat_gm, flat_inputs, to_flat = seen["plain"]
    assert [type(t) for t in flat_inputs] == [torch.Tensor] * 4  # crow, col, val, x
    assert to_flat([adj, x])[:3] == [adj._crow, adj._col, adj.val]
    assert_close_to_reference(flat_gm(*to_flat([adj, x]))[0], torch.from_numpy(A.toarray()).double() @ x)
    assert seen["weighted"] is None


_FLATTEN_CASES = {
    "the matrix returned": lambda A, B, x: (A @ x, A),
    "its values read": lambda A, B, x: (A @ x) * A.val.sum(),
    "its row pointers read": lambda A, B, x: (A @ x) + (A.crow[1:] - A.crow[:-1]).unsqueeze(1).double(),
    "densified too": lambda A, B, x: A.to_dense() @ x + A @ x,
    "two matrices": lambda A, B, x: A @ x + B @ (A @ x),
}


@pytest.mark.parametrize("case", sorted(_FLATTEN_CASES))
@pytest.mark.parametrize("same", [False, True], ids=["two", "one-twice"])
def test_flattened_matrices_in_unusual_graphs_match_eager(case, same):
    """Graphs that return the matrix, read its parts themselves, or take one matrix as two
    arguments: the flattened graph agrees with eager (and the returned matrix is the input)."""
    g = torch.Generator().manual_seed(7)
    M = (torch.rand(30, 30, generator=g) < 0.2).double() * torch.randn(30, 30, generator=g, dtype=torch.float64)
    A = ts.csr(M.to_sparse_csr())
    B = A if same else ts.csr((2 * M).to_sparse_csr())
    x = torch.randn(30, 4, generator=g, dtype=torch.float64)
    fn = _FLATTEN_CASES[case]
    want, got = fn(A, B, x), torch.compile(fn, backend="sparserl", options={"strict": True})(A, B, x)
    if isinstance(want, tuple):
        assert got[1] is A
        want, got = want[0], got[0]
    assert_close_to_reference(got, want)
