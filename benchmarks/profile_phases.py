"""Where a CPU-bound epoch's time goes, phase by phase, and what one product call costs.

For each (graph, model, way) at hidden 128: the CPU microseconds of each phase of
``bench_gnn``'s epoch (``zero_grad``, forward, backward, Adam's step, the loss copy), summed
over pipelined epochs (no synchronization inside the loop: on these small graphs the CPU is
the bound, so a phase's CPU time is its cost). ``bound_inductor`` is the model compiled with
the product taken out; ``sparserl_off`` the sparserl model with the runtime off (cuSPARSE in
the compiled graph); ``sparserl_python`` the sparserl model with the C++ fast path off. Beside each, the GPU's busy time per epoch (``gpu``: is the epoch waiting
on the CPU or on the GPU?), and the synchronizing CUDA calls of one epoch (``syncs``, torch's
sync debug mode). Then, on pubmed with its kernel installed, the CPU microseconds of one
``A @ X`` (N=128) at each layer of the call: the C++ fast path's operator, the direct operator, its implementation, the
runtime's call, the installed launch, the bound kernel alone; and beside them an allocation
with and without its zero-fill, cuSPARSE and a dense ``X @ W``. Last, ``--profile`` writes
``torch.profiler``'s table and cProfile's functions of one compiled epoch, with Inductor's
generated code of its graphs.

    OUT=/tmp python benchmarks/profile_phases.py
    OUT=/tmp python benchmarks/profile_phases.py --graphs pubmed --models sage --ways sparserl,sparserl_off,bound_inductor \\
        --no-calls --profile sage:sparserl
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import re
import shutil
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))

PHASES = ("zero_grad", "forward", "backward", "step", "clone")


def phases(task, k=200, reps=5) -> dict:
    """CPU µs per epoch phase, medians of ``reps`` runs of ``k`` pipelined epochs."""
    import torch

    opt = torch.optim.Adam(list(task.parameters()), lr=0.01)
    for _ in range(30):
        opt.zero_grad(set_to_none=True)
        loss = task()
        loss.backward()
        opt.step()
        loss.detach().clone()
    torch.cuda.synchronize()
    per, total = {p: [] for p in PHASES}, []
    for _ in range(reps):
        acc = dict.fromkeys(PHASES, 0.0)
        s0 = time.perf_counter()
        for _ in range(k):
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            t1 = time.perf_counter()
            loss = task()
            t2 = time.perf_counter()
            loss.backward()
            t3 = time.perf_counter()
            opt.step()
            t4 = time.perf_counter()
            loss.detach().clone()
            t5 = time.perf_counter()
            for p, a, b in zip(PHASES, (t0, t1, t2, t3, t4), (t1, t2, t3, t4, t5)):
                acc[p] += b - a
        torch.cuda.synchronize()
        total.append((time.perf_counter() - s0) / k * 1e6)
        for p in PHASES:
            per[p].append(acc[p] / k * 1e6)
    return {"epoch_us": round(statistics.median(total), 1), **{p: round(statistics.median(v), 1) for p, v in per.items()},
            "gpu": gpu_time(task, opt), "syncs": synchronizing_calls(task, opt)}


def synchronizing_calls(task, opt) -> int:
    """CUDA calls that wait for the GPU in one epoch, as torch's sync debug mode sees them (not
    every kind): one in a CPU-bound epoch stops the CPU queueing kernels while the GPU drains."""
    import warnings

    import torch

    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt.zero_grad(set_to_none=True)
            loss = task()
            loss.backward()
            opt.step()
            loss.detach().clone()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return sum("synchronizing" in str(w.message) for w in caught)


def gpu_time(task, opt, k=50) -> dict:
    """The GPU's busy time per epoch (its kernels' durations summed, from torch.profiler), the
    kernels launched per epoch, and the five costliest: an epoch whose ``epoch_us`` is near
    ``busy_us`` waits on the GPU, one far above it on the CPU."""
    import torch
    from torch.autograd import DeviceType

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(k):
            opt.zero_grad(set_to_none=True)
            task().backward()
            opt.step()
        torch.cuda.synchronize()
    kernels: dict[str, list[float]] = {}
    for event in prof.events():
        if event.device_type == DeviceType.CUDA and not getattr(event, "is_user_annotation", False):
            kernels.setdefault(event.name, []).append(event.time_range.elapsed_us())
    busy = sum(sum(v) for v in kernels.values())
    top = sorted(kernels.items(), key=lambda kv: -sum(kv[1]))[:5]
    return {"busy_us": round(busy / k, 1), "kernels": round(sum(len(v) for v in kernels.values()) / k, 1),
            "top_us": {name[:80]: round(sum(v) / k, 1) for name, v in top}}


def build(way: str, model: str, graph, dev):
    import bench_gnn as bench
    from torch_sparserl import intercept

    bench.reset_compiled()
    # sparserl_off: the sparserl way under a runtime that is off (main() sets it)
    task = bench.build_task("sparserl" if way == "sparserl_off" else way, model, 128, graph, dev,
                            SimpleNamespace(mode="default"))
    task()  # compiles; in sync mode decides the kernels
    intercept.deactivate_backend()
    return task


def per_call(graph, dev) -> dict:
    """CPU µs of one A @ X (pubmed, N=128) at each layer of the call, and of its neighbours."""
    import torch
    from torch_sparserl import ops
    from torch_sparserl import pattern as patterns
    from torch_sparserl import runtime as rt

    on = rt.active()
    A = graph["csr_matrix_gcn"]
    n = graph["n"]
    crow, col, val = A.crow, A.col, A.val
    X = torch.randn(n, 128, device=dev)
    W = torch.randn(128, 128, device=dev)
    A @ X
    entry = patterns.validated(crow, col, n)
    state = on.state("spmm", entry, 128, torch.float32)
    shape = (n, 128)
    stream = torch.cuda.current_stream().cuda_stream
    y0 = torch.zeros(shape, device=dev)
    torch.ops.sparserl_fast.spmm.default(crow, col, val, n, X)  # Python serves it once, C++ then

    def us(f, k=500, reps=7):
        for _ in range(50):
            f()
        torch.cuda.synchronize()
        v = []
        for _ in range(reps):
            s = time.perf_counter()
            for _ in range(k):
                f()
            torch.cuda.synchronize()
            v.append((time.perf_counter() - s) / k * 1e6)
        return round(statistics.median(v), 2)

    probes = {
        "torch.ops.sparserl_fast.spmm (C++ fast path)": lambda: torch.ops.sparserl_fast.spmm.default(crow, col, val, n, X),
        "torch.ops.sparserl_direct.spmm": lambda: torch.ops.sparserl_direct.spmm.default(crow, col, val, n, X),
        "torch.ops.sparserl.spmm (no grad)": lambda: torch.ops.sparserl.spmm(crow, col, val, n, X),
        "ops._spmm (python impl)": lambda: ops._spmm(crow, col, val, n, X),
        "runtime.call": lambda: on.call("spmm", entry, crow, col, val, X),
        "X.new_zeros": lambda: X.new_zeros(shape),
        "X.new_empty": lambda: X.new_empty(shape),
        "torch.empty_like": lambda: torch.empty_like(X),
        "y0.zero_": lambda: y0.zero_(),
        "torch.sparse.mm (cuSPARSE)": lambda: torch.sparse.mm(graph["torch_csr_gcn"], X),
        "X @ W (128x128)": lambda: X @ W,
        "torch.ops.aten.mm.default": lambda: torch.ops.aten.mm.default(X, W),
    }
    if isinstance(state, rt.Installed):  # a kernel serves it (else cuSPARSE, decided)
        launch = state.launch
        probes["installed launch (alloc+zero+bound)"] = lambda: launch(crow, col, val, X)
        probes["bound only (y preallocated, zeroed=True)"] = lambda: launch.kernel(crow, col, val, X, y0, stream,
                                                                                   zeroed=True)
    out = {}
    with torch.no_grad():
        for name, f in probes.items():
            out[f"call us: {name}"] = us(f)
            print(name, out[f"call us: {name}"], flush=True)
    out["pubmed spmm decision"] = on.decisions(crow, col, n)
    return out


def profile_epoch(model: str, way: str, graph, dev, out: Path) -> None:
    """torch.profiler's table and cProfile's functions of one compiled epoch; Inductor's code."""
    import torch
    import bench_gnn as bench

    epoch = bench.epoch_fn(build(way, model, graph, dev))
    for _ in range(30):
        epoch()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(300):
        epoch()
    torch.cuda.synchronize()
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(60)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as p:
        for _ in range(50):
            epoch()
        torch.cuda.synchronize()
    (out / f"phases-profile-{model}-{way}.txt").write_text(
        p.key_averages().table(sort_by="self_cpu_time_total", row_limit=60)
        + f"\n\ncProfile, 300 epochs {model} {way}:\n" + text.getvalue())
    for i, path in enumerate(sorted(set(re.findall(r"(/tmp/torchinductor_[^:]+\.py):\d+\(call\)", text.getvalue())))):
        shutil.copy(path, out / f"phases-inductor-{model}-{way}-{i}.py")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--graphs", default="pubmed,fb100_Cornell5")
    parser.add_argument("--models", default="gcn,sage")
    parser.add_argument("--ways", default="eager,sparserl,bound_inductor")
    parser.add_argument("--no-calls", dest="calls", action="store_false", help="skip the per-call layers")
    parser.add_argument("--profile", help="MODEL:WAY of one compiled epoch to profile, on the first graph")
    args = parser.parse_args(argv)

    import torch
    import bench_gnn as bench
    from torch_sparserl import runtime as rt

    out = Path(os.environ.get("OUT", "/tmp"))
    dev = torch.device("cuda")
    res = {"command": "python benchmarks/profile_phases.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    on = rt.configure(mode="sync")
    off = rt.Runtime(rt.RuntimeSettings(mode="off"))
    graphs = args.graphs.split(",")
    for name in graphs:
        graph = bench.prepare_graph(name, dev)
        for model in args.models.split(","):
            for way in args.ways.split(","):
                rt.set_active(off if way == "sparserl_off" else on)
                key = f"{name} {model} {way}"
                res[key] = phases(build(way, model, graph, dev))
                print(key, res[key], flush=True)
            A = graph[f"csr_matrix_{model}"]
            res[f"{name} {model} decisions"] = on.decisions(A.crow, A.col, A.shape[1])
            rt.set_active(on)
        if name == graphs[0] and args.profile:
            profile_epoch(*args.profile.split(":"), graph, dev, out)
        if name == "pubmed" and args.calls:
            res.update(per_call(graph, dev))
        bench.reset_compiled()
        del graph
        torch.cuda.empty_cache()
    (out / "phases.json").write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
