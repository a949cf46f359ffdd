"""PyTorch Geometric layers on a CSRMatrix adjacency (torch_sparserl.integrations.pyg).

Each layer is compared with PyG's own sparse path (a torch sparse CSR ``adj_t``) and with its
``edge_index`` path, in float64, forward and backward, eagerly and under
``torch.compile(backend="sparserl")``; and the products are checked to be sparserl's. The
sparse-adjacency cases of PyG 2.8's own layer tests run on a CSRMatrix, and the layers still
script with TorchScript after the import.
"""

import os
import subprocess
import sys
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

pytest.importorskip("torch_geometric")

import torch_sparserl as ts  # noqa: E402
import torch_sparserl.integrations.pyg as tpyg  # noqa: E402
from torch_sparserl.compiler import passes  # noqa: E402
from torch_sparserl.dtypes import assert_close_to_reference  # noqa: E402
from torch_geometric.nn import (  # noqa: E402
    APPNP,
    ChebConv,
    GATConv,
    GATv2Conv,
    GCNConv,
    GINConv,
    GraphConv,
    SAGEConv,
    SGConv,
    SimpleConv,
    TransformerConv,
)
from torch_geometric.utils import coalesce, remove_self_loops, softmax  # noqa: E402

from helpers import REPO  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

LAYERS = {
    "gcn": lambda i, o: GCNConv(i, o),
    "gcn_improved": lambda i, o: GCNConv(i, o, improved=True),
    "gcn_no_loops": lambda i, o: GCNConv(i, o, add_self_loops=False),
    "sage": lambda i, o: SAGEConv(i, o),
    "gin": lambda i, o: GINConv(torch.nn.Sequential(torch.nn.Linear(i, o), torch.nn.ReLU(), torch.nn.Linear(o, o))),
    "graphconv": lambda i, o: GraphConv(i, o),
    # attention that changes every step: every head in one product (spmm_heads), the attention as values
    "gat": lambda i, o: GATConv(i, o, heads=2),
    "gat_one_head": lambda i, o: GATConv(i, o, heads=1),
    "gat_mean_no_loops": lambda i, o: GATConv(i, o, heads=3, concat=False, add_self_loops=False,
                                              fill_value="mean"),
}


