"""What the specializer's idle worker costs a training loop: epochs timed with the sandbox's
worker alive (its CUDA context and the learned policy on the same GPU) and stopped, in turns,
in one process, with the GPU memory it holds.

The model is ``bench_gnn``'s, compiled with ``backend="sparserl"`` (``--mode`` as
torch.compile's); its kernels are decided first (sync JIT, empty cache), which leaves the
worker running. Then, ``--rounds`` times: ``--epochs`` epochs timed one by one with the worker
alive, the worker stopped (``specializer.close()``, as the runtime does after ``idle_s``
without a specialization), the same epochs again, and the worker started again with its
policy (``Runtime.prewarm``).

    python benchmarks/profile_worker.py --graph pubmed --model gcn --mode reduce-overhead --out /tmp/worker.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_gnn as bench  # noqa: E402
from bench_cold_start import _timed  # noqa: E402


def _used_mib(device) -> float:
    import torch

    free, total = torch.cuda.mem_get_info(device)
    return (total - free) / 2**20


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--graph", default="pubmed")
    parser.add_argument("--model", default="gcn")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--mode", default="reduce-overhead", choices=("default", "reduce-overhead"))
    parser.add_argument("--epochs", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)

    os.environ["SPARSERL_CACHE_DIR"] = tempfile.mkdtemp(prefix="sparserl-worker-")
    import torch
    from torch_sparserl import runtime as rt

    device = torch.device("cuda")
    runtime = rt.configure(mode="sync", idle_s=0)  # the worker stops only when this script says
    graph = bench.prepare_graph(args.graph, device)
    task = bench.build_task("sparserl", args.model, args.hidden, graph, device, SimpleNamespace(mode=args.mode))
    epoch = bench.epoch_fn(task)
    for _ in range(5):  # compile, decide (sync), record
        _timed(epoch, device)

    def timed() -> float:
        return statistics.median(_timed(epoch, device)[0] for _ in range(args.epochs))

    rows = []
    for round_ in range(args.rounds):
        alive = {"worker": "alive", "epoch_ms": timed(), "gpu_used_mib": _used_mib(device)}
        runtime.specializer.close()
        stopped = {"worker": "stopped", "epoch_ms": timed(), "gpu_used_mib": _used_mib(device)}
        started = runtime.prewarm(device)
        rows += [dict(alive, round=round_), dict(stopped, round=round_, restart_s=started)]
        print(f"round {round_}: alive {alive['epoch_ms']:.3f} ms ({alive['gpu_used_mib']:.0f} MiB used on the GPU), "
              f"stopped {stopped['epoch_ms']:.3f} ms ({stopped['gpu_used_mib']:.0f} MiB); restart {started or float('nan'):.1f} s",
              flush=True)
    runtime.close()
    alive = [r["epoch_ms"] for r in rows if r["worker"] == "alive"]
    stopped = [r["epoch_ms"] for r in rows if r["worker"] == "stopped"]
    memory = [a["gpu_used_mib"] - s["gpu_used_mib"] for a, s in zip(rows[::2], rows[1::2])]
    summary = {"alive_ms": statistics.median(alive), "stopped_ms": statistics.median(stopped),
               "worker_gpu_mib": statistics.median(memory)}
    print(f"median epoch: worker alive {summary['alive_ms']:.3f} ms, stopped {summary['stopped_ms']:.3f} ms; "
          f"the worker holds {summary['worker_gpu_mib']:.0f} MiB of GPU memory", flush=True)
    from bench_kernels import environment

    A = graph[f"csr_matrix_{args.model}"]
    doc = {"schema": "torch_sparserl.profile_worker/1", "env": environment(), "args": vars(args),
           "command": "python benchmarks/profile_worker.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "rows": rows, "summary": summary, "kernels": runtime.decisions(A.crow, A.col, A.shape[1])}
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
