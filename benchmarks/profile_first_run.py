"""What stalls the first run's epochs while the kernels are decided in the background?

In ``bench_cold_start.py``'s first run (fresh kernel cache, background JIT), dozens of epochs
take 10-130 ms instead of 2-3 ms until every product is decided. This runs that first run
in-process for a few (graph, model, hidden) rows with the runtime's steps timed as intervals
(on whichever thread runs them): each key's decision, the fingerprint, the specializer (the
policy's samples and their timing in the sandbox's worker), the install (build or load of the
library, plan preparation), the in-process build, the pattern helpers' kept work, and Python's
garbage collections. Every epoch is timed with its start; a stalled epoch (over 4x the
median) is listed with the intervals that overlap it. Epochs are also grouped by the
background steps they overlap (the worker's start, its tasks by name): the median epoch while
each runs. Writes ``$OUT/first-run.json``.
``SPARSERL_EVAL_BURST_REPS=0`` runs the candidates' timing loops back to back, as before the
runtime's evaluations were timed in bursts (``autotune.RUNTIME_BURST_REPS``);
``SPARSERL_POLICY_DEVICE=cpu`` samples the policy on the worker's CPU instead of the GPU.

    OUT=/tmp python benchmarks/profile_first_run.py --rows fb100_Cornell5:gcn:128,uk-2007-05_100000:sage:128
"""
from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("SPARSERL_CACHE_DIR", tempfile.mkdtemp(prefix="sparserl-first-run-"))

import bench_cold_start as cold  # noqa: E402
import bench_gnn as bench  # noqa: E402

INSTALL_STEPS = ("_bind_spec", "inline.build", "dlopen", "cudaFuncGetAttributes", "nvrtc.compile", "cuModuleLoadData",
                 "prepare", "cuda.synchronize", "Kernel.bind", "fastpath.forget")
INTERVALS: list[tuple[str, str, float, float]] = []
EPOCHS: list[tuple[float, float]] = []


def _record(name, fn):
    """``fn``, each call recorded as an interval named ``name`` (or ``name(*args)``)."""
    @functools.wraps(fn)
    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            label = name(*args) if callable(name) else name
            INTERVALS.append((label, threading.current_thread().name, start, time.perf_counter()))
    return timed


def instrument() -> None:
    import torch

    from torch_sparserl import runtime as rt
    from torch_sparserl.build import inline

    for cls, names in ((rt.Runtime, ("_decide", "_specialize", "_install", "_install_interim")),
                       (rt.autotune_specializer, ("__call__",)), (rt.learned_specializer, ("__call__",))):
        for name in names:
            setattr(cls, name, _record(f"{cls.__name__}.{name}", getattr(cls, name)))
    from torch_sparserl.evaluate import sandbox as sb

    # the worker's side: its start, the matrix sent, and each task by name (the policy's load and
    # samples, the candidates' builds and timings)
    sb.Sandbox._ensure_worker = _record("worker start", sb.Sandbox._ensure_worker)
    sb.Sandbox._ensure_matrix = _record("worker matrix", sb.Sandbox._ensure_matrix)
    sb.Sandbox.run = _record(lambda self, task, *rest: f"worker {task.rpartition(':')[2]}", sb.Sandbox.run)
    rt.fingerprint = _record("fingerprint", rt.fingerprint)
    rt.run_kept = _record("run_kept", rt.run_kept)
    rt._bind_spec = _record("_bind_spec", rt._bind_spec)
    inline.build = _record("inline.build", inline.build)
    # the install's steps, to split its stall (the library's dlopen, the first query of a kernel,
    # which loads its module under CUDA's lazy loading, the plan data, the synchronize after it)
    inline._load = _record("dlopen", inline._load)
    inline._bind = _record("cudaFuncGetAttributes", inline._bind)
    # the interim install's NVRTC build (its compile, and its module's load in this process)
    from torch_sparserl.build import driver, nvrtc

    nvrtc.compile = _record("nvrtc.compile", nvrtc.compile)
    driver.Module.__init__ = _record("cuModuleLoadData", driver.Module.__init__)
    from torch_sparserl import fastpath
    from torch_sparserl import prepare as prep
    from torch_sparserl.build import kernel as kmod

    prep.prepare = _record("prepare", prep.prepare)
    kmod.Kernel.bind = _record("Kernel.bind", kmod.Kernel.bind)
    fastpath.record = _record("fastpath.record", fastpath.record)
    fastpath.forget = _record("fastpath.forget", fastpath.forget)
    synchronize = torch.cuda.synchronize

    def background_synchronize(*args, **kwargs):  # the training loop's own are not intervals
        if threading.current_thread() is threading.main_thread():
            return synchronize(*args, **kwargs)
        return _record("cuda.synchronize", synchronize)(*args, **kwargs)
    torch.cuda.synchronize = background_synchronize
    started = {}

    def on_gc(phase, info):
        if phase == "start":
            started[threading.get_ident()] = time.perf_counter()
        elif threading.get_ident() in started:
            INTERVALS.append((f"gc gen{info['generation']}", threading.current_thread().name,
                              started.pop(threading.get_ident()), time.perf_counter()))
    gc.callbacks.append(on_gc)

    original = cold._timed

    def timed(epoch, device):
        start = time.perf_counter()
        ms, loss = original(epoch, device)
        EPOCHS.append((start, ms))
        return ms, loss
    cold._timed = timed


