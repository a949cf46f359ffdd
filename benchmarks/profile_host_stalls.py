"""Does work in other processes (busy CPUs, nvcc builds, another CUDA context on the GPU) stall
a launch-bound training loop?

The first-run benchmark's misses come from runs of slow epochs, 40-90 ms over the median, on
graphs whose epoch is bound by the CPU (``bench_cold_start.py``). Some overlap the sandbox
worker's kernel build (nvcc through torch's extension builder, in another process); others
overlap nothing the runtime records. This times one loop in the foreground while a load runs
in other processes, load by load, in rounds (so that the machine's drift falls on every load
alike):

  none       nothing
  spin:K     K processes, each a busy Python loop
  nvcc:K     K processes, each building a small CUDA library with nvcc in a loop
  cuda:K     K processes, each starting Python on the same GPU in a loop, as the sandbox's worker
             starts: torch's import, a CUDA context, 640 MiB allocated, a cuBLAS product, exit
  policy:K   K processes, each sampling the shipped policy (4 kernels for the graph's A @ X, N=128)
             on the GPU in a loop, as the worker does for a decision (policy-cpu:K: on its CPU)
  timing:K   K processes, each timing cuSPARSE's A @ X (N=128) on the graph in loops of 30 runs
             between CUDA events, as the evaluator times a candidate against cuSPARSE

Foreground loops (``--loop``): ``gnn``, ``bench_gnn``'s eager epoch (``--graph``, ``--model``,
hidden 128), synchronized; ``cpu``, a fixed amount of pure-Python work per "epoch".

Per load it reports the epochs' median and maximum, the runs of slow epochs
(``bench_cold_start.slow_runs``: one starts over 2.5x the median, lasts while over 1.3x), and
the machine's steal time over the load's span (``/proc/stat``: time the hypervisor did not run
a virtual CPU that had work), with the CPU quota of the process's cgroup where there is one.

    python benchmarks/profile_host_stalls.py --loop gnn --graph pubmed --model sage --loads none,spin:1,spin:8,spin:15,nvcc:1,nvcc:4 --out /tmp/stalls.json
    python benchmarks/profile_host_stalls.py --loop gnn --graph pubmed --model gcn --loads none,cuda:1,cuda:3 --seconds 12
    python benchmarks/profile_host_stalls.py --loop gnn --graph pubmed --model sage --loads none,policy:1,policy-cpu:1,timing:1 --seconds 5 --rounds 3

Results: ``benchmarks/results/host-stalls-h100-2026-11-24*.{log,json}``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_cold_start import slow_runs, steal_s  # noqa: E402

KERNEL = r"""
#include <cuda_fp16.h>
template <typename T, int VEC>
__global__ void rows(const int* crow, const int* col, const T* val, const T* x, T* y, int n, int rows) {
  int r = blockIdx.x * blockDim.y + threadIdx.y;
  if (r >= rows) return;
  for (int c = threadIdx.x * VEC; c < n; c += blockDim.x * VEC) {
    float acc[VEC] = {};
    for (int k = crow[r]; k < crow[r + 1]; ++k)
      for (int v = 0; v < VEC; ++v) acc[v] += float(val[k]) * float(x[(long)col[k] * n + c + v]);
    for (int v = 0; v < VEC; ++v) y[(long)r * n + c + v] = T(acc[v]);
  }
}
template __global__ void rows<float, 1>(const int*, const int*, const float*, const float*, float*, int, int);
template __global__ void rows<float, 4>(const int*, const int*, const float*, const float*, float*, int, int);
template __global__ void rows<__half, 2>(const int*, const int*, const __half*, const __half*, __half*, int, int);
template __global__ void rows<__half, 8>(const int*, const int*, const __half*, const __half*, __half*, int, int);
"""


def cgroup_quota() -> str | None:
    for path in ("/sys/fs/cgroup/cpu.max", "/sys/fs/cgroup/cpu/cpu.cfs_quota_us"):
        try:
            return Path(path).read_text().strip()
        except OSError:
            continue
    return None


# the policy and timing loads: a process that prepares, prints "ready", then loops until killed
_LOAD_SCRIPTS = {
    "policy": """
import sys
sys.path.insert(0, sys.argv[3])
import torch
from bench_kernels import select_matrices
from torch_sparserl.policy import CHECKPOINT_DIR
from torch_sparserl.policy.encoder import PatternInput
from torch_sparserl.policy.model import KernelPolicy
from torch_sparserl.policy.propose import _sample
M = select_matrices([sys.argv[1]])[0].load().tocsr()
policy = KernelPolicy.load(CHECKPOINT_DIR, sys.argv[2])
inp = PatternInput.from_pattern(M.indptr, M.indices, M.shape, "spmm", "f32", 128, policy.config.samples)
_sample(policy, inp, "spmm", "f32", 128, 4, 1.0, 0)
print("ready", flush=True)
seed = 1
while True:
    _sample(policy, inp, "spmm", "f32", 128, 4, 1.0, seed)
    seed += 1
""",
    "timing": """
import sys
sys.path.insert(0, sys.argv[3])
import torch
from bench_kernels import select_matrices
M = select_matrices([sys.argv[1]])[0].load().tocsr()
A = torch.sparse_csr_tensor(torch.from_numpy(M.indptr).long(), torch.from_numpy(M.indices).long(),
                            torch.ones(M.nnz), M.shape).to("cuda")
X = torch.randn(M.shape[1], 128, device="cuda")
start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
torch.sparse.mm(A, X); torch.cuda.synchronize()
print("ready", flush=True)
while True:
    start.record()
    for _ in range(30):
        torch.sparse.mm(A, X)
    end.record()
    end.synchronize()
