"""Full-graph GNN training as the GNN benchmarks run it (``bench_gnn``, ``bench_cold_start``),
and the host copies of sampled batches the mini-batch ones train on (``bench_minibatch``,
``bench_classes``).

Every *way* trains the same model from the same parameters: a two-layer GCN or GraphSAGE
whose layers aggregate with ``aggregate(h)`` (the way's adjacency product), or PyG's own
layers. :func:`prepare_graph` loads a graph once with every adjacency the ways need;
:func:`build_task` makes a way's training task (model + loss) and :func:`epoch_fn` an epoch
of it.
"""

from __future__ import annotations

import time

import numpy as np
import scipy.sparse as sp

from .matrices import load_graph

WAYS = ["eager", "inductor", "pyg", "sparserl"]
# also available: sparserl with the fused epilogues (off by default), to measure what the
# fusion is worth against Inductor's pointwise kernel after the product: --ways ...,sparserl,sparserl_fused;
# sparserl_eager, the CSRMatrix model run eagerly (no torch.compile) on the same runtime and kernels;
# and bound_inductor, the model compiled by Inductor with the adjacency product taken out (each
# layer aggregates nothing): what an epoch of any compiled way would cost if its sparse products
# were free, so eager / bound_inductor bounds a compiled way's speedup (its losses differ)
# and sparserl_cudagraphs, the sparserl way compiled with mode="reduce-overhead" (CUDA graphs:
# the path for small graphs, whose epochs are bound by the CPU); and sparserl_subclass, the
# sparserl way with options={"flatten_matrices": False} (the CSRMatrix reaches AOTAutograd as
# a tensor subclass), to measure what the flattening is worth per epoch; and sparserl_python, the
# sparserl way with options={"fast_path": False} (every product through its Python
# implementation: sparserl_direct), to measure what the C++ fast path is worth per epoch; and
# sparserl_captured, the sparserl_eager model with its whole epoch (forward, loss, backward, a
# capturable Adam's step) replayed as one CUDA graph by ts.capture_step: no compiler (on the CPU
# the step runs eagerly); and PyG's model the other ways a PyG user would run it: compiled by
# Inductor (pyg_inductor), under its CUDA graphs (pyg_cudagraphs, mode="reduce-overhead") and with
# the whole epoch captured by ts.capture_step as sparserl_captured is (pyg_captured); and
# sparserl_compiled_captured, the sparserl way (compiled) with its whole epoch captured the same
# way: torch.compile and ts.capture_step together
EXTRA_WAYS = ["sparserl_fused", "sparserl_eager", "sparserl_cudagraphs", "sparserl_subclass", "sparserl_python",
              "sparserl_captured", "sparserl_compiled_captured", "pyg_inductor", "pyg_cudagraphs", "pyg_captured",
              "bound_inductor"]
PYG_WAYS = ("pyg", "pyg_inductor", "pyg_cudagraphs", "pyg_captured")  # PyG's layers; the best of them is PyG's best
WAY_OPTIONS = {"sparserl_fused": {"fuse_epilogues": True}, "sparserl_subclass": {"flatten_matrices": False},
               "sparserl_python": {"fast_path": False}}
BOUND_WAYS = ("bound_inductor",)  # not the same computation: no loss comparison
SPARSERL_WAYS = ("sparserl", "sparserl_fused", "sparserl_eager", "sparserl_cudagraphs", "sparserl_subclass",
                 "sparserl_python", "sparserl_captured", "sparserl_compiled_captured")
# epochs through ts.capture_step (epoch_fn's capture)
CAPTURED_WAYS = ("sparserl_captured", "sparserl_compiled_captured", "pyg_captured")
COMPILED_WAYS = ("inductor", "sparserl", "sparserl_fused", "sparserl_cudagraphs", "sparserl_subclass",
                 "sparserl_python", "sparserl_compiled_captured", "pyg_inductor", "pyg_cudagraphs", "bound_inductor")
INDUCTOR_WAYS = ("inductor", "pyg_inductor", "pyg_cudagraphs", "bound_inductor")  # compiled by Inductor alone
CUDAGRAPH_WAYS = ("sparserl_cudagraphs", "pyg_cudagraphs")  # compiled with mode="reduce-overhead"

FEATURES = 128
CLASSES = 16
GAT_HEADS = 4