def stalls(epochs: list[tuple[float, float]], intervals, factor: float = 4.0) -> dict:
    median = statistics.median(ms for _, ms in epochs)
    out, excess_by = [], {}
    for index, (start, ms) in enumerate(epochs):
        if ms <= factor * median:
            continue
        end = start + ms / 1e3
        overlapping = sorted({f"{name} [{thread}]" for name, thread, a, b in intervals if a < end and b > start})
        out.append({"epoch": index, "ms": round(ms, 2), "overlapping": overlapping})
        for label in overlapping or ["(nothing recorded)"]:
            excess_by[label] = excess_by.get(label, 0.0) + ms - median
    return {"median_ms": round(median, 3), "stalled": out, "count": len(out),
            "excess_ms_total": round(sum(s["ms"] - median for s in out), 1),
            "excess_ms_by_overlapping_interval": {k: round(v, 1) for k, v in sorted(excess_by.items(), key=lambda kv: -kv[1])}}


def by_phase(epochs: list[tuple[float, float]], intervals) -> dict:
    """Median epoch while each kind of interval overlaps it (gc aside), and over epochs that
    overlap none: which background step slows the training loop, stalls or not."""
    kinds: dict[str, list[float]] = {}
    for start, ms in epochs:
        end = start + ms / 1e3
        names = {name for name, _, a, b in intervals if a < end and b > start and not name.startswith("gc")}
        for name in names or {"(none)"}:
            kinds.setdefault(name, []).append(ms)
    return {name: {"epochs": len(v), "median_ms": round(statistics.median(v), 3)}
            for name, v in sorted(kinds.items(), key=lambda kv: -len(kv[1]))}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="fb100_Cornell5:gcn:128,uk-2007-05_100000:sage:128")
    parser.add_argument("--after", type=int, default=40)
    parser.add_argument("--max-s", type=float, default=40.0)
    parser.add_argument("--eager-epochs", type=int, default=200,
                        help="eager's epochs before each cold run; its runs of slow epochs are reported too "
                             "(thousands of them tell the host's own stalls from the runtime's)")
    args = parser.parse_args(argv)
    import torch

    from torch_sparserl import fastpath

    fastpath.ensure(wait=True)  # once per machine, as bench_cold_start does: not part of a first run on a graph
    instrument()
    device = torch.device("cuda")
    from torch_sparserl import autotune

    result = {"rows": [], "eval_burst_reps": autotune.RUNTIME_BURST_REPS}
    for spec in args.rows.split(","):
        name, model, hidden = spec.split(":")
        graph = bench.prepare_graph(name, device)
        eager = cold.run_eager(model, int(hidden), graph, device, args.eager_epochs)
        eager_slow = cold.slow_runs(eager["epochs_ms"])
        print(f"{spec}: eager, {len(eager['epochs_ms'])} epochs over {sum(eager['epochs_ms']) / 1e3:.1f} s: "
              f"{len(eager_slow)} runs of slow epochs, {sum(r['excess_ms'] for r in eager_slow):.0f} ms over the "
              f"median; at s: {[round(r['at_s'], 2) for r in eager_slow]}", flush=True)
        EPOCHS.clear()
        INTERVALS.clear()
        run = cold.run_cold(model, int(hidden), graph, device, jit="background", after=args.after, max_s=args.max_s)
        epochs = EPOCHS[1:1 + len(run["epochs_ms"])]  # the first is the compile
        t0 = epochs[0][0]
        row = {"row": spec, "eager_ms": eager["epoch_ms"], "eager_slow_runs": eager_slow,
               "decided_after_epochs": run["decided_after_epochs"], "decided_after_s": run["decided_after_s"], "steady_ms": run["steady_ms"],
               "stalls": stalls(epochs, INTERVALS), "by_phase": by_phase(epochs, INTERVALS),
               "intervals": [(n, th, round((a - t0) * 1e3, 2), round((b - a) * 1e3, 2)) for n, th, a, b in INTERVALS],
               "epochs": [(round((a - t0) * 1e3, 2), ms) for a, ms in epochs]}
        s = row["stalls"]
        during = run["epochs_ms"][:run["decided_after_epochs"]]
        print(f"{spec}: decided after {run['decided_after_epochs']} epochs ({run['decided_after_s']} s), median "
              f"epoch while deciding {statistics.median(during) if during else None} ms, steady {run['steady_ms']} ms; "
              f"kernels: {run['kernels']}", flush=True)
        print(f"{spec}: eager {eager['epoch_ms']:.2f} ms, median cold epoch {s['median_ms']} ms, "
              f"{s['count']} stalled epochs, {s['excess_ms_total']} ms over the median; by overlapping interval:",
              flush=True)
        for label, ms in list(s["excess_ms_by_overlapping_interval"].items())[:12]:
            print(f"    {ms:9.1f} ms  {label}", flush=True)
        for name, thread, at, ms in row["intervals"]:
            if name in INSTALL_STEPS:
                stalled = [e for e in s["stalled"] if e["epoch"] < len(row["epochs"])
                           and row["epochs"][e["epoch"]][0] < at + ms and row["epochs"][e["epoch"]][0] + e["ms"] > at]
                print(f"    install step {name} [{thread}] at {at:.1f} ms: {ms:.2f} ms"
                      + (f"; overlaps stalled epochs {[(e['epoch'], e['ms']) for e in stalled]}" if stalled else ""),
                      flush=True)
        for label, what in row["by_phase"].items():
            print(f"    while {label}: {what['epochs']} epochs, median {what['median_ms']} ms", flush=True)
        result["rows"].append(row)
    Path(os.environ.get("OUT", "/tmp"), "first-run.json").write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
