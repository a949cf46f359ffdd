"""Epoch time of full-graph GNN training on one fixed graph, four ways.

A two-layer GCN and a two-layer GraphSAGE (mean aggregation), hidden 128 and 256, trained with
Adam on random features (128) and labels (16 classes, half the nodes for training) of each graph:

* ``eager``    — ``torch.sparse.mm`` on a torch CSR tensor (cuSPARSE), eager PyTorch;
* ``inductor`` — the same model under ``torch.compile`` (Inductor); the sparse product runs
  eagerly between the compiled graphs (Dynamo cannot trace sparse tensors);
* ``pyg``      — PyG's default path: ``GCNConv(cached=True)`` / ``SAGEConv`` on ``edge_index``
  (gather + scatter), eager;
* ``sparserl`` — the model of ``eager`` with the adjacency a ``CSRMatrix``, under
  ``torch.compile(backend="sparserl")``; the JIT runtime specializes every product (sync mode,
  an empty kernel cache unless ``--cache-dir`` says otherwise).

All four start from the same parameters. The GCN adjacency is ``D^-1/2 (A + I) D^-1/2`` and
the SAGE one ``D^-1 A``, computed once (A binary, self loops removed, row i = edges into i).

``--models gat`` (not in the default set) times PyG's own ``GATConv`` (layer 1: 4 heads of
hidden/4, concatenated; layer 2: one head) in every way, on ``A + I`` with the layers'
``add_self_loops=False``: ``eager`` gives it a torch sparse ``adj_t`` (PyG's sparse path),
``pyg`` and ``inductor`` the ``edge_index`` (Inductor compiles PyG's gather/scatter), and
``sparserl`` the ``CSRMatrix`` (one product per head, the head's attention as values).
Per row, each way in turn: compiled and trained 20 epochs whose losses are recorded (the first
includes compilation and JIT). Then all the ways are timed interleaved: ``--chunks`` rounds, each
running one chunk of epochs of every way (starting one way further on each round), so that the
machine's drift falls on every way alike; a way's epoch time is the median chunk's mean, and the
report gives the range of the per-round ratios. JIT cost is the time the runtime spent
specializing (policy, validation, build), summed over every key.

    python benchmarks/bench_gnn.py --out benchmarks/results                       # everything
    python benchmarks/bench_gnn.py --graphs pubmed --models gcn --hidden 128 --out /tmp/g
    python benchmarks/bench_gnn.py --report benchmarks/results/gnn-<gpu>-....json # re-render
    python benchmarks/bench_gnn.py --compare run1.json run2.json --out runs.md      # repeated runs

Results go to ``gnn-<gpu>-<date>.json`` (``--resume`` adds to an existing file) with ``.md``
and ``.svg`` beside it.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (cuda_available, emit_markdown, environment, fmt, geomean, matrix_list, plots,  # noqa: E402
                    tables, write_json_md)
from common.gnn import (BOUND_WAYS, CAPTURED_WAYS, CLASSES, EXTRA_WAYS, FEATURES, PYG_WAYS, SPARSERL_WAYS,  # noqa: E402
                        WAYS, build_task, epoch_fn, fresh_copy, prepare_graph, reset_compiled, sync)
from common.timing import device_ms  # noqa: E402

SCHEMA = "torch_sparserl.bench_gnn/1"
GRAPHS = ["pubmed", "dblp-2010", "fb100_Cornell5", "uk-2007-05_100000", "rmat:scale=22,edge_factor=16"]
MODELS = ["gcn", "sage"]
ALL_MODELS = [*MODELS, "gat"]  # gat on request (--models): PyG's GATConv in every way
HIDDEN = [128, 256]
LOSS_EPOCHS = 20
LOSS_RTOL = 1e-3  # fp32 with different summation orders, over 20 Adam steps


# ----------------------------------------------------------------------- training


def start_training(task, params, device, min_chunk_s: float, capture: bool = False) -> tuple[dict, object]:
    """20 epochs with their losses (the first timed alone: compilation, JIT), then one more
    timed epoch to size the way's chunks. Returns the result so far and the epoch function.
    ``capture``: epochs through ``ts.capture_step`` (:func:`common.gnn.epoch_fn`)."""
    import torch

    epoch = epoch_fn(task, params, capture=capture)
    sync(device)
    start = time.perf_counter()
    losses = [epoch()]
    sync(device)
    first_s = time.perf_counter() - start
    for _ in range(LOSS_EPOCHS - 1):
        losses.append(epoch())
    sync(device)
    start = time.perf_counter()
    epoch()
    sync(device)
    estimate = max(time.perf_counter() - start, 1e-6)
    return ({"status": "ok", "epochs_per_chunk": max(3, min(200, math.ceil(min_chunk_s / estimate))),
             "first_epoch_s": first_s, "losses": [float(v) for v in torch.stack(losses).cpu()]}, epoch)


def time_rounds(epochs: dict, results: dict, device, rounds: int) -> None:
    """Time the ways' chunks interleaved: each round runs one chunk of every way, each round
    starting one way further on, so that the machine's drift over the row (clocks, other
    tenants, background threads) falls on every way alike instead of on whichever ran last.
    A way's epoch time is the median of its chunks' means."""
    import torch
    from torch_sparserl.tensor import intercept

    order = list(epochs)
    for r in range(rounds):
        # a recompilation with the sparserl backend installs the eager interception again:
        # the baselines' products must not pay for it
        intercept.deactivate_backend()
        for way in order[r % len(order):] + order[:r % len(order)]:
            if way not in epochs:
                continue
            result, epoch = results[way], epochs[way]
            try:
                sync(device)
                start = time.perf_counter()
                for _ in range(result["epochs_per_chunk"]):
                    epoch()
                sync(device)
            except torch.cuda.OutOfMemoryError as exc:
                results[way] = _failed(exc)
                del epochs[way]
                continue
            result.setdefault("chunk_ms", []).append((time.perf_counter() - start) * 1e3 / result["epochs_per_chunk"])
    for way in epochs:
        results[way]["epoch_ms"] = statistics.median(results[way]["chunk_ms"])


def profile_epochs(epochs: dict, results: dict, device) -> None:
    """Each way's device time of one more epoch (``gpu_ms``: the profiler's kernels, copies and
    memsets, summed), after its timed chunks; and its wall time over it (``wall_over_gpu``: 1
    where the host keeps the GPU busy). Nothing on the CPU."""
    for way, epoch in epochs.items():
        gpu_ms = device_ms(epoch, device)
        if gpu_ms is not None and results[way].get("status") == "ok":
            results[way]["gpu_ms"] = gpu_ms
            results[way]["wall_over_gpu"] = results[way]["epoch_ms"] / gpu_ms if gpu_ms > 0 else None


def _failed(exc: BaseException) -> dict:
    import torch

    if isinstance(exc, torch.cuda.OutOfMemoryError):
        return {"status": "oom", "error": str(exc).splitlines()[0]}
    return {"status": "error", "error": f"{type(exc).__name__}: {exc}"[:2000], "traceback": traceback.format_exc()[-4000:]}


def run_row(ways: list[str], model_name, hidden, graph, device, args) -> dict:
    """Every way of one (graph, model, hidden) row: each way compiled and trained for its
    losses in turn (the runtime's JIT measured per way), then all of them timed interleaved
    (:func:`time_rounds`), then the sparserl way's warm start."""
    import torch
    from torch_sparserl.compiler import passes
    from torch_sparserl.jit import runtime as rt
    from torch_sparserl.tensor import intercept

    results, epochs = {}, {}
    compiles = torch._dynamo.utils.counters["stats"]
    # the worker stops after 30 s without a specialization (the previous row's timing): each
    # row's JIT is measured from the same started state, its restart reported beside it
    prewarm_s = rt.active().prewarm(device) if set(ways) & set(SPARSERL_WAYS) and device.type == "cuda" else None
    reset_compiled()
    try:
        for way in ways:
            if device.type == "cuda":
                # what the ways before cached and no longer use (PyG's gathers on R-MAT: tens of
                # GB) would leave the runtime's worker, another process, no memory to evaluate in
                torch.cuda.empty_cache()
            if way not in SPARSERL_WAYS:
                intercept.deactivate_backend()  # the baselines run as in a process without sparserl
            else:
                runtime = rt.active()  # one runtime for the process (main configures and prewarms it)
                before = dict(runtime.stats), SPECIALIZED["keys"]
                passes.REPORTS.clear()  # what an earlier way compiled is not this way's
            try:
                task = build_task(way, model_name, hidden, graph, device, args)
                results[way], epochs[way] = start_training(task, list(task.parameters()), device, args.min_chunk_s,
                                                           capture=way in CAPTURED_WAYS)
            except Exception as exc:  # noqa: BLE001 - recorded, the row goes on
                results[way] = _failed(exc)
                epochs.pop(way, None)
            if way in SPARSERL_WAYS and results[way]["status"] == "ok":
                result = results[way]
                result["fused_epilogues"] = sorted({line for report in passes.REPORTS for line in report.fused})
                passes.REPORTS.clear()
                result["jit_s"] = runtime.stats["jit_s"] - before[0]["jit_s"]
                result["jit_keys"] = SPECIALIZED["keys"] - before[1]
                result["runtime_stats"] = dict(runtime.stats)
                A = graph[f"csr_matrix_{model_name}"]
                result["kernels"] = runtime.decisions(A.crow, A.col, A.shape[1])
            _print_way(model_name, hidden, way, results[way])
        reference = None
        if device.type == "cuda" and "eager" in ways and set(ways) & set(CAPTURED_WAYS):
            intercept.deactivate_backend()  # eager torch.sparse, as the eager way ran
            reference = eager_capturable_losses(model_name, hidden, graph, device, args)
        unique_graphs = compiles["unique_graphs"]
        worker_stops = rt.active().stats.get("worker_stops", 0)
        time_rounds(epochs, results, device, args.chunks)
        timing = {"recompiled": compiles["unique_graphs"] - unique_graphs,
                  "worker_stops": rt.active().stats.get("worker_stops", 0) - worker_stops}
        profile_epochs(epochs, results, device)
    finally:
        epochs.clear()
        reset_compiled()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if args.warm and results.get("sparserl", {}).get("status") == "ok":
        try:
            results["sparserl"]["warm"] = warm_start("sparserl", model_name, hidden, graph, device, args)
        except Exception as exc:  # noqa: BLE001
            results["sparserl"]["warm"] = _failed(exc)
    row = {"ways": results, "timing": timing, "runtime_prewarm_s": prewarm_s}
    if reference is not None:
        row["eager_capturable_losses"] = reference
    return row


def eager_capturable_losses(model_name, hidden, graph, device, args) -> list[float] | str:
    """The eager way's first LOSS_EPOCHS losses with Adam(capturable=True), not captured: the
    captured ways' Adam, so that their losses can be told apart from the optimizer's own
    rounding (its step count and bias corrections in float32 on the device). Not timed."""
    import torch

    try:
        task = build_task("eager", model_name, hidden, graph, device, args)
        epoch = epoch_fn(task, list(task.parameters()), capturable=True)
        return [float(v) for v in torch.stack([epoch() for _ in range(LOSS_EPOCHS)]).cpu()]
    except Exception as exc:  # noqa: BLE001 - recorded, the row goes on
        return f"{type(exc).__name__}: {exc}"[:500]


def _print_way(model_name, hidden, way, r) -> None:
    print(f"  {model_name:4s} h={hidden:3d} {way:8s} "
          + (f"first {r['first_epoch_s']:.1f} s, loss {r['losses'][-1]:.5f}"
             + (f", JIT {r['jit_s']:.1f} s ({r['jit_keys']} keys)" if "jit_s" in r else "")
             if r["status"] == "ok" else f"{r['status']}: {r.get('error', '')[:300]}"), flush=True)


def warm_start(way, model_name, hidden, graph, device, args) -> dict:
    """What the next run on this graph pays: a fresh runtime reading the same disk cache, a
    fresh copy of the adjacency (so its fingerprint and transpose are computed again, as in a
    new process), compiled again; the first epoch, timed. A key missing from the cache is
    counted (``cache_misses``) and served by cuSPARSE, never specialized here."""
    from torch_sparserl.jit import runtime as rt
    from torch_sparserl.jit.cache import KernelCache

    cold = rt.active()
    missed = []

    def no_specializing(key, crow, col, ncols):
        missed.append(f"{key.op} n={key.n}")
        raise RuntimeError("warm start: the key is not in the disk cache")

    no_specializing.policy_id = cold.policy_id
    warm = rt.Runtime(cold.settings, cache=KernelCache(cold.cache.root), specializer=no_specializing)
    fresh = fresh_copy(graph[f"csr_matrix_{model_name}"])
    rt.set_active(warm)
    reset_compiled()
    try:
        epoch = epoch_fn(build_task(way, model_name, hidden, graph, device, args, adjacency=fresh))
        sync(device)
        start = time.perf_counter()
        loss = epoch()
        sync(device)
        first_s = time.perf_counter() - start
    finally:
        reset_compiled()
        rt.set_active(cold)
        warm.close()
    return {"jit_s": warm.stats["jit_s"], "first_epoch_s": first_s, "loss": float(loss.detach()),
            "cache_misses": missed, "installs": warm.stats["installs"]}


SPECIALIZED = {"keys": 0}  # keys the process's runtime specialized (cache misses)


def start_runtime(policy: str, device) -> float | None:
    """Configure the process's runtime (sync: the first epoch waits for every kernel), count
    the keys its specializer decides, and prewarm it (sandbox worker, policy): returns the
    prewarm's seconds. The JIT time of a way is the runtime's own ``stats["jit_s"]``: what
    products waited for decisions (fingerprints, cache, specialization, builds)."""
    from torch_sparserl.jit import runtime as rt

    runtime = rt.configure(mode="sync", policy=policy)
    specialize = runtime.specializer

    def counted(*a, **k):
        SPECIALIZED["keys"] += 1
        return specialize(*a, **k)

    counted.policy_id = runtime.policy_id
    runtime.specializer = counted
    counted.prewarm = getattr(specialize, "prewarm", None)
    return runtime.prewarm(device) if device.type == "cuda" else None


# ------------------------------------------------------------------------ results


def round_ratios(ways: dict, num: str, den: str) -> list[float] | None:
    """``num``'s chunk time over ``den``'s, round by round (interleaved runs: adjacent in time)."""
    a, b = ways.get(num, {}).get("chunk_ms"), ways.get(den, {}).get("chunk_ms")
    if not a or not b or len(a) != len(b):
        return None
    return [x / y for x, y in zip(a, b)]


def row_metrics(row: dict) -> dict:
    ways = row["ways"]
    ms = {w: ways[w]["epoch_ms"] for w in WAYS if ways.get(w, {}).get("status") == "ok"}
    out = {}
    if "sparserl" in ms:
        ours = ms["sparserl"]
        if "eager" in ms:
            out["speedup_vs_eager"] = ms["eager"] / ours
            if bounds := _bounds(ways, "eager", "sparserl"):
                out["speedup_vs_eager_rounds"] = bounds
        best = [ms[w] for w in ("inductor", "pyg") if w in ms]
        if best:
            out["speedup_vs_best_other"] = min(best) / ours
        jit = ways["sparserl"].get("jit_s")
        saved = ms.get("eager", 0) - ours
        if jit is not None:
            out["jit_s"] = jit
            out["breakeven_epochs_vs_eager"] = jit * 1e3 / saved if saved > 0 else None
        warm = ways["sparserl"].get("warm")
        if warm:
            out["warm_jit_s"] = warm["jit_s"]
            out["warm_breakeven_epochs_vs_eager"] = warm["jit_s"] * 1e3 / saved if saved > 0 else None
            out["warm_cache_misses"] = len(warm["cache_misses"])
    fused = ways.get("sparserl_fused", {})
    if "sparserl" in ms and fused.get("status") == "ok":
        out["fusion_speedup"] = ms["sparserl"] / fused["epoch_ms"]
    uncompiled = ways.get("sparserl_eager", {})
    if uncompiled.get("status") == "ok":
        if "eager" in ms:
            out["uncompiled_vs_eager"] = ms["eager"] / uncompiled["epoch_ms"]
        if "sparserl" in ms:
            out["uncompiled_vs_compiled"] = ms["sparserl"] / uncompiled["epoch_ms"]
    subclass = ways.get("sparserl_subclass", {})
    if "sparserl" in ms and subclass.get("status") == "ok":
        out["flatten_speedup"] = subclass["epoch_ms"] / ms["sparserl"]
    python = ways.get("sparserl_python", {})
    if "sparserl" in ms and python.get("status") == "ok":
        out["fast_path_speedup"] = python["epoch_ms"] / ms["sparserl"]
    graphs = ways.get("sparserl_cudagraphs", {})
    if graphs.get("status") == "ok" and "eager" in ms:
        out["cudagraphs_vs_eager"] = ms["eager"] / graphs["epoch_ms"]
        best = [ms[w] for w in ("inductor", "pyg") if w in ms]
        if best:
            out["cudagraphs_vs_best_other"] = min(best) / graphs["epoch_ms"]
    captured = ways.get("sparserl_captured", {})
    if captured.get("status") == "ok":
        if "eager" in ms:
            out["captured_vs_eager"] = ms["eager"] / captured["epoch_ms"]
        if uncompiled.get("status") == "ok":
            out["captured_vs_uncaptured"] = uncompiled["epoch_ms"] / captured["epoch_ms"]
    both = ways.get("sparserl_compiled_captured", {})
    if both.get("status") == "ok" and captured.get("status") == "ok":  # >= 0.95: compiling costs a capture little
        out["compiled_captured_over_captured"] = captured["epoch_ms"] / both["epoch_ms"]
    if both.get("status") == "ok" and "eager" in ms:
        out["compiled_captured_vs_eager"] = ms["eager"] / both["epoch_ms"]
    pyg = {w: ways[w]["epoch_ms"] for w in PYG_WAYS if ways.get(w, {}).get("status") == "ok"}
    if pyg:
        out["best_pyg_way"] = min(pyg, key=pyg.get)
        if captured.get("status") == "ok":
            out["captured_vs_best_pyg"] = min(pyg.values()) / captured["epoch_ms"]
        if both.get("status") == "ok":
            out["compiled_captured_vs_best_pyg"] = min(pyg.values()) / both["epoch_ms"]
    if "sparserl" in ms and uncompiled.get("status") == "ok":
        out["compiled_over_eager"] = uncompiled["epoch_ms"] / ms["sparserl"]  # >= 1: compiling costs nothing
    walls = {w: r["wall_over_gpu"] for w, r in ways.items() if r.get("wall_over_gpu") is not None}
    if walls:
        out["wall_over_gpu"] = walls
    bound = ways.get("bound_inductor", {})
    if bound.get("status") == "ok" and "eager" in ms:
        out["bound_vs_eager"] = ms["eager"] / bound["epoch_ms"]
    eager_losses = ways.get("eager", {}).get("losses") if ways.get("eager", {}).get("status") == "ok" else None
    same_adam = row.get("eager_capturable_losses")
    for way in CAPTURED_WAYS:
        losses = ways.get(way, {}).get("losses") if ways.get(way, {}).get("status") == "ok" else None
        if losses and eager_losses:  # over every epoch, not only the last
            out[f"{way}_loss_rel_diff"] = _max_rel_diff(losses, eager_losses)
        if losses and isinstance(same_adam, list):
            out[f"{way}_loss_rel_diff_same_adam"] = _max_rel_diff(losses, same_adam)
    finals = {w: ways[w]["losses"][-1] for w in WAYS + EXTRA_WAYS
              if w not in BOUND_WAYS and ways.get(w, {}).get("status") == "ok"}
    if len(finals) > 1:
        ref = finals.get("eager", next(iter(finals.values())))
        out["loss_max_rel_diff"] = max(abs(v - ref) / abs(ref) for v in finals.values())
        out["losses_equal"] = out["loss_max_rel_diff"] <= LOSS_RTOL
    return out


def _max_rel_diff(losses: list[float], reference: list[float]) -> float:
    return max(abs(a - b) / abs(b) for a, b in zip(losses, reference))


def _bounds(ways: dict, num: str, den: str):
    rounds = round_ratios(ways, num, den)
    return [min(rounds), max(rounds)] if rounds else None


def _range(bounds) -> str:
    return "" if not bounds else f" ({bounds[0]:.2f}–{bounds[1]:.2f})"


def _way_section(rows, way, intro, columns, align, cells, mean) -> list[str]:
    """The Markdown section of an extra way: ``intro``, then a table of the rows that ran it
    (graph, model, hidden, then ``cells(row, metrics)``, aligned as ``align`` says: a letter per
    column, see :func:`common.tables.header`) and the ``mean(selected)`` line."""
    selected = [(r, row_metrics(r)) for r in rows if way in r["ways"]]
    if not selected:
        return []
    lines = ["", intro, "", *tables.header(["graph", "model", "hidden", *columns], "llr" + align)]
    lines += [tables.row([r["graph"], r["model"], r["hidden"], *cells(r, m)]) for r, m in selected]
    return lines + [tables.row(mean(selected))]


def markdown(doc: dict) -> str:
    env = doc.get("env", {})
    lines = [f"# GNN epoch time — {env.get('gpu', '?')}", ""]
    if doc.get("superseded"):
        lines += [f"> **Superseded:** {doc['superseded']}", ""]
    lines += [
             f"torch {env.get('torch')}, CUDA {env.get('cuda')}; features {FEATURES}, classes {CLASSES}, "
             f"Adam, fp32. Epoch = forward + loss + backward + step; after {LOSS_EPOCHS} epochs per way, the "
             "ways' timed chunks run interleaved, round by round, and a way's epoch is the median chunk's mean; "
             "in parentheses, the lowest and highest ratio of one round's adjacent chunks. Speedups are sparserl's over the way named. JIT = the time products "
             "waited for the runtime's decisions (fingerprints, kernel cache, policy, validation, builds) "
             "over every key: *cold* with an empty kernel cache (the first run on a graph), *warm* in a "
             "fresh runtime on the same disk cache with a fresh copy of the adjacency (every later run); "
             "break-even = JIT / (eager epoch − sparserl epoch).", "",
             *tables.header(["graph", "nodes", "nnz", "model", "hidden", "eager ms", "inductor ms", "pyg ms",
                             "sparserl ms", "vs eager", "vs best other", "JIT s cold", "break-even epochs cold",
                             "JIT ms warm", "break-even epochs warm", "final losses equal"], "lrrlrrrrrrrrrrrl")]
    rows = doc.get("rows", [])
    for row in rows:
        m = row_metrics(row)
        cells = []
        for w in WAYS:
            r = row["ways"].get(w, {})
            cells.append(fmt(r.get("epoch_ms"), ".2f") if r.get("status") == "ok" else r.get("status", "—"))
        lines.append(tables.row([
            row["graph"], f"{row['n']:,}", f"{row['nnz']:,}", row["model"], row["hidden"], *cells,
            fmt(m.get("speedup_vs_eager"), ".2f", "×") + _range(m.get("speedup_vs_eager_rounds")),
            fmt(m.get("speedup_vs_best_other"), ".2f", "×"), fmt(m.get("jit_s"), ".1f"),
            fmt(m.get("breakeven_epochs_vs_eager"), ".0f"),
            fmt(m["warm_jit_s"] * 1e3 if "warm_jit_s" in m else None, ".1f")
            + (f" ({m['warm_cache_misses']} missed)" if m.get("warm_cache_misses") else ""),
            fmt(m.get("warm_breakeven_epochs_vs_eager"), ".1f"),
            f"{'yes' if m.get('losses_equal') else 'no'} ({fmt(m.get('loss_max_rel_diff'), '.1e')})"]))
    lines += ["", "Geometric means over the graphs:", "",
              *tables.header(["model", "hidden", "vs eager", "vs best of inductor, pyg"], "lrrr")]
    for model in dict.fromkeys(r["model"] for r in rows):
        for hidden in sorted({r["hidden"] for r in rows if r["model"] == model}):
            ms = [row_metrics(r) for r in rows if r["model"] == model and r["hidden"] == hidden]
            if ms:
                lines.append(tables.row([model, hidden, fmt(geomean(m.get("speedup_vs_eager") for m in ms), ".2f", "×"),
                                         fmt(geomean(m.get("speedup_vs_best_other") for m in ms), ".2f", "×")]))
    every = [row_metrics(r) for r in rows]
    graphs = list(dict.fromkeys(r["graph"] for r in rows))
    per_graph = {g: [row_metrics(r) for r in rows if r["graph"] == g] for g in graphs}
    means = {g: (geomean(m.get("speedup_vs_eager") for m in ms), geomean(m.get("speedup_vs_best_other") for m in ms))
             for g, ms in per_graph.items()}
    for g in graphs:
        lines.append(tables.row([f"{g} (its {len(per_graph[g])} rows)", "", fmt(means[g][0], ".2f", "×"),
                                 fmt(means[g][1], ".2f", "×")]))
    lines.append(tables.row(["over the graphs (each graph one mean)", "",
                             fmt(geomean(v[0] for v in means.values()), ".2f", "×"),
                             fmt(geomean(v[1] for v in means.values()), ".2f", "×")]))
    lines.append(tables.row(["all rows", "", fmt(geomean(m.get("speedup_vs_eager") for m in every), ".2f", "×"),
                             fmt(geomean(m.get("speedup_vs_best_other") for m in every), ".2f", "×")]))
    lines += _way_section(
        rows, "sparserl_fused",
        "Fused epilogues: sparserl_fused (the post-grad pass fuses the layer tail into the product's kernel "
        "where that kernel stores each row once) against sparserl (Inductor's pointwise kernel after the "
        "product), same kernels otherwise:",
        ["fused ms", "unfused ms", "fusion speedup", "fused chains"], "rrrl",
        lambda r, m: [fmt(r["ways"]["sparserl_fused"].get("epoch_ms"), ".3f"),
                      fmt(r["ways"].get("sparserl", {}).get("epoch_ms"), ".3f"),
                      fmt(m.get("fusion_speedup"), ".3f", "×"),
                      "; ".join(r["ways"]["sparserl_fused"].get("fused_epilogues", [])) or "—"],
        lambda sel: ["geometric mean", "", "", "", "", fmt(geomean(m.get("fusion_speedup") for _, m in sel), ".3f", "×"), ""])
    lines += _way_section(
        rows, "sparserl_eager",
        "Without torch.compile: sparserl_eager (the CSRMatrix model run eagerly, same runtime and kernels) "
        "against eager torch.sparse and against sparserl compiled:",
        ["sparserl_eager ms", "vs eager", "vs sparserl compiled"], "rrr",
        lambda r, m: [fmt(r["ways"]["sparserl_eager"].get("epoch_ms"), ".2f"),
                      fmt(m.get("uncompiled_vs_eager"), ".2f", "×"), fmt(m.get("uncompiled_vs_compiled"), ".2f", "×")],
        lambda sel: ["geometric mean", "", "", "", fmt(geomean(m.get("uncompiled_vs_eager") for _, m in sel), ".2f", "×"),
                     fmt(geomean(m.get("uncompiled_vs_compiled") for _, m in sel), ".2f", "×")])

    def against_sparserl(way: str, text: str, names: list[str], metric: str) -> list[str]:
        """A section of one variant of the sparserl way timed in the same rounds: its epoch,
        sparserl's, and sparserl's speedup over it (with the rounds' range)."""
        return _way_section(
            rows, way, text, names, "rrr",
            lambda r, m: [fmt(r["ways"][way].get("epoch_ms"), ".3f"), fmt(r["ways"].get("sparserl", {}).get("epoch_ms"), ".3f"),
                          fmt(m.get(metric), ".3f", "×") + _range(_bounds(r["ways"], way, "sparserl"))],
            lambda sel: ["geometric mean", "", "", "", "", fmt(geomean(m.get(metric) for _, m in sel), ".3f", "×")])

    lines += against_sparserl(
        "sparserl_subclass",
        "Flattened CSRMatrix inputs: sparserl (the backend hands the matrix to AOTAutograd as its parts, the "
        "default) against sparserl_subclass (options={\"flatten_matrices\": False}), same kernels, same rounds:",
        ["subclass ms", "flattened ms", "flattening speedup"], "flatten_speedup")
    lines += against_sparserl(
        "sparserl_python",
        "C++ fast path: sparserl (compiled products served in C++ once Python has served the same call, the "
        "default) against sparserl_python (options={\"fast_path\": False}: every product through its Python "
        "implementation), same kernels, same rounds:",
        ["python ms", "fast path ms", "fast path speedup"], "fast_path_speedup")

    def over_graphs(sel, key):
        per_graph = {}
        for r, m in sel:
            per_graph.setdefault(r["graph"], []).append(m.get(key))
        return fmt(geomean(geomean(v) for v in per_graph.values()), ".2f", "×")

    lines += _way_section(
        rows, "sparserl_cudagraphs",
        "Under CUDA graphs: sparserl_cudagraphs (the sparserl way compiled with mode=\"reduce-overhead\"), "
        "timed in the same rounds, against eager torch.sparse and the best of Inductor and PyG (default mode):",
        ["sparserl_cudagraphs ms", "vs eager", "vs best other"], "rrr",
        lambda r, m: [fmt(r["ways"]["sparserl_cudagraphs"].get("epoch_ms"), ".2f"),
                      fmt(m.get("cudagraphs_vs_eager"), ".2f", "×") + _range(_bounds(r["ways"], "eager", "sparserl_cudagraphs")),
                      fmt(m.get("cudagraphs_vs_best_other"), ".2f", "×")],
        lambda sel: ["geometric mean over the graphs (each graph one mean)", "", "", "",
                     over_graphs(sel, "cudagraphs_vs_eager"), over_graphs(sel, "cudagraphs_vs_best_other")])

    lines += _way_section(
        rows, "sparserl_captured",
        "Whole step captured: sparserl_captured (the sparserl_eager model, each epoch replayed as one CUDA graph "
        "by ts.capture_step, Adam capturable; eager on the CPU), timed in the same rounds, against eager "
        "torch.sparse and against sparserl_eager (the same model and kernels, launched one by one); loss diff: the "
        f"largest relative difference over the first {LOSS_EPOCHS} losses from eager torch.sparse's with the default "
        "Adam / with Adam(capturable=True), the captured step's optimizer:",
        ["sparserl_captured ms", "vs eager", "vs sparserl_eager", "vs PyG's best (which)", "loss diff (same Adam)"],
        "rrrlr",
        lambda r, m: [fmt(r["ways"]["sparserl_captured"].get("epoch_ms"), ".3f"),
                      fmt(m.get("captured_vs_eager"), ".2f", "×") + _range(_bounds(r["ways"], "eager", "sparserl_captured")),
                      fmt(m.get("captured_vs_uncaptured"), ".2f", "×"),
                      fmt(m.get("captured_vs_best_pyg"), ".2f", "×") + (f" ({m['best_pyg_way']})"
                                                                          if "best_pyg_way" in m else ""),
                      f"{fmt(m.get('sparserl_captured_loss_rel_diff'), '.1e')} "
                      f"({fmt(m.get('sparserl_captured_loss_rel_diff_same_adam'), '.1e')})"],
        lambda sel: ["geometric mean over the graphs (each graph one mean)", "", "", "",
                     over_graphs(sel, "captured_vs_eager"), over_graphs(sel, "captured_vs_uncaptured"),
                     over_graphs(sel, "captured_vs_best_pyg"), ""])

    lines += _way_section(
        rows, "sparserl_compiled_captured",
        "Compiled and captured: sparserl_compiled_captured (the compiled sparserl model, each epoch replayed as "
        "one CUDA graph by ts.capture_step), against sparserl_captured (the same step uncompiled); 1.0 or more: "
        "compiling costs the captured step nothing:",
        ["sparserl_compiled_captured ms", "vs sparserl_captured"], "rr",
        lambda r, m: [fmt(r["ways"]["sparserl_compiled_captured"].get("epoch_ms"), ".3f"),
                      fmt(m.get("compiled_captured_over_captured"), ".2f", "×")],
        lambda sel: ["geometric mean over the graphs (each graph one mean)", "", "", "",
                     over_graphs(sel, "compiled_captured_over_captured")])

    profiled = [(r, walls) for r in rows if (walls := row_metrics(r).get("wall_over_gpu"))]
    if profiled:
        shown = [w for w in WAYS + EXTRA_WAYS if any(w in walls for _, walls in profiled)]
        lines += ["", "Wall time over device time per epoch (one more epoch of each way under the profiler: "
                      "kernels, copies and memsets summed; 1 where the host keeps the GPU busy):", "",
                  *tables.header(["graph", "model", "hidden", *shown], "llr" + "r" * len(shown))]
        lines += [tables.row([r["graph"], r["model"], r["hidden"], *(fmt(walls.get(w), ".2f") for w in shown)])
                  for r, walls in profiled]

    lines += _way_section(
        rows, "bound_inductor",
        "The bound of a compiled way: bound_inductor is the model compiled by Inductor with the adjacency "
        "product taken out, what a compiled epoch would cost with free sparse products (Dynamo, AOTAutograd "
        "and Inductor's per-call work, the dense layers, the loss, Adam). Eager over it is the most any "
        "compiled way could gain over eager on that row:",
        ["eager ms", "bound_inductor ms", "bound vs eager", "sparserl vs eager"], "rrrr",
        lambda r, m: [fmt(r["ways"].get("eager", {}).get("epoch_ms"), ".2f"),
                      fmt(r["ways"]["bound_inductor"].get("epoch_ms"), ".2f"),
                      fmt(m.get("bound_vs_eager"), ".2f", "×"), fmt(m.get("speedup_vs_eager"), ".2f", "×")],
        lambda sel: ["geometric mean over the graphs (each graph one mean)", "", "", "", "",
                     over_graphs(sel, "bound_vs_eager"), over_graphs(sel, "speedup_vs_eager")])
    disturbed = [f"{r['graph']} {r['model']} {r['hidden']}: {t.get('recompiled', 0)} recompilations, "
                 f"{t.get('worker_stops', 0)} worker stops" for r in rows
                 for t in [r.get("timing", {})] if t.get("recompiled") or t.get("worker_stops")]
    if any("timing" in r for r in rows):
        lines += ["", "While the rounds were timed: " + ("; ".join(disturbed) if disturbed else
                  "no recompilation and no stop of the specializer's worker on any row") + "."]
    lines += ["", "Runs (the runtime's one-time start — sandbox worker, policy load — is done by a prewarm "
              "before the first graph, and again before each row in case the worker stopped idle; it is not "
              "in any row's JIT):", ""]
    runs = doc.get("runs", [])
    bullets = tables.run_bullets(runs, lambda r: f"compile mode {r.get('compile_mode', 'default')}; prewarm "
                                                 f"{fmt(r.get('runtime_prewarm_s'), '.1f', ' s')}")
    lines += [bullet + (f". {r['note']}" if r.get("note") else "") for bullet, r in zip(bullets, runs)]
    return "\n".join(lines) + "\n"


def plot(doc: dict) -> str:
    """Epoch-time speedup over eager cuSPARSE of each way, grouped per (graph, model, hidden)."""
    colors = {"inductor": "#8c8c8c", "pyg": "#e39b2d", "sparserl": "#2b6cb0"}
    labels, speedups = [], {way: [] for way in colors}
    for r in doc.get("rows", []):
        eager = r["ways"].get("eager", {})
        if eager.get("status") != "ok":
            continue
        labels.append(f"{r['graph'][:14]} {r['model']} {r['hidden']}")
        for way in colors:
            ok = r["ways"].get(way, {}).get("status") == "ok"
            speedups[way].append(eager["epoch_ms"] / r["ways"][way]["epoch_ms"] if ok else None)
    fig, (ax,) = plots.figure("GNN epoch-time speedup over eager cuSPARSE — " + str(doc.get("env", {}).get("gpu", "?")),
                              width=max(6.4, 1.5 + 0.45 * len(labels)), height=4.8)
    if not labels:
        plots.no_results(ax)
        return plots.to_svg(fig)
    plots.grouped_bars(ax, labels, {way: (speedups[way], color) for way, color in colors.items()})
    plots.times_axis(ax)
    plots.unity(ax)
    ax.set_ylim(0, 1.05 * max([2.0] + [v for values in speedups.values() for v in values if v is not None]))
    ax.legend(loc="upper left", fontsize=8)
    return plots.to_svg(fig)


def save(doc: dict, path: Path) -> None:
    write_json_md(doc, path, markdown, plot)


COMPARED = (("speedup_vs_eager", "sparserl vs eager"), ("speedup_vs_best_other", "sparserl vs best other"),
            ("cudagraphs_vs_eager", "sparserl_cudagraphs vs eager"), ("captured_vs_eager", "sparserl_captured vs eager"))


def compare(paths: list[Path]) -> str:
    """How far repeated runs agree: each row's speedups in every run, the means over the graphs
    per run, and their spread. Rows are matched by (graph, model, hidden)."""
    docs = [json.loads(Path(p).read_text()) for p in paths]
    names = [Path(p).stem for p in paths]
    keyed = [{(r["graph"], r["model"], r["hidden"]): row_metrics(r) for r in d.get("rows", [])} for d in docs]
    keys = [k for k in dict.fromkeys(k for runs in keyed for k in runs) if all(k in runs for runs in keyed)]
    lines = [f"# GNN epoch time: {len(docs)} runs compared", "",
             "Runs: " + ", ".join(f"`{n}`" for n in names) + f". Rows present in every run: {len(keys)}. Each "
             "speedup is the baseline's epoch time over the sparserl way's, both from the same run.", ""]
    for metric, title in COMPARED:
        if not any(runs[k].get(metric) is not None for runs in keyed for k in keys):
            continue
        lines += [f"## {title}", "", *tables.header(["graph", "model", "hidden", *(f"run {i + 1}" for i in range(len(docs))),
                                                      "spread (max/min)"], "llr" + "r" * (len(docs) + 1))]
        for k in keys:
            values = [runs[k].get(metric) for runs in keyed]
            spread = max(values) / min(values) if None not in values else None
            lines.append(tables.row([*k, *(fmt(v, ".2f", "×") for v in values), fmt(spread, ".2f")]))
        per_run = []
        for runs in keyed:
            graphs = {}
            for k in keys:
                graphs.setdefault(k[0], []).append(runs[k].get(metric))
            per_run.append({g: geomean(v) for g, v in graphs.items()})
        for g in per_run[0]:
            lines.append(tables.row([f"{g} (its rows)", "", "", *(fmt(run[g], ".2f", "×") for run in per_run), ""]))
        overall = [geomean(run.values()) for run in per_run]
        lines += [tables.row(["**over the graphs**", "", "", *(fmt(v, ".2f", "×") for v in overall),
                              fmt(max(overall) / min(overall) if None not in overall else None, ".2f")]), ""]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- main


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--graphs", default=",".join(GRAPHS))
    parser.add_argument("--models", default=",".join(MODELS), help=f"some of {ALL_MODELS} (gat: PyG's GATConv)")
    parser.add_argument("--hidden", default=",".join(map(str, HIDDEN)))
    parser.add_argument("--ways", default=",".join(WAYS))
    parser.add_argument("--out", default="benchmarks/results", help="folder (a dated file in it) or a .json path")
    parser.add_argument("--resume", help="add to this results file (rows already there are skipped)")
    parser.add_argument("--report", help="only re-render the .md and .svg of this results file")
    parser.add_argument("--compare", nargs="+", metavar="JSON",
                        help="only compare these results files (repeated runs): Markdown to --out (a .md path) or stdout")
    parser.add_argument("--chunks", type=int, default=5, help="timed rounds (one chunk of every way each)")
    parser.add_argument("--min-chunk-s", type=float, default=0.3)
    parser.add_argument("--policy", default="learned", choices=("learned", "autotune"))
    parser.add_argument("--mode", default="default", choices=("default", "reduce-overhead", "max-autotune-no-cudagraphs"),
                        help="torch.compile mode of the inductor and sparserl ways")
    parser.add_argument("--cache-dir", help="the kernel cache (default: a fresh empty folder, so JIT is measured)")
    parser.add_argument("--no-warm", dest="warm", action="store_false",
                        help="skip the warm start (the next run's JIT: a fresh runtime on the same disk cache)")
    parser.add_argument("--device", default="cuda" if cuda_available() else "cpu")
    parser.add_argument("--max-time-s", type=float, default=None, help="start no graph after this much time")
    args = parser.parse_args(argv)

    if args.compare:
        emit_markdown(compare([Path(p) for p in args.compare]), args.out)
        return 0
    if args.report:
        path = Path(args.report)
        save(json.loads(path.read_text()), path)
        return 0
    os.environ["SPARSERL_CACHE_DIR"] = args.cache_dir or tempfile.mkdtemp(prefix="sparserl-gnn-cache-")
    import torch
    import torch_sparserl.integrations.pyg  # noqa: F401  (PyG's own layers are used by the pyg way only)

    device = torch.device(args.device)
    env = environment()
    if args.resume:
        path = Path(args.resume)
        doc = json.loads(path.read_text())
    else:
        out = Path(args.out)
        path = out if out.suffix == ".json" else out / f"gnn-{env['gpu_slug']}-{dt.date.today().isoformat()}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        doc = {"schema": SCHEMA, "env": env, "runs": [], "rows": []}
    unknown_models = set(args.models.split(",")) - set(ALL_MODELS)
    if unknown_models:
        parser.error(f"--models: unknown {sorted(unknown_models)} (expected some of {ALL_MODELS})")
    ways = args.ways.split(",")
    unknown = set(ways) - set(WAYS + EXTRA_WAYS)
    if unknown:
        parser.error(f"--ways: unknown {sorted(unknown)} (expected some of {WAYS + EXTRA_WAYS})")
    wants_runtime = set(SPARSERL_WAYS) & set(ways)
    prewarm_s = start_runtime(args.policy, device) if wants_runtime else None
    doc["runs"].append({"started": dt.datetime.now().isoformat(timespec="seconds"),
                        "command": " ".join(["python benchmarks/bench_gnn.py"] + (argv if argv is not None else sys.argv[1:])),
                        "env": env, "compile_mode": args.mode, "runtime_prewarm_s": prewarm_s})
    done = {(r["graph"], r["model"], r["hidden"]) for r in doc["rows"]}
    started = time.perf_counter()
    for name in matrix_list(args.graphs):
        todo = [(m, int(h)) for m in args.models.split(",") for h in args.hidden.split(",") if (name, m, int(h)) not in done]
        if not todo:
            continue
        if args.max_time_s is not None and time.perf_counter() - started > args.max_time_s:
            print(f"bench_gnn: time limit reached before {name}", flush=True)
            save(doc, path)
            return 3
        graph = prepare_graph(name, device, models=list(dict.fromkeys(m for m, _ in todo)))
        print(f"{name}: {graph['n']:,} nodes, {graph['nnz']:,} edges, prepared in {graph['load_s']:.1f} s", flush=True)
        for model_name, hidden in todo:
            row = {"graph": name, "n": graph["n"], "nnz": graph["nnz"], "model": model_name, "hidden": hidden}
            row.update(run_row(ways, model_name, hidden, graph, device, args))
            for way, r in row["ways"].items():
                if r.get("status") == "ok":
                    print(f"  {model_name:4s} h={hidden:3d} {way:8s} {r['epoch_ms']:8.3f} ms/epoch "
                          f"(chunks {', '.join(f'{v:.3f}' for v in r['chunk_ms'])})", flush=True)
            row.update(row_metrics(row))
            doc["rows"].append(row)
            save(doc, path)
        del graph
    save(doc, path)
    print(f"wrote {path}", flush=True)
    return 0



if __name__ == "__main__":
    sys.exit(main())
