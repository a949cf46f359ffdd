"""Train GraphSAGE on sampled mini-batches with sparserl: each step's adjacency is a new pattern.

    python examples/train_sage_minibatch.py                      # the shipped cora, GPU if there is one
    python examples/train_sage_minibatch.py --graph ../shared/matrices/dblp-2010.npz --epochs 3

Each epoch draws batches of seed nodes with up to 10 and then 5 sampled neighbours
(``torch_sparserl.data.sampling``), and a step multiplies by the subgraph's mean adjacency
wrapped as ``ts.csr`` from its (crow, col, val) host arrays (checked and sent to the GPU in one
C++ call), made for the next batch on a background thread while a step trains
(``torch_sparserl.data.prefetch``): nothing else changes from a ``torch.sparse`` model. A
subgraph lives for one step, younger than the runtime's ``admit_age_s`` (0.1 s by default), so it
is never specialized: its products are served by cuSPARSE through the C++ path, and a graph
reused across steps still gets its kernels.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
import torch.nn.functional as F

import torch_sparserl as ts
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
    args = parser.parse_args(argv)

    A = load_matrix(args.graph)
    A = ((A + A.T) > 0).astype(np.float32).tocsr()  # an undirected graph: neighbours both ways
    features, classes = 64, 8
    g = torch.Generator().manual_seed(0)
    x = torch.randn(A.shape[0], features, generator=g).to(args.device)
    y = torch.randint(0, classes, (A.shape[0],), generator=g).to(args.device)
    layers = torch.nn.ModuleList([SageLayer(features, args.hidden), SageLayer(args.hidden, classes)]).to(args.device)
    opt = torch.optim.Adam(layers.parameters(), lr=0.01)

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


if __name__ == "__main__":
    main()
