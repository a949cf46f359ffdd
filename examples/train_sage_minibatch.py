"""Train GraphSAGE on sampled mini-batches with sparserl: each step's adjacency is a new pattern.

    python examples/train_sage_minibatch.py                      # the shipped cora, GPU if there is one
    python examples/train_sage_minibatch.py --graph ../shared/matrices/dblp-2010.npz --epochs 3
    python examples/train_sage_minibatch.py --capture 3          # each step replayed as a CUDA graph

Each epoch draws batches of seed nodes with up to 10 and then 5 sampled neighbours
(``torch_sparserl.data.sampling``), and a step multiplies by the subgraph's mean adjacency
wrapped as ``ts.csr`` from its (crow, col, val) host arrays (checked and sent to the GPU in one
C++ call), made for the next batch on a background thread while a step trains
(``torch_sparserl.data.prefetch``): nothing else changes from a ``torch.sparse`` model. A
subgraph lives for one step, younger than the runtime's ``admit_age_s`` (0.1 s by default), so it
is never specialized: its products are served by cuSPARSE through the C++ path, and a graph
reused across steps still gets its kernels.

``--capture K`` pads every batch to one of K sizes (``torch_sparserl.data.buckets``) and runs
the whole step (the matrix built from the batch's padded parts, forward, loss over the seed
rows, backward, a capturable Adam's step) with ``ts.capture_step(..., max_shapes=2K)``: one
CUDA graph per size, replayed with each batch's tensors copied in; the indices are checked
inside the graph. A later epoch's batch larger than every bucket adds a size (a warning).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
import torch.nn.functional as F

import torch_sparserl as ts
from torch_sparserl.data.buckets import Buckets
from torch_sparserl.data.datasets import load_matrix
from torch_sparserl.data.prefetch import prefetch
from torch_sparserl.data.sampling import neighbor_batches
from torch_sparserl.jit import runtime


class SageLayer(torch.nn.Module):
    """Mean of the sampled neighbours, and the node itself: lin_neigh(A @ h) + lin_self(h)."""

    def __init__(self, inputs: int, outputs: int):
        super().__init__()
        self.lin_neigh = torch.nn.Linear(inputs, outputs)
        self.lin_self = torch.nn.Linear(inputs, outputs, bias=False)

    def forward(self, adj, h):
        return self.lin_neigh(adj @ h) + self.lin_self(h)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--graph", default="cora", help="a shipped matrix name or an .npz path")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--capture", type=int, default=0, metavar="K",
                        help="pad batches to K sizes and replay each step as a CUDA graph, one per size (0: eager)")
    args = parser.parse_args(argv)
    if not 0 <= args.capture <= 32:
        parser.error(f"--capture: expected a number of sizes from 0 (eager) to 32 (got {args.capture})")

    A = load_matrix(args.graph)
    A = ((A + A.T) > 0).astype(np.float32).tocsr()  # an undirected graph: neighbours both ways
    features, classes = 64, 8
    g = torch.Generator().manual_seed(0)
    x = torch.randn(A.shape[0], features, generator=g).to(args.device)
    y = torch.randint(0, classes, (A.shape[0],), generator=g).to(args.device)
    torch.manual_seed(0)  # the layers' initial weights: runs with and without --capture start alike
    layers = torch.nn.ModuleList([SageLayer(features, args.hidden), SageLayer(args.hidden, classes)]).to(args.device)
    opt = torch.optim.Adam(layers.parameters(), lr=0.01, capturable=args.capture > 0 and args.device != "cpu")
    if args.capture:
        return train_captured(args, A, x, y, layers, opt)

    for epoch in range(args.epochs):
        started, losses = time.perf_counter(), []
        def to_device(batch):  # runs on prefetch's thread, one batch ahead
            return (batch, ts.csr(batch.parts("mean"), batch.shape, device=args.device),
                    torch.from_numpy(batch.nodes).to(args.device, non_blocking=True))

        for batch, adj, nodes in prefetch(neighbor_batches(A, args.batch_size, (10, 5), seed=epoch), to_device):
            h = F.relu(layers[0](adj, x[nodes]))
            out = layers[1](adj, h)[: batch.seeds]
            loss = F.cross_entropy(out, y[nodes[: batch.seeds]])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        mean_loss = torch.stack(losses).mean().item()  # synchronizes
        print(f"epoch {epoch}: loss {mean_loss:.4f}, {time.perf_counter() - started:.2f} s, {len(losses)} batches")
    shown = ("installs", "young_calls", "unadmitted_calls", "dropped")
    print("runtime:", {k: v for k, v in runtime.active().stats.items() if k in shown})


def train_captured(args, A, x, y, layers, opt):
    """The epochs of ``--capture K``: padded batches, each step one replay of its size's graph."""
    buckets = Buckets.fit(list(neighbor_batches(A, args.batch_size, (10, 5), seed=0)), count=args.capture)

    def train_step(h, labels, crow, col, val, seeds):
        opt.zero_grad(set_to_none=True)
        adj = ts.csr((crow, col, val), (crow.shape[0] - 1, h.shape[0]))
        out = layers[1](adj, F.relu(layers[0](adj, h)))
        loss = (F.cross_entropy(out, labels, reduction="none") * seeds).sum() / seeds.sum()  # the seeds' mean
        loss.backward()
        opt.step()
        return loss.detach()

    step = ts.capture_step(train_step, max_shapes=2 * args.capture)
    pin = args.device != "cpu"

    def to_device(batch):  # runs on prefetch's thread, one batch ahead
        batch = buckets.pad(batch)
        parts = tuple((t.pin_memory() if pin else t).to(args.device, non_blocking=pin) for t in batch.parts("mean"))
        nodes = torch.from_numpy(batch.nodes).to(args.device, non_blocking=pin)
        seeds = (torch.arange(batch.shape[0]) < batch.seeds).float().to(args.device, non_blocking=pin)
        return nodes, parts, seeds

    for epoch in range(args.epochs):
        started, losses = time.perf_counter(), []
        for nodes, parts, seeds in prefetch(neighbor_batches(A, args.batch_size, (10, 5), seed=epoch), to_device):
            losses.append(step(x[nodes], y[nodes], *parts, seeds).clone())
        mean_loss = torch.stack(losses).mean().item()  # synchronizes
        print(f"epoch {epoch}: loss {mean_loss:.4f}, {time.perf_counter() - started:.2f} s, {len(losses)} batches, "
              f"{step.captured} graph(s) live")


if __name__ == "__main__":
    main()