class Counter(TorchDispatchMode):
    """Names of the sparserl operators that ran (a mode also keeps the direct eager path off)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "sparserl":
            self.ops.append(func._opname)
        return func(*args, **(kwargs or {}))


def _graph(device, n=40, edges=260, features=6, seed=0, self_loops=False):
    g = torch.Generator().manual_seed(seed)
    edge_index = torch.randint(0, n, (2, edges), generator=g)
    if not self_loops:
        edge_index = remove_self_loops(edge_index)[0]
    else:  # a few explicit self loops, which gcn_norm must merge with the added ones
        edge_index = torch.cat([edge_index, torch.arange(0, n, 3).repeat(2, 1)], dim=1)
    edge_index = coalesce(edge_index, num_nodes=n).to(device)
    x = torch.randn(n, features, generator=g, dtype=torch.float64).to(device)
    return edge_index, x


def _torch_adj_t(edge_index, n):
    adj = torch.sparse_coo_tensor(edge_index.flip(0), torch.ones(edge_index.shape[1], dtype=torch.float64,
                                                                  device=edge_index.device), (n, n))
    return adj.coalesce().to_sparse_csr()


def _model(name, seed=1):
    torch.manual_seed(seed)
    return LAYERS[name](6, 5).double()


def _seq(i, o):
    return torch.nn.Sequential(torch.nn.Linear(i, o), torch.nn.ReLU(), torch.nn.Linear(o, o))


def _grads(module):
    return [p.grad.detach().clone() for p in module.parameters()]


def _flat(tensors):
    return torch.cat([t.reshape(-1) for t in tensors])


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_layer_matches_pyg_forward_and_backward(name, device):
    edge_index, x = _graph(device, self_loops=name.startswith("gcn"))
    n = x.shape[0]
    A = tpyg.adjacency(edge_index, n, dtype=torch.float64)
    assert isinstance(A, ts.CSRMatrix)
    layer = _model(name).to(device)

    x_ref = x.clone().requires_grad_()
    ref = layer(x_ref, _torch_adj_t(edge_index, n))  # PyG's own sparse path
    ref.square().sum().backward()
    grads_ref = _grads(layer)
    layer.zero_grad()

    x_ours = x.clone().requires_grad_()
    with Counter() as seen:
        out = layer(x_ours, A)
        out.square().sum().backward()
    heads = getattr(layer, "heads", 1) > 1
    products = ("spmm_heads", "spmm_heads_transposed") if heads else ("spmm", "spmm_transposed")
    assert set(products) <= set(seen.ops), seen.ops
    if name.startswith("gat"):  # the attention needs a gradient: SDDMM
        assert ("sddmm_heads" if heads else "sddmm") in seen.ops, seen.ops
    assert_close_to_reference(out, ref)
    assert_close_to_reference(x_ours.grad, x_ref.grad)
    for ours, theirs in zip(_grads(layer), grads_ref):
        assert_close_to_reference(ours, theirs)
    if not name.startswith("gcn"):  # without self loops in the graph the edge_index path agrees too
        assert_close_to_reference(out, layer(x, edge_index))


def test_gcn_norm_keeps_a_csr_matrix_and_caches_the_looped_pattern():
    edge_index, x = _graph("cpu", self_loops=True)
    A = tpyg.adjacency(edge_index, x.shape[0], dtype=torch.float64)
    before = ts.pattern.stats()["diagonals"]
    normed, weight = tpyg.gcn_norm(A)
    again, _ = tpyg.gcn_norm(A)
    assert weight is None and isinstance(normed, ts.CSRMatrix)
    assert again._crow is normed._crow and again._col is normed._col  # the looped pattern, computed once
    assert ts.pattern.stats()["diagonals"] == before + 1
    want = A.to_dense() + torch.eye(x.shape[0], dtype=torch.float64)
    d = want.sum(1).pow(-0.5)
    assert_close_to_reference(normed.to_dense(), d[:, None] * want * d[None, :])


def _dense(A, values=None):
    """A CSRMatrix (or its pattern with other per-entry ``values``, any trailing shape) as dense."""
    values = A.val if values is None else values
    rows = torch.repeat_interleave(torch.arange(A.shape[0]), (A.crow[1:] - A.crow[:-1]).long())
    out = torch.zeros(*A.shape, *values.shape[1:], dtype=values.dtype)
    out.index_put_((rows, A.col.long()), values.detach(), accumulate=True)
    return out


def _torch_csr(A):
    """The torch sparse CSR tensor of a CSRMatrix's pattern and values (PyG's own sparse input)."""
    return torch.sparse_csr_tensor(A.crow.long(), A.col.long(), A.val.detach(), tuple(A.shape))


def _assert_same_sparse(ours, theirs):
    """A CSRMatrix (or torch sparse CSR result) and PyG's torch sparse CSR result: the same
    size, pattern and values."""
    if isinstance(ours, ts.CSRMatrix):
        ours = _torch_csr(ours)
    assert ours.layout == theirs.layout == torch.sparse_csr and ours.shape == theirs.shape
    assert torch.equal(ours.crow_indices().long(), theirs.crow_indices().long())
    assert torch.equal(ours.col_indices().long(), theirs.col_indices().long())
    assert_close_to_reference(ours.values(), theirs.values())


def test_self_loops_on_a_csr_matrix_as_pyg_adds_them():
    edge_index, x = _graph("cpu", self_loops=True)
    n = x.shape[0]
    weights = torch.rand(edge_index.shape[1], dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    A = tpyg.adjacency(edge_index, n, weights, dtype=torch.float64)
    attr = torch.randn(A.nnz, 3, dtype=torch.float64)
    bare, bare_attr = tpyg.remove_self_loops(A, attr)
    dense = _dense(A)
    off = ~torch.eye(n, dtype=torch.bool)
    torch.testing.assert_close(_dense(bare), dense * off)
    torch.testing.assert_close(_dense(bare, bare_attr), _dense(A, attr) * off[:, :, None])
    again, _ = tpyg.remove_self_loops(A)
    assert again._crow is bare._crow and again._col is bare._col  # computed once per pattern

    # As PyG adds them to a torch sparse matrix: with and without diagonal entries (a loop added
    # where one is sums with it), square and rectangular, num_nodes not read (GATConv passes
    # the source count for a bipartite graph).
    wide = ts.csr(A.to_dense()[:25])
    tall = ts.csr(A.to_dense()[:, :25])
    for matrix in (bare, A, wide, tall):
        # (PyG's own fails on string fills when there are more rows than loops: index out of bounds)
        for fill in (None, 2.5) + (("mean", "add", "max") if matrix is not tall else ()):
            looped, none = tpyg.add_self_loops(matrix, fill_value=fill, num_nodes=7)
            theirs, _ = tpyg._ORIGINAL["add_self_loops"](_torch_csr(matrix), fill_value=fill)
            assert none is None and isinstance(looped, ts.CSRMatrix)
            _assert_same_sparse(looped, theirs)

    with pytest.raises(NotImplementedError, match=r"add_self_loops: edge_attr with self loops is not supported"):
        tpyg.add_self_loops(bare, bare_attr)
    with pytest.raises(NotImplementedError, match=r"fill_value must be None, a number or one of"):
        tpyg.add_self_loops(bare, fill_value="median")
    # anything else reaches PyG's own
    assert tpyg.add_self_loops(edge_index, num_nodes=n)[0].shape[1] == edge_index.shape[1] + n


@pytest.mark.parametrize("make", [lambda: GATConv(6, 5, heads=3), lambda: GATConv(6, 5, heads=1, add_self_loops=False),
                                  lambda: GATv2Conv(6, 5, heads=2)], ids=["gat", "gat_one_head_no_loops", "gatv2"])
def test_attention_weights_are_what_pyg_returns_for_a_sparse_adjacency(make):
    """PyG returns ``(out, (adj, alpha))`` for a torch sparse adjacency, ``adj`` a sparse CSR tensor
    of size (N, N, heads) holding ``alpha`` on the (looped) pattern: the same for a CSRMatrix."""
    edge_index, x = _graph("cpu")
    A = tpyg.adjacency(edge_index, x.shape[0], dtype=torch.float64)
    torch.manual_seed(5)
    layer = make().double()
    out, (adj, alpha) = layer(x, A, return_attention_weights=True)
    ref, (ref_adj, ref_alpha) = layer(x, _torch_adj_t(edge_index, x.shape[0]), return_attention_weights=True)
    assert_close_to_reference(out, ref)
    assert adj.shape == ref_adj.shape == (x.shape[0], x.shape[0], layer.heads)
    _assert_same_sparse(adj, ref_adj)
    assert_close_to_reference(alpha, ref_alpha)


@pytest.mark.parametrize("make", [lambda: GATv2Conv(6, 5, heads=2), lambda: TransformerConv(6, 5, heads=2)],
                         ids=["gatv2", "transformer"])
def test_attention_layers_without_a_fused_product_run_pyg_s_path_on_the_matrix(make):
    edge_index, x = _graph("cpu")
    A = tpyg.adjacency(edge_index, x.shape[0], dtype=torch.float64)
    torch.manual_seed(6)
    layer = make().double()
    assert_close_to_reference(layer(x, A), layer(x, edge_index))


class AttentionConv(torch.nn.Module):
    """A GAT-style layer: scores q_i·k_j at the edges (SDDMM), a softmax over each row,
    then PyG's GraphConv-free weighted sum through GCNConv(normalize=False) on those values."""

    def __init__(self, features, out):
        super().__init__()
        self.q = torch.nn.Linear(features, 4, dtype=torch.float64)
        self.k = torch.nn.Linear(features, 4, dtype=torch.float64)
        self.conv = GCNConv(features, out, normalize=False, bias=False).double()

    def forward(self, x, adj):
        if isinstance(adj, ts.CSRMatrix):
            scores = torch.ops.sparserl.sddmm(adj.crow, adj.col, self.q(x), self.k(x))
            rows = torch.repeat_interleave(torch.arange(adj.shape[0], device=x.device),
                                           (adj.crow[1:] - adj.crow[:-1]).long())
            return self.conv(x, adj.with_values(softmax(scores, rows, num_nodes=adj.shape[0])))
        edge_index = adj  # the same layer on PyG's edge_index path: target i = row 1, source j = row 0
        scores = (self.q(x)[edge_index[1]] * self.k(x)[edge_index[0]]).sum(-1)
        return self.conv(x, edge_index, softmax(scores, edge_index[1], num_nodes=x.shape[0]))


