"""Epoch time of full-graph GNN training on one fixed graph, four ways.

A two-layer GCN and a two-layer GraphSAGE (mean aggregation), hidden 128 and 256, trained with
Adam on random features (128) and labels (16 classes, half the nodes for training) of each graph:

* ``eager``    — ``torch.sparse.mm`` on a torch CSR tensor (cuSPARSE), eager PyTorch;
* ``inductor`` — the same model under ``torch.compile`` (Inductor); the sparse product runs
  eagerly between the compiled graphs (Dynamo cannot trace sparse tensors);
* ``pyg``      — PyG's default path: ``GCNConv(cached=True)`` / ``SAGEConv`` on ``edge_index``
  (gather + scatter), eager;
* ``sparserl`` — the model of ``eager`` with the adjacency a ``CSRMatrix``, under
  ``torch.compile(backend="sparserl")``; the JIT runtime specializes every product (sync mode,
  an empty kernel cache unless ``--cache-dir`` says otherwise).

All four start from the same parameters. The GCN adjacency is ``D^-1/2 (A + I) D^-1/2`` and
the SAGE one ``D^-1 A``, computed once (A binary, self loops removed, row i = edges into i).

``--models gat`` (not in the default set) times PyG's own ``GATConv`` (layer 1: 4 heads of
hidden/4, concatenated; layer 2: one head) in every way, on ``A + I`` with the layers'
``add_self_loops=False``: ``eager`` gives it a torch sparse ``adj_t`` (PyG's sparse path),
``pyg`` and ``inductor`` the ``edge_index`` (Inductor compiles PyG's gather/scatter), and
``sparserl`` the ``CSRMatrix`` (one product per head, the head's attention as values).
Per row, each way in turn: compiled and trained 20 epochs whose losses are recorded (the first
includes compilation and JIT). Then all the ways are timed interleaved: ``--chunks`` rounds, each
running one chunk of epochs of every way (starting one way further on each round), so that the
machine's drift falls on every way alike; a way's epoch time is the median chunk's mean, and the
report gives the range of the per-round ratios. JIT cost is the time the runtime spent
specializing (policy, validation, build), summed over every key.

    python benchmarks/bench_gnn.py --out benchmarks/results                       # everything
    python benchmarks/bench_gnn.py --graphs pubmed --models gcn --hidden 128 --out /tmp/g
    python benchmarks/bench_gnn.py --report benchmarks/results/gnn-<gpu>-....json # re-render
    python benchmarks/bench_gnn.py --compare run1.json run2.json --out runs.md      # repeated runs

Results go to ``gnn-<gpu>-<date>.json`` (``--resume`` adds to an existing file) with ``.md``
and ``.svg`` beside it.
"""

from __future__ import annotations

import argparse
import datetime as dt
import html
import json
import math
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np
import scipy.sparse as sp

sys.path.insert(0, str(Path(__file__).resolve().parent))

from report import emit_markdown, geomean, write_json_md  # noqa: E402

SCHEMA = "torch_sparserl.bench_gnn/1"
GRAPHS = ["pubmed", "dblp-2010", "fb100_Cornell5", "uk-2007-05_100000", "rmat:scale=22,edge_factor=16"]
MODELS = ["gcn", "sage"]
ALL_MODELS = [*MODELS, "gat"]  # gat on request (--models): PyG's GATConv in every way
GAT_HEADS = 4
HIDDEN = [128, 256]
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
# implementation: sparserl_direct), to measure what the C++ fast path is worth per epoch
EXTRA_WAYS = ["sparserl_fused", "sparserl_eager", "sparserl_cudagraphs", "sparserl_subclass", "sparserl_python",
              "bound_inductor"]
WAY_OPTIONS = {"sparserl_fused": {"fuse_epilogues": True}, "sparserl_subclass": {"flatten_matrices": False},
               "sparserl_python": {"fast_path": False}}
BOUND_WAYS = ("bound_inductor",)  # not the same computation: no loss comparison
FEATURES = 128
CLASSES = 16
LOSS_EPOCHS = 20
LOSS_RTOL = 1e-3  # fp32 with different summation orders, over 20 Adam steps


# ------------------------------------------------------------------------- graphs


def split_graphs(text: str) -> list[str]:
    """``--graphs`` names: commas separate graphs, except inside a generator spec, whose
    ``key=value`` parameters are comma-separated too (``pubmed,rmat:scale=22,edge_factor=16``)."""
    names: list[str] = []
    for token in (t.strip() for t in text.split(",")):
        if "=" in token and ":" not in token and names and ":" in names[-1]:
            names[-1] += "," + token
        elif token:
            names.append(token)
    return names


def load_graph(name: str) -> sp.csr_matrix:
    """A binary adjacency without self loops; row i lists the sources of the edges into i."""
    from bench_kernels import select_matrices

    entry = select_matrices([name])[0]
    A = entry.load().tocsr()
    A = sp.csr_matrix((np.ones(A.nnz, dtype=np.float32), A.indices, A.indptr), shape=A.shape)
    A.setdiag(0)
    A.eliminate_zeros()
    A.sum_duplicates()
    A.sort_indices()
    A.data[:] = 1.0
    if A.shape[0] != A.shape[1]:
        raise ValueError(f"bench_gnn: graph {name} is not square ({A.shape})")
    return A


def normalized(A: sp.csr_matrix, model: str) -> sp.csr_matrix:
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


