"""What a graph attention (GAT) epoch costs under sparserl against Inductor, and what each of its
sparse operators costs per call.

For each graph: ``bench_gnn``'s ``gat`` model (PyG's GATConv, 4 heads then 1) compiled by
Inductor (PyG's gather/scatter) and by sparserl (the heads products on a ``CSRMatrix``), its
kernels decided first (sync runtime), the two timed interleaved in rounds of 50 epochs (median
of 8 rounds). Then, on the graph's GAT pattern (A + I), the host time of one call of each
operator a compiled GAT epoch runs, in loops of 100 calls (``host``: until the loop returns;
``with GPU``: until the GPU is done too; a per-call ``host`` near ``with GPU`` means the call
is bound by the CPU): the implementation-only ``sparserl_direct`` heads operators (4 heads of
32 columns: Python checks, the pattern's block-diagonal form, a value gather, the product
through the C++ fast path), ``sparserl_direct::sddmm`` and the C++ fast path's
``spmm``/``spmm_transposed`` (N = 16), and an ``aten.add`` for scale.

    python benchmarks/profile_heads.py --graphs pubmed,fb100_Cornell5 --out /tmp/heads.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))

HEADS, C = 4, 32  # bench_gnn's GAT: hidden 128 = 4 heads of 32 in layer 1


def epochs(graph, dev) -> dict:
    """Median epoch (ms) of the inductor and sparserl ways, timed interleaved."""
    import torch
    import bench_gnn as bench

    ways = {}
    for way in ("inductor", "sparserl"):
        bench.reset_compiled()
        epoch = bench.epoch_fn(bench.build_task(way, "gat", 128, graph, dev, SimpleNamespace(mode="default")))
        for _ in range(30):
            epoch()
        torch.cuda.synchronize()
        ways[way] = epoch
    rounds = {way: [] for way in ways}
    for _ in range(8):
        for way, epoch in ways.items():
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(50):
                epoch()
            torch.cuda.synchronize()
            rounds[way].append((time.perf_counter() - start) / 50 * 1e3)
    return {way: round(statistics.median(ms), 3) for way, ms in rounds.items()}


def per_call(graph, dev) -> dict:
    """``{operator: (host µs, with GPU µs)}`` per call on the graph's GAT pattern."""
    import torch

    A = graph["csr_matrix_gat"]
    crow, col = A.crow, A.col
    n, nnz = crow.numel() - 1, col.numel()
    g = torch.Generator(device=dev).manual_seed(0)
    val = torch.rand(nnz, HEADS, device=dev, generator=g)
    X = torch.randn(n, HEADS, C, device=dev, generator=g)
    Y = torch.randn(n, HEADS, C, device=dev, generator=g)
    val1 = torch.rand(nnz, device=dev, generator=g)
    X1 = torch.randn(n, 16, device=dev, generator=g)
    Y1 = torch.randn(n, 16, device=dev, generator=g)
    direct, fast = torch.ops.sparserl_direct, torch.ops.sparserl_fast
    calls = {
        "sparserl_direct::spmm_heads": lambda: direct.spmm_heads.default(crow, col, val, n, X),
        "sparserl_direct::spmm_heads_transposed": lambda: direct.spmm_heads_transposed.default(crow, col, val, n, Y),
        "sparserl_direct::sddmm_heads": lambda: direct.sddmm_heads.default(crow, col, Y, X),
        "sparserl_direct::sddmm n=16": lambda: direct.sddmm.default(crow, col, Y1, X1),
        "sparserl_fast::spmm n=16": lambda: fast.spmm.default(crow, col, val1, n, X1),
        "sparserl_fast::spmm_transposed n=16": lambda: fast.spmm_transposed.default(crow, col, val1, n, X1),
        "aten.add n=16": lambda: X1 + X1,
    }
    out = {}
    for name, call in calls.items():
        for _ in range(20):  # decides (sync runtime), records the C++ entries, warms up
            call()
        torch.cuda.synchronize()
        host, total = [], []
        for _ in range(7):
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(100):
                call()
            queued = time.perf_counter()
            torch.cuda.synchronize()
            done = time.perf_counter()
            host.append((queued - start) / 100 * 1e6)
            total.append((done - start) / 100 * 1e6)
        out[name] = (round(statistics.median(host), 1), round(statistics.median(total), 1))
        print(f"  {name:40s} host {out[name][0]:7.1f} µs/call, with GPU {out[name][1]:7.1f} µs/call", flush=True)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--graphs", default="pubmed,fb100_Cornell5")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)

    import torch
    import bench_gnn as bench
    from torch_sparserl import runtime as rt

    dev = torch.device("cuda")
    doc = {"command": "python benchmarks/profile_heads.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    for name in args.graphs.split(","):
        graph = bench.prepare_graph(name, dev, models=["gat"])
        rt.configure(mode="sync")
        doc[name] = {"epoch_ms": epochs(graph, dev)}
        print(name, "epoch ms", doc[name]["epoch_ms"], flush=True)
        doc[name]["per_call_us"] = per_call(graph, dev)
        rt.configure(mode="off")
    Path(args.out).write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