def test_edge_weights_that_change_every_step_get_gradients(device):
    edge_index, x = _graph(device)
    A = tpyg.adjacency(edge_index, x.shape[0], dtype=torch.float64)
    torch.manual_seed(3)
    layer = AttentionConv(6, 5).to(device)
    for step in range(2):  # values change with the parameters between steps
        ref = layer(x, edge_index)
        ref.square().sum().backward()
        grads_ref = _grads(layer)
        layer.zero_grad()
        with Counter() as seen:
            out = layer(x, A)
            out.square().sum().backward()
        assert {"sddmm", "spmm"} <= set(seen.ops), seen.ops
        assert_close_to_reference(out, ref)
        # The attention biases' gradients are sums that cancel to nearly 0 (softmax): two summation
        # orders differ there by the rounding of the terms, so the gradients are compared as one
        # vector, whose scale the tolerance follows (on the H100 one kernel choice gave 1.7e-12
        # where the largest gradient is about 57).
        assert_close_to_reference(_flat(_grads(layer)), _flat(grads_ref))
        with torch.no_grad():
            for p in layer.parameters():
                p -= 0.1 * p.grad
        layer.zero_grad()


class TwoLayers(torch.nn.Module):
    def __init__(self, make):
        super().__init__()
        self.c1, self.c2 = make(6, 8), make(8, 3)

    def forward(self, x, adj):
        return self.c2(self.c1(x, adj).relu(), adj)