# ------------------------------------------------------------------------- models


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


# ----------------------------------------------------------------------- training


def reset_compiled():
    """Forget compiled code, and take out the eager interception of raw CSR products that
    compiling with the sparserl backend installs for the rest of the process, so that the
    next way (eager ``torch.sparse`` above all) runs as in a process that never named it."""
    import torch
    from torch_sparserl.tensor import intercept

    torch._dynamo.reset()
    intercept.deactivate_backend()


def _sync(device):
    import torch
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def epoch_fn(task, params=None):
    """One training epoch of ``task`` with Adam (lr 0.01) as a function returning the loss.

    CUDA graphs (``--mode reduce-overhead``) reuse their outputs' memory on the next replay:
    each epoch is marked a new step and returns a copy of the loss."""
    import torch

    opt = torch.optim.Adam(list(task.parameters()) if params is None else params, lr=0.01)

    def epoch():
        torch.compiler.cudagraph_mark_step_begin()
        opt.zero_grad(set_to_none=True)
        loss = task()
        loss.backward()
        opt.step()
        return loss.detach().clone()

    return epoch


def start_training(task, params, device, min_chunk_s: float) -> tuple[dict, object]:
    """20 epochs with their losses (the first timed alone: compilation, JIT), then one more
    timed epoch to size the way's chunks. Returns the result so far and the epoch function."""
    import torch

    epoch = epoch_fn(task, params)
    _sync(device)
    start = time.perf_counter()
    losses = [epoch()]
    _sync(device)
    first_s = time.perf_counter() - start
    for _ in range(LOSS_EPOCHS - 1):
        losses.append(epoch())
    _sync(device)
    start = time.perf_counter()
    epoch()
    _sync(device)
    estimate = max(time.perf_counter() - start, 1e-6)
    return ({"status": "ok", "epochs_per_chunk": max(3, min(200, math.ceil(min_chunk_s / estimate))),
             "first_epoch_s": first_s, "losses": [float(v) for v in torch.stack(losses).cpu()]}, epoch)


def time_rounds(epochs: dict, results: dict, device, rounds: int) -> None:
    """Time the ways' chunks interleaved: each round runs one chunk of every way, each round
    starting one way further on, so that the machine's drift over the row (clocks, other
    tenants, background threads) falls on every way alike instead of on whichever ran last.
    A way's epoch time is the median of its chunks' means."""
    import torch
    from torch_sparserl.tensor import intercept

    order = list(epochs)
    for r in range(rounds):
        # a recompilation with the sparserl backend installs the eager interception again:
        # the baselines' products must not pay for it
        intercept.deactivate_backend()
        for way in order[r % len(order):] + order[:r % len(order)]:
            if way not in epochs:
                continue
            result, epoch = results[way], epochs[way]
            try:
                _sync(device)
                start = time.perf_counter()
                for _ in range(result["epochs_per_chunk"]):
                    epoch()
                _sync(device)
            except torch.cuda.OutOfMemoryError as exc:
                results[way] = _failed(exc)
                del epochs[way]
                continue
            result.setdefault("chunk_ms", []).append((time.perf_counter() - start) * 1e3 / result["epochs_per_chunk"])
    for way in epochs:
        results[way]["epoch_ms"] = statistics.median(results[way]["chunk_ms"])


SPARSERL_WAYS = ("sparserl", "sparserl_fused", "sparserl_eager", "sparserl_cudagraphs", "sparserl_subclass",
                 "sparserl_python")
COMPILED_WAYS = ("inductor", "sparserl", "sparserl_fused", "sparserl_cudagraphs", "sparserl_subclass",
                 "sparserl_python", "bound_inductor")


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
    if way == "pyg":
        return pyg_task(model_name, params, FEATURES, hidden, CLASSES, graph["edge_index"], x, y, train)
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

    mode = "reduce-overhead" if way == "sparserl_cudagraphs" else None if args.mode == "default" else args.mode
    return torch.compile(task, backend="inductor" if way in ("inductor", *BOUND_WAYS) else "sparserl",
                         mode=mode, options=WAY_OPTIONS.get(way))


def _failed(exc: BaseException) -> dict:
    import torch

    if isinstance(exc, torch.cuda.OutOfMemoryError):
        return {"status": "oom", "error": str(exc).splitlines()[0]}
    return {"status": "error", "error": f"{type(exc).__name__}: {exc}"[:2000], "traceback": traceback.format_exc()[-4000:]}


