"""Mini-batch GraphSAGE under DistributedDataParallel: one neighbour sampler per rank over a shared graph.

    torchrun --nproc_per_node 2 examples/ddp_sage_minibatch.py                   # cora, CPUs (gloo)
    torchrun --nproc_per_node 4 examples/ddp_sage_minibatch.py --graph ../shared/matrices/dblp-2010.npz \\
        --buckets 3 --out result.json                                              # GPUs (NCCL)

Every rank holds the whole graph on the host and the features on its device, and draws its own
batches: each epoch one permutation of the seed nodes (the same on every rank, from the epoch
number) is cut into ``world_size`` equal, disjoint shares, and rank ``r`` samples its share with
``torch_sparserl.data.sampling.neighbor_batches`` (deterministic per rank and epoch). Equal
shares give every rank the same number of steps, so no rank waits at DDP's all-reduce for a
step another never takes: the last ``seeds % world_size`` seeds of each epoch's permutation are
dropped (a different few every epoch). A step multiplies by its subgraph's mean adjacency,
``ts.csr(batch.parts(), batch.shape, device=...)``: a pattern one step old, served as on one GPU
(young patterns are never specialized; ``--buckets K`` pads the batches to ``K`` sizes,
``torch_sparserl.data.buckets``, fitted on rank 0's first epoch, so that the shapes repeat).
The ranks share one kernel cache (``--cache-dir``, created by rank 0 when not given), as
``examples/ddp_gcn.py``.

Rank 0 checks the first step before training from the same start: DDP's averaged gradient
against one process computing the mean loss over the union of the ranks' first batches (one
block-diagonal adjacency, float64, ``torch.sparse``), within the tolerance of the run's dtype
(``torch_sparserl.dtypes``). The ranks' first batches have ``--batch-size`` seeds each, so the
mean of their means is the union's mean (a smaller last batch would weigh its seeds more). The
JSON written to ``--out`` holds, per rank, its steps and seeds per epoch, its epoch times and the
runtime's counters; and the throughput in seeds per second over all ranks.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time

import numpy as np
import scipy.sparse as sp
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import torch_sparserl as ts
from torch_sparserl import config
from torch_sparserl.data.buckets import Buckets
from torch_sparserl.data.prefetch import prefetch
from torch_sparserl.data.sampling import neighbor_batches
from torch_sparserl.dtypes import close_to_reference
from torch_sparserl.jit import runtime as rt


class SAGE(torch.nn.Module):
    """Two mean-aggregation GraphSAGE layers, as benchmarks/bench_minibatch.py's:
    ``out = neigh(A @ x) + root(x)``, ReLU between."""

    def __init__(self, features: int, hidden: int, classes: int):
        super().__init__()
        self.neigh = torch.nn.ModuleList([torch.nn.Linear(features, hidden), torch.nn.Linear(hidden, classes)])
        self.root = torch.nn.ModuleList([torch.nn.Linear(features, hidden, bias=False),
                                         torch.nn.Linear(hidden, classes, bias=False)])

    def forward(self, A, x):
        for layer, (neigh, root) in enumerate(zip(self.neigh, self.root)):
            aggregated = torch.sparse.mm(A, x) if A.layout == torch.sparse_csr else A @ x
            x = neigh(aggregated) + root(x)
            if layer == 0:
                x = torch.relu(x)
        return x


def share_of(seed_nodes: np.ndarray, epoch: int, rank: int, world: int) -> np.ndarray:
    """Rank ``rank``'s seeds of ``epoch``: its equal, disjoint slice of one permutation shared by
    every rank (the remainder of ``len(seed_nodes) / world`` dropped)."""
    order = np.random.default_rng([epoch, 0x5A6E]).permutation(seed_nodes)
    each = order.size // world
    return order[rank * each:(rank + 1) * each]


def epoch_batches(A, seed_nodes, epoch: int, rank: int, world: int, args):
    """Rank ``rank``'s batches of ``epoch`` (its own sampler: deterministic per rank and epoch)."""
    return neighbor_batches(A, args.batch_size, args.fanouts, seed=(epoch * 1000 + rank) * 7919,
                            nodes=share_of(seed_nodes, epoch, rank, world), shuffle=False)