COMPILED = {
    "gcn_cached": (lambda i, o: GCNConv(i, o, cached=True), False),
    "gcn": (GCNConv, False),
    "gcn_no_loops": (lambda i, o: GCNConv(i, o, add_self_loops=False), True),
    "sage": (SAGEConv, True),
    "gin": (lambda i, o: GINConv(torch.nn.Linear(i, o)), True),
    "gat": (lambda i, o: GATConv(i, o, heads=2, concat=False), False),  # the loops' pattern is computed outside the graph
    "gat_no_loops": (lambda i, o: GATConv(i, o, heads=2, concat=False, add_self_loops=False), True),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(COMPILED))
def test_compiled_layers_match_eager(name, device):
    make, fullgraph = COMPILED[name]
    edge_index, x = _graph(device)
    x = x.float()
    A = tpyg.adjacency(edge_index, x.shape[0])
    torch.manual_seed(2)
    eager = TwoLayers(make).double().to(device)  # the float64 reference, with the same parameters
    torch.manual_seed(2)
    model = TwoLayers(make).to(device)
    ref = eager(x.double(), tpyg.adjacency(edge_index, x.shape[0], dtype=torch.float64))
    ref.square().sum().backward()
    torch._dynamo.reset()
    passes.REPORTS.clear()
    compiled = torch.compile(model, backend="sparserl", fullgraph=fullgraph)
    # no cached graphs: the post-grad pass, which reports the sparse sites, runs on fresh compiles only
    with torch._inductor.config.patch(force_disable_caches=True), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(3):
            model.zero_grad()
            out = compiled(x, A)
            out.square().sum().backward()
    assert_close_to_reference(out, ref)
    assert_close_to_reference(_flat(_grads(model)), _flat(_grads(eager)))
    seen = [op for report in passes.REPORTS for op in report.ops()]
    products = ("spmm_heads", "spmm_heads_transposed") if name.startswith("gat") else ("spmm", "spmm_transposed")
    assert set(products) <= set(seen), seen