def run_row(ways: list[str], model_name, hidden, graph, device, args) -> dict:
    """Every way of one (graph, model, hidden) row: each way compiled and trained for its
    losses in turn (the runtime's JIT measured per way), then all of them timed interleaved
    (:func:`time_rounds`), then the sparserl way's warm start."""
    import torch
    from torch_sparserl.compiler import passes
    from torch_sparserl.jit import runtime as rt
    from torch_sparserl.tensor import intercept

    results, epochs = {}, {}
    compiles = torch._dynamo.utils.counters["stats"]
    # the worker stops after 30 s without a specialization (the previous row's timing): each
    # row's JIT is measured from the same started state, its restart reported beside it
    prewarm_s = rt.active().prewarm(device) if set(ways) & set(SPARSERL_WAYS) and device.type == "cuda" else None
    reset_compiled()
    try:
        for way in ways:
            if device.type == "cuda":
                # what the ways before cached and no longer use (PyG's gathers on R-MAT: tens of
                # GB) would leave the runtime's worker, another process, no memory to evaluate in
                torch.cuda.empty_cache()
            if way not in SPARSERL_WAYS:
                intercept.deactivate_backend()  # the baselines run as in a process without sparserl
            else:
                runtime = rt.active()  # one runtime for the process (main configures and prewarms it)
                before = dict(runtime.stats), SPECIALIZED["keys"]
                passes.REPORTS.clear()  # what an earlier way compiled is not this way's
            try:
                task = build_task(way, model_name, hidden, graph, device, args)
                results[way], epochs[way] = start_training(task, list(task.parameters()), device, args.min_chunk_s)
            except Exception as exc:  # noqa: BLE001 - recorded, the row goes on
                results[way] = _failed(exc)
                epochs.pop(way, None)
            if way in SPARSERL_WAYS and results[way]["status"] == "ok":
                result = results[way]
                result["fused_epilogues"] = sorted({line for report in passes.REPORTS for line in report.fused})
                passes.REPORTS.clear()
                result["jit_s"] = runtime.stats["jit_s"] - before[0]["jit_s"]
                result["jit_keys"] = SPECIALIZED["keys"] - before[1]
                result["runtime_stats"] = dict(runtime.stats)
                A = graph[f"csr_matrix_{model_name}"]
                result["kernels"] = runtime.decisions(A.crow, A.col, A.shape[1])
            _print_way(model_name, hidden, way, results[way])
        unique_graphs = compiles["unique_graphs"]
        worker_stops = rt.active().stats.get("worker_stops", 0)
        time_rounds(epochs, results, device, args.chunks)
        timing = {"recompiled": compiles["unique_graphs"] - unique_graphs,
                  "worker_stops": rt.active().stats.get("worker_stops", 0) - worker_stops}
    finally:
        epochs.clear()
        reset_compiled()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if args.warm and results.get("sparserl", {}).get("status") == "ok":
        try:
            results["sparserl"]["warm"] = warm_start("sparserl", model_name, hidden, graph, device, args)
        except Exception as exc:  # noqa: BLE001
            results["sparserl"]["warm"] = _failed(exc)
    return {"ways": results, "timing": timing, "runtime_prewarm_s": prewarm_s}


def _print_way(model_name, hidden, way, r) -> None:
    print(f"  {model_name:4s} h={hidden:3d} {way:8s} "
          + (f"first {r['first_epoch_s']:.1f} s, loss {r['losses'][-1]:.5f}"
             + (f", JIT {r['jit_s']:.1f} s ({r['jit_keys']} keys)" if "jit_s" in r else "")
             if r["status"] == "ok" else f"{r['status']}: {r.get('error', '')[:300]}"), flush=True)


def fresh_copy(A):
    """``A`` on new index tensors: its pattern's transpose, fingerprint and decisions are
    computed again, as in a new process."""
    import torch_sparserl as ts

    return ts.csr((A.crow.clone(), A.col.clone(), A.val.clone()), shape=A.shape)


def warm_start(way, model_name, hidden, graph, device, args) -> dict:
    """What the next run on this graph pays: a fresh runtime reading the same disk cache, a
    fresh copy of the adjacency (so its fingerprint and transpose are computed again, as in a
    new process), compiled again; the first epoch, timed. A key missing from the cache is
    counted (``cache_misses``) and served by cuSPARSE, never specialized here."""
    import torch
    from torch_sparserl.jit import runtime as rt
    from torch_sparserl.jit.cache import KernelCache

    cold = rt.active()
    missed = []

    def no_specializing(key, crow, col, ncols):
        missed.append(f"{key.op} n={key.n}")
        raise RuntimeError("warm start: the key is not in the disk cache")

    no_specializing.policy_id = cold.policy_id
    warm = rt.Runtime(cold.settings, cache=KernelCache(cold.cache.root), specializer=no_specializing)
    fresh = fresh_copy(graph[f"csr_matrix_{model_name}"])
    rt.set_active(warm)
    reset_compiled()
    try:
        epoch = epoch_fn(build_task(way, model_name, hidden, graph, device, args, adjacency=fresh))
        _sync(device)
        start = time.perf_counter()
        loss = epoch()
        _sync(device)
        first_s = time.perf_counter() - start
    finally:
        reset_compiled()
        rt.set_active(cold)
        warm.close()
    return {"jit_s": warm.stats["jit_s"], "first_epoch_s": first_s, "loss": float(loss.detach()),
            "cache_misses": missed, "installs": warm.stats["installs"]}


SPECIALIZED = {"keys": 0}  # keys the process's runtime specialized (cache misses)


def start_runtime(policy: str, device) -> float | None:
    """Configure the process's runtime (sync: the first epoch waits for every kernel), count
    the keys its specializer decides, and prewarm it (sandbox worker, policy): returns the
    prewarm's seconds. The JIT time of a way is the runtime's own ``stats["jit_s"]``: what
    products waited for decisions (fingerprints, cache, specialization, builds)."""
    from torch_sparserl.jit import runtime as rt

    runtime = rt.configure(mode="sync", policy=policy)
    specialize = runtime.specializer

    def counted(*a, **k):
        SPECIALIZED["keys"] += 1
        return specialize(*a, **k)

    counted.policy_id = runtime.policy_id
    runtime.specializer = counted
    counted.prewarm = getattr(specialize, "prewarm", None)
    return runtime.prewarm(device) if device.type == "cuda" else None


