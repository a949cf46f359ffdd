"""Where one GNN training epoch's time goes, per way (``bench_gnn``'s models and ways).

For each way: the epoch time measured two ways (chunks of epochs, as ``bench_gnn``; and each
epoch synchronized, as a loop that reads its loss every epoch), the kernels launched per
epoch, and ``torch.profiler``'s table of the operators by CPU time (self) and by GPU time.
The sparserl ways run warm: their kernels are decided (sync) before anything is timed;
``sparserl_off`` is the same compiled model with the runtime off (cuSPARSE in the graph).

    python benchmarks/profile_epoch.py --graph pubmed --model gcn --hidden 128 --out /tmp/prof.json
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

WAYS = ("eager", "inductor", "pyg", "sparserl", "sparserl_off")


def profile_way(way: str, graph, model: str, hidden: int, device, epochs: int, rows: int) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    import bench_gnn as bench
    from torch_sparserl import runtime as rt

    rt.configure(mode="off" if way == "sparserl_off" else "sync")
    bench.reset_compiled()
    task = bench.build_task("sparserl" if way.startswith("sparserl") else way, model, hidden, graph, device,
                            SimpleNamespace(mode="default"))
    epoch = bench.epoch_fn(task)
    for _ in range(20):
        epoch()
    bench._sync(device)
    synced = []
    for _ in range(epochs):
        start = time.perf_counter()
        epoch().item()
        synced.append((time.perf_counter() - start) * 1e3)
    bench._sync(device)
    start = time.perf_counter()
    for _ in range(epochs):
        epoch()
    bench._sync(device)
    chunked = (time.perf_counter() - start) * 1e3 / epochs
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(10):
            epoch()
        bench._sync(device)
    events = prof.key_averages()
    gpu_kernels = sum(e.count for e in events if e.device_type == torch.autograd.DeviceType.CUDA) / 10
    cpu = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:rows]
    gpu = sorted(events, key=lambda e: getattr(e, "self_device_time_total", 0), reverse=True)[:rows]
    result = {"synced_ms": statistics.median(synced), "chunked_ms": chunked, "gpu_kernels_per_epoch": gpu_kernels,
              "cpu_top": [{"name": e.key, "calls_per_epoch": e.count / 10, "self_cpu_us_per_epoch": e.self_cpu_time_total / 10}
                          for e in cpu],
              "gpu_top": [{"name": e.key, "calls_per_epoch": e.count / 10,
                           "self_gpu_us_per_epoch": getattr(e, "self_device_time_total", 0) / 10} for e in gpu],
              "table": prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)}
    if way == "sparserl":
        A = graph[f"csr_matrix_{model}"]
        result["kernels"] = rt.active().decisions(A.crow, A.col, A.shape[1])
    bench.reset_compiled()
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--graph", default="pubmed")
    parser.add_argument("--model", default="gcn")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--ways", default=",".join(WAYS))
    parser.add_argument("--epochs", type=int, default=200)
    parser.add_argument("--rows", type=int, default=25)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)

    import torch

    import bench_gnn as bench
    import torch_sparserl.pyg  # noqa: F401

    device = torch.device(args.device)
    graph = bench.prepare_graph(args.graph, device, models=[args.model])
    doc = {"graph": args.graph, "model": args.model, "hidden": args.hidden, "device": str(device),
           "command": " ".join(["python benchmarks/profile_epoch.py"] + (argv if argv is not None else sys.argv[1:])),
           "ways": {}}
    for way in args.ways.split(","):
        doc["ways"][way] = profile_way(way, graph, args.model, args.hidden, device, args.epochs, args.rows)
        r = doc["ways"][way]
        print(f"== {way}: synced {r['synced_ms']:.3f} ms, chunked {r['chunked_ms']:.3f} ms, "
              f"{r['gpu_kernels_per_epoch']:.0f} GPU kernels per epoch", flush=True)
        print(r["table"], flush=True)
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