""",
}


def start_load(load: str, workdir: Path, graph: str = "pubmed") -> list[subprocess.Popen]:
    if load == "none":
        return []
    kind, _, count = load.partition(":")
    count = int(count or 1)
    procs = []
    for i in range(count):
        if kind == "spin":
            procs.append(subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True))
        elif kind == "cuda":
            code = ("import torch; x = torch.empty(160 * 2**20, device='cuda'); "
                    "y = torch.randn(2048, 2048, device='cuda'); (y @ y).sum().item()")
            procs.append(subprocess.Popen(["bash", "-c", f'while true; do {sys.executable} -c "{code}" || exit 1; done'],
                                          start_new_session=True))
        elif kind in ("policy", "policy-cpu", "timing"):
            script = _LOAD_SCRIPTS["timing" if kind == "timing" else "policy"]
            device = "cpu" if kind == "policy-cpu" else "cuda"
            procs.append(subprocess.Popen([sys.executable, "-c", script, graph, device, str(Path(__file__).parent)],
                                          stdout=subprocess.PIPE, text=True, start_new_session=True))
        elif kind == "nvcc":
            src = workdir / f"k{i}.cu"
            src.write_text(KERNEL)
            command = (f"while true; do nvcc -O3 -std=c++17 -arch=sm_90 -shared -Xcompiler -fPIC "
                       f"{src} -o {workdir / f'k{i}.so'} || exit 1; done")
            procs.append(subprocess.Popen(["bash", "-c", command], stdout=subprocess.DEVNULL, start_new_session=True))
        else:
            raise SystemExit(f"profile_host_stalls: unknown load {load!r} (expected none, spin:K, nvcc:K, cuda:K, "
                             "policy:K, policy-cpu:K or timing:K)")
    for proc in procs:  # the policy and timing loads say when their loop starts
        if proc.stdout is not None and proc.stdout.readline().strip() != "ready":
            stop_load(procs)
            raise RuntimeError(f"profile_host_stalls: the {load} load did not start (exit {proc.wait()})")
    return procs


def stop_load(procs: list[subprocess.Popen]) -> None:
    """Kill each load with what it started (its own process group: a loop's current child too)."""
    for p in procs:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for p in procs:
        p.wait()


def foreground(loop: str, graph: str, model: str):
    """The epoch to time: a callable returning its milliseconds."""
    if loop == "cpu":
        def epoch():
            start = time.perf_counter()
            sum(i * i for i in range(40000))
            return (time.perf_counter() - start) * 1e3
        return epoch
    import torch
    import bench_gnn as bench

    device = torch.device("cuda")
    data = bench.prepare_graph(graph, device)
    task = bench.build_task("eager", model, 128, data, device, SimpleNamespace(mode="default"))
    step = bench.epoch_fn(task)

    def epoch():
        torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        return (time.perf_counter() - start) * 1e3
    for _ in range(50):
        epoch()
    return epoch


def measure(epoch, load: str, seconds: float, workdir: Path, graph: str = "pubmed") -> dict:
    procs = start_load(load, workdir, graph)
    try:
        time.sleep(0.5)  # let the load start (an interpreter's import, nvcc's first phases)
        steal0, started, times = steal_s(), time.perf_counter(), []
        while time.perf_counter() - started < seconds:
            times.append(epoch())
        stolen = steal_s() - steal0
    finally:
        stop_load(procs)
    runs = slow_runs(times)
    return {"load": load, "epochs": len(times), "median_ms": round(statistics.median(times), 4),
            "max_ms": round(max(times), 3), "slow_runs": len(runs),
            "slow_excess_ms": round(sum(r["excess_ms"] for r in runs), 1),
            "slow_runs_ms": [round(r["excess_ms"], 1) for r in runs], "steal_s": round(stolen, 3)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--loop", default="gnn", choices=("gnn", "cpu"))
    parser.add_argument("--graph", default="pubmed")
    parser.add_argument("--model", default="sage")
    parser.add_argument("--loads", default="none,spin:1,spin:8,spin:15,nvcc:1,nvcc:4")
    parser.add_argument("--seconds", type=float, default=3.0, help="timed span per load and round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args(argv)
    loads = args.loads.split(",")
    if any(load.startswith("nvcc") for load in loads) and shutil.which("nvcc") is None:
        raise SystemExit("profile_host_stalls: the nvcc loads need nvcc on the PATH")
    env = {"cpus": os.cpu_count(), "affinity": len(os.sched_getaffinity(0)), "cgroup_cpu_quota": cgroup_quota(),
           "loop": args.loop, "graph": args.graph, "model": args.model, "seconds": args.seconds}
    print(json.dumps(env), flush=True)
    epoch = foreground(args.loop, args.graph, args.model)
    results = []
    with tempfile.TemporaryDirectory(prefix="sparserl-stalls-") as tmp:
        for round_ in range(args.rounds):
            for load in loads:
                row = {"round": round_, **measure(epoch, load, args.seconds, Path(tmp), args.graph)}
                results.append(row)
                largest = sorted(row["slow_runs_ms"], reverse=True)[:8]
                print(f"round {round_} {load:>12}: {row['epochs']:5d} epochs, median {row['median_ms']:.3f} ms, "
                      f"max {row['max_ms']:.1f} ms, {row['slow_runs']} slow runs, {row['slow_excess_ms']:.0f} ms over "
                      f"in all (largest {largest}), steal {row['steal_s']:.3f} s", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"env": env, "results": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