def prepare_graph(name: str, device, models=MODELS) -> dict:
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


# ------------------------------------------------------------------------ results


def round_ratios(ways: dict, num: str, den: str) -> list[float] | None:
    """``num``'s chunk time over ``den``'s, round by round (interleaved runs: adjacent in time)."""
    a, b = ways.get(num, {}).get("chunk_ms"), ways.get(den, {}).get("chunk_ms")
    if not a or not b or len(a) != len(b):
        return None
    return [x / y for x, y in zip(a, b)]


def row_metrics(row: dict) -> dict:
    ways = row["ways"]
    ms = {w: ways[w]["epoch_ms"] for w in WAYS if ways.get(w, {}).get("status") == "ok"}
    out = {}
    if "sparserl" in ms:
        ours = ms["sparserl"]
        if "eager" in ms:
            out["speedup_vs_eager"] = ms["eager"] / ours
            if bounds := _bounds(ways, "eager", "sparserl"):
                out["speedup_vs_eager_rounds"] = bounds
        best = [ms[w] for w in ("inductor", "pyg") if w in ms]
        if best:
            out["speedup_vs_best_other"] = min(best) / ours
        jit = ways["sparserl"].get("jit_s")
        saved = ms.get("eager", 0) - ours
        if jit is not None:
            out["jit_s"] = jit
            out["breakeven_epochs_vs_eager"] = jit * 1e3 / saved if saved > 0 else None
        warm = ways["sparserl"].get("warm")
        if warm:
            out["warm_jit_s"] = warm["jit_s"]
            out["warm_breakeven_epochs_vs_eager"] = warm["jit_s"] * 1e3 / saved if saved > 0 else None
            out["warm_cache_misses"] = len(warm["cache_misses"])
    fused = ways.get("sparserl_fused", {})
    if "sparserl" in ms and fused.get("status") == "ok":
        out["fusion_speedup"] = ms["sparserl"] / fused["epoch_ms"]
    uncompiled = ways.get("sparserl_eager", {})
    if uncompiled.get("status") == "ok":
        if "eager" in ms:
            out["uncompiled_vs_eager"] = ms["eager"] / uncompiled["epoch_ms"]
        if "sparserl" in ms:
            out["uncompiled_vs_compiled"] = ms["sparserl"] / uncompiled["epoch_ms"]
    subclass = ways.get("sparserl_subclass", {})
    if "sparserl" in ms and subclass.get("status") == "ok":
        out["flatten_speedup"] = subclass["epoch_ms"] / ms["sparserl"]
    python = ways.get("sparserl_python", {})
    if "sparserl" in ms and python.get("status") == "ok":
        out["fast_path_speedup"] = python["epoch_ms"] / ms["sparserl"]
    graphs = ways.get("sparserl_cudagraphs", {})
    if graphs.get("status") == "ok" and "eager" in ms:
        out["cudagraphs_vs_eager"] = ms["eager"] / graphs["epoch_ms"]
        best = [ms[w] for w in ("inductor", "pyg") if w in ms]
        if best:
            out["cudagraphs_vs_best_other"] = min(best) / graphs["epoch_ms"]
    bound = ways.get("bound_inductor", {})
    if bound.get("status") == "ok" and "eager" in ms:
        out["bound_vs_eager"] = ms["eager"] / bound["epoch_ms"]
    finals = {w: ways[w]["losses"][-1] for w in WAYS + EXTRA_WAYS
              if w not in BOUND_WAYS and ways.get(w, {}).get("status") == "ok"}
    if len(finals) > 1:
        ref = finals.get("eager", next(iter(finals.values())))
        out["loss_max_rel_diff"] = max(abs(v - ref) / abs(ref) for v in finals.values())
        out["losses_equal"] = out["loss_max_rel_diff"] <= LOSS_RTOL
    return out


def _fmt(v, spec=".2f", suffix=""):
    return "—" if v is None else f"{v:{spec}}{suffix}"


def _bounds(ways: dict, num: str, den: str):
    rounds = round_ratios(ways, num, den)
    return [min(rounds), max(rounds)] if rounds else None


def _range(bounds) -> str:
    return "" if not bounds else f" ({bounds[0]:.2f}–{bounds[1]:.2f})"


def _way_section(rows, way, intro, columns, align, cells, mean) -> list[str]:
    """The Markdown section of an extra way: ``intro``, then a table of the rows that ran it
    (graph, model, hidden, then ``cells(row, metrics)``) and the ``mean(selected)`` line."""
    selected = [(r, row_metrics(r)) for r in rows if way in r["ways"]]
    if not selected:
        return []
    def line(values):
        return "|" + "|".join(f" {v} " if v else " " for v in values) + "|"

    lines = ["", intro, "", line(["graph", "model", "hidden", *columns]), "|---|---|---:|" + align + "|"]
    lines += [line([r["graph"], r["model"], str(r["hidden"]), *cells(r, m)]) for r, m in selected]
    return lines + [line(mean(selected))]


