"""Compiled graphs follow every size they depend on (issue 33, class 3).

A CSRMatrix's ``ncols`` lives only in the wrapper's shape, in none of ``crow``, ``col`` and
``val``. The backend's flatten pass once rebuilt the matrix from its parts with the shape of
the example in hand as a constant; once automatic dynamic shapes made the graph symbolic
(the second size), Dynamo no longer guarded that size and every later size reused it:
``(X.t() @ A).t()`` with matrices of 2×4, 2×9, 2×2 gave 4×3, 9×3, 9×3. Each test here
runs a sequence of sizes through one compiled function, compares every call against a float64
reference computed eagerly, and checks that dynamic shapes still spare a recompile per size.
"""

import pytest
import torch

import torch_sparserl as ts
from torch_sparserl.compiler import backend as sparserl_backend
from torch_sparserl.dtypes import assert_close_to_reference

from compile_shapes_cases import DYNAMIC, SEQUENCES, SPELLINGS, _graphs, _matrix, _operand, _run_sequence

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("fresh_dynamo")]


def test_flattened_graph_takes_the_size_from_dynamos_graph():
    """Once the graph is symbolic the matrix is still flattened, rebuilt with the size's
    symbolic inputs, never with a constant of the example's size."""
    from torch_sparserl.compiler.flatten import from_parts

    seen = []
    original = sparserl_backend.flatten_matrix_inputs

    def spy(gm, example_inputs):
        flat = original(gm, example_inputs)
        seen.append(flat)
        return flat

    sparserl_backend.flatten_matrix_inputs = spy
    try:
        compiled = torch.compile(lambda A, X: (X.t() @ A).t(), backend="sparserl", fullgraph=True)
        _run_sequence(compiled, "(X.t() @ A).t()", "issue")
    finally:
        sparserl_backend.flatten_matrix_inputs = original
    assert len(seen) == 2 and all(flat is not None for flat in seen)
    (static_call,) = seen[0][0].graph.find_nodes(op="call_function", target=from_parts)
    (symbolic_call,) = seen[1][0].graph.find_nodes(op="call_function", target=from_parts)
    assert static_call.args[3] == (2, 4)
    nrows, ncols = symbolic_call.args[3]
    assert nrows == 2  # never changed: Dynamo keeps it static and guards it
    assert isinstance(ncols, torch.fx.Node) and ncols.op == "placeholder"
    assert isinstance(ncols.meta["example_value"], torch.SymInt)


@pytest.mark.parametrize("flatten", [True, False], ids=["flattened", "subclass"])
def test_sizes_are_followed_through_the_on_disk_caches(tmp_path, flatten):
    """Run again after ``torch._dynamo.reset()`` the graphs come from Inductor's and
    AOTAutograd's on-disk caches (and Dynamo may start symbolic from what it saw): they
    follow every size too."""
    from torch._inductor.utils import fresh_cache

    with fresh_cache(dir=str(tmp_path)), torch._functorch.config.patch(enable_autograd_cache=True):
        for _ in range(2):
            torch._dynamo.reset()
            compiled = torch.compile(lambda A, X: (X.t() @ A).t() + A.to_dense().sum(), backend="sparserl",
                                     fullgraph=True, options={"flatten_matrices": flatten})
            for step, (nrows, ncols, nnz, n) in enumerate(SEQUENCES["everything"]):
                A, D = _matrix(nrows, ncols, nnz, seed=step)
                X = _operand((nrows, n), seed=100 + step)
                assert_close_to_reference(compiled(A, X), D.t() @ X.double() + D.sum())


@pytest.mark.parametrize("changes", ["issue", "everything"])
def test_transpose_of_the_matrix_follows_every_size(changes):
    """``A.t() @ X`` is a graph break (the transposed pattern is cached outside any graph):
    refused with fullgraph=True, and right at every size without it."""
    fn = lambda A, X: A.t() @ X  # noqa: E731
    A, _ = _matrix(3, 4, 5, seed=0)
    with pytest.raises(torch._dynamo.exc.Unsupported, match="transposed pattern"):
        torch.compile(fn, backend="sparserl", fullgraph=True)(A, torch.randn(3, 2))
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="sparserl")
    for step, (nrows, ncols, nnz, n) in enumerate(SEQUENCES[changes]):
        A, D = _matrix(nrows, ncols, nnz, seed=step)
        X = _operand((nrows, n), seed=100 + step)
        assert_close_to_reference(compiled(A, X), D.t() @ X.double())


class _Propagate(torch.nn.Module):
    """A module holding a sparse buffer: ``Aᵀ(A X)`` on it, with a dense weight."""

    def __init__(self, adj):
        super().__init__()
        self.register_buffer("adj", adj)
        self.weight = torch.nn.Parameter(torch.ones(()))

    def forward(self, x):
        return (((self.adj @ x) * self.weight).t() @ self.adj).t()