def normalized(A: sp.csr_matrix, model: str) -> sp.csr_matrix:
    """The model's adjacency from the binary ``A``: GCN ``D^-1/2 (A + I) D^-1/2``, SAGE
    ``D^-1 A``, GAT ``A + I`` (its attention supplies the values)."""
    if model == "gat":  # A + I, binary: the attention is the values
        out = (A + sp.identity(A.shape[0], dtype=np.float32, format="csr")).tocsr().astype(np.float32)
        out.sort_indices()
        return out
    if model == "gcn":
        looped = (A + sp.identity(A.shape[0], dtype=np.float32, format="csr")).tocsr()
        inv_sqrt = 1.0 / np.sqrt(np.asarray(looped.sum(axis=1)).ravel())
        out = sp.diags(inv_sqrt) @ looped @ sp.diags(inv_sqrt)
    else:
        deg = np.maximum(np.asarray(A.sum(axis=1)).ravel(), 1.0)
        out = sp.diags(1.0 / deg) @ A
    out = out.tocsr().astype(np.float32)
    out.sort_indices()
    return out


def _models():
    import torch
    from torch import nn

    class GCN(nn.Module):
        """PyG GCNConv's layout: a bias-free linear map, the product, then the bias."""

        def __init__(self, features, hidden, classes):
            super().__init__()
            self.lin1 = nn.Linear(features, hidden, bias=False)
            self.bias1 = nn.Parameter(torch.zeros(hidden))
            self.lin2 = nn.Linear(hidden, classes, bias=False)
            self.bias2 = nn.Parameter(torch.zeros(classes))

        def forward(self, x, aggregate):
            h = torch.relu(aggregate(self.lin1(x)) + self.bias1)
            return aggregate(self.lin2(h)) + self.bias2

    class SAGE(nn.Module):
        """PyG SAGEConv's layout: lin_l(mean of neighbours) + lin_r(self)."""

        def __init__(self, features, hidden, classes):
            super().__init__()
            self.lin_l1, self.lin_r1 = nn.Linear(features, hidden), nn.Linear(features, hidden, bias=False)
            self.lin_l2, self.lin_r2 = nn.Linear(hidden, classes), nn.Linear(hidden, classes, bias=False)

        def forward(self, x, aggregate):
            h = torch.relu(self.lin_l1(aggregate(x)) + self.lin_r1(x))
            return self.lin_l2(aggregate(h)) + self.lin_r2(h)

    class Task(nn.Module):
        """Model + loss on the training nodes; the adjacency product is ``aggregate``."""

        def __init__(self, model, aggregate, x, y, train):
            super().__init__()
            self.model, self.aggregate = model, aggregate
            self.x, self.y, self.train_idx = x, y, train

        def forward(self):
            out = self.model(self.x, self.aggregate)
            return nn.functional.cross_entropy(out.index_select(0, self.train_idx), self.y.index_select(0, self.train_idx))

    return GCN, SAGE, Task


def _no_product(h):
    """The bound_inductor way's aggregation: none (the layer's features pass unchanged)."""
    return h


class Product:
    """``A @ h`` for a fixed adjacency: a callable object, so Dynamo sees ``A`` as an input."""

    def __init__(self, A, mm):
        self.A, self.mm = A, mm

    def __call__(self, h):
        return self.mm(self.A, h)