def union_gradients(model0: dict, batches, x, y, args) -> dict:
    """The gradient of one process's mean loss over the seeds of all ``batches`` (one
    block-diagonal adjacency), in float64 through ``torch.sparse``."""
    model = SAGE(args.features, args.hidden, args.classes).double()
    model.load_state_dict(model0)
    A = sp.block_diag([b.adjacency("mean") for b in batches], format="csr").astype(np.float64)
    adj = torch.sparse_csr_tensor(torch.from_numpy(A.indptr).long(), torch.from_numpy(A.indices).long(),
                                  torch.from_numpy(A.data), A.shape, check_invariants=True)
    nodes = torch.from_numpy(np.concatenate([b.nodes for b in batches])).long()
    starts = np.cumsum([0] + [b.nodes.size for b in batches[:-1]])
    seed_rows = torch.from_numpy(np.concatenate([s + np.arange(b.seeds) for s, b in zip(starts, batches)])).long()
    out = model(adj, x.double()[nodes])
    F.cross_entropy(out[seed_rows], y[nodes[seed_rows]]).backward()
    return {k: p.grad for k, p in model.named_parameters()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--graph", default="cora", help="a shipped matrix name or a .npz/.mtx path")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--fanouts", type=lambda s: tuple(int(v) for v in s.split(",")), default=(10, 5),
                        help="neighbours drawn per hop, comma-separated (default 10,5)")
    parser.add_argument("--features", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--classes", type=int, default=8)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    parser.add_argument("--buckets", type=int, default=0, help="pad the batches to this many sizes (0: no padding)")
    parser.add_argument("--no-check", action="store_true", help="skip rank 0's check of the first step")
    parser.add_argument("--cache-dir", help="the shared kernel cache (default: a new folder made by rank 0)")
    parser.add_argument("--out", help="write the report (JSON) here, from rank 0")
    args = parser.parse_args(argv)
    if args.batch_size < 1 or args.epochs < 1 or args.buckets < 0 or not args.fanouts or min(args.fanouts) < 1:
        parser.error("--batch-size, --epochs and every fanout must be >= 1, --buckets >= 0")

    cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if cuda:
        torch.cuda.set_device(local_rank)  # before the group: NCCL binds each rank to its GPU
    dist.init_process_group("nccl" if cuda else "gloo")  # gloo on CPU: a smoke run of the script
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    dtype = getattr(torch, args.dtype)
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    # One kernel cache for all ranks, chosen before the runtime first looks at it.
    shared = [args.cache_dir or (tempfile.mkdtemp(prefix="sparserl-ddp-") if rank == 0 else None)]
    dist.broadcast_object_list(shared, src=0)
    os.environ["SPARSERL_CACHE_DIR"] = shared[0]
    runtime = rt.configure(config.from_environment().jit)  # its settings, and now its cache, the environment's:
    # as on one GPU, a batch's pattern is young for its step and cuSPARSE serves it (background mode)

    A = ts.load_matrix(args.graph)
    A = ((A + A.T) > 0).astype(np.float32).tocsr()  # an undirected graph: neighbours both ways
    n = A.shape[0]
    seed_nodes = np.arange(n)
    if n // world < args.batch_size and not args.no_check:
        parser.error(f"--batch-size {args.batch_size}: each of the {world} ranks has only {n // world} seeds; "
                     "the first-step check needs a full batch on every rank")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, args.features, generator=g, dtype=torch.float64)
    y = torch.randint(0, args.classes, (n,), generator=g)
    x_dev, y_dev = x.to(device=device, dtype=dtype), y.to(device)

    buckets = None
    if args.buckets:  # rank 0's sizes on every rank; a larger batch later grows its own bucket
        sizes = [Buckets.fit(epoch_batches(A, seed_nodes, 0, 0, world, args), args.buckets).sizes
                 if rank == 0 else None]
        dist.broadcast_object_list(sizes, src=0)
        buckets = Buckets(sizes[0])

    torch.manual_seed(0)
    model0 = SAGE(args.features, args.hidden, args.classes).state_dict()
    model = SAGE(args.features, args.hidden, args.classes).to(device=device, dtype=dtype)
    model.load_state_dict(model0)
    ddp = DistributedDataParallel(model, device_ids=[local_rank] if cuda else None)
    opt = torch.optim.Adam(ddp.parameters(), lr=args.lr)

    def to_device(batch):  # on prefetch's thread, one batch ahead
        padded = buckets.pad(batch) if buckets is not None else batch
        return (padded, ts.csr(padded.parts("mean"), padded.shape, dtype=dtype, device=device),
                torch.from_numpy(padded.nodes).to(device, non_blocking=True))

    def loss_of(batch, adj, nodes):
        out = ddp(adj, x_dev[nodes])[: batch.seeds]
        return F.cross_entropy(out, y_dev[nodes[: batch.seeds]])

    check = None
    if not args.no_check:  # the first step's gradient, before any step is taken
        first = next(iter(epoch_batches(A, seed_nodes, 0, rank, world, args)))
        loss_of(*to_device(first)).backward()
        ddp_grads = {k: p.grad.detach().to(torch.float64).cpu() for k, p in model.named_parameters()}
        opt.zero_grad(set_to_none=True)
        firsts = [None] * world
        dist.all_gather_object(firsts, first)
        if rank == 0:
            reference = union_gradients(model0, firsts, x, y, args)
            verdicts = {k: close_to_reference(ddp_grads[k], reference[k], dtype) for k in reference}
            check = {"ok": all(ok for ok, _ in verdicts.values()),
                     "max_rel_grad_diff": max(float((ddp_grads[k] - r).norm() / r.norm().clamp(min=1e-300))
                                              for k, r in reference.items()),
                     "failures": {k: why for k, (ok, why) in verdicts.items() if not ok},
                     "union_seeds": sum(b.seeds for b in firsts)}

    epochs = []
    for epoch in range(args.epochs):
        sync()
        dist.barrier()  # every rank starts the epoch together: its time is the slowest rank's
        started, losses, seeds = time.perf_counter(), [], 0
        for batch, adj, nodes in prefetch(epoch_batches(A, seed_nodes, epoch, rank, world, args), to_device):
            loss = loss_of(batch, adj, nodes)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(loss.detach())
            seeds += batch.seeds
        mean_loss = float(torch.stack(losses).mean())  # synchronizes
        epochs.append({"epoch": epoch, "seconds": time.perf_counter() - started, "steps": len(losses),
                       "seeds": seeds, "mean_loss": mean_loss})

    rank_report = {"rank": rank, "device": torch.cuda.get_device_name(device) if cuda else "cpu",
                   "steps_per_epoch": [e["steps"] for e in epochs], "seeds_per_epoch": [e["seeds"] for e in epochs],
                   "epoch_s": [e["seconds"] for e in epochs], "mean_loss": [e["mean_loss"] for e in epochs],
                   "runtime_stats": dict(runtime.stats)}
    reports = [None] * world
    dist.all_gather_object(reports, rank_report)

    status = 0
    if rank == 0:
        slowest = [max(r["epoch_s"][e] for r in reports) for e in range(args.epochs)]
        seeds = [sum(r["seeds_per_epoch"][e] for r in reports) for e in range(args.epochs)]
        same_steps = all(r["steps_per_epoch"] == reports[0]["steps_per_epoch"] for r in reports)
        steady = slice(1, None) if args.epochs > 1 else slice(None)  # the first epoch warms up
        report = {"graph": args.graph, "nodes": n, "nnz": int(A.nnz), "world_size": world,
                  "backend": dist.get_backend(), "dtype": args.dtype, "batch_size": args.batch_size,
                  "fanouts": list(args.fanouts), "buckets": [list(s) for s in buckets.sizes] if buckets else None,
                  "epochs": args.epochs, "epoch_s": slowest, "seeds_per_epoch": seeds,
                  "dropped_seeds_per_epoch": n - seeds[0],
                  "throughput_seeds_per_s": sum(seeds[steady]) / sum(slowest[steady]),
                  "same_steps_on_every_rank": same_steps, "check": check, "ranks": reports, "cache_dir": shared[0]}
        report["ok"] = same_steps and (check is None or check["ok"])
        print(json.dumps({k: v for k, v in report.items() if k != "ranks"}, indent=1))
        print(f"{world} ranks: {report['throughput_seeds_per_s']:.0f} seeds/s, "
              f"{reports[0]['steps_per_epoch'][0]} steps per epoch on every rank: {same_steps}; first step's "
              f"gradient against one process: "
              f"{'not checked' if check is None else ('OK' if check['ok'] else 'MISMATCH')}")
        if args.out:
            with open(args.out, "w") as f:
                json.dump(report, f, indent=1)
        status = 0 if report["ok"] else 1
    # Drop DDP's reducer while the process group is still registered (examples/ddp_gcn.py says why).
    del ddp, opt
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    return status


if __name__ == "__main__":
    sys.exit(main())
