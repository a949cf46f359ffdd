"""What a CPU-bound epoch costs eager and compiled, measured interleaved.

On small graphs (pubmed, fb100) an epoch is 2-3 ms and its time moves by up to about 10%
between minutes of the same process, as large as the differences between ways. Here one
compiled model serves three ways, switched round by round: the runtime off (cuSPARSE in
the graph), the runtime on with its kernels installed and its sandbox worker alive, and the
same after the worker is stopped; eager ``torch.sparse`` runs in every round too. Each
round times ``--epochs`` synchronized epochs per way; the medians of the rounds' medians
are reported, with each way's ratio to eager in the same rounds.

    python benchmarks/profile_overhead.py --graphs pubmed,fb100_Cornell5 --models sage,gcn --out /tmp/o.json
    python benchmarks/profile_overhead.py ... --cpp-wrapper   # Inductor's C++ wrapper code
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


def _synced_ms(epoch, device, epochs: int) -> float:
    import bench_gnn as bench
    times = []
    for _ in range(epochs):
        bench._sync(device)
        start = time.perf_counter()
        epoch().item()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def measure(graph, model: str, hidden: int, device, rounds: int, epochs: int) -> dict:
    import torch
    import bench_gnn as bench
    from torch_sparserl import intercept
    from torch_sparserl import runtime as rt

    on = rt.configure(mode="sync")
    off = rt.Runtime(rt.RuntimeSettings(mode="off"))
    bench.reset_compiled()
    eager = bench.epoch_fn(bench.build_task("eager", model, hidden, graph, device, SimpleNamespace(mode="default")))
    start = time.perf_counter()
    compiled = bench.epoch_fn(bench.build_task("sparserl", model, hidden, graph, device,
                                               SimpleNamespace(mode="default")))
    compiled()
    bench._sync(device)
    first_s = time.perf_counter() - start
    # The adjacency is a CSRMatrix: the compiled graph needs no eager interception of raw
    # CSR products, and eager torch.sparse must run as without sparserl.
    intercept.deactivate_backend()
    A = graph[f"csr_matrix_{model}"]
    kernels = on.decisions(A.crow, A.col, A.shape[1])
    ways = {"eager": (eager, on), "off": (compiled, off), "on": (compiled, on)}
    samples: dict[str, list[float]] = {}

    def rounds_of(names):
        for _ in range(rounds):
            for name in names:
                epoch, runtime = ways[name.split("/")[0]]
                rt.set_active(runtime)
                for _ in range(5):
                    epoch()
                samples.setdefault(name, []).append(_synced_ms(epoch, device, epochs))
        rt.set_active(on)

    rounds_of(["eager", "off", "on"])
    on.specializer.close()  # what the idle timer does after idle_s
    rounds_of(["eager/stopped", "off/stopped", "on/stopped"])
    medians = {name: statistics.median(v) for name, v in samples.items()}
    ratio = {name: medians["eager/stopped" if name.endswith("/stopped") else "eager"] / ms
             for name, ms in medians.items()}
    off.close()
    bench.reset_compiled()
    return {"first_s": round(first_s, 3), "ms": {k: round(v, 4) for k, v in medians.items()},
            "vs_eager": {k: round(v, 3) for k, v in ratio.items()},
            "rounds_ms": {k: [round(x, 4) for x in v] for k, v in samples.items()}, "kernels": kernels}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--graphs", default="pubmed,fb100_Cornell5")
    p.add_argument("--models", default="sage,gcn")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--cpp-wrapper", action="store_true", help="compile with Inductor's C++ wrapper code")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    import torch
    import torch._inductor.config as inductor_config
    import bench_gnn as bench

    inductor_config.cpp_wrapper = args.cpp_wrapper
    device = torch.device("cuda")
    doc = {"command": " ".join(["python benchmarks/profile_overhead.py"] + (argv if argv is not None else sys.argv[1:])),
           "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": []}
    for name in args.graphs.split(","):
        graph = bench.prepare_graph(name, device)
        for model in args.models.split(","):
            row = {"graph": name, "model": model, "hidden": args.hidden, "cpp_wrapper": args.cpp_wrapper,
                   **measure(graph, model, args.hidden, device, args.rounds, args.epochs)}
            doc["rows"].append(row)
            print(name, model, "first", row["first_s"], "s;", row["ms"], row["vs_eager"], flush=True)
            Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
