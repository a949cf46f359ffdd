"""The first training run on a graph, as a user meets it: a fresh process, an empty kernel
cache, the runtime's defaults.

By default the JIT runtime specializes in a background thread while cuSPARSE serves, so a
training loop never waits for a kernel; the kernels take over from the epoch after they are
installed. This benchmark measures what that costs and when it is repaid. Per (graph, model,
hidden), in a child process of its own with an empty cache (``SPARSERL_CACHE_DIR``) and
Inductor's caches off:

The C++ fast path's library (built once per machine, not per graph) is built by this process
first and copied into each row's empty cache.

* ``eager``: the model of ``bench_gnn`` on ``torch.sparse.mm`` (cuSPARSE), every epoch timed;
* ``cold``: ``torch.compile(backend="sparserl")`` with the runtime on (``--jit background``,
  the default; ``sync`` to compare), on a fresh copy of the adjacency, the first compiled model
  of the process: every epoch timed (synchronized), with the number of products still being
  specialized, until every product is decided, the runtime's background work is over
  (``Runtime.busy``: the libraries that replace kernels' interim NVRTC builds are built) and
  ``--after`` epochs more have run; then ``--after`` epochs with the runtime closed;
* ``compiled, runtime off``: the same with the runtime off, after it, on another fresh copy:
  the compile (first epoch) and cuSPARSE inside the compiled graph, timed for as many epochs
  as the cold run. It is also the break-even's control: a compiled run with no JIT to repay,
  judged by the same rule, shows what the rule makes of the host's drift alone;
* ``eager`` again, last: eager's reference epoch is the median over both of its runs, which
  bracket the compiled ones (a launch-bound epoch can drift by several percent within minutes
  on a virtual machine).

``--mode reduce-overhead`` compiles both compiled ways under CUDA graphs (eager stays eager):
the graphs are recorded with cuSPARSE, and recorded again once the kernels are decided.
``--off-first`` compiles and runs the model with the runtime off first in each row's process
(not judged), so that the cold run, like the control, is not its process's first compiled
model (a process's first CUDA graph recording costs more than its next ones).

Break-even: the first epoch k from which, for every later epoch j of the run,
``waited + t_2 + ... + t_(j+1) <= e_2 + ... + e_(j+1)``, where ``waited`` is what products
waited for the runtime (``Runtime.stats["jit_s"]``: fingerprints, cache, and in sync mode the
whole specialization), the t are the cold run's epochs after its first (the first holds the
compile, which every compiled way pays and is reported apart), and the e are eager's epochs
after its first as measured, then its reference epoch beyond them. Rows with ``eager_span``
(every row this script writes) also give it against eager's epochs measured over the whole
span: eager's run after the compiled ones lasts as many epochs as the cold run had beyond
eager's first, and the two eager runs end to end are the e (some hosts stall every process
for tens of milliseconds about once a second, which the cold run meets over its span and a
median of eager leaves out). Losses of the first 20
epochs are compared with eager's.

    python benchmarks/bench_cold_start.py --graphs pubmed,dblp-2010 --models gcn,sage --hidden 128 --out benchmarks/results
    python benchmarks/bench_cold_start.py --graphs pubmed --models gcn --mode reduce-overhead --out benchmarks/results/x.json
    python benchmarks/bench_cold_start.py --report benchmarks/results/cold-start-....json   # re-render
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (cuda_available, emit_markdown, environment, fmt, geomean, gnn, matrix_list, plots,  # noqa: E402
                    results_path, tables, write_json_md)

SCHEMA = "torch_sparserl.bench_cold_start/1"
GRAPHS = ["pubmed", "dblp-2010", "fb100_Cornell5", "uk-2007-05_100000"]
LOSS_EPOCHS = 20
LOSS_RTOL = 1e-3  # as bench_gnn: fp32, different summation orders, 20 Adam steps
TARGET_EPOCHS = 10  # the issue's target: the JIT repaid within the first 10 epochs
FIRST_EPOCHS = 10  # the report sums the epochs after the compile's over this many
SLOW_START, SLOW_LAST, SLOW_SHOWN = 2.5, 1.3, 6  # the report's runs of slow epochs (slow_runs)
EAGER_AFTER_EPOCHS = 100  # eager timed again after the compiled runs (the reference brackets them)
PLOT_POINTS = 400  # points per row in the plot (means of consecutive epochs)


# ------------------------------------------------------------------------ analysis


def breakeven(waited_s: float, epochs_ms: list[float], eager_epochs_ms: list[float], eager_ms: float) -> int | None:
    """The first k from which the run stays ahead of eager: for every j >= k (within the
    measured epochs) ``waited + sum(epochs[:j]) <= sum(eager[:j])``; None when the measured
    run ends behind. Both lists are the epochs after the first; eager's measured ones, then
    its median ``eager_ms`` beyond them."""
    found = None
    spent, eager = waited_s * 1e3, 0.0
    for j, t in enumerate(epochs_ms, start=1):
        spent += t
        eager += eager_epochs_ms[j - 1] if j <= len(eager_epochs_ms) else eager_ms
        if spent <= eager:
            found = j if found is None else found
        else:
            found = None
    return found


def slow_runs(epochs_ms: list[float], pending: list[int] | None = None, start_over: float = SLOW_START,
              last_over: float = SLOW_LAST, near: int = 3) -> list[dict]:
    """Runs of slow epochs: one starts at an epoch over ``start_over`` times the median and lasts
    while epochs stay over ``last_over`` times it. Each: ``epoch`` (index into ``epochs_ms``),
    ``epochs``, ``excess_ms`` (over the median, summed), ``at_s`` (seconds of epochs before it)
    and ``decision`` (a product's decision landed within ``near`` epochs of it: ``pending``
    changed there)."""
    if not epochs_ms:
        return []
    median = statistics.median(epochs_ms)
    changes = [i for i in range(1, len(pending or [])) if pending[i] != pending[i - 1]]
    runs, i, elapsed = [], 0, 0.0
    while i < len(epochs_ms):
        if epochs_ms[i] <= start_over * median:
            elapsed += epochs_ms[i]
            i += 1
            continue
        start, excess, at = i, 0.0, elapsed
        while i < len(epochs_ms) and (i == start or epochs_ms[i] > last_over * median):
            excess += epochs_ms[i] - median
            elapsed += epochs_ms[i]
            i += 1
        runs.append({"epoch": start, "epochs": i - start, "excess_ms": excess, "at_s": at / 1e3,
                     "decision": any(start - near <= c <= i + near for c in changes)})
    return runs


def steal_s() -> float:
    """Seconds of steal time summed over the machine's CPUs (``/proc/stat``: time the hypervisor did
    not run a virtual CPU that had work; on some virtual machines every process then stalls for
    tens of milliseconds at a time); nan where the kernel does not say."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()
        return int(fields[8]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return float("nan")


def eager_steal(row: dict) -> float:
    """The host's steal time (s of CPU) over eager's timed runs (before and after the compiled ones)."""
    return sum(run.get("steal_s", 0.0) for run in (row["eager"], row.get("eager_after") or {}))


def eager_span_s(row: dict) -> float:
    return sum(sum(run.get("epochs_ms", [])) for run in (row["eager"], row.get("eager_after") or {})) / 1e3


def eager_ms(row: dict) -> float:
    """Eager's reference epoch: the median of its epochs (after the first 20) timed before the
    compiled runs and, in newer rows, after them too."""
    after = row.get("eager_after")
    if after is None:
        return row["eager"]["epoch_ms"]
    return statistics.median(row["eager"]["epochs_ms"][LOSS_EPOCHS - 1:] + after["epochs_ms"][LOSS_EPOCHS - 1:])


def row_metrics(row: dict) -> dict:
    eager, cold = row["eager"], row["cold"]
    steady, reference = cold["steady_ms"], eager_ms(row)
    out = {"breakeven_epochs": breakeven(cold["waited_s"], cold["epochs_ms"], eager["epochs_ms"], reference),
           # against eager's measured epochs over the cold run's span (its two runs end to end)
           "breakeven_measured_epochs": (breakeven(cold["waited_s"], cold["epochs_ms"],
                                                   eager["epochs_ms"] + row["eager_after"]["epochs_ms"], reference)
                                         if row.get("eager_span") else None),
           "eager_span": bool(row.get("eager_span")),
           "eager_ms": reference,
           # seconds of timed epochs (after the compile) until every product was decided
           "decided_after_s": cold.get("decided_after_s") if cold.get("all_decided", True) else None,
           "steady_speedup_vs_eager": reference / steady if steady else None,
           "closed_speedup_vs_eager": reference / cold["closed_ms"] if cold.get("closed_ms") else None,
           "first_epochs_ms": {"eager": sum(eager["epochs_ms"][:FIRST_EPOCHS]),
                               "cold": sum(cold["epochs_ms"][:FIRST_EPOCHS])}}
    during = cold["epochs_ms"][:cold["decided_after_epochs"]]
    if during:
        out["during_jit_vs_eager"] = reference / statistics.median(during)
    off = row.get("off")
    if off and row.get("off_span"):
        # the control: the runtime-off run (no JIT, cuSPARSE in the compiled graph), as long as the
        # cold run, by the same rule against the same eager epochs
        out["off_breakeven_epochs"] = breakeven(0.0, off["epochs_ms"], eager["epochs_ms"], reference)
        out["off_breakeven_measured_epochs"] = (
            breakeven(0.0, off["epochs_ms"], eager["epochs_ms"] + row["eager_after"]["epochs_ms"], reference)
            if row.get("eager_span") else None)
    if off:
        out["first_epochs_ms"]["off"] = sum(off["epochs_ms"][:FIRST_EPOCHS])
        out["compile_s"] = off["first_epoch_s"]
        out["off_speedup_vs_eager"] = reference / off["epoch_ms"]
    a, b = eager["losses"][-1], cold["losses"][-1]
    out["loss_rel_diff"] = abs(a - b) / abs(a)
    out["losses_equal"] = out["loss_rel_diff"] <= LOSS_RTOL
    return out


def compare(paths: list[Path]) -> str:
    """Repeated first runs side by side: each row's break-even and speedups in every run, rows
    matched by (graph, model, hidden), and how many rows each run repaid within the target."""
    docs = [json.loads(Path(p).read_text()) for p in paths]
    keyed = [{(r["graph"], r["model"], r["hidden"]): row_metrics(r) for r in d.get("rows", [])} for d in docs]
    keys = [k for k in dict.fromkeys(k for runs in keyed for k in runs) if all(k in runs for runs in keyed)]
    runs = [f"run {i + 1}" for i in range(len(docs))]
    lines = [f"# First run on a graph: {len(docs)} runs compared", "",
             "Runs: " + ", ".join(f"`{Path(p).stem}` ({d['env'].get('gpu', '?')})" for p, d in zip(paths, docs))
             + f". Rows present in every run: {len(keys)}. Break-even in epochs (target: {TARGET_EPOCHS}; — : "
             "never within the run), speedups over eager from the same run.", ""]
    measured = [("breakeven_measured_epochs", "Break-even epochs against eager measured over the run", "d", "")
                if any(r[k]["eager_span"] for r in keyed for k in keys) else None]
    if any("off_breakeven_epochs" in r[k] for r in keyed for k in keys):
        measured += [("off_breakeven_epochs", "Control: the runtime-off run by the same rule (no JIT to repay)",
                      "d", ""),
                     ("off_breakeven_measured_epochs", "Control against eager measured over the run", "d", "")]
    for metric, title, spec, unit in (("breakeven_epochs", "Break-even epochs", "d", ""), *filter(None, measured),
                                      ("decided_after_s", "Decided after (seconds of epochs after the compile; "
                                                          "0: during it)", ".1f", " s"),
                                      ("during_jit_vs_eager", "During JIT vs eager", ".2f", "×"),
                                      ("steady_speedup_vs_eager", "Steady vs eager", ".2f", "×")):
        lines += [f"## {title}", "", *tables.header(["graph", "model", "hidden", *runs], "llr" + "r" * len(docs))]
        # rows of older runs did not time eager over the cold run's span: nothing to show there
        timed = {"breakeven_measured_epochs": lambda m: m["eager_span"],
                 "off_breakeven_epochs": lambda m: "off_breakeven_epochs" in m,
                 "off_breakeven_measured_epochs": lambda m: m["eager_span"] and "off_breakeven_epochs" in m,
                 }.get(metric, lambda m: True)
        for k in keys:
            lines.append(tables.row([*k, *(fmt(r[k].get(metric), spec, unit) if timed(r[k]) else "not timed"
                                           for r in keyed)]))
        if "breakeven" in metric:
            repaid = [f"{sum(1 for k in keys if (r[k][metric] or TARGET_EPOCHS + 1) <= TARGET_EPOCHS)} of "
                      f"{sum(1 for k in keys if timed(r[k]))}" if any(timed(r[k]) for k in keys) else "not timed"
                      for r in keyed]
            lines.append(tables.row([f"**repaid within {TARGET_EPOCHS}**", "", "", *repaid]))
        elif metric == "decided_after_s":
            lines.append(tables.row(["**median**", "", "", *(
                fmt(statistics.median(v) if (v := [r[k][metric] for k in keys if r[k].get(metric) is not None])
                    else None, spec, unit) for r in keyed)]))
        else:
            lines.append(tables.row(["**geometric mean**", "", "", *(
                fmt(geomean(r[k].get(metric) for k in keys), spec, unit) for r in keyed)]))
        lines.append("")
    return "\n".join(lines) + "\n"


# -------------------------------------------------------------------- one row (child)


def _timed(epoch, device) -> tuple[float, float]:
    gnn.sync(device)
    start = time.perf_counter()
    loss = epoch()
    gnn.sync(device)
    return round((time.perf_counter() - start) * 1e3, 4), float(loss)


def run_eager(model, hidden, graph, device, epochs: int) -> dict:
    task = gnn.build_task("eager", model, hidden, graph, device, SimpleNamespace(mode="default"))
    epoch = gnn.epoch_fn(task)
    stolen = steal_s()
    times, losses = zip(*(_timed(epoch, device) for _ in range(epochs)))
    return {"first_epoch_s": times[0] / 1e3, "epoch_ms": statistics.median(times[LOSS_EPOCHS:] or times[1:]),
            "epochs_ms": list(times[1:]), "losses": list(losses[:LOSS_EPOCHS]), "steal_s": steal_s() - stolen}


def run_off(model, hidden, graph, device, epochs: int, mode: str = "default") -> dict:
    """Compiled with the runtime off: the compile alone, then cuSPARSE inside the graph."""
    from torch_sparserl.jit import runtime as rt

    rt.configure(mode="off")
    gnn.reset_compiled()
    A = graph[f"csr_matrix_{model}"]
    task = gnn.build_task("sparserl", model, hidden, graph, device, SimpleNamespace(mode=mode),
                            adjacency=gnn.fresh_copy(A))
    epoch = gnn.epoch_fn(task)
    times = [_timed(epoch, device)[0] for _ in range(epochs)]
    gnn.reset_compiled()
    return {"first_epoch_s": times[0] / 1e3, "epoch_ms": statistics.median(times[LOSS_EPOCHS:] or times[1:]),
            "epochs_ms": times[1:]}


def pending_products(runtime, A) -> int:
    """Products of ``A`` and of its transpose whose kernel is still being decided."""
    return sum(text.startswith("specializing") for text in runtime.decisions(A.crow, A.col, A.shape[1]).values())


def run_cold(model, hidden, graph, device, *, jit: str, after: int, max_s: float, mode: str = "default",
             runtime=None) -> dict:
    """The first run with the runtime on and an empty cache: each epoch timed, until every
    product is decided, the runtime is no longer busy, and ``after`` epochs more have run (or
    ``max_s`` has passed).
    ``runtime``: use this one instead of configuring the process's (tests)."""
    from torch_sparserl.jit import runtime as rt

    if runtime is None:
        runtime = rt.configure(mode=jit)
    else:
        rt.set_active(runtime)
    gnn.reset_compiled()
    A = gnn.fresh_copy(graph[f"csr_matrix_{model}"])
    task = gnn.build_task("sparserl", model, hidden, graph, device, SimpleNamespace(mode=mode), adjacency=A)
    epoch = gnn.epoch_fn(task)
    first_ms, first_loss = _timed(epoch, device)
    epochs_ms, pending, losses = [], [], [first_loss]
    decided_at, idle_at, started, stolen = None, None, time.perf_counter(), steal_s()
    while True:
        waiting = pending_products(runtime, A)
        if waiting == 0 and decided_at is None:
            decided_at = len(epochs_ms)
        # the steady state: once the runtime's background work is over too (a kernel served from
        # its interim NVRTC build is decided, while its library is still being built)
        if decided_at is not None and idle_at is None and not runtime.busy:
            idle_at = len(epochs_ms)
        if (idle_at is not None and len(epochs_ms) - idle_at >= after and len(losses) >= LOSS_EPOCHS) \
                or time.perf_counter() - started > max_s:
            break
        ms, loss = _timed(epoch, device)
        epochs_ms.append(ms)
        pending.append(waiting)
        losses.append(loss)
    stolen = steal_s() - stolen
    runtime.wait()
    steady = epochs_ms[idle_at:] if idle_at is not None else []
    # The same model once the runtime is closed (its sandbox worker, with the policy on the
    # same GPU, stopped): what the worker's presence costs the epochs after the decisions.
    runtime.close()
    closed = [_timed(epoch, device)[0] for _ in range(after)]
    result = {"jit": jit, "mode": mode, "first_epoch_s": first_ms / 1e3, "epochs_ms": epochs_ms, "pending": pending,
              "decided_after_epochs": decided_at if decided_at is not None else len(epochs_ms),
              "decided_after_s": sum(epochs_ms[:decided_at]) / 1e3 if decided_at is not None else None,
              "all_decided": decided_at is not None,
              "idle_after_epochs": idle_at,
              "steady_ms": statistics.median(steady) if steady else None,
              "closed_ms": statistics.median(closed) if closed else None,
              "losses": losses[:LOSS_EPOCHS], "waited_s": runtime.stats["jit_s"],
              "background_s": runtime.stats["background_s"], "stats": dict(runtime.stats), "steal_s": stolen,
              "kernels": runtime.decisions(A.crow, A.col, A.shape[1])}
    gnn.reset_compiled()
    return result


def measure_row(name: str, model: str, hidden: int, device_name: str, *, jit: str = "background",
                mode: str = "default", after: int = 50, max_s: float = 120.0, eager_epochs: int = 200,
                off: bool = True, off_first: bool = False, graph=None, runtime=None) -> dict:
    import torch

    device = torch.device(device_name)
    graph = graph or gnn.prepare_graph(name, device)
    row = {"graph": name, "n": graph["n"], "nnz": graph["nnz"], "model": model, "hidden": hidden, "mode": mode,
           "order": ["eager", "cold"]}
    row["eager"] = run_eager(model, hidden, graph, device, eager_epochs)
    if off_first:
        # The process's first compiled model is a runtime-off one (not timed against the rule):
        # the cold run and the control then both come after it, so the cold run does not pay the
        # process's first CUDA graph recording (which costs more than a later one)
        row["off_first"] = run_off(model, hidden, graph, device, 3 * LOSS_EPOCHS, mode=mode)
        row["order"].insert(1, "off")
    # Otherwise the cold run first: it pays what the first compiled model of a process pays.
    row["cold"] = run_cold(model, hidden, graph, device, jit=jit, after=after, max_s=max_s, mode=mode,
                           runtime=runtime)
    if off:
        # As many epochs as the cold run: the control, a compiled run that waits for no JIT, judged
        # by the same break-even rule over the same span (what the rule makes of the host alone)
        row["off"] = run_off(model, hidden, graph, device, max(3 * LOSS_EPOCHS, len(row["cold"]["epochs_ms"]) + 1),
                             mode=mode)
        row["off_span"] = True
        row["order"].append("off")
    # Eager again at the end: on a launch-bound graph a VM's epoch time drifts within minutes,
    # so eager's reference brackets the compiled runs. It runs as many epochs as the cold run
    # had beyond eager's first run, so that a break-even is also found against eager's measured
    # epochs over the whole span (some hosts stall every process for tens of milliseconds every
    # second or so, which eager's median leaves out).
    span = len(row["cold"]["epochs_ms"]) - len(row["eager"]["epochs_ms"]) + 1
    row["eager_after"] = run_eager(model, hidden, graph, device, max(EAGER_AFTER_EPOCHS, span))
    row["eager_span"] = True
    row["order"].append("eager")
    row.update(row_metrics(row))
    return row


# ------------------------------------------------------------------------ report


def _within(metrics: list[dict], key: str) -> int:
    return sum(1 for m in metrics if m.get(key) is not None and m[key] <= TARGET_EPOCHS)


def _control(m: dict) -> str:
    if "off_breakeven_epochs" not in m:
        return "not timed"
    return f"{fmt(m['off_breakeven_epochs'], 'd')} / {fmt(m.get('off_breakeven_measured_epochs'), 'd')}"


def markdown(doc: dict) -> str:
    env = doc.get("env", {})
    rows = doc.get("rows", [])
    modes = sorted({row.get("mode", "default") for row in rows})
    spans = any(row.get("eager_span") for row in rows)
    controls = any(row.get("off_span") for row in rows)
    order = ("the cold run is the first compiled model of its process, the runtime-off one comes after it."
             if all(row.get("order", [])[:2] == ["eager", "cold"] for row in rows) else
             "a runtime-off run (60 epochs, not judged) is the first compiled model of each process (`--off-first`), "
             "so the cold run does not pay the process's first CUDA graph recording; the runtime-off run judged as "
             "the control comes after the cold one."
             if all("off_first" in row for row in rows) else
             "the runtime-off run comes before the cold one in the same process, so the cold run does not pay the "
             "process's first CUDA graph recording.")
    under = ("" if modes == ["default"] else
             f" The compiled ways run under torch.compile mode {', '.join(modes)}"
             + (": CUDA graphs, recorded with cuSPARSE serving and recorded again once the kernels are decided;"
                " eager stays eager." if "reduce-overhead" in modes else "."))
    lines = [f"# First run on a graph (empty kernel cache) — {env.get('gpu', '?')}", "",
             f"torch {env.get('torch')}, CUDA {env.get('cuda')}.{under} Each row in a fresh process with an empty kernel "
             "cache and the runtime's default settings (JIT in the background: cuSPARSE serves until a kernel is "
             "installed). Epochs timed one by one (synchronized); " + order + " *eager ms*: eager's median epoch; where eager "
             "was timed again after the compiled runs, over both (before / after in parentheses), since a launch-bound "
             "epoch drifts within minutes on these machines. *compile*: the first epoch (Dynamo, AOTAutograd, "
             "Inductor), paid by any compiled way and not counted below, of the runtime-off run and of the cold run. *waited*: what the "
             "training loop waited for the runtime. *decided after*: epochs (and seconds) until no product was "
             "still being specialized. *during JIT*: eager's epoch over the median cold epoch before that; "
             "*steady*: from when the runtime's background work has ended too (the libraries' builds that replace kernels' interim NVRTC builds; rows without `idle_after_epochs`: from the decisions); *closed*: then with the runtime closed (its sandbox worker stopped). Break-even: the first epoch k from which waited + the cold epochs 2..j+1 stay at "
             f"or under eager's epochs 2..j+1 for every later j of the run (target: {TARGET_EPOCHS})."
             + (" *Control*: the runtime-off run (no JIT to repay; cuSPARSE in the compiled graph), timed for as many "
                "epochs as the cold run, by the same rule (against eager's epochs then its median / against eager "
                "measured over the run): what the rule makes of the host's drift alone." if controls else ""), "",
             *tables.header(["graph", "model", "hidden", "eager ms", "compile s (runtime off / on)", "waited ms",
                             f"epochs 2–{FIRST_EPOCHS + 1} ms (eager / off / on)", "decided after",
                             "during JIT vs eager", "steady vs eager", "closed vs eager", "off vs eager",
                             "break-even epochs", *(["vs eager measured over the run"] if spans else []),
                             *(["control"] if controls else []), "kernels", "losses equal"],
                            "llrrrrrlrrrrr" + "r" * (spans + controls))]
    for row in rows:
        m, cold = row_metrics(row), row["cold"]
        first = m["first_epochs_ms"]
        installed = sum(v.startswith("installed") for v in cold["kernels"].values())
        decided = (f"{cold['decided_after_epochs']} ({fmt(cold['decided_after_s'], '.1f', ' s')})"
                   if cold["all_decided"] else f"not within the run ({len(cold['epochs_ms'])} epochs)")
        bracket = f" ({row['eager']['epoch_ms']:.2f} / {row['eager_after']['epoch_ms']:.2f})" if "eager_after" in row else ""
        lines.append(tables.row([
            row["graph"], row["model"], row["hidden"], f"{m['eager_ms']:.2f}{bracket}",
            f"{fmt(m.get('compile_s'), '.1f')} / {cold['first_epoch_s']:.1f}", f"{cold['waited_s'] * 1e3:.0f}",
            f"{first['eager']:.0f} / {fmt(first.get('off'), '.0f')} / {first['cold']:.0f}", decided,
            fmt(m.get("during_jit_vs_eager"), ".2f", "×"), fmt(m["steady_speedup_vs_eager"], ".2f", "×"),
            fmt(m.get("closed_speedup_vs_eager"), ".2f", "×"), fmt(m.get("off_speedup_vs_eager"), ".2f", "×"),
            fmt(m["breakeven_epochs"], "d"), *([fmt(m["breakeven_measured_epochs"], "d")] if spans else []),
            *([_control(m)] if controls else []), f"{installed} of {len(cold['kernels'])} installed",
            f"{'yes' if m['losses_equal'] else 'no'} ({m['loss_rel_diff']:.1e})"]))
    if rows:
        metrics = [row_metrics(r) for r in rows]
        within, measured = _within(metrics, "breakeven_epochs"), _within(metrics, "breakeven_measured_epochs")
        against = (f" ({measured} of {sum(1 for r in rows if r.get('eager_span'))} against eager's epochs measured "
                   "over the run: eager timed again after the compiled runs for as many epochs as the cold run "
                   "had, end to end with its first run)") if spans else ""
        controlled = [m for r, m in zip(rows, metrics) if r.get("off_span")]
        if controlled:
            against += (f"; the control, {_within(controlled, 'off_breakeven_epochs')} of {len(controlled)} "
                        f"({_within(controlled, 'off_breakeven_measured_epochs')} against eager measured over the run)")
        lines += ["", f"Repaid within {TARGET_EPOCHS} epochs: {within} of {len(rows)} rows{against}. Geometric means: "
                  f"during JIT {fmt(geomean(m.get('during_jit_vs_eager') for m in metrics), '.2f', '×')} eager, "
                  f"steady {fmt(geomean(m['steady_speedup_vs_eager'] for m in metrics), '.2f', '×')} eager, "
                  f"compiled with the runtime off {fmt(geomean(m.get('off_speedup_vs_eager') for m in metrics), '.2f', '×')} eager."]
        lines += ["", f"Runs of slow epochs in the cold run (one starts at an epoch over {SLOW_START}× the run's median and "
                  f"lasts while epochs stay over {SLOW_LAST}×; the {SLOW_SHOWN} largest, in order: ms over the median "
                  "at epoch k (the compile's is epoch 1), seconds into the timed epochs; † a decision landed within 3 "
                  "epochs):", ""]
        for row in rows:
            runs = slow_runs(row["cold"]["epochs_ms"], row["cold"].get("pending"))
            shown = sorted(sorted(runs, key=lambda r: -r["excess_ms"])[:SLOW_SHOWN], key=lambda r: r["epoch"])
            stolen = row["cold"].get("steal_s")
            lines.append(f"- {row['graph']} {row['model']} {row['hidden']}: {len(runs)} runs, "
                         f"{sum(r['excess_ms'] for r in runs):.0f} ms in all"
                         + (f" (the host's steal time: {stolen:.2f} s of CPU over the cold run's "
                            f"{sum(row['cold']['epochs_ms']) / 1e3:.1f} s, {eager_steal(row):.2f} s over eager's "
                            f"{eager_span_s(row):.1f} s)" if stolen is not None else "")
                         + ("; " + ", ".join(f"{r['excess_ms']:.0f} ms at {r['epoch'] + 2} ({r['at_s']:.2f} s)"
                                             f"{'†' if r['decision'] else ''}" for r in shown) if shown else ""))
        lines += ["", "Kernels decided in the cold run:", ""]
        for row in rows:
            lines.append(f"- {row['graph']} {row['model']} {row['hidden']}: "
                         + "; ".join(f"{k}: {v}" for k, v in row["cold"]["kernels"].items()))
    lines += ["", "Runs:", ""] + tables.run_bullets(doc.get("runs", []))
    return "\n".join(lines) + "\n"


def plot(doc: dict) -> str:
    """Each row's cold epochs as eager's epoch over them, against seconds since the first epoch."""
    fig, (ax,) = plots.figure("First run, background JIT: eager epoch / cold epoch — "
                              + str(doc.get("env", {}).get("gpu", "?")), width=9.0, height=4.4)
    rows = doc.get("rows", [])
    if not rows:
        plots.no_results(ax)
        return plots.to_svg(fig)
    for i, row in enumerate(rows):
        eager, t, times, ratios = eager_ms(row), 0.0, [], []
        epochs = row["cold"]["epochs_ms"]
        step = max(1, len(epochs) // PLOT_POINTS)  # one point per `step` epochs: their mean
        for k in range(0, len(epochs), step):
            chunk = epochs[k:k + step]
            t += sum(chunk) / 1e3
            times.append(t)
            ratios.append(eager * len(chunk) / sum(chunk))
        (line,) = ax.plot(times, ratios, color=plots.COLORS[i % len(plots.COLORS)], linewidth=1.2,
                          label=f"{row['graph'][:16]} {row['model']} {row['hidden']}")
        line.set_gid(f"row-{i}")
    plots.times_axis(ax)
    plots.unity(ax)
    ax.set_xlim(left=0)
    ax.set_ylim(0, max([2.0] + [max(line.get_ydata(), default=0) for line in ax.get_lines()]))
    ax.set_xlabel("seconds since the first epoch")
    ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8)
    return plots.to_svg(fig)


def save(doc: dict, path: Path) -> None:
    write_json_md(doc, path, markdown, plot)


# -------------------------------------------------------------------------- main


def _fast_path_library(device: str) -> Path | None:
    """The folder of the C++ fast path's library, built here first if need be (once per machine
    and torch version); None where it cannot be built. Each row's empty cache gets
    a copy: the row measures the first run on a graph, not on a machine."""
    if not str(device).startswith("cuda"):
        return None
    from torch_sparserl.jit import fastpath

    return fastpath.library()[0].parent if fastpath.ensure(wait=True) else None


def _child_env(cache_dir: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPARSERL_JIT") and "TORCHINDUCTOR" not in k}
    env.update({"SPARSERL_CACHE_DIR": cache_dir, "TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1", "PYTHONUNBUFFERED": "1"})
    return env


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--graphs", default=",".join(GRAPHS))
    parser.add_argument("--models", default="gcn,sage")
    parser.add_argument("--hidden", default="128")
    parser.add_argument("--jit", default="background", choices=("background", "sync"))
    parser.add_argument("--mode", default="default", choices=("default", "reduce-overhead"),
                        help="torch.compile mode of the compiled ways (eager stays eager)")
    parser.add_argument("--after", type=int, default=50, help="epochs timed after every product is decided")
    parser.add_argument("--max-s", type=float, default=120.0, help="stop a row's timed run after this long")
    parser.add_argument("--row-timeout-s", type=float, default=600.0)
    parser.add_argument("--out", default="benchmarks/results", help="folder (a dated file in it) or a .json path")
    parser.add_argument("--resume", help="add to this results file (rows already there are skipped)")
    parser.add_argument("--report", help="only re-render the .md and .svg of this results file")
    parser.add_argument("--compare", nargs="+", metavar="JSON", help="only compare these results files (Markdown "
                        "to --out, a .md path, or stdout)")
    parser.add_argument("--off-first", action="store_true",
                        help="compile and run the model with the runtime off first in each row's process, so that "
                        "the cold run is not its process's first compiled model (under CUDA graphs the first "
                        "recording of a process costs more)")
    parser.add_argument("--device", default=None)
    parser.add_argument("--row", nargs=3, metavar=("GRAPH", "MODEL", "HIDDEN"), help=argparse.SUPPRESS)
    parser.add_argument("--row-out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.report:
        path = Path(args.report)
        save(json.loads(path.read_text()), path)
        return 0
    if args.compare:
        emit_markdown(compare([Path(p) for p in args.compare]), args.out)
        return 0
    device = args.device or ("cuda" if cuda_available() else "cpu")
    if args.row:  # the child: one row, in this fresh process
        name, model, hidden = args.row
        row = measure_row(name, model, int(hidden), device, jit=args.jit, mode=args.mode, after=args.after,
                          max_s=args.max_s, off_first=args.off_first)
        Path(args.row_out).write_text(json.dumps(row) + "\n")
        return 0

    env = environment()
    if args.resume:
        path = Path(args.resume)
        doc = json.loads(path.read_text())
    else:
        path = results_path(args.out, "cold-start", env["gpu"], dt.date.today().isoformat())
        doc = {"schema": SCHEMA, "env": env, "runs": [], "rows": []}
    doc["runs"].append({"started": dt.datetime.now().isoformat(timespec="seconds"),
                        "command": " ".join(["python benchmarks/bench_cold_start.py"]
                                            + (argv if argv is not None else sys.argv[1:]))})
    done = {(r["graph"], r["model"], r["hidden"]) for r in doc["rows"]}
    fast = _fast_path_library(device)
    for name in matrix_list(args.graphs):
        for model in args.models.split(","):
            for hidden in map(int, args.hidden.split(",")):
                if (name, model, hidden) in done:
                    continue
                with tempfile.TemporaryDirectory(prefix="sparserl-cold-") as tmp:
                    row_out = Path(tmp) / "row.json"
                    command = [sys.executable, __file__, "--row", name, model, str(hidden), "--row-out", str(row_out),
                               "--jit", args.jit, "--mode", args.mode, "--after", str(args.after), "--max-s", str(args.max_s),
                               "--device", device] + (["--off-first"] if args.off_first else [])
                    if fast is not None:  # built once per machine, as after a user's first run on it
                        shutil.copytree(fast, Path(tmp) / "cache" / "build" / fast.name)
                    started = time.perf_counter()
                    result = subprocess.run(command, env=_child_env(str(Path(tmp) / "cache")), capture_output=True,
                                            text=True, timeout=args.row_timeout_s)
                    if result.returncode != 0 or not row_out.exists():
                        print(f"{name} {model} {hidden}: the row failed (exit {result.returncode}):\n"
                              f"{result.stdout[-2000:]}{result.stderr[-4000:]}", flush=True)
                        continue
                    row = json.loads(row_out.read_text())
                row["process_s"] = time.perf_counter() - started
                doc["rows"].append(row)
                save(doc, path)
                m = row_metrics(row)
                print(f"{name} {model} h={hidden}: eager {m['eager_ms']:.2f} ms, compile "
                      f"{fmt(m.get('compile_s'), '.1f')} s, waited {row['cold']['waited_s'] * 1e3:.0f} ms, decided after "
                      f"{row['cold']['decided_after_epochs']} epochs, steady {fmt(m['steady_speedup_vs_eager'], '.2f')}x, "
                      f"break-even {m['breakeven_epochs']}", flush=True)
    save(doc, path)
    print(f"wrote {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
