"""Train a PyG GCN on a fixed graph with sparserl: the adjacency is the only change.

    python examples/train_gcn.py                         # the shipped cora, GPU if there is one
    python examples/train_gcn.py --graph ../shared/matrices/pubmed.npz --epochs 200 --hidden 256
    python examples/train_gcn.py --graph ../shared/matrices/pubmed.npz --epochs 200 --mode reduce-overhead
    python examples/train_gcn.py --graph ../shared/matrices/pubmed.npz --epochs 200 --capture

The same two-layer ``GCNConv`` model trains twice from the same start: on PyG's default path
(``edge_index``, gather + scatter) and on ``torch_sparserl.csr`` adjacency under
``torch.compile(backend="sparserl")``, where on a GPU the JIT runtime specializes a kernel per
product (the first epoch waits for it: ``mode="sync"``). Prints both losses and epoch times.
On small graphs (tens of thousands of nodes) an epoch is a few milliseconds of CPU work
(Python, dispatch, launches) and the GPU mostly waits: ``--mode reduce-overhead`` compiles with
CUDA graphs, which replay the epoch's kernels without that work. ``--capture`` does the same
without compiling: the sparserl model runs eagerly and its whole training step (forward, loss,
backward, Adam's step) is captured as one CUDA graph by ``ts.capture_step`` (on the CPU the step
runs eagerly: the same script runs anywhere).
Needs ``torch_geometric`` (``pip install torch_geometric``). What each phase is doing is said on
stderr as it starts; the results are printed on stdout at the end.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch_geometric.nn import GCNConv

import torch_sparserl as ts
import torch_sparserl.integrations.pyg  # noqa: F401  (teaches PyG's layers to take a CSRMatrix)


def note(text):
    """A line on stderr as a slow phase starts (stdout holds the results)."""
    print(text, file=sys.stderr, flush=True)


class GCN(torch.nn.Module):
    def __init__(self, features, hidden, classes):
        super().__init__()
        self.conv1 = GCNConv(features, hidden, cached=True)  # cached: the graph is fixed
        self.conv2 = GCNConv(hidden, classes, cached=True)

    def forward(self, x, adj):
        return self.conv2(F.relu(self.conv1(x, adj)), adj)


def training_step(model, opt, adj, x, y, nodes):
    """One epoch of full-graph training: forward, loss, backward, Adam's step; returns the loss."""
    opt.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(x, adj)[nodes], y[nodes])
    loss.backward()
    opt.step()
    return loss.detach()


def run(step, x, epochs, name):
    """``epochs`` calls of ``step()`` (one epoch each, returning the loss), timed one by one."""
    times, losses = [], []
    started = shown = time.perf_counter()
    for epoch in range(1, epochs + 1):
        if x.is_cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        losses.append(step().item())  # synchronizes
        times.append(time.perf_counter() - start)
        if epoch == epochs or time.perf_counter() - shown > 5:  # on a CPU an epoch can take seconds
            shown = time.perf_counter()
            note(f"{name}: epoch {epoch}/{epochs}, {shown - started:.1f} s")
    return losses, times


def compiled_steps(model, adj, x, y, nodes):
    opt = torch.optim.Adam(model.parameters(), lr=0.01)

    def step():
        torch.compiler.cudagraph_mark_step_begin()  # a new step (CUDA graphs reuse their outputs' memory)
        return training_step(model, opt, adj, x, y, nodes)
    return step


def captured_steps(model, adj, x, y, nodes):
    """The step as one CUDA graph: the first calls warm up (the runtime decides its kernels), the
    next captures, the rest replay. Adam must be capturable for that, which only a GPU's is."""
    opt = torch.optim.Adam(model.parameters(), lr=0.01, capturable=x.is_cuda)
    step = ts.capture_step(lambda x, y: training_step(model, opt, adj, x, y, nodes))
    return lambda: step(x, y)  # a replay's loss is overwritten by the next: run() reads it at once


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--graph", default="cora")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--epochs", type=int, default=50)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--mode", default="default", choices=("default", "reduce-overhead"),
                        help="torch.compile mode of the sparserl model (reduce-overhead: CUDA graphs)")
    parser.add_argument("--capture", action="store_true",
                        help="do not compile the sparserl model: run it eagerly, each training step replayed "
                             "as one CUDA graph (ts.capture_step)")
    args = parser.parse_args(argv)
    if args.capture and args.mode != "default":
        parser.error("--capture runs the sparserl model without torch.compile: --mode does not apply")
    device = torch.device(args.device)
    ts.configure(mode="sync")

    A = ts.load_matrix(args.graph).tocoo()
    keep = A.row != A.col
    edge_index = torch.from_numpy(np.stack([A.col[keep], A.row[keep]]).astype(np.int64)).to(device)
    n = A.shape[0]
    adj = ts.integrations.pyg.adjacency(edge_index, n)  # adj_t: row i = the edges into node i
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 128, generator=g).to(device)
    y = torch.randint(0, 16, (n,), generator=g).to(device)
    nodes = torch.arange(0, n, 2, device=device)

    torch.manual_seed(0)
    start = GCN(128, args.hidden, 16).state_dict()
    results, prepared = {}, {}
    for name in ("pyg", "sparserl"):
        model = GCN(128, args.hidden, 16).to(device)
        model.load_state_dict(start)
        if name == "sparserl":
            then = (f"then {args.epochs} epochs, each step one CUDA graph once warmed up (ts.capture_step)"
                    if args.capture else
                    f"then torch.compile and {args.epochs} epochs (the first compiles: tens of seconds)")
            note(f"sparserl: one eager forward{' (the runtime decides its kernels here: up to a minute)' if x.is_cuda else ''}, "
                 f"{then}")
            # One eager forward fills GCNConv's cached normalized adjacency before compiling: the
            # compiled model then never computes it, and under CUDA graphs a tensor cached from
            # inside a graph would live in memory that the next replay overwrites.
            started = time.perf_counter()
            with torch.no_grad():
                model(x, adj)  # in sync mode the runtime decides the forward's kernels here
            if x.is_cuda:
                torch.cuda.synchronize()
            prepared[name] = time.perf_counter() - started
            if args.capture:
                step = captured_steps(model, adj, x, y, nodes)
            else:
                model = torch.compile(model, backend="sparserl", mode=None if args.mode == "default" else args.mode)
                step = compiled_steps(model, adj, x, y, nodes)
            results[name] = run(step, x, args.epochs, name)
        else:
            note(f"pyg: {args.epochs} epochs on PyG's default path (edge_index)")
            results[name] = run(compiled_steps(model, edge_index, x, y, nodes), x, args.epochs, name)
    warm = max(1, args.epochs // 5)
    for name, (losses, times) in results.items():
        before = f"eager warm-up {prepared[name]:.2f} s, " if name in prepared else ""
        print(f"{name:9s} loss {losses[0]:.4f} -> {losses[-1]:.4f}   {before}first epoch {times[0]:.2f} s   "
              f"then {1e3 * np.median(times[warm:]):.3f} ms/epoch (median)")
    print(f"final losses differ by {abs(results['pyg'][0][-1] - results['sparserl'][0][-1]):.2e}")


if __name__ == "__main__":
    main()
