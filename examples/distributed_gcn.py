"""Full-graph GCN (or GraphSAGE) training with the graph partitioned over the ranks, checked
against one process.

    torchrun --nproc_per_node 2 examples/distributed_gcn.py                       # cora, CPUs, gloo
    torchrun --nproc_per_node 4 examples/distributed_gcn.py --device cuda --graph ../shared/matrices/pubmed.npz \\
        --order rcm --out result.json
    torchrun --nproc_per_node 4 examples/distributed_gcn.py --device cuda --model sage --rows-only \\
        --graph power_law:nodes=2^27,edge_factor=16 --no-check   # each rank makes only its rows

Unlike ``examples/ddp_gcn.py``, where every rank holds the whole graph, each rank here holds its
rows of the adjacency (``ts.distributed.distribute_csr``) and of the features and activations:
a product ``adj @ h`` receives the rows of ``h`` its block reads from the other ranks (the
halo) while it multiplies its own. The model's parameters are replicated; after each backward
the ranks sum their gradients (``all_reduce``), so every rank takes the step one process would
take on the whole graph. The loss is the mean over all training nodes: each rank sums its own
nodes' losses and divides by their total count.

Rank 0 trains one process on the whole graph from the same start (``--no-check`` skips it, for
a graph that does not fit one device) and compares: the summed gradient at the start and the
loss of every step. In float32 it also trains one process in float64: runs that sum in another
order drift apart over Adam's steps, and where the two float32 runs differ by more than
``LOSS_RTOL`` the partitioned one passes if it is as close to the float64 losses as one process
is (within a factor of 2). The JSON written to ``--out`` holds, per rank, its rows and halo, the halo
bytes it sends and receives per product, its epoch time, the time it waited for the halo and
computed, and its peak memory; with ``--without-halo N``, also its epoch over N more epochs with
the halo exchange left out (the halo zeros): what the exchange costs where it is not hidden.

``--rows-only`` builds each rank's blocks from its own rows alone
(``ts.distributed.DistributedCSRMatrix.from_local``), read from a ``.npz`` with
``torch_sparserl.data.datasets.load_rows``: the path for a graph no host holds whole. Here the
whole graph is still loaded to normalize it, partition it and check the run; such a graph
needs its adjacency and its partition prepared once, offline (docs/distributed.md). With a
``power_law:...`` graph (``torch_sparserl.data.synthetic.power_law``) and ``--rows-only``, no host
holds the graph at all: each rank generates its own contiguous rows of it
(``synthetic.power_law_rows``), their neighbours' mean (``--model sage``: a row's normalization
needs only the row), and its rows of the features and labels, which are drawn per block of rows
so that one process (the check, on a graph that fits) draws the same ones.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time

import numpy as np
import scipy.sparse as sp
import torch
import torch.distributed as dist
import torch.nn.functional as F

import torch_sparserl as ts
from torch_sparserl.data import synthetic
from torch_sparserl.data.datasets import load_rows
from torch_sparserl.jit import runtime as rt

GRAD_RTOL = {torch.float32: 1e-5, torch.float64: 1e-10}  # summed gradients against one process's
LOSS_RTOL = {torch.float32: 1e-5, torch.float64: 1e-10}  # every step's loss, over the run


class GCN(torch.nn.Module):
    def __init__(self, features: int, hidden: int, classes: int):
        super().__init__()
        self.lin1 = torch.nn.Linear(features, hidden)
        self.lin2 = torch.nn.Linear(hidden, classes)

    def forward(self, x, adj):
        return adj @ self.lin2(torch.relu(adj @ self.lin1(x)))


class SAGE(torch.nn.Module):
    """GraphSAGE with mean aggregation: ``lin_self(h) + lin_neigh(mean of the neighbours' h)``."""

    def __init__(self, features: int, hidden: int, classes: int):
        super().__init__()
        self.self1, self.neigh1 = torch.nn.Linear(features, hidden), torch.nn.Linear(features, hidden, bias=False)
        self.self2, self.neigh2 = torch.nn.Linear(hidden, classes), torch.nn.Linear(hidden, classes, bias=False)

    def forward(self, x, adj):
        h = torch.relu(self.self1(x) + self.neigh1(adj @ x))
        return self.self2(h) + adj @ self.neigh2(h)


MODELS = {"gcn": GCN, "sage": SAGE}


def adjacency(A: sp.csr_matrix, model: str) -> sp.csr_matrix:
    """The model's adjacency from ``A``'s pattern without self loops: GCN's
    ``D^-1/2 (A + I) D^-1/2``, SAGE's ``D^-1 A`` (the neighbours' mean)."""
    if model != "gcn":
        return mean_rows(A, 0)
    A = sp.csr_matrix((np.ones(A.nnz), A.indices, A.indptr), shape=A.shape)
    A.setdiag(0)
    A.eliminate_zeros()
    A = (A + sp.identity(A.shape[0], format="csr")).tocsr()
    inv_sqrt = 1.0 / np.sqrt(np.asarray(A.sum(axis=1)).ravel())
    out = (sp.diags(inv_sqrt) @ A @ sp.diags(inv_sqrt)).tocsr()
    out.sort_indices()
    return out


def mean_rows(rows: sp.csr_matrix, start: int) -> sp.csr_matrix:
    """:func:`adjacency`'s SAGE form of rows ``start:start + len`` of a graph, from those rows alone."""
    rows = sp.csr_matrix((np.ones(rows.nnz), rows.indices, rows.indptr), shape=rows.shape)
    diagonal = sp.csr_matrix((np.ones(rows.shape[0]), (np.arange(rows.shape[0]), start + np.arange(rows.shape[0]))),
                             shape=rows.shape)
    rows = (rows - rows.multiply(diagonal)).tocsr()  # no self loops, as adjacency() drops them
    rows.eliminate_zeros()
    out = (sp.diags(1.0 / np.maximum(np.asarray(rows.sum(axis=1)).ravel(), 1.0)) @ rows).tocsr()
    out.sort_indices()
    return out


ROW_BLOCK = 1 << 16  # features and labels are drawn per block of rows: any range comes out the same


def node_data(start: int, stop: int, features: int, classes: int, dtype) -> tuple:
    """Rows ``start:stop`` of the features, labels and training mask of a generated graph."""
    xs, ys = [], []
    for block in range(start // ROW_BLOCK, (max(stop, start + 1) - 1) // ROW_BLOCK + 1):
        g = torch.Generator().manual_seed(1_000_003 * block + 7)
        lo = block * ROW_BLOCK
        keep = slice(max(start, lo) - lo, min(stop, lo + ROW_BLOCK) - lo)
        xs.append(torch.randn(ROW_BLOCK, features, generator=g, dtype=dtype)[keep])
        ys.append(torch.randint(0, classes, (ROW_BLOCK,), generator=g)[keep])
    return torch.cat(xs)[: stop - start], torch.cat(ys)[: stop - start], torch.arange(start, stop) % 2 == 0


def load_graph(name: str) -> sp.csr_matrix:
    """A shipped matrix, a file, or a synthetic spec (``generator:key=value,...``)."""
    if ":" in name and not os.path.exists(name):
        return synthetic.make(name)
    return ts.load_matrix(name)


def train(model, adj, x, y, train_mask, count: int, epochs: int, lr: float, sum_gradients=None, sync=None):
    """``epochs`` Adam steps on the mean loss over the ``count`` training nodes (``train_mask``
    marks this process's); ``sum_gradients`` sums the gradients over the ranks before each step.
    Returns this process's share of every step's loss and the seconds each epoch took."""
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    losses, seconds = [], []
    for _ in range(epochs):
        started = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        out = model(x, adj)
        loss = F.cross_entropy(out[train_mask], y[train_mask], reduction="sum") / count
        loss.backward()
        if sum_gradients is not None:
            sum_gradients(model)
        opt.step()
        losses.append(loss.detach())
        if sync is not None:
            sync()
        seconds.append(time.perf_counter() - started)
    return torch.stack(losses), seconds


class WithoutExchange:
    """A halo exchange that sends nothing: the halo is zeros and the gradient of the rows sent stays
    as it is. With it a rank's epoch is its work alone (``--without-halo``), the numbers wrong."""

    def __init__(self, plan):
        self.plan = plan

    def start_forward(self, X):
        return None

    def finish_forward(self, pending, X):
        return X.new_zeros((self.plan.halo_size, *X.shape[1:]))

    def start_backward(self, grad_halo):
        return None

    def finish_backward(self, pending, grad_X):
        return grad_X


def _alone(rank_report: dict) -> str:
    alone = rank_report["epoch_without_halo_s"]
    return "" if alone is None else f", {alone * 1e3:.1f} ms without the halo exchange"


def _max_rel(losses, reference) -> float:
    """The largest relative difference of ``losses`` from ``reference``, step by step."""
    return max(abs(a - b) / abs(b) for a, b in zip(losses, reference))


def sum_gradients(model) -> None:
    """Sum every parameter's gradient over the ranks, in one all_reduce."""
    grads = [p.grad for p in model.parameters()]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    start = 0
    for g in grads:
        g.copy_(flat[start:start + g.numel()].view_as(g))
        start += g.numel()


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10  # Linux: KiB


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--graph", default="cora", help="a shipped matrix name, a .npz/.mtx path, or a synthetic "
                        "spec such as rmat:scale=22,edge_factor=16 (a power-law graph, the same on every rank)")
    parser.add_argument("--model", choices=sorted(MODELS), default="gcn")
    parser.add_argument("--order", choices=ts.distributed.ORDERS, default="rows", help="how the rows are split")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--backend", choices=("gloo", "nccl"), help="default: nccl on cuda, gloo on cpu")
    parser.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    parser.add_argument("--features", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--classes", type=int, default=16)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--without-halo", type=int, default=0, metavar="EPOCHS",
                        help="after training, time this many more epochs with the halo exchange left out "
                             "(zeros for the halo): each rank's epoch without the exchange")
    parser.add_argument("--timeout", type=float, help="seconds a rank waits for a peer's halo (default: the group's)")
    parser.add_argument("--rows-only", action="store_true",
                        help="each rank reads only its rows of the adjacency from a .npz, or makes them for a "
                        "power_law graph (DistributedCSRMatrix.from_local)")
    parser.add_argument("--no-check", action="store_true", help="skip the one-process run (a graph too large for it)")
    parser.add_argument("--cache-dir", help="the shared kernel cache (default: a new folder made by rank 0)")
    parser.add_argument("--out", help="write the report (JSON) here, from rank 0")
    args = parser.parse_args(argv)

    generated = args.rows_only and args.graph.strip().startswith("power_law:")
    if generated and args.model != "sage":
        parser.error("--rows-only with a power_law graph trains --model sage: the neighbours' mean needs only a "
                     "rank's own rows, GCN's normalization every node's degree")
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available")
    backend = args.backend or ("nccl" if cuda else "gloo")
    if backend == "nccl" and not cuda:
        parser.error("--backend nccl needs --device cuda")
    if args.without_halo < 0:
        parser.error(f"--without-halo must be >= 0 (got {args.without_halo})")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if cuda:
        torch.cuda.set_device(local_rank)  # before the group: NCCL binds each rank to its GPU
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    dtype = getattr(torch, args.dtype)
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else None

    # One kernel cache for all ranks, chosen before the runtime first looks at it.
    shared = [args.cache_dir or (tempfile.mkdtemp(prefix="sparserl-dist-") if rank == 0 else None)]
    dist.broadcast_object_list(shared, src=0)
    os.environ["SPARSERL_CACHE_DIR"] = shared[0]
    runtime = rt.configure(mode="sync")

    M = None
    if generated:  # each rank makes its own rows, and draws its own node data: no host holds the graph
        spec = synthetic.parse_spec(args.graph)[1]
        n = spec.pop("nodes")
        part = ts.distributed.Partition(tuple(n * r // world for r in range(world + 1)), None, order="rows")
        first, last = part.bounds[rank], part.bounds[rank + 1]
        rows = mean_rows(synthetic.power_law_rows(n, first, last, **spec), first)
        adj = ts.distributed.DistributedCSRMatrix.from_local(ts.csr(rows, dtype=dtype), part, device=device,
                                                             timeout=args.timeout)
        x_local, y_local, mask_local = node_data(first, last, args.features, args.classes, dtype)
        count = (n + 1) // 2  # the even nodes
    else:
        M = adjacency(load_graph(args.graph), args.model)
        n = M.shape[0]
        if args.rows_only:
            # Rank 0 writes the adjacency as a graph prepared offline would be (uncompressed: each
            # rank seeks to its rows); every rank then reads only its rows from it.
            part = ts.distributed.partition(M, world, order=args.order)
            path = os.path.join(shared[0], "adjacency.npz")
            if rank == 0:
                sp.save_npz(path, M, compressed=False)
            dist.barrier()
            adj = ts.distributed.DistributedCSRMatrix.from_local(
                ts.csr(load_rows(path, part.rows_of(rank).numpy()), dtype=dtype), part, device=device,
                timeout=args.timeout)
        else:
            adj = ts.distributed.distribute_csr(ts.csr(M, dtype=dtype), order=args.order, device=device,
                                                timeout=args.timeout)
        g = torch.Generator().manual_seed(0)
        x = torch.randn(n, args.features, generator=g, dtype=dtype)
        y = torch.randint(0, args.classes, (n,), generator=g)
        train_mask = torch.zeros(n, dtype=torch.bool)
        train_mask[::2] = True
        count = int(train_mask.sum())
        x_local, y_local, mask_local = adj.shard_rows(x), adj.shard_rows(y), adj.shard_rows(train_mask)
    x_local, y_local, mask_local = x_local.to(device), y_local.to(device), mask_local.to(device)

    torch.manual_seed(0)
    start = MODELS[args.model](args.features, args.hidden, args.classes).to(dtype).state_dict()
    model = MODELS[args.model](args.features, args.hidden, args.classes).to(device=device, dtype=dtype)
    model.load_state_dict(start)

    # The gradient at the start, summed over the ranks (no step taken: training starts from here).
    (F.cross_entropy(model(x_local, adj)[mask_local], y_local[mask_local], reduction="sum") / count).backward()
    sum_gradients(model)
    start_grads = {k: p.grad.detach().clone() for k, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    adj.stats.update(compute_s=0.0, wait_s=0.0, products=0)
    if sync is not None:
        torch.cuda.reset_peak_memory_stats(device)
    shares, seconds = train(model, adj, x_local, y_local, mask_local, count, args.epochs, args.lr, sum_gradients, sync)
    dist.all_reduce(shares)
    losses = shares.tolist()
    stats = dict(adj.stats)
    alone = None
    if args.without_halo:  # the same epochs with the halo exchange left out: what the exchange costs
        exchange, adj.exchange = adj.exchange, WithoutExchange(adj.exchange.plan)
        try:
            alone = train(model, adj, x_local, y_local, mask_local, count, args.without_halo + 1, args.lr,
                          sum_gradients, sync)[1][1:]
        finally:
            adj.exchange = exchange

    timed = seconds[1:] or seconds  # the first epoch specializes the kernels
    rank_report = {"rank": rank, "device": torch.cuda.get_device_name(device) if cuda else "cpu",
                   "rows": adj.local_rows, "local_nnz": adj.local.nnz, "halo_nnz": 0 if adj.halo is None else adj.halo.nnz,
                   "halo_rows": adj.plan.halo_size, "peers": sorted(set(adj.plan.send) | set(adj.plan.recv)),
                   "halo_bytes_per_product": adj.halo_bytes(args.hidden if args.model == "gcn" else args.features),
                   "epoch_s": sum(timed) / len(timed), "epoch_s_all": seconds,
                   "epoch_without_halo_s": sum(alone) / len(alone) if alone else None,
                   "halo_wait_s_per_epoch": stats["wait_s"] / args.epochs,
                   "compute_s_per_epoch": stats["compute_s"] / args.epochs,
                   "products_per_epoch": stats["products"] / args.epochs,
                   "peak_memory_mb": peak_memory_mb(device),
                   # what serves each block's products: the JIT's decisions for two ordinary patterns
                   "kernels": {name: runtime.decisions(block.crow, block.col, block.shape[1])
                               for name, block in (("local", adj.local), ("halo", adj.halo)) if block is not None},
                   "cache_builds": runtime.cache.stats["builds"]}
    reports = [None] * world
    dist.all_gather_object(reports, rank_report)

    status = 0
    if rank == 0:
        nnz = int(M.nnz) if M is not None else sum(r["local_nnz"] + r["halo_nnz"] for r in reports)
        report = {"graph": args.graph, "model": args.model, "nodes": n, "nnz": nnz, "world_size": world,
                  "backend": backend, "order": adj.partition.order, "rows_only": args.rows_only, "dtype": args.dtype, "epochs": args.epochs,
                  "hidden": args.hidden, "features": args.features, "ranks": reports, "losses": losses,
                  "epoch_s": max(r["epoch_s"] for r in reports),
                  "epoch_without_halo_s": (max(r["epoch_without_halo_s"] for r in reports)
                                           if args.without_halo else None)}
        ok = True
        if not args.no_check:
            if generated:  # the same graph and node data, whole, in one process
                M = mean_rows(synthetic.make(args.graph), 0)
                x, y, train_mask = node_data(0, n, args.features, args.classes, dtype)
            single = MODELS[args.model](args.features, args.hidden, args.classes).to(device=device, dtype=dtype)
            single.load_state_dict(start)
            whole = ts.csr(M, dtype=dtype, device=device, index_dtype=torch.int32)
            xd, yd, maskd = x.to(device), y.to(device), train_mask.to(device)
            (F.cross_entropy(single(xd, whole)[maskd], yd[maskd], reduction="sum") / count).backward()
            grad_diff = max(float((start_grads[k] - p.grad).norm() / p.grad.norm().clamp(min=1e-30))
                            for k, p in single.named_parameters())
            single.zero_grad(set_to_none=True)
            single_losses, _ = train(single, whole, xd, yd, maskd, count, args.epochs, args.lr)
            single_losses = single_losses.tolist()
            loss_diff = _max_rel(losses, single_losses)
            ok = grad_diff < GRAD_RTOL[dtype] and loss_diff < LOSS_RTOL[dtype]
            report.update(single_process_losses=single_losses, max_rel_grad_diff_at_start=grad_diff,
                          max_rel_loss_diff=loss_diff)
            closeness = ""
            if dtype == torch.float32:
                # Float32 runs that sum in different orders drift apart over Adam's steps. Where the
                # two differ by more than LOSS_RTOL, the run is still right if it is as close to
                # one process in float64 as one process in float32 is (within a factor of 2).
                exact = MODELS[args.model](args.features, args.hidden, args.classes).to(device=device,
                                                                                       dtype=torch.float64)
                exact.load_state_dict({k: v.double() for k, v in start.items()})
                exact_losses, _ = train(exact, ts.csr(M, dtype=torch.float64, device=device), xd.double(), yd, maskd,
                                        count, args.epochs, args.lr)
                exact_losses = exact_losses.tolist()
                error, single_error = _max_rel(losses, exact_losses), _max_rel(single_losses, exact_losses)
                ok = grad_diff < GRAD_RTOL[dtype] and (loss_diff < LOSS_RTOL[dtype] or error <= 2 * single_error)
                report.update(float64_losses=exact_losses, max_rel_loss_error=error,
                              single_process_max_rel_loss_error=single_error)
                closeness = (f"; against one process in float64: {error:.2e} (one process in float32: "
                             f"{single_error:.2e})")
            print(f"{world} ranks: losses first {losses[0]:.6f}, last {losses[-1]:.6f}; one process: first "
                  f"{single_losses[0]:.6f}, last {single_losses[-1]:.6f}; gradient at the start: max relative "
                  f"difference {grad_diff:.2e}; max relative loss difference {loss_diff:.2e}{closeness}; "
                  f"{'OK' if ok else 'MISMATCH'}")
        report["ok"] = ok
        for r in reports:
            print(f"rank {r['rank']}: {r['rows']} rows, {r['local_nnz']} + {r['halo_nnz']} (halo) nonzeros, "
                  f"{r['halo_rows']} halo rows; epoch {r['epoch_s'] * 1e3:.1f} ms"
                  f"{_alone(r)} (halo wait "
                  f"{r['halo_wait_s_per_epoch'] * 1e3:.1f} ms, products {r['compute_s_per_epoch'] * 1e3:.1f} ms); "
                  f"peak memory {r['peak_memory_mb']:.0f} MB")
        if args.out:
            with open(args.out, "w") as f:
                json.dump(report, f, indent=1)
        status = 0 if ok else 1
    dist.barrier()
    dist.destroy_process_group()
    return status


if __name__ == "__main__":
    sys.exit(main())
