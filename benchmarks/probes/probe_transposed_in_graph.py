"""Probe (not adopted yet): the backward's transposed product of a sampled subgraph inside a CUDA
graph, as a captured mini-batch step runs it, two ways.

* ``library`` — ``torch.ops.sparserl.spmm_transposed`` on indices first met in the capture: the
  graph copies and checks them at every replay, builds the transpose by a sort, and cuSPARSE
  multiplies (what ``ts.capture_step`` replays today);
* ``scatter`` — each nonzero's row of ``G`` scaled by its value and added into its column's row of
  the result (a gather and an ``index_add_``): no transpose, no check, float32 atomics.

Per batch (neighbour-sampled like ``bench_minibatch``: 1024 seeds, fanouts 10,5), each way is
captured alone and replayed ``--replays`` times between CUDA events: GPU µs per replay, and its
result against the float64 product. The scatter's sums come in no fixed order, so its results
are compared with the float32 tolerance, not bitwise::

    python benchmarks/probes/probe_transposed_in_graph.py --graph dblp-2010 --batches 8 --n 128 --out t.json

Needs a CUDA GPU; graphs are named as the benchmarks name them (``common.load_graph``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the common core

from common import load_graph  # noqa: E402


def _captured(fn, static: tuple, warm: tuple):
    """``(graph, output)``: ``fn(*static)`` captured as ``ts.capture_step`` captures a step, after
    one warm-up call on ``warm`` (other tensors than the captured ones, so that the capture meets
    its indices for the first time)."""
    from torch_sparserl.train.capture import CudaGraphs

    graphs = CudaGraphs()
    graphs.warm(fn, warm, None)
    return graphs.capture(fn, static, None)


def _replay_us(graph, replays: int) -> float:
    import torch

    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / replays


def library(crow, col, val, ncols, G):
    import torch

    return torch.ops.sparserl.spmm_transposed(crow, col, val, ncols, G)


def scatter(crow, col, val, ncols, G):
    """``Aᵀ @ G`` by rows: nonzero k's row (found by a search of ``crow``, with no host read), its
    row of ``G`` scaled by ``val[k]``, added into row ``col[k]`` of the result."""
    import torch

    nnz = col.shape[0]
    rows = torch.searchsorted(crow[1:], torch.arange(nnz, device=col.device, dtype=crow.dtype), right=True)
    out = torch.zeros((ncols, G.shape[1]), dtype=G.dtype, device=G.device)
    return out.index_add_(0, col.long(), G.index_select(0, rows) * val.unsqueeze(1))


WAYS = {"library": library, "scatter": scatter}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--graph", default="dblp-2010")
    parser.add_argument("--batches", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--n", type=int, default=128, help="columns of G (the layer's width)")
    parser.add_argument("--replays", type=int, default=50)
    parser.add_argument("--out", type=Path, help="write the timings as JSON here")
    args = parser.parse_args(argv)

    import torch

    import torch_sparserl  # noqa: F401 - registers torch.ops.sparserl
    from torch_sparserl.data.sampling import neighbor_batches
    from torch_sparserl.dtypes import assert_close_to_reference

    if not torch.cuda.is_available():
        print("probe_transposed_in_graph: needs a CUDA GPU", file=sys.stderr)
        return 2
    import torch_sparserl as ts

    ts.configure(mode="off")  # no decisions in the background (a warm-up's pattern) while timing
    A = load_graph(args.graph)
    rows = []
    generator = torch.Generator().manual_seed(0)
    for number, batch in enumerate(neighbor_batches(A, args.batch_size, (10, 5), seed=0, limit=args.batches)):
        crow, col, val = (t.cuda() for t in batch.parts())
        nrows, ncols = batch.shape
        G = torch.randn(nrows, args.n, generator=generator).cuda()
        D = torch.sparse_csr_tensor(*(t.cpu() for t in (crow, col, val)), batch.shape).to_dense().double()
        want = D.t() @ G.double().cpu()
        row = {"batch": number, "rows": nrows, "cols": ncols, "nnz": int(col.shape[0])}
        for name, fn in WAYS.items():
            static = (crow.clone(), col.clone(), val.clone(), ncols, G.clone())
            graph, out = _captured(fn, static, (crow, col, val, ncols, G))
            row[f"{name}_us"] = _replay_us(graph, args.replays)
            assert_close_to_reference(out.cpu(), want, torch.float32)
        rows.append(row)
        print(f"batch {number}: {nrows} rows, {row['nnz']} nonzeros: "
              + ", ".join(f"{name} {row[name + '_us']:.1f} µs" for name in WAYS), flush=True)
    summary = {name: statistics.median(r[f"{name}_us"] for r in rows) for name in WAYS}
    print("median µs per replay: " + ", ".join(f"{k} {v:.1f}" for k, v in summary.items()))
    if args.out:
        args.out.write_text(json.dumps({"graph": args.graph, "n": args.n, "batch_size": args.batch_size,
                                        "gpu": torch.cuda.get_device_name(), "rows": rows,
                                        "median_us": summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