@pytest.mark.parametrize("dynamic", sorted(DYNAMIC))
@pytest.mark.parametrize("changes", ["issue", "ncols only", "nrows only", "everything"])
def test_ts_compile_module_with_a_sparse_buffer_follows_every_size(changes, dynamic):
    A, _ = _matrix(*SEQUENCES[changes][0][:3], seed=0)
    model = _Propagate(A.to_dense().to_sparse_csr())
    compiled = ts.compile(model, fullgraph=True, dynamic=DYNAMIC[dynamic])
    assert isinstance(model.adj, ts.CSRMatrix)  # converted in place
    for step, (nrows, ncols, nnz, n) in enumerate(SEQUENCES[changes]):
        A, D = _matrix(nrows, ncols, nnz, seed=step)
        model.adj = A
        X = _operand((ncols, n), seed=100 + step)
        with torch.no_grad():
            out = compiled(X)
        assert_close_to_reference(out, D.t() @ (D @ X.double()))


@pytest.mark.parametrize("dynamic", sorted(DYNAMIC))
@pytest.mark.parametrize("spelling", ["X @ A", "(X.t() @ A).t()", "A.to_dense()", "A @ X"])
def test_ts_compile_with_sparse_arguments_follows_every_size(spelling, dynamic):
    """``ts.compile(fn)`` converts torch sparse CSR arguments of each call."""
    fn, x_shape, reference = SPELLINGS[spelling]
    compiled = ts.compile(fn, fullgraph=True, dynamic=DYNAMIC[dynamic])
    for step, (nrows, ncols, nnz, n) in enumerate(SEQUENCES["everything"]):
        A, D = _matrix(nrows, ncols, nnz, seed=step)
        X = _operand(x_shape(nrows, ncols, n), seed=100 + step)
        out = compiled(D.to(torch.float32).to_sparse_csr(), X)
        assert_close_to_reference(out, reference(D, X.double()))


class _GNN(torch.nn.Module):
    """Two layers over a graph given per call: ``relu(Â X W1)``, then ``Âᵀ`` spelled the
    compilable way, and a readout of the node count."""

    def __init__(self, features=6, hidden=8, classes=3):
        super().__init__()
        self.lin1 = torch.nn.Linear(features, hidden, dtype=torch.float64)
        self.lin2 = torch.nn.Linear(hidden, classes, dtype=torch.float64)

    def forward(self, adj, x):
        h = torch.relu(adj @ self.lin1(x))
        out = (self.lin2(h).t() @ adj).t()
        return out + adj.to_dense().sum(1, keepdim=True) / adj.shape[0]


def _graph(nodes: int, seed: int):
    """A graph of ``nodes`` nodes (the same pattern for the same count: a static graph
    compiles once per size) with values and features drawn from ``seed``."""
    mask = torch.rand(nodes, nodes, generator=torch.Generator().manual_seed(nodes)) < 0.3
    g = torch.Generator().manual_seed(seed)
    dense = mask * torch.randn(nodes, nodes, generator=g, dtype=torch.float64)
    return ts.csr(dense.to_sparse_csr()), dense, torch.randn(nodes, 6, generator=g, dtype=torch.float64)


@pytest.mark.parametrize("how", ["torch.compile", "torch.compile subclass", "ts.compile"])
@pytest.mark.parametrize("dynamic", sorted(DYNAMIC))
def test_gnn_on_graphs_of_different_node_counts(how, dynamic):
    """A model whose forward takes the adjacency and the features, trained a step on graphs
    of 30, 50, 17, 30 and 50 nodes: outputs and gradients match a float64 dense model."""
    torch.manual_seed(0)
    model = _GNN()
    options = {"flatten_matrices": how != "torch.compile subclass"}
    compiled = (ts.compile(model, fullgraph=True, dynamic=DYNAMIC[dynamic]) if how == "ts.compile" else
                torch.compile(model, backend="sparserl", fullgraph=True, dynamic=DYNAMIC[dynamic], options=options))
    for step, nodes in enumerate([30, 50, 17, 30, 50]):
        adj, dense, x = _graph(nodes, seed=step)
        model.zero_grad()
        out = compiled(adj, x)
        out.square().mean().backward()
        got = {name: p.grad.clone() for name, p in model.named_parameters()}
        model.zero_grad()
        want = model.forward(dense, x)
        want.square().mean().backward()
        assert_close_to_reference(out, want)
        for name, p in model.named_parameters():
            assert_close_to_reference(got[name], p.grad)
    assert _graphs() <= (3 if dynamic == "static" else 2)
