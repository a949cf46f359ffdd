"""PyTorch Geometric layers on a CSRMatrix adjacency (torch_sparserl.pyg).

Each layer is compared with PyG's own sparse path (a torch sparse CSR ``adj_t``) and with its
``edge_index`` path, in float64, forward and backward, eagerly and under
``torch.compile(backend="sparserl")``; and the products are checked to be sparserl's.
"""

import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

pytest.importorskip("torch_geometric")

import torch_sparserl as ts  # noqa: E402
import torch_sparserl.pyg as tpyg  # noqa: E402
from torch_sparserl import passes  # noqa: E402
from torch_geometric.nn import GCNConv, GINConv, GraphConv, SAGEConv  # noqa: E402
from torch_geometric.utils import coalesce, remove_self_loops, softmax  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

LAYERS = {
    "gcn": lambda i, o: GCNConv(i, o),
    "gcn_improved": lambda i, o: GCNConv(i, o, improved=True),
    "gcn_no_loops": lambda i, o: GCNConv(i, o, add_self_loops=False),
    "sage": lambda i, o: SAGEConv(i, o),
    "gin": lambda i, o: GINConv(torch.nn.Sequential(torch.nn.Linear(i, o), torch.nn.ReLU(), torch.nn.Linear(o, o))),
    "graphconv": lambda i, o: GraphConv(i, o),
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


def _grads(module):
    return [p.grad.detach().clone() for p in module.parameters()]


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
    assert "spmm" in seen.ops and "spmm_transposed" in seen.ops, seen.ops
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(x_ours.grad, x_ref.grad, rtol=1e-12, atol=1e-12)
    for ours, theirs in zip(_grads(layer), grads_ref):
        torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)
    if not name.startswith("gcn"):  # without self loops in the graph the edge_index path agrees too
        torch.testing.assert_close(out, layer(x, edge_index), rtol=1e-12, atol=1e-12)


def test_gcn_norm_keeps_a_csr_matrix_and_caches_the_looped_pattern():
    edge_index, x = _graph("cpu", self_loops=True)
    A = tpyg.adjacency(edge_index, x.shape[0], dtype=torch.float64)
    before = ts.pattern.stats()["diagonals"]
    normed, weight = tpyg.gcn_norm(A)
    again, _ = tpyg.gcn_norm(A)
    assert weight is None and isinstance(normed, ts.CSRMatrix)
    assert again.crow is normed.crow and again.col is normed.col  # the looped pattern, computed once
    assert ts.pattern.stats()["diagonals"] == before + 1
    want = A.to_dense() + torch.eye(x.shape[0], dtype=torch.float64)
    d = want.sum(1).pow(-0.5)
    torch.testing.assert_close(normed.to_dense(), d[:, None] * want * d[None, :], rtol=1e-12, atol=1e-12)


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
        torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
        for ours, theirs in zip(_grads(layer), grads_ref):
            torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-12)
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
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(COMPILED))
def test_compiled_layers_match_eager(name, device):
    make, fullgraph = COMPILED[name]
    edge_index, x = _graph(device)
    x = x.float()
    A = tpyg.adjacency(edge_index, x.shape[0])
    torch.manual_seed(2)
    eager = TwoLayers(make).to(device)
    torch.manual_seed(2)
    model = TwoLayers(make).to(device)
    ref = eager(x, A)
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
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    for ours, theirs in zip(_grads(model), _grads(eager)):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)
    seen = [op for report in passes.REPORTS for op in report.ops()]
    assert "spmm" in seen and "spmm_transposed" in seen, seen


def test_errors_are_named():
    edge_index, x = _graph("cpu")
    A = tpyg.adjacency(edge_index, x.shape[0], dtype=torch.float64)
    with pytest.raises(NotImplementedError, match=r"torch_sparserl.pyg.spmm: reduce='max'"):
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


def test_other_inputs_reach_pyg_unchanged():
    """The adapter is installed process-wide: edge_index and torch sparse inputs take PyG's paths."""
    assert tpyg.installed()
    tpyg.install()  # idempotent
    edge_index, x = _graph("cpu")
    layer = _model("gcn")
    out_edge_index = layer(x, edge_index)
    out_sparse = layer(x, _torch_adj_t(edge_index, x.shape[0]))
    torch.testing.assert_close(out_edge_index, out_sparse, rtol=1e-12, atol=1e-12)
