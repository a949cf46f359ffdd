"""GCN training under DistributedDataParallel with sparserl products, checked against one GPU.

    torchrun --nproc_per_node 2 examples/ddp_gcn.py                  # the shipped cora
    torchrun --nproc_per_node 2 examples/ddp_gcn.py --graph ../shared/matrices/pubmed.npz --out result.json

Every rank holds the whole graph (a fixed ``CSRMatrix``, the normalized adjacency of a
PyG-style GCN) and its share of the training nodes; DDP averages the gradients, which equals
one GPU training on all of them. The ranks share one kernel cache (``--cache-dir``, created by
rank 0 when not given): for each product one rank specializes and the others wait for its
entry, so every rank runs the same kernel and nothing is built twice.

Rank 0 compares with one GPU training alone from the same start: the gradient at the start
(DDP's average against the single process's, to rounding) and the losses of every epoch; the
JSON written to ``--out`` says what ran where.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import scipy.sparse as sp
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import torch_sparserl as ts
from torch_sparserl.jit import runtime as rt


GRAD_RTOL = 1e-5  # DDP's averaged gradient against one process's, float32
LOSS_RTOL = 1e-3  # loss curves over the run (as benchmarks/bench_gnn.py compares its four ways)


class GCN(torch.nn.Module):
    def __init__(self, features: int, hidden: int, classes: int):
        super().__init__()
        self.lin1 = torch.nn.Linear(features, hidden)
        self.lin2 = torch.nn.Linear(hidden, classes)

    def forward(self, x, adj):
        return adj @ self.lin2(torch.relu(adj @ self.lin1(x)))


def gcn_adjacency(A: sp.csr_matrix) -> sp.csr_matrix:
    """D^-1/2 (A + I) D^-1/2 of the binary adjacency without its own self loops."""
    A = sp.csr_matrix((np.ones(A.nnz, dtype=np.float32), A.indices, A.indptr), shape=A.shape)
    A.setdiag(0)
    A.eliminate_zeros()
    A = (A + sp.identity(A.shape[0], dtype=np.float32, format="csr")).tocsr()
    inv_sqrt = 1.0 / np.sqrt(np.asarray(A.sum(axis=1)).ravel())
    out = (sp.diags(inv_sqrt) @ A @ sp.diags(inv_sqrt)).tocsr().astype(np.float32)
    out.sort_indices()
    return out


def train(model, adj, x, y, nodes, epochs: int, lr: float) -> list[float]:
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    losses = []
    for _ in range(epochs):
        opt.zero_grad(set_to_none=True)
        out = model(x, adj)
        loss = F.cross_entropy(out.index_select(0, nodes), y.index_select(0, nodes))
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return [float(v) for v in torch.stack(losses).cpu()]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--graph", default="cora", help="a shipped matrix name or a .npz/.mtx path")
    parser.add_argument("--features", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--classes", type=int, default=16)
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--cache-dir", help="the shared kernel cache (default: a new folder made by rank 0)")
    parser.add_argument("--out", help="write the report (JSON) here, from rank 0")
    args = parser.parse_args(argv)

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")  # gloo on CPU: a smoke run of the script
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if cuda:
        torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")

    # One kernel cache for all ranks, chosen before the runtime first looks at it.
    shared = [args.cache_dir or (tempfile.mkdtemp(prefix="sparserl-ddp-") if rank == 0 else None)]
    dist.broadcast_object_list(shared, src=0)
    os.environ["SPARSERL_CACHE_DIR"] = shared[0]
    runtime = rt.configure(mode="sync")
    specialize, calls = runtime.specializer, []

    def counted(*a, **k):
        started = time.perf_counter()
        entry = specialize(*a, **k)
        calls.append({"key": f"{a[0].op} n={a[0].n} {a[0].dtype}", "seconds": time.perf_counter() - started})
        return entry

    runtime.specializer = counted

    M = gcn_adjacency(ts.load_matrix(args.graph))
    n = M.shape[0]
    adj = ts.csr(M, device=device, index_dtype=torch.int32)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, args.features, generator=g).to(device)
    y = torch.randint(0, args.classes, (n,), generator=g).to(device)
    train_nodes = torch.arange(0, n - n % (2 * world), 2, device=device)  # an equal share per rank
    mine = train_nodes[rank::world]

    torch.manual_seed(0)
    start = GCN(args.features, args.hidden, args.classes).state_dict()
    model = GCN(args.features, args.hidden, args.classes).to(device)
    model.load_state_dict(start)
    ddp = DistributedDataParallel(model, device_ids=[local_rank] if cuda else None)
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    # The gradient at the start: DDP's average over the ranks' shares against one process's
    # gradient over all training nodes (no step is taken, so training starts from here).
    F.cross_entropy(ddp(x, adj).index_select(0, mine), y.index_select(0, mine)).backward()
    ddp_grads = {k: p.grad.detach().clone() for k, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    sync()
    t0 = time.perf_counter()
    local_losses = train(ddp, adj, x, y, mine, args.epochs, args.lr)
    sync()
    seconds = time.perf_counter() - t0

    # The loss over all training nodes is the mean of the ranks' (equal shares).
    losses = torch.tensor(local_losses, device=device)
    dist.all_reduce(losses)
    losses = (losses / world).tolist()
    rank_report = {"rank": rank, "device": torch.cuda.get_device_name(device) if cuda else "cpu", "cuda_device": local_rank,
                   "train_s": seconds, "specializations": calls, "cache_builds": runtime.cache.stats["builds"],
                   "kernels": runtime.decisions(adj.crow, adj.col, adj.shape[1]), "runtime_stats": dict(runtime.stats)}
    reports = [None] * world
    dist.all_gather_object(reports, rank_report)
    params = {k: v.detach().clone() for k, v in model.state_dict().items()}

    status = 0
    if rank == 0:
        single = GCN(args.features, args.hidden, args.classes).to(device)
        single.load_state_dict(start)
        F.cross_entropy(single(x, adj).index_select(0, train_nodes), y.index_select(0, train_nodes)).backward()
        grad_diff = max(float((ddp_grads[k] - p.grad).norm() / p.grad.norm().clamp(min=1e-30))
                        for k, p in single.named_parameters())
        single.zero_grad(set_to_none=True)
        single_losses = train(single, adj, x, y, train_nodes, args.epochs, args.lr)
        param_diff = max(float((params[k] - v).abs().max()) for k, v in single.state_dict().items())
        loss_diff = max(abs(a - b) / abs(b) for a, b in zip(losses, single_losses))
        same_kernels = all(r["kernels"] == reports[0]["kernels"] for r in reports)
        keys = {c["key"] for r in reports for c in r["specializations"]}
        specializations = sum(len(r["specializations"]) for r in reports)
        build_root = Path(shared[0]) / "build"
        builds = sorted(p.name for p in build_root.glob("*") if p.is_dir()) if build_root.is_dir() else []
        report = {"graph": args.graph, "nodes": n, "nnz": int(M.nnz), "world_size": world, "epochs": args.epochs,
                  "hidden": args.hidden, "ranks": reports, "ddp_losses": losses, "single_gpu_losses": single_losses,
                  "max_rel_grad_diff_at_start": grad_diff, "max_rel_loss_diff": loss_diff,
                  "max_abs_param_diff": param_diff,
                  "same_kernels_on_every_rank": same_kernels, "specializations_total": specializations,
                  "distinct_keys": len(keys), "extension_builds": builds, "cache_dir": shared[0]}
        # Gradients agree to rounding; over many Adam steps the losses agree to LOSS_RTOL but single
        # parameters do not: Adam moves a parameter whose gradient is ~0 by about lr in the
        # direction of its rounding noise (and atomics make kernels' sums run-to-run different).
        ok = (same_kernels and specializations == len(keys) and grad_diff < GRAD_RTOL and loss_diff < LOSS_RTOL)
        report["ok"] = ok
        print(json.dumps({k: v for k, v in report.items() if k not in ("ddp_losses", "single_gpu_losses")}, indent=1))
        print(f"losses (DDP, {world} ranks): first {losses[0]:.6f}, last {losses[-1]:.6f}; "
              f"one GPU: first {single_losses[0]:.6f}, last {single_losses[-1]:.6f}")
        print(f"gradient at the start: max relative difference {grad_diff:.2e}; "
              f"max relative loss difference {loss_diff:.2e}, max parameter difference {param_diff:.2e}; "
              f"same kernels on every rank: {same_kernels}; specializations {specializations} for "
              f"{len(keys)} keys; {'OK' if ok else 'MISMATCH'}")
        if args.out:
            with open(args.out, "w") as f:
                json.dump(report, f, indent=1)
        status = 0 if ok else 1
    # Drop DDP's reducer while the process group is still registered: when it held the group's
    # last reference, the group's destructor ran with the GIL held and joined gloo's worker
    # thread, which was waiting for the GIL to free the last collective's tensors (a hang at
    # exit, seen on CPU).
    del ddp
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    return status


if __name__ == "__main__":
    sys.exit(main())