def gat_task(way: str, hidden: int, graph, device, adjacency=None):
    """The ``gat`` model's task: PyG's GATConv in every way, the way deciding the adjacency."""
    import torch
    from torch_geometric.nn import GATConv

    if way in BOUND_WAYS:
        raise ValueError(f"bench_gnn: way {way} is not defined for the gat model")
    if way in SPARSERL_WAYS:
        import torch_sparserl.integrations.pyg  # noqa: F401 - the adapter: GATConv on a CSRMatrix
        adj = adjacency if adjacency is not None else graph["csr_matrix_gat"]
    else:
        adj = graph["torch_csr_gat"] if way == "eager" else graph["edge_index_gat"]
    x, y, train = graph["x"], graph["y"], graph["train"]

    class GATTask(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)  # the same parameters in every way
            self.c1 = GATConv(FEATURES, hidden // GAT_HEADS, heads=GAT_HEADS, add_self_loops=False)
            self.c2 = GATConv(hidden, CLASSES, heads=1, add_self_loops=False)
            self.adj = adj

        def forward(self):
            out = self.c2(torch.relu(self.c1(x, self.adj)), self.adj)
            return torch.nn.functional.cross_entropy(out.index_select(0, train), y.index_select(0, train))

    return GATTask().to(device)


def pyg_task(model_name: str, params: dict, features, hidden, classes, edge_index, x, y, train):
    import torch
    from torch_geometric.nn import GCNConv, SAGEConv

    class PygNet(torch.nn.Module):
        def __init__(self):
            super().__init__()
            if model_name == "gcn":
                self.c1, self.c2 = GCNConv(features, hidden, cached=True), GCNConv(hidden, classes, cached=True)
            else:
                self.c1, self.c2 = SAGEConv(features, hidden), SAGEConv(hidden, classes)

        def forward(self):
            h = torch.relu(self.c1(x, edge_index))
            out = self.c2(h, edge_index)
            return torch.nn.functional.cross_entropy(out.index_select(0, train), y.index_select(0, train))

    net = PygNet().to(x.device)
    mapping = ({"c1.lin.weight": "lin1.weight", "c1.bias": "bias1", "c2.lin.weight": "lin2.weight", "c2.bias": "bias2"}
               if model_name == "gcn" else
               {"c1.lin_l.weight": "lin_l1.weight", "c1.lin_l.bias": "lin_l1.bias", "c1.lin_r.weight": "lin_r1.weight",
                "c2.lin_l.weight": "lin_l2.weight", "c2.lin_l.bias": "lin_l2.bias", "c2.lin_r.weight": "lin_r2.weight"})
    state = net.state_dict()
    missing = set(state) - set(mapping)
    if missing:
        raise RuntimeError(f"bench_gnn: PyG parameters without a counterpart: {sorted(missing)}")
    net.load_state_dict({name: params[ours].clone() for name, ours in mapping.items()})
    return net


def reset_compiled():
    """Forget compiled code, and take out the eager interception of raw CSR products that
    compiling with the sparserl backend installs for the rest of the process, so that the
    next way (eager ``torch.sparse`` above all) runs as in a process that never named it."""
    import torch
    from torch_sparserl.tensor import intercept

    torch._dynamo.reset()
    intercept.deactivate_backend()


def sync(device):
    """Wait for ``device`` (CUDA); nothing on the CPU."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def epoch_fn(task, params=None, capture: bool = False, capturable: bool = False):
    """One training epoch of ``task`` with Adam (lr 0.01) as a function returning the loss.
    ``capturable``: Adam's capturable form without the capture (its step count on the device),
    the reference a captured epoch's losses are compared with beside the default Adam's.

    CUDA graphs (``--mode reduce-overhead``) reuse their outputs' memory on the next replay:
    each epoch is marked a new step and returns a copy of the loss. ``capture``: the epoch is
    replayed as one CUDA graph by ``ts.capture_step`` (Adam capturable on a GPU), whose loss is
    copied out of the graph's memory; on the CPU it runs eagerly."""
    import torch

    params = list(task.parameters()) if params is None else params
    if capture:
        import torch_sparserl as ts

        opt = torch.optim.Adam(params, lr=0.01, capturable=params[0].is_cuda)

        def step():
            opt.zero_grad(set_to_none=True)
            loss = task()
            loss.backward()
            opt.step()
            return loss.detach()

        captured = ts.capture_step(step)
        return lambda: captured().clone()
    opt = torch.optim.Adam(params, lr=0.01, capturable=capturable)

    def epoch():
        torch.compiler.cudagraph_mark_step_begin()
        opt.zero_grad(set_to_none=True)
        loss = task()
        loss.backward()
        opt.step()
        return loss.detach().clone()

    return epoch


def build_task(way, model_name, hidden, graph, device, args, adjacency=None):
    """The way's training task (model + loss), from the same initial parameters every time;
    ``adjacency`` replaces the graph's CSRMatrix (the warm start's fresh copy)."""
    import torch

    if model_name == "gat":
        task = gat_task(way, hidden, graph, device, adjacency)
        return _compiled(way, task, args) if way in COMPILED_WAYS else task
    GCN, SAGE, Task = _models()
    torch.manual_seed(0)
    model = (GCN if model_name == "gcn" else SAGE)(FEATURES, hidden, CLASSES)
    params = {k: v.detach().clone() for k, v in model.state_dict().items()}
    x, y, train = graph["x"], graph["y"], graph["train"]
    if way in PYG_WAYS:
        task = pyg_task(model_name, params, FEATURES, hidden, CLASSES, graph["edge_index"], x, y, train)
        return _compiled(way, task, args) if way in COMPILED_WAYS else task
    model = model.to(device)
    if way in SPARSERL_WAYS:
        aggregate = Product(adjacency if adjacency is not None else graph[f"csr_matrix_{model_name}"], torch.matmul)
    elif way in BOUND_WAYS:
        aggregate = _no_product
    else:
        mm = torch.sparse.mm
        aggregate = Product(graph[f"torch_csr_{model_name}"], torch.compiler.disable(mm) if way == "inductor" else mm)
    task = Task(model, aggregate, x, y, train)
    return _compiled(way, task, args) if way in COMPILED_WAYS else task


def _compiled(way, task, args):
    import torch

    mode = "reduce-overhead" if way in CUDAGRAPH_WAYS else None if args.mode == "default" else args.mode
    return torch.compile(task, backend="inductor" if way in INDUCTOR_WAYS else "sparserl",
                         mode=mode, options=WAY_OPTIONS.get(way))


def fresh_copy(A):
    """``A`` on new index tensors: its pattern's transpose, fingerprint and decisions are
    computed again, as in a new process."""
    import torch_sparserl as ts

    return ts.csr((A.crow.clone(), A.col.clone(), A.val.clone()), shape=A.shape)


def prepare_graph(name: str, device, models=("gcn", "sage")) -> dict:
    """The graph ``name`` on ``device``: random features and labels (seeded), the training
    nodes, PyG's ``edge_index``, and per model its adjacency as a torch CSR tensor and as a
    ``CSRMatrix``."""
    import torch
    import torch_sparserl as ts

    t0 = time.perf_counter()
    A = load_graph(name)
    n = A.shape[0]
    g = torch.Generator().manual_seed(0)
    graph = {"n": n, "nnz": int(A.nnz), "load_s": 0.0,
             "x": torch.randn(n, FEATURES, generator=g).to(device),
             "y": torch.randint(0, CLASSES, (n,), generator=g).to(device),
             "train": torch.arange(0, n, 2, device=device)}
    coo = A.tocoo()
    graph["edge_index"] = torch.from_numpy(np.stack([coo.col, coo.row]).astype(np.int64)).to(device)
    for model in models:
        M = normalized(A, model)
        crow = torch.from_numpy(M.indptr.astype(np.int64)).to(device)
        col = torch.from_numpy(M.indices.astype(np.int64)).to(device)
        val = torch.from_numpy(M.data).to(device)
        graph[f"torch_csr_{model}"] = torch.sparse_csr_tensor(crow, col, val, M.shape)
        graph[f"csr_matrix_{model}"] = ts.csr((crow.int(), col.int(), val), shape=M.shape)
        if model == "gat":  # PyG's edge_index of A + I: row 0 the sources, row 1 the targets
            coo_gat = M.tocoo()
            graph["edge_index_gat"] = torch.from_numpy(np.stack([coo_gat.col, coo_gat.row]).astype(np.int64)).to(device)
    graph["load_s"] = time.perf_counter() - t0
    return graph


class PreparedBatch:
    """A sampled batch's host tensors, made before timing and pinned where a GPU takes them (as a
    loader with ``pin_memory=True`` hands them over): every way times its own transfers."""

    def __init__(self, batch, device):
        import torch

        pin = torch.device(device).type == "cuda"
        host = (lambda a: torch.from_numpy(np.ascontiguousarray(a)).pin_memory()) if pin else torch.from_numpy
        self.seeds, self.n = batch.seeds, batch.nodes.size
        self.nodes = host(batch.nodes)
        self.csr = (host(batch.crow), host(batch.col), host(batch.adjacency("mean").data))
        rows = np.repeat(np.arange(self.n), np.diff(batch.crow))
        # PyG's flow: messages from edge_index[0] (a neighbour) to edge_index[1] (the row)
        self.edge_index = host(np.stack([batch.col, rows]))