def markdown(doc: dict) -> str:
    env = doc.get("env", {})
    lines = [f"# GNN epoch time — {env.get('gpu', '?')}", ""]
    if doc.get("superseded"):
        lines += [f"> **Superseded:** {doc['superseded']}", ""]
    lines += [
             f"torch {env.get('torch')}, CUDA {env.get('cuda')}; features {FEATURES}, classes {CLASSES}, "
             f"Adam, fp32. Epoch = forward + loss + backward + step; after {LOSS_EPOCHS} epochs per way, the "
             "ways' timed chunks run interleaved, round by round, and a way's epoch is the median chunk's mean; "
             "in parentheses, the lowest and highest ratio of one round's adjacent chunks. Speedups are sparserl's over the way named. JIT = the time products "
             "waited for the runtime's decisions (fingerprints, kernel cache, policy, validation, builds) "
             "over every key: *cold* with an empty kernel cache (the first run on a graph), *warm* in a "
             "fresh runtime on the same disk cache with a fresh copy of the adjacency (every later run); "
             "break-even = JIT / (eager epoch − sparserl epoch).", "",
             "| graph | nodes | nnz | model | hidden | eager ms | inductor ms | pyg ms | sparserl ms | vs eager "
             "| vs best other | JIT s cold | break-even epochs cold | JIT ms warm | break-even epochs warm "
             "| final losses equal |",
             "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    rows = doc.get("rows", [])
    for row in rows:
        m = row_metrics(row)
        cells = []
        for w in WAYS:
            r = row["ways"].get(w, {})
            cells.append(_fmt(r.get("epoch_ms"), ".2f") if r.get("status") == "ok" else r.get("status", "—"))
        lines.append(f"| {row['graph']} | {row['n']:,} | {row['nnz']:,} | {row['model']} | {row['hidden']} | "
                     + " | ".join(cells)
                     + f" | {_fmt(m.get('speedup_vs_eager'), '.2f', '×')}{_range(m.get('speedup_vs_eager_rounds'))}"
                     f" | {_fmt(m.get('speedup_vs_best_other'), '.2f', '×')}"
                     f" | {_fmt(m.get('jit_s'), '.1f')} | {_fmt(m.get('breakeven_epochs_vs_eager'), '.0f')}"
                     f" | {_fmt(m['warm_jit_s'] * 1e3 if 'warm_jit_s' in m else None, '.1f')}"
                     + (f" ({m['warm_cache_misses']} missed)" if m.get("warm_cache_misses") else "")
                     + f" | {_fmt(m.get('warm_breakeven_epochs_vs_eager'), '.1f')}"
                     f" | {'yes' if m.get('losses_equal') else 'no'} ({_fmt(m.get('loss_max_rel_diff'), '.1e')}) |")
    lines += ["", "Geometric means over the graphs:", "",
              "| model | hidden | vs eager | vs best of inductor, pyg |", "|---|---:|---:|---:|"]
    for model in dict.fromkeys(r["model"] for r in rows):
        for hidden in sorted({r["hidden"] for r in rows if r["model"] == model}):
            ms = [row_metrics(r) for r in rows if r["model"] == model and r["hidden"] == hidden]
            if ms:
                lines.append(f"| {model} | {hidden} | {_fmt(geomean(m.get('speedup_vs_eager') for m in ms), '.2f', '×')} | "
                             f"{_fmt(geomean(m.get('speedup_vs_best_other') for m in ms), '.2f', '×')} |")
    every = [row_metrics(r) for r in rows]
    graphs = list(dict.fromkeys(r["graph"] for r in rows))
    per_graph = {g: [row_metrics(r) for r in rows if r["graph"] == g] for g in graphs}
    means = {g: (geomean(m.get("speedup_vs_eager") for m in ms), geomean(m.get("speedup_vs_best_other") for m in ms))
             for g, ms in per_graph.items()}
    for g in graphs:
        lines.append(f"| {g} (its {len(per_graph[g])} rows) | | {_fmt(means[g][0], '.2f', '×')} | {_fmt(means[g][1], '.2f', '×')} |")
    lines.append(f"| over the graphs (each graph one mean) | | {_fmt(geomean(v[0] for v in means.values()), '.2f', '×')} | "
                 f"{_fmt(geomean(v[1] for v in means.values()), '.2f', '×')} |")
    lines.append(f"| all rows | | {_fmt(geomean(m.get('speedup_vs_eager') for m in every), '.2f', '×')} | "
                 f"{_fmt(geomean(m.get('speedup_vs_best_other') for m in every), '.2f', '×')} |")
    lines += _way_section(
        rows, "sparserl_fused",
        "Fused epilogues: sparserl_fused (the post-grad pass fuses the layer tail into the product's kernel "
        "where that kernel stores each row once) against sparserl (Inductor's pointwise kernel after the "
        "product), same kernels otherwise:",
        ["fused ms", "unfused ms", "fusion speedup", "fused chains"], "---:|---:|---:|---",
        lambda r, m: [_fmt(r["ways"]["sparserl_fused"].get("epoch_ms"), ".3f"),
                      _fmt(r["ways"].get("sparserl", {}).get("epoch_ms"), ".3f"),
                      _fmt(m.get("fusion_speedup"), ".3f", "×"),
                      "; ".join(r["ways"]["sparserl_fused"].get("fused_epilogues", [])) or "—"],
        lambda sel: ["geometric mean", "", "", "", "", _fmt(geomean(m.get("fusion_speedup") for _, m in sel), ".3f", "×"), ""])
    lines += _way_section(
        rows, "sparserl_eager",
        "Without torch.compile: sparserl_eager (the CSRMatrix model run eagerly, same runtime and kernels) "
        "against eager torch.sparse and against sparserl compiled:",
        ["sparserl_eager ms", "vs eager", "vs sparserl compiled"], "---:|---:|---:",
        lambda r, m: [_fmt(r["ways"]["sparserl_eager"].get("epoch_ms"), ".2f"),
                      _fmt(m.get("uncompiled_vs_eager"), ".2f", "×"), _fmt(m.get("uncompiled_vs_compiled"), ".2f", "×")],
        lambda sel: ["geometric mean", "", "", "", _fmt(geomean(m.get("uncompiled_vs_eager") for _, m in sel), ".2f", "×"),
                     _fmt(geomean(m.get("uncompiled_vs_compiled") for _, m in sel), ".2f", "×")])

    def against_sparserl(way: str, text: str, names: list[str], metric: str) -> list[str]:
        """A section of one variant of the sparserl way timed in the same rounds: its epoch,
        sparserl's, and sparserl's speedup over it (with the rounds' range)."""
        return _way_section(
            rows, way, text, names, "---:|---:|---:",
            lambda r, m: [_fmt(r["ways"][way].get("epoch_ms"), ".3f"), _fmt(r["ways"].get("sparserl", {}).get("epoch_ms"), ".3f"),
                          _fmt(m.get(metric), ".3f", "×") + _range(_bounds(r["ways"], way, "sparserl"))],
            lambda sel: ["geometric mean", "", "", "", "", _fmt(geomean(m.get(metric) for _, m in sel), ".3f", "×")])

    lines += against_sparserl(
        "sparserl_subclass",
        "Flattened CSRMatrix inputs: sparserl (the backend hands the matrix to AOTAutograd as its parts, the "
        "default) against sparserl_subclass (options={\"flatten_matrices\": False}), same kernels, same rounds:",
        ["subclass ms", "flattened ms", "flattening speedup"], "flatten_speedup")
    lines += against_sparserl(
        "sparserl_python",
        "C++ fast path: sparserl (compiled products served in C++ once Python has served the same call, the "
        "default) against sparserl_python (options={\"fast_path\": False}: every product through its Python "
        "implementation), same kernels, same rounds:",
        ["python ms", "fast path ms", "fast path speedup"], "fast_path_speedup")

    def over_graphs(sel, key):
        per_graph = {}
        for r, m in sel:
            per_graph.setdefault(r["graph"], []).append(m.get(key))
        return _fmt(geomean(geomean(v) for v in per_graph.values()), ".2f", "×")

    lines += _way_section(
        rows, "sparserl_cudagraphs",
        "Under CUDA graphs: sparserl_cudagraphs (the sparserl way compiled with mode=\"reduce-overhead\"), "
        "timed in the same rounds, against eager torch.sparse and the best of Inductor and PyG (default mode):",
        ["sparserl_cudagraphs ms", "vs eager", "vs best other"], "---:|---:|---:",
        lambda r, m: [_fmt(r["ways"]["sparserl_cudagraphs"].get("epoch_ms"), ".2f"),
                      _fmt(m.get("cudagraphs_vs_eager"), ".2f", "×") + _range(_bounds(r["ways"], "eager", "sparserl_cudagraphs")),
                      _fmt(m.get("cudagraphs_vs_best_other"), ".2f", "×")],
        lambda sel: ["geometric mean over the graphs (each graph one mean)", "", "", "",
                     over_graphs(sel, "cudagraphs_vs_eager"), over_graphs(sel, "cudagraphs_vs_best_other")])

    lines += _way_section(
        rows, "bound_inductor",
        "The bound of a compiled way: bound_inductor is the model compiled by Inductor with the adjacency "
        "product taken out, what a compiled epoch would cost with free sparse products (Dynamo, AOTAutograd "
        "and Inductor's per-call work, the dense layers, the loss, Adam). Eager over it is the most any "
        "compiled way could gain over eager on that row:",
        ["eager ms", "bound_inductor ms", "bound vs eager", "sparserl vs eager"], "---:|---:|---:|---:",
        lambda r, m: [_fmt(r["ways"].get("eager", {}).get("epoch_ms"), ".2f"),
                      _fmt(r["ways"]["bound_inductor"].get("epoch_ms"), ".2f"),
                      _fmt(m.get("bound_vs_eager"), ".2f", "×"), _fmt(m.get("speedup_vs_eager"), ".2f", "×")],
        lambda sel: ["geometric mean over the graphs (each graph one mean)", "", "", "", "",
                     over_graphs(sel, "bound_vs_eager"), over_graphs(sel, "speedup_vs_eager")])
    disturbed = [f"{r['graph']} {r['model']} {r['hidden']}: {t.get('recompiled', 0)} recompilations, "
                 f"{t.get('worker_stops', 0)} worker stops" for r in rows
                 for t in [r.get("timing", {})] if t.get("recompiled") or t.get("worker_stops")]
    if any("timing" in r for r in rows):
        lines += ["", "While the rounds were timed: " + ("; ".join(disturbed) if disturbed else
                  "no recompilation and no stop of the specializer's worker on any row") + "."]
    lines += ["", "Runs (the runtime's one-time start — sandbox worker, policy load — is done by a prewarm "
              "before the first graph, and again before each row in case the worker stopped idle; it is not "
              "in any row's JIT):", ""]
    lines += [f"- `{r['command']}` ({r['started']}; compile mode {r.get('compile_mode', 'default')}; prewarm "
              f"{_fmt(r.get('runtime_prewarm_s'), '.1f', ' s')})" + (f". {r['note']}" if r.get("note") else "")
              for r in doc.get("runs", [])]
    return "\n".join(lines) + "\n"


def svg(doc: dict) -> str:
    """Epoch-time speedup over eager cuSPARSE of each way, grouped per (graph, model, hidden)."""
    rows = doc.get("rows", [])
    colors = {"inductor": "#8c8c8c", "pyg": "#e39b2d", "sparserl": "#2b6cb0"}
    groups = []
    for row in rows:
        eager = row["ways"].get("eager", {})
        if eager.get("status") != "ok":
            continue
        bars = {w: eager["epoch_ms"] / row["ways"][w]["epoch_ms"] for w in colors
                if row["ways"].get(w, {}).get("status") == "ok"}
        groups.append((f"{row['graph'][:14]} {row['model']} {row['hidden']}", bars))
    hi = max([2.0] + [v for _, b in groups for v in b.values()])
    left, top, plot_h, bar_w, gap = 50, 40, 260, 10, 14
    width = max(600, left + len(groups) * (3 * bar_w + gap) + 20)
    height = top + plot_h + 150
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
           f'font-size="10"><rect width="100%" height="100%" fill="white"/>',
           f'<text x="{left}" y="20" font-size="13" font-weight="bold">'
           f'{html.escape("GNN epoch-time speedup over eager cuSPARSE — " + str(doc.get("env", {}).get("gpu", "?")))}</text>']

    def y_of(v):
        return top + plot_h * (1 - v / hi)

    for tick in np.arange(0, hi + 1e-9, 0.5):
        out.append(f'<line x1="{left}" x2="{width - 10}" y1="{y_of(tick):.1f}" y2="{y_of(tick):.1f}" '
                   f'stroke="{"#000" if tick == 1 else "#ddd"}"/><text x="{left - 4}" y="{y_of(tick) + 3:.1f}" '
                   f'text-anchor="end">{tick:.1f}×</text>')
    for i, (label, bars) in enumerate(groups):
        x0 = left + 6 + i * (3 * bar_w + gap)
        for j, way in enumerate(colors):
            if way in bars:
                y = y_of(bars[way])
                out.append(f'<rect x="{x0 + j * bar_w}" y="{y:.1f}" width="{bar_w - 1}" height="{top + plot_h - y:.1f}" '
                           f'fill="{colors[way]}"><title>{html.escape(label)} {way}: {bars[way]:.2f}×</title></rect>')
        out.append(f'<text transform="translate({x0 + bar_w},{top + plot_h + 6}) rotate(60)">{html.escape(label)}</text>')
    for j, (way, color) in enumerate(colors.items()):
        out.append(f'<rect x="{left + j * 90}" y="{height - 18}" width="10" height="10" fill="{color}"/>'
                   f'<text x="{left + j * 90 + 14}" y="{height - 9}">{way}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def save(doc: dict, path: Path) -> None:
    write_json_md(doc, path, markdown, svg)


COMPARED = (("speedup_vs_eager", "sparserl vs eager"), ("speedup_vs_best_other", "sparserl vs best other"),
            ("cudagraphs_vs_eager", "sparserl_cudagraphs vs eager"))


def compare(paths: list[Path]) -> str:
    """How far repeated runs agree: each row's speedups in every run, the means over the graphs
    per run, and their spread. Rows are matched by (graph, model, hidden)."""
    docs = [json.loads(Path(p).read_text()) for p in paths]
    names = [Path(p).stem for p in paths]
    keyed = [{(r["graph"], r["model"], r["hidden"]): row_metrics(r) for r in d.get("rows", [])} for d in docs]
    keys = [k for k in dict.fromkeys(k for runs in keyed for k in runs) if all(k in runs for runs in keyed)]
    lines = [f"# GNN epoch time: {len(docs)} runs compared", "",
             "Runs: " + ", ".join(f"`{n}`" for n in names) + f". Rows present in every run: {len(keys)}. Each "
             "speedup is the baseline's epoch time over the sparserl way's, both from the same run.", ""]
    for metric, title in COMPARED:
        if not any(runs[k].get(metric) is not None for runs in keyed for k in keys):
            continue
        lines += [f"## {title}", "", "| graph | model | hidden | " + " | ".join(f"run {i + 1}" for i in range(len(docs)))
                  + " | spread (max/min) |", "|---|---|---:|" + "---:|" * (len(docs) + 1)]
        for k in keys:
            values = [runs[k].get(metric) for runs in keyed]
            spread = max(values) / min(values) if None not in values else None
            lines.append(f"| {k[0]} | {k[1]} | {k[2]} | " + " | ".join(_fmt(v, ".2f", "×") for v in values)
                         + f" | {_fmt(spread, '.2f')} |")
        per_run = []
        for runs in keyed:
            graphs = {}
            for k in keys:
                graphs.setdefault(k[0], []).append(runs[k].get(metric))
            per_run.append({g: geomean(v) for g, v in graphs.items()})
        for g in per_run[0]:
            lines.append(f"| {g} (its rows) | | | " + " | ".join(_fmt(run[g], ".2f", "×") for run in per_run) + " | |")
        overall = [geomean(run.values()) for run in per_run]
        lines += [f"| **over the graphs** | | | " + " | ".join(_fmt(v, ".2f", "×") for v in overall)
                  + f" | {_fmt(max(overall) / min(overall) if None not in overall else None, '.2f')} |", ""]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- main


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--graphs", default=",".join(GRAPHS))
    parser.add_argument("--models", default=",".join(MODELS), help=f"some of {ALL_MODELS} (gat: PyG's GATConv)")
    parser.add_argument("--hidden", default=",".join(map(str, HIDDEN)))
    parser.add_argument("--ways", default=",".join(WAYS))
    parser.add_argument("--out", default="benchmarks/results", help="folder (a dated file in it) or a .json path")
    parser.add_argument("--resume", help="add to this results file (rows already there are skipped)")
    parser.add_argument("--report", help="only re-render the .md and .svg of this results file")
    parser.add_argument("--compare", nargs="+", metavar="JSON",
                        help="only compare these results files (repeated runs): Markdown to --out (a .md path) or stdout")
    parser.add_argument("--chunks", type=int, default=5, help="timed rounds (one chunk of every way each)")
    parser.add_argument("--min-chunk-s", type=float, default=0.3)
    parser.add_argument("--policy", default="learned", choices=("learned", "autotune"))
    parser.add_argument("--mode", default="default", choices=("default", "reduce-overhead", "max-autotune-no-cudagraphs"),
                        help="torch.compile mode of the inductor and sparserl ways")
    parser.add_argument("--cache-dir", help="the kernel cache (default: a fresh empty folder, so JIT is measured)")
    parser.add_argument("--no-warm", dest="warm", action="store_false",
                        help="skip the warm start (the next run's JIT: a fresh runtime on the same disk cache)")
    parser.add_argument("--device", default="cuda" if _cuda() else "cpu")
    parser.add_argument("--max-time-s", type=float, default=None, help="start no graph after this much time")
    args = parser.parse_args(argv)

    if args.compare:
        emit_markdown(compare([Path(p) for p in args.compare]), args.out)
        return 0
    if args.report:
        path = Path(args.report)
        save(json.loads(path.read_text()), path)
        return 0
    os.environ["SPARSERL_CACHE_DIR"] = args.cache_dir or tempfile.mkdtemp(prefix="sparserl-gnn-cache-")
    import torch
    import torch_sparserl.integrations.pyg  # noqa: F401  (PyG's own layers are used by the pyg way only)
    from bench_kernels import environment

    device = torch.device(args.device)
    env = environment()
    if args.resume:
        path = Path(args.resume)
        doc = json.loads(path.read_text())
    else:
        out = Path(args.out)
        path = out if out.suffix == ".json" else out / f"gnn-{env['gpu_slug']}-{dt.date.today().isoformat()}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        doc = {"schema": SCHEMA, "env": env, "runs": [], "rows": []}
    unknown_models = set(args.models.split(",")) - set(ALL_MODELS)
    if unknown_models:
        parser.error(f"--models: unknown {sorted(unknown_models)} (expected some of {ALL_MODELS})")
    ways = args.ways.split(",")
    unknown = set(ways) - set(WAYS + EXTRA_WAYS)
    if unknown:
        parser.error(f"--ways: unknown {sorted(unknown)} (expected some of {WAYS + EXTRA_WAYS})")
    wants_runtime = set(SPARSERL_WAYS) & set(ways)
    prewarm_s = start_runtime(args.policy, device) if wants_runtime else None
    doc["runs"].append({"started": dt.datetime.now().isoformat(timespec="seconds"),
                        "command": " ".join(["python benchmarks/bench_gnn.py"] + (argv if argv is not None else sys.argv[1:])),
                        "env": env, "compile_mode": args.mode, "runtime_prewarm_s": prewarm_s})
    done = {(r["graph"], r["model"], r["hidden"]) for r in doc["rows"]}
    started = time.perf_counter()
    for name in split_graphs(args.graphs):
        todo = [(m, int(h)) for m in args.models.split(",") for h in args.hidden.split(",") if (name, m, int(h)) not in done]
        if not todo:
            continue
        if args.max_time_s is not None and time.perf_counter() - started > args.max_time_s:
            print(f"bench_gnn: time limit reached before {name}", flush=True)
            save(doc, path)
            return 3
        graph = prepare_graph(name, device, models=list(dict.fromkeys(m for m, _ in todo)))
        print(f"{name}: {graph['n']:,} nodes, {graph['nnz']:,} edges, prepared in {graph['load_s']:.1f} s", flush=True)
        for model_name, hidden in todo:
            row = {"graph": name, "n": graph["n"], "nnz": graph["nnz"], "model": model_name, "hidden": hidden}
            row.update(run_row(ways, model_name, hidden, graph, device, args))
            for way, r in row["ways"].items():
                if r.get("status") == "ok":
                    print(f"  {model_name:4s} h={hidden:3d} {way:8s} {r['epoch_ms']:8.3f} ms/epoch "
                          f"(chunks {', '.join(f'{v:.3f}' for v in r['chunk_ms'])})", flush=True)
            row.update(row_metrics(row))
            doc["rows"].append(row)
            save(doc, path)
        del graph
    save(doc, path)
    print(f"wrote {path}", flush=True)
    return 0


def _cuda() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except ImportError:  # pragma: no cover
        return False


if __name__ == "__main__":
    sys.exit(main())