def test_errors_are_named():
    edge_index, x = _graph("cpu")
    A = tpyg.adjacency(edge_index, x.shape[0], dtype=torch.float64)
    with pytest.raises(NotImplementedError, match=r"add_self_loops: edge_attr with self loops is not supported"):
        GATConv(6, 5, edge_dim=2).double()(x, A, edge_attr=torch.randn(A.nnz, 2, dtype=torch.float64))
    with pytest.raises(NotImplementedError, match=r"torch_sparserl.integrations.pyg.spmm: reduce='max'"):
        SAGEConv(6, 5, aggr="max").double()(x, A)
    with pytest.raises(ValueError, match=r"GraphConv.propagate: flow='target_to_source'"):
        GraphConv(6, 5, flow="target_to_source").double()(x, A)
    with pytest.raises(ValueError, match=r"SAGEConv.propagate: size \(3, 3\) does not match"):
        SAGEConv(6, 5).double()(x, A, size=(3, 3))
    rect = ts.csr(torch.ones(3, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"gcn_norm: the adjacency must be square \(got shape \(3, 4\)\)"):
        tpyg.gcn_norm(rect)
    with pytest.raises(ValueError, match=r"adjacency: edge_index must be an integer tensor of shape \(2, E\)"):
        tpyg.adjacency(torch.zeros(3, 5, dtype=torch.long))
    with pytest.raises(ValueError, match=r"adjacency: edge_weight must have shape"):
        tpyg.adjacency(edge_index, x.shape[0], torch.ones(2))
    with pytest.raises(ValueError, match=rf"set_sparse_value: value must have {A.nnz} rows, one per entry of the "
                                         r"CSRMatrix \(got shape \(3, 2\)\)"):
        tpyg.set_sparse_value(A, torch.ones(3, 2, dtype=torch.float64))


def test_other_inputs_reach_pyg_unchanged():
    """The adapter is installed process-wide: edge_index and torch sparse inputs take PyG's paths."""
    assert tpyg.installed()
    tpyg.install()  # idempotent
    edge_index, x = _graph("cpu")
    layer = _model("gcn")
    out_edge_index = layer(x, edge_index)
    out_sparse = layer(x, _torch_adj_t(edge_index, x.shape[0]))
    assert_close_to_reference(out_edge_index, out_sparse)


SCRIPTED = {
    "gcn": lambda: GCNConv(8, 4),
    "sage": lambda: SAGEConv(8, 4),
    "gin": lambda: GINConv(_seq(8, 4)),
    "graphconv": lambda: GraphConv(8, 4),
    "sg": lambda: SGConv(8, 4, K=2),
    "appnp": lambda: APPNP(K=2, alpha=0.1),
    "simple_self_loop": lambda: SimpleConv(combine_root="self_loop"),
    "cheb": lambda: ChebConv(8, 4, K=2),
}


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
@pytest.mark.parametrize("name", sorted(SCRIPTED))
def test_layers_script_after_the_import(name):
    """The adapter stands in for PyG's functions and methods in Python only: TorchScript
    compiles PyG's own, and the scripted layer gives the layer's result on an edge_index."""
    edge_index, x = _graph("cpu", features=8, seed=11, self_loops=True)
    weights = torch.rand(edge_index.shape[1], dtype=torch.float64, generator=torch.Generator().manual_seed(13))
    torch.manual_seed(1)
    layer = SCRIPTED[name]().double()
    scripted = torch.jit.script(layer)
    assert_close_to_reference(scripted(x, edge_index), layer(x, edge_index))
    if name in ("gcn", "graphconv", "sg", "cheb"):
        assert_close_to_reference(scripted(x, edge_index, weights), layer(x, edge_index, weights))


_SCRIPTED_BEFORE = """
import warnings
warnings.simplefilter("ignore")
import torch
from torch_geometric.nn import APPNP, GCNConv, SGConv, SimpleConv
torch.jit.script(GCNConv(8, 4))  # PyG's gcn_norm, add_self_loops, ... compiled before the adapter stands in
torch.jit.script(SimpleConv(combine_root="self_loop"))
import torch_sparserl.integrations.pyg

x, edge_index = torch.randn(10, 8), torch.randint(0, 10, (2, 30))
for layer in (APPNP(K=2, alpha=0.1), SGConv(8, 4, K=2)):
    assert torch.allclose(torch.jit.script(layer)(x, edge_index), layer(x, edge_index))
print("scripted")
"""


@pytest.mark.slow
def test_layers_script_after_the_import_when_pyg_was_scripted_before():
    """PyG's functions compiled by TorchScript before the import: the layers scripted after it
    reuse their compiled overloads (a fresh interpreter: TorchScript keeps them per process)."""
    root = REPO
    result = subprocess.run([sys.executable, "-c", _SCRIPTED_BEFORE], cwd=root, capture_output=True, text=True,
                            timeout=300, env={**os.environ, "SPARSERL_JIT": "off"})
    assert result.returncode == 0 and result.stdout.strip() == "scripted", result.stderr[-3000:]


def test_appnp_drops_out_the_adjacency_values_as_pyg():
    """APPNP in training mode drops out the normalized adjacency's values each step: on a
    CSRMatrix the values of the same pattern (the products stay sparserl's), with the masks
    PyG draws for torch's sparse adj_t from the same seed."""
    edge_index, x = _graph("cpu", n=30, edges=150, features=8)
    n = x.shape[0]
    A = tpyg.adjacency(edge_index, n, dtype=torch.float64)

    def run(dropout, adj, seed=7):
        torch.manual_seed(seed)
        layer = APPNP(K=2, alpha=0.1, dropout=dropout)
        assert layer.training
        features = x.clone().requires_grad_()
        out = layer(features, adj)
        out.square().sum().backward()
        return out, features.grad

    without, grad_without = run(0.0, A)
    ref, grad_ref = run(0.0, _torch_adj_t(edge_index, n))
    assert_close_to_reference(without, ref)
    assert_close_to_reference(grad_without, grad_ref)

    with Counter() as seen:
        dropped, grad_dropped = run(0.5, A)
    assert seen.ops.count("spmm") == 2, seen.ops  # K products, on the CSRMatrix
    ref, grad_ref = run(0.5, _torch_adj_t(edge_index, n))
    assert_close_to_reference(dropped, ref)
    assert_close_to_reference(grad_dropped, grad_ref)
    assert (dropped - without).abs().max() > 1e-3  # the dropout did drop values
    assert_close_to_reference(run(1.0, A)[0], 0.1 * x)  # every value dropped: alpha * x (PyG's test)

    values = torch.rand(A.nnz, dtype=torch.float64)
    kept = tpyg.set_sparse_value(A, values)
    assert isinstance(kept, ts.CSRMatrix) and kept._crow is A._crow and kept._col is A._col and kept.val is values
    index, read = tpyg.to_edge_index(kept)
    ref_index, ref_read = tpyg._ORIGINAL["to_edge_index"](_torch_csr(kept))
    assert torch.equal(index, ref_index)
    assert_close_to_reference(read, ref_read)


# ---------------------------------------------------------------- PyG's own layer tests
#
# PyG 2.8's tests of these layers (test/nn/conv/test_*_conv.py, test_appnp.py) run each layer on
# an edge_index and on a torch sparse adj_t, square and bipartite, with and without edge values,
# cached; here each of those sparse cases runs on a CSRMatrix and on torch's sparse CSR adj_t
# (PyG's own sparse path), on fresh random graphs in float64, forward and backward.

SRC, DST = 12, 5  # nodes of a square graph (SRC) and the targets of a bipartite one

# PyG 2.8 writes a layer class's propagate from its first instance: a first SAGEConv or SimpleConv
# with lstm or several aggregations would leave the class without its fused path, and PyG's own
# sparse path (the reference here) would raise "'message_and_aggregate' not implemented" for
# every later one. PyG's tests build a plain one first; so does this module.
SAGEConv(1, 1), SimpleConv()


# name: (layer, inputs, dst_features, weighted, products are sparserl's, calls); inputs "square"
# (x), "pair" (x_src, x_dst of dst_features) or "source_only" (x_src, None); a second call runs
# on what a cached layer kept from the first.
PYG_CASES = {
    "gcn": (lambda: GCNConv(8, 32), "square", 8, False, True, 1),
    "gcn_weighted": (lambda: GCNConv(8, 32), "square", 8, True, True, 1),
    "gcn_cached": (lambda: GCNConv(8, 32, cached=True), "square", 8, False, True, 2),
    **{f"sage_{aggr}{'_project' if project else ''}_{inputs}": (
        lambda aggr=aggr, project=project, inputs=inputs: SAGEConv((8, 16) if inputs != "square" else 8, 32,
                                                                  project=project, aggr=aggr),
        inputs, 16, False, True, 1)
       for aggr in ("mean", "sum") for project in (False, True) for inputs in ("square", "pair", "source_only")},
    "sage_multi_aggr_cat": (lambda: SAGEConv(8, 32, aggr=["mean", "max", "sum", "softmax"],
                                             aggr_kwargs=dict(mode="cat")), "square", 8, False, False, 1),
    "sage_multi_aggr_proj": (lambda: SAGEConv(8, 32, aggr=["mean", "max", "sum", "softmax"],
                                              aggr_kwargs=dict(mode="proj", mode_kwargs=dict(in_channels=8,
                                                                                             out_channels=16))),
                             "square", 8, False, False, 1),
    "sage_lstm": (lambda: SAGEConv(8, 32, aggr="lstm"), "square", 8, False, False, 1),
    **{f"gin_{inputs}": (lambda: GINConv(_seq(8, 32), train_eps=True), inputs, 8, False, True, 1)
       for inputs in ("square", "pair", "source_only")},
    **{f"graphconv{'_weighted' if weighted else ''}_{inputs}": (
        lambda inputs=inputs: GraphConv((8, 16) if inputs != "square" else 8, 32), inputs, 16, weighted, True, 1)
       for weighted in (False, True) for inputs in ("square", "pair", "source_only")},
    **{f"gat{'_residual' if residual else ''}_{inputs}": (
        lambda inputs=inputs, residual=residual: GATConv((8, 16) if inputs != "square" else 8, 32, heads=2,
                                                         residual=residual),
        inputs, 16, False, True, 1)
       for residual in (False, True) for inputs in ("square", "pair", "source_only")},
    **{f"gatv2{'_residual' if residual else ''}_{inputs}": (
        lambda residual=residual: GATv2Conv(8, 32, heads=2, residual=residual), inputs, 8, False, False, 1)
       for residual in (False, True) for inputs in ("square", "pair")},
    "sg": (lambda: SGConv(8, 32, K=10), "square", 8, False, True, 1),
    "sg_weighted": (lambda: SGConv(8, 32, K=10), "square", 8, True, True, 1),
    "sg_cached": (lambda: SGConv(8, 32, K=10, cached=True), "square", 8, False, True, 2),
    "appnp_cached": (lambda: APPNP(K=3, alpha=0.1, cached=True), "square", 8, False, True, 2),
    **{f"simple_{name}_{inputs}": (lambda aggr=aggr, root=root: SimpleConv(aggr, root), inputs, 8, False,
                                   isinstance(aggr, str), 1)
       for name, aggr, root in (("mean", "mean", None), ("sum_sum", "sum", "sum"),
                                ("mean_max_cat", ["mean", "max"], "cat"), ("mean_self_loop", "mean", "self_loop"))
       for inputs in ("square", "pair") if not (root == "self_loop" and inputs == "pair")},
}


def _bipartite_graph(inputs, weighted, dst_features, seed):
    """A random graph for ``inputs`` (entries (i, i) too, as in PyG's tests) and features:
    ``(x, adj_t as a CSRMatrix, adj_t as torch's sparse CSR)``."""
    g = torch.Generator().manual_seed(seed)
    targets = SRC if inputs == "square" else DST
    edge_index = coalesce(torch.stack([torch.randint(0, SRC, (40,), generator=g),
                                       torch.randint(0, targets, (40,), generator=g)]), num_nodes=SRC)
    values = (torch.rand(edge_index.shape[1], generator=g, dtype=torch.float64) if weighted
              else torch.ones(edge_index.shape[1], dtype=torch.float64))
    theirs = torch.sparse_coo_tensor(edge_index.flip(0), values, (targets, SRC)).coalesce().to_sparse_csr()
    x_src = torch.randn(SRC, 8, generator=g, dtype=torch.float64)
    x = {"square": x_src, "pair": (x_src, torch.randn(DST, dst_features, generator=g, dtype=torch.float64)),
         "source_only": (x_src, None)}[inputs]
    return x, ts.csr(theirs), theirs


def _leaves(x):
    """Copies of the features that collect gradients."""
    if isinstance(x, tuple):
        return tuple(None if t is None else t.clone().requires_grad_() for t in x)
    return x.clone().requires_grad_()


def _feature_grads(x):
    return [t.grad for t in (x if isinstance(x, tuple) else (x,)) if t is not None]


@pytest.mark.parametrize("name", sorted(PYG_CASES))
def test_pyg_layer_test_cases_on_a_csr_matrix(name):
    make, inputs, dst_features, weighted, fused, calls = PYG_CASES[name]
    x, A, theirs = _bipartite_graph(inputs, weighted, dst_features, seed=len(name))

    def run(adj):
        torch.manual_seed(1)
        layer = make().double()
        features = _leaves(x)
        outs = [layer(features, adj) for _ in range(calls)]
        outs[-1].square().sum().backward()
        return outs, _feature_grads(features) + [p.grad for p in layer.parameters()]

    refs, grads_ref = run(theirs)
    with Counter() as seen:
        outs, grads = run(A)
    if fused:  # the products are sparserl's (the heads' form for GATConv's two heads)
        assert ("spmm_heads" if name.startswith("gat") else "spmm") in seen.ops, seen.ops
    for out, ref in zip(outs, refs):
        assert_close_to_reference(out, ref)
    assert [g is None for g in grads] == [g is None for g in grads_ref]  # GINConv's eps: no x_dst, no gradient
    for ours, theirs_grad in zip(grads, grads_ref):
        if ours is not None:
            assert_close_to_reference(ours, theirs_grad)


def test_chebconv_takes_an_edge_index_only_as_in_pyg():
    """PyG's ChebConv has no sparse path (its tests give it edge_index only; a torch sparse
    adj_t fails inside it): a CSRMatrix fails with an error naming the matrix, not a result."""
    x, A, theirs = _bipartite_graph("square", False, 8, seed=3)
    layer = ChebConv(8, 4, K=2).double()
    with pytest.raises(Exception):
        layer(x, theirs)
    with pytest.raises(NotImplementedError, match=r"CSRMatrix: aten\.\w+.* is not supported"):
        layer(x, A)


@pytest.mark.parametrize("heads", [1, 3])
def test_attention_products_are_specialized_at_compile_time(tmp_path, heads):
    """GATConv calls the operators on the matrix's index tensors, which Dynamo hands the backend
    as inputs: their products (the heads' block-diagonal form for several heads), their
    backward on the transpose and the SDDMM of the attention are planned and decided before
    the first step (CPU, a fake specializer)."""
    from fakes import Fakes

    from torch_sparserl.compiler import prespecialize
    from torch_sparserl.config import JitOptions
    from torch_sparserl.jit import runtime as rt
    from torch_sparserl.jit.cache import CacheEntry, KernelCache

    edge_index, x = _graph("cpu")
    A = tpyg.adjacency(edge_index, x.shape[0])
    layer = GATConv(6, 4, heads=heads, add_self_loops=False)
    graphs = []

    def capture(gm, example_inputs):
        graphs.append((gm, list(example_inputs)))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(lambda x, A: layer(x, A), backend=capture, fullgraph=True)(x.float(), A)
    (gm, inputs), = graphs
    planned = {(p.op, p.n, p.transposed, p.heads) for p in prespecialize.plan_graph(gm, inputs, devices=("cpu",))}
    form = heads if heads > 1 else 0
    assert planned == {("spmm", 4, False, form), ("spmm", 4, True, form), ("sddmm", 4, False, form)}
    assert prespecialize.plan_graph(gm, inputs) == []  # CUDA only by default

    class SpmmFakes(Fakes):  # the fake installer runs products: the SDDMM stays with cuSPARSE
        def specializer(self, key, crow, col, ncols):
            if key.op != "sddmm":
                return super().specializer(key, crow, col, ncols)
            self.specialized.append(key)
            return CacheEntry(key, None, family="fake", params={}, reason="none beat cuSPARSE")

    fakes = SpmmFakes()
    runtime = rt.Runtime(JitOptions(mode="sync"), cache=KernelCache(tmp_path),
                         specializer=fakes.specializer, installer=fakes.installer, devices=("cpu",))
    previous = rt.set_active(runtime)
    try:
        started = {(item.op, item.transposed): state for item, state in prespecialize.prespecialize_graph(gm, inputs)}
        assert len(started) == 3 and isinstance(started["sddmm", False], rt.Fallback), started
        assert isinstance(started["spmm", False], rt.Installed) and isinstance(started["spmm", True], rt.Installed)
        label = f" heads={heads}" if heads > 1 else ""
        decided = runtime.decisions(A.crow, A.col, A.shape[1])
        assert decided[f"A{label} spmm n=4 float32"].startswith("installed"), decided
        assert decided[f"At{label} spmm n=4 float32"].startswith("installed"), decided
        assert f"A{label} sddmm n=4 float32" in decided, decided
        searched = len(fakes.specialized)
        out = layer(x.float(), A)  # the products find their decisions taken
        out.square().sum().backward()
        assert len(fakes.specialized) == searched
    finally:
        rt.set_active(previous)
