"""Mini-batch GraphSAGE: every step a new sampled subgraph, so every product a new pattern.

The batches of each epoch are sampled once (``torch_sparserl.data.sampling``: 1024 seeds, fanouts
10 and 5, the subgraph's adjacency with mean values) and kept on the host, pinned, as a loader
hands them over; every *way* moves each batch to the device itself and trains on the same ones
from the same initial weights, each with a fresh runtime and an empty kernel cache of its own,
after an untimed epoch of the ``torch`` way has paid the process's one-time costs (``warm_up``).
The ways' epochs are interleaved (every way's first epoch, then every way's second), so that a
drift of the host's speed over the run reaches them alike:

* ``torch`` — ``torch.sparse.mm`` on a ``torch.sparse_csr`` tensor (cuSPARSE);
* ``sparserl`` — ``ts.csr(A_i, device=...) @ X`` in eager code (the indices checked on the host),
  at the runtime's settings (``--admit-calls``);
* ``sparserl_compiled`` — the same model under ``torch.compile(backend="sparserl", dynamic=True)``
  (``dynamic=False`` with ``--buckets``: below);
* ``sparserl_classes`` — ``sparserl`` with class kernels on (``jit.class_after``, ``--class-after``):
  after that many young patterns of a class, one kernel decided in the background serves the
  class's new patterns (``torch_sparserl.jit.classes``);
* ``sparserl_captured`` — with ``--buckets`` only: the whole step (``ts.csr`` of the batch's
  parts, forward, loss over a mask of the seed rows, backward, a capturable Adam's step) under
  ``ts.capture_step(..., max_shapes=2K)``, one CUDA graph per bucket, each batch's indices
  checked inside its graph (eager on the CPU);
* ``pyg`` — PyG's ``SAGEConv`` on ``edge_index`` (gather + scatter), where PyG is installed.

Per way: each epoch's wall time (the first includes compiles and decisions), the losses (equal
across ways within float32 tolerance), the runtime's counters (decisions installed, calls
before admission, decisions not queued), the kernel cache's entries and bytes on disk, and the
process's resident memory growth over the way's epochs; on CUDA, per step, the steady wall time
and the device time of one more, profiled epoch (``--no-profile`` skips it). ``--breakdown`` also times the library's
per-pattern host work in the sparserl ways (``ts.csr``, its index check, the transpose for the
backward, the runtime's call, the vendor product's Python path, the C++ recording), in host ms per step
of the last epoch; its wrappers add a microsecond or so per call to the epochs.

``--buckets K`` pads every batch to one of K sizes (``torch_sparserl.data.buckets``: the K sizes that
pad the epoch's batches with the fewest nonzeros), for every way alike: the padding rows gather the
batch's first node, the padding entries (value 0) lie in the padding rows and columns only, and the
loss is over the seed rows as before, so the losses are the unpadded run's within float32 rounding.
``sparserl_compiled`` then compiles with ``dynamic=False``: an epoch shows at most K shapes, each
compiled once with every size static (what per-shape CUDA graph capture needs), where
``dynamic=True`` would pay the padding for shapes it does not need. The report gives the padding's
overhead: padded rows and nonzeros over the real ones, over the epoch.

    python benchmarks/bench_minibatch.py --graph dblp-2010 --out benchmarks/results/
    python benchmarks/bench_minibatch.py --graph rmat:scale=22,edge_factor=16 --epochs 2 --batches 300
    python benchmarks/bench_minibatch.py --graph cora --device cpu --epochs 2 --batches 3 --out /tmp/m.json
    python benchmarks/bench_minibatch.py --graph dblp-2010 --buckets 3 --ways torch,sparserl,sparserl_compiled,sparserl_captured
"""

from __future__ import annotations

import argparse
import datetime as dt
import html
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import environment, load_graph, plots, results_path, rss_mb, tables, timing, write_json_md  # noqa: E402
from common.gnn import PreparedBatch  # noqa: E402

SCHEMA = "torch_sparserl.bench_minibatch/1"
WAYS = ("torch", "sparserl", "sparserl_classes", "sparserl_compiled", "sparserl_captured", "pyg")
CAPTURED = "sparserl_captured"  # needs --buckets: one CUDA graph per bucket (ts.capture_step, max_shapes)


def make_model(features: int, hidden: int, classes: int):
    """Two mean-aggregation GraphSAGE layers: out = neigh(A @ x) + root(x), ReLU between."""
    import torch

    class SAGE(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.neigh = torch.nn.ModuleList([torch.nn.Linear(features, hidden), torch.nn.Linear(hidden, classes)])
            self.root = torch.nn.ModuleList([torch.nn.Linear(features, hidden, bias=False),
                                             torch.nn.Linear(hidden, classes, bias=False)])

        def forward(self, A, x):
            for layer, (neigh, root) in enumerate(zip(self.neigh, self.root)):
                aggregated = torch.sparse.mm(A, x) if A.layout == torch.sparse_csr else A @ x
                x = neigh(aggregated) + root(x)
                if layer == 0:
                    x = torch.relu(x)
            return x

    return SAGE()


def pyg_model(model):
    """PyG's SAGEConv layers holding ``model``'s weights (lin_l: the neighbours', lin_r: the root's)."""
    import torch
    from torch_geometric.nn import SAGEConv

    class PygSAGE(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.convs = torch.nn.ModuleList()
            for neigh, root in zip(model.neigh, model.root):
                conv = SAGEConv(neigh.in_features, neigh.out_features, aggr="mean")
                with torch.no_grad():
                    conv.lin_l.weight.copy_(neigh.weight)
                    conv.lin_l.bias.copy_(neigh.bias)
                    conv.lin_r.weight.copy_(root.weight)
                self.convs.append(conv)

        def forward(self, edge_index, x):
            x = torch.relu(self.convs[0](x, edge_index))
            return self.convs[1](x, edge_index)

    return PygSAGE()


_BREAKDOWN = (  # (module, attribute, label): the library's per-pattern host work, timed by --breakdown
    ("torch_sparserl", "csr", "ts.csr"),
    ("torch_sparserl.tensor.construct", "check_csr_values", "index check"),  # host indices, in ts.csr
    ("torch_sparserl.pattern.cache", "check_csr_values", "index check"),  # CPU indices, at the first product
    ("torch_sparserl.pattern.cache", "DeviceCheck", "index check on the device"),  # CUDA indices, queued
    ("torch_sparserl.pattern", "Pattern.transpose", "transpose"),
    ("torch_sparserl.jit.runtime", "Runtime.call", "runtime.call"),
    ("torch_sparserl.kernels.vendor", "_product", "vendor product, Python path"),  # cuSPARSE on CUDA
    ("torch_sparserl.jit.fastpath", "record", "C++ recording"),
)


class WayRun:
    """One way's training, an epoch at a time (:meth:`epoch`), with a fresh runtime and an empty
    kernel cache of its own, active only while its epochs run: :func:`main` interleaves the
    ways' epochs, so that a drift of the host's speed over the run reaches every way alike."""

    def __init__(self, way: str, batches, features, labels, model0, args):
        import copy

        import torch

        from torch_sparserl.jit import runtime as rt
        from torch_sparserl.jit.cache import KernelCache

        self.way, self.batches, self.features, self.labels, self.args = way, batches, features, labels, args
        self.device = torch.device(args.device)
        self.epochs, self.losses, self.error = [], [], None
        changes = {name: value for name, value in (("admit_calls", args.admit_calls),
                                                     ("admit_age_s", getattr(args, "admit_age_s", None)))
                   if value is not None}
        if way == "sparserl_classes":
            changes["class_after"] = getattr(args, "class_after", 16)
        self.runtime = rt.Runtime(rt.config.from_environment().jit.replace("bench_minibatch", **changes),
                                  cache=KernelCache(tempfile.mkdtemp(prefix=f"sparserl-minibatch-{way}-")))
        self.rss_growth, self.graphs = 0.0, 0  # over this way's epochs
        self.gpu_ms_per_step: float | None = None  # profile()
        breakdown = getattr(args, "breakdown", False) and way.startswith("sparserl")
        self.breakdown = timing.HostBreakdown(_BREAKDOWN) if breakdown else None
        try:
            model = pyg_model(model0) if way == "pyg" else copy.deepcopy(model0)
        except ImportError as exc:
            self.error = f"{type(exc).__name__}: {exc}"
            return
        self.model = model.to(self.device)
        self.buckets = getattr(args, "buckets", 0)
        # padded to buckets, the shapes repeat: each compiled static, once (see the module's docstring)
        self.step = torch.compile(self.model, backend="sparserl", dynamic=not self.buckets) \
            if way == "sparserl_compiled" else self.model
        self.opt = torch.optim.Adam(self.model.parameters(), lr=0.01, capturable=way == CAPTURED
                                    and self.device.type == "cuda")
        if way == CAPTURED:
            self.step = captured_step(self.model, self.opt, self.buckets)

    def epoch(self, record: bool = True) -> None:
        """One epoch over every batch, timed from a synchronized device to a synchronized device;
        its time and losses recorded unless ``record`` is false (the profiled epoch)."""
        import contextlib

        import torch

        from torch_sparserl.data.prefetch import prefetch
        from torch_sparserl.jit import runtime as rt

        if self.error is not None:
            return
        previous = rt.set_active(self.runtime)
        rss0, graphs0 = rss_mb(), torch._dynamo.utils.counters["stats"]["unique_graphs"]
        try:
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            if self.breakdown is not None:
                self.breakdown.reset()  # the last epoch's is reported
            started = time.perf_counter()
            losses = []
            with self.breakdown if self.breakdown is not None else contextlib.nullcontext(), \
                    recompiles_allowed(self.buckets):
                if getattr(self.args, "prefetch", False):  # the next batch moved while this one trains
                    items = prefetch(self.batches, lambda b: (b, to_device(self.way, b, self.device)))
                else:  # on the host, pinned, as a loader hands them over
                    items = ((b, None) for b in self.batches)
                step = replay_step if self.way == CAPTURED else train_step
                for batch, moved in items:
                    losses.append(step(self.way, self.step, self.opt, batch, self.features, self.labels,
                                       self.device, moved))
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            if record:
                self.epochs.append(time.perf_counter() - started)
                self.losses.append([float(v) for v in torch.stack(losses).cpu()])
        finally:
            rt.set_active(previous)
            self.rss_growth += rss_mb() - rss0
            self.graphs += torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs0

    def profile(self) -> None:
        """The device time of one more epoch (the profiler's; none on the CPU), per step."""
        if self.error is None:
            device_ms = timing.device_ms(lambda: self.epoch(record=False), self.device)
            self.gpu_ms_per_step = None if device_ms is None else device_ms / len(self.batches)

    def finish(self) -> dict:
        """The way's result; closes its runtime."""
        try:
            if self.error is not None:
                return {"status": "skipped", "error": self.error}
            entries = self.runtime.cache.entries()
            stats = {k: v for k, v in self.runtime.stats.items() if isinstance(v, (int, float))}
            decided = [{"class": key.pattern, "op": key.op, "n": key.n, "dtype": key.dtype, "served_by": what}
                       for key, what in self.runtime.classes()]
            return {"status": "ok", "epoch_s": self.epochs, "losses": self.losses, "runtime": stats, "classes": decided,
                    "cache_entries": len(entries), "cache_bytes": sum(p.stat().st_size for p in entries),
                    "rss_growth_mb": self.rss_growth, "graphs": self.graphs, "gpu_ms_per_step": self.gpu_ms_per_step,
                    "host_ms_per_step": self.breakdown.per_step(len(self.batches)) if self.breakdown is not None
                    else None}
        finally:
            self.runtime.close()


def to_device(way: str, batch, device):
    """``(nodes, A)``: the batch's node numbers and adjacency on the device, moved the way's own way."""
    import torch

    import torch_sparserl as ts

    nodes = batch.nodes.to(device, non_blocking=True)
    shape = (batch.n, batch.n)
    if way == "torch":
        A = torch.sparse_csr_tensor(*(t.to(device, non_blocking=True) for t in batch.csr), shape)
    elif way == "pyg":
        A = batch.edge_index.to(device, non_blocking=True)
    elif way == CAPTURED:  # the parts themselves: the captured step builds its matrix (replay_step)
        A = tuple(t.to(device, non_blocking=True) for t in batch.csr)
    else:  # checked on the host, sent without blocking
        A = ts.csr(batch.csr, shape, device=device)
    return nodes, A


def captured_step(model, opt, buckets: int):
    """The whole training step of a padded batch as ``ts.capture_step`` replays it, one CUDA graph
    per bucket: its arguments are the batch's features, labels, ``(crow, col, val)`` and a mask
    of its seed rows (the loss is their mean, as :func:`train_step`'s), the matrix built inside."""
    import torch

    import torch_sparserl as ts

    def step(x, y, crow, col, val, seeds):
        opt.zero_grad(set_to_none=True)
        A = ts.csr((crow, col, val), (crow.shape[0] - 1, x.shape[0]))
        losses = torch.nn.functional.cross_entropy(model(A, x), y, reduction="none")
        loss = (losses * seeds).sum() / seeds.sum()
        loss.backward()
        opt.step()
        return loss.detach()

    return ts.capture_step(step, max_shapes=max(1, min(64, 2 * buckets)))


def replay_step(way: str, step, opt, batch, features, labels, device, moved=None):
    """:func:`train_step` for the captured way: one call of the captured step."""
    import torch

    nodes, parts = moved if moved is not None else to_device(way, batch, device)
    seeds = (torch.arange(batch.n, device=device) < batch.seeds).to(features.dtype)
    return step(features[nodes], labels[nodes], *parts, seeds).clone()


def recompiles_allowed(shapes: int):
    """Dynamo's recompile limit raised to ``shapes`` (padded batches: one compile per bucket), so
    that more buckets than its default limit (8) are compiled rather than run eagerly."""
    import contextlib

    import torch

    if shapes <= torch._dynamo.config.recompile_limit:
        return contextlib.nullcontext()
    return torch._dynamo.config.patch(recompile_limit=shapes)


def train_step(way: str, step, opt, batch, features, labels, device, moved=None):
    """One optimizer step of ``way`` on ``batch`` (``moved``: its :func:`to_device`, made
    already, else made here); the loss, detached."""
    import torch

    nodes, A = moved if moved is not None else to_device(way, batch, device)
    x = features[nodes]
    opt.zero_grad(set_to_none=True)
    out = step(A, x)[: batch.seeds]
    loss = torch.nn.functional.cross_entropy(out, labels[nodes[: batch.seeds]])
    loss.backward()
    opt.step()
    return loss.detach()


def warm_up(batches, features, labels, model0, device) -> None:
    """An untimed epoch of the ``torch`` way on a copy of the model: the process's one-time costs
    (CUDA context, cuBLAS and cuSPARSE handles, torch's kernels loaded, the caching allocator's
    growth to the batches' sizes) are paid before any way is timed, so that they do not land in
    whichever way's first epoch comes first. The library's own one-time costs stay in its ways'
    first epochs."""
    import copy

    import torch

    model = copy.deepcopy(model0).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for batch in batches:
        train_step("torch", model, opt, batch, features, labels, device)
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def summary(doc: dict) -> list[dict]:
    rows = []
    reference = next((w["losses"] for w in doc["ways"].values() if w.get("status") == "ok"), None)
    for way, result in doc["ways"].items():
        if result.get("status") != "ok":
            rows.append({"way": way, "status": result.get("status"), "error": result.get("error")})
            continue
        rounds = result.get("rounds_epoch_s") or [result["epoch_s"]]
        later = [t for epochs in rounds for t in epochs[1:]]
        flat = [v for epoch in result["losses"] for v in epoch]
        ref = [v for epoch in reference for v in epoch]
        steady = statistics.median(later) if later else None
        steps = doc["setup"]["batches"]
        gpu_ms = result.get("gpu_ms_per_step")
        rows.append({"way": way, "status": "ok", "first_epoch_s": statistics.median(e[0] for e in rounds),
                     "first_epochs_s": [e[0] for e in rounds],
                     "steady_epoch_s": steady,
                     "steady_step_ms": None if steady is None else steady * 1e3 / steps,
                     "gpu_step_ms": gpu_ms,
                     "wall_over_gpu": None if steady is None or not gpu_ms else steady * 1e3 / steps / gpu_ms,
                     "loss_max_diff": max(abs(a - b) for a, b in zip(flat, ref)),
                     "installs": result["runtime"].get("installs", 0),
                     "unadmitted_calls": result["runtime"].get("unadmitted_calls", 0)
                     + result["runtime"].get("young_calls", 0),
                     "dropped": result["runtime"].get("dropped", 0),
                     "class_calls": result["runtime"].get("class_calls", 0),
                     "cache_entries": result["cache_entries"], "cache_kb": result["cache_bytes"] / 1024,
                     "rss_growth_mb": result["rss_growth_mb"], "graphs": result["graphs"]})
    return rows


def markdown(doc: dict) -> str:
    setup = doc["setup"]
    lines = [f"# Mini-batch GraphSAGE: {setup['graph']} on {doc['env'].get('gpu') or 'CPU'}", "",
             f"{setup['batches']} batches of {setup['batch_size']} seeds per epoch, fanouts {setup['fanouts']}, "
             f"hidden {setup['hidden']}, {setup['epochs']} epochs; {setup['mean_rows']:.0f} rows and "
             f"{setup['mean_nnz']:.0f} nonzeros per subgraph on average. Every way trains on the same batches "
             f"from the same weights, with an empty kernel cache, after "
             f"{setup.get('warmup_steps', 0)} untimed steps of torch's way warmed the process up; the ways' "
             f"epochs interleaved, in {setup.get('rounds', 1)} round(s) from fresh runtimes, caches, weights and "
             "compiles. "
             + ("Every way moved the next batch to the device on a background thread while the current one "
                "trained (`--prefetch`). " if setup.get("prefetch") else "")
             + (f"Every batch padded to one of {setup['buckets']} sizes (`--buckets`; rows, nonzeros: "
                + ", ".join(f"{r}, {z}" for r, z in setup["padding"]["sizes"]) + "): padded rows / real rows "
                f"{setup['padding']['rows']:.3f}, padded nonzeros / real nonzeros {setup['padding']['nnz']:.3f}; "
                "sparserl_compiled compiled with static shapes. " if setup.get("buckets") else "")
             + "First epoch: the median over the rounds (each listed); steady: the median of the later epochs; "
             "GPU ms per step: the device time of one more, profiled epoch (the profiler's kernels, copies and "
             "memsets, summed), and wall / GPU the steady step's wall time over it (1 where the host keeps up). "
             "The other columns are the first round's.", "",
             *tables.header(["way", "first epoch s", "first epochs s", "steady epoch s", "vs torch first / steady",
                             "steady step ms", "GPU ms per step", "wall / GPU",
                             "loss diff", "kernels", "calls before admission", "calls by class kernels", "not queued",
                             "cache entries (kB)", "RSS growth MB", "graphs compiled"], "lrlrlrrrrrrrrrrr")]
    torch_row = next((r for r in doc["summary"] if r["way"] == "torch" and r["status"] == "ok"), None)
    for row in doc["summary"]:
        if row["status"] != "ok":
            lines.append(f"| {row['way']} | {row['status']}: {html.escape(str(row.get('error'))[:80])} ||||||||||||||| ")
            continue
        steady = "–" if row["steady_epoch_s"] is None else f"{row['steady_epoch_s']:.3f}"
        firsts = ", ".join(f"{t:.3f}" for t in row.get("first_epochs_s", [row["first_epoch_s"]]))
        versus = "–"
        if torch_row is not None:
            versus = f"{torch_row['first_epoch_s'] / row['first_epoch_s']:.2f}× / " + (
                f"{torch_row['steady_epoch_s'] / row['steady_epoch_s']:.2f}×" if row["steady_epoch_s"]
                and torch_row["steady_epoch_s"] else "–")
        step = [("–" if row.get(key) is None else f"{row[key]:{form}}")
                for key, form in (("steady_step_ms", ".3f"), ("gpu_step_ms", ".3f"), ("wall_over_gpu", ".2f"))]
        lines.append(tables.row([row["way"], f"{row['first_epoch_s']:.3f}", firsts, steady, versus, *step,
                                 f"{row['loss_max_diff']:.1e}", row["installs"], row["unadmitted_calls"],
                                 row.get("class_calls", 0), row["dropped"],
                                 f"{row['cache_entries']} ({row['cache_kb']:.0f})", f"{row['rss_growth_mb']:.0f}",
                                 row["graphs"]]))
    for way, result in doc["ways"].items():
        parts = result.get("host_ms_per_step")
        if parts:
            where = " (`ts.csr` on the prefetch thread)" if setup.get("prefetch") else ""
            lines += ["", f"Host ms per step of the last epoch in the library's per-pattern work, {way} "
                          f"(calls per step){where}:", ""]
            lines += [f"- {label}: {v['ms']:.3f} ({v['calls']:g})" for label, v in parts.items()]
    for way, result in doc["ways"].items():
        if result.get("classes"):
            lines += ["", f"Classes of young patterns met by {way} (the first round's; the background thread "
                          f"spent {result['runtime'].get('background_s', 0):.1f} s deciding):", ""]
            lines += [f"- `{c['class']}` {c['op']} n={c['n']} {c['dtype']}: {html.escape(c['served_by'], quote=False)}"
                      for c in result["classes"]]
    lines += ["", tables.runs_line(doc["runs"])]
    return "\n".join(lines) + "\n"


def plot(doc: dict) -> str:
    """Every epoch of every round, per way: first epochs (a fresh runtime and cache) and later ones."""
    ways = [(way, r.get("rounds_epoch_s") or [r["epoch_s"]]) for way, r in doc["ways"].items()
            if r.get("status") == "ok"]
    fig, (ax,) = plots.figure(f"Mini-batch epochs, s: {doc['setup']['graph']} on {doc['env'].get('gpu') or 'CPU'}",
                              width=max(4.8, 1.5 + 1.2 * len(ways)), height=4.4)
    if not ways:
        plots.no_results(ax)
        return plots.to_svg(fig)
    first, later = "#c05621", "#2b6cb0"
    plots.strip(ax, [(way, [epochs[0] for epochs in rounds], first) for way, rounds in ways], gid="first", offset=-0.12)
    plots.strip(ax, [(way, [t for epochs in rounds for t in epochs[1:]], later) for way, rounds in ways], gid="later",
                offset=0.12)
    ax.set_xticks(range(len(ways)), [way for way, _ in ways], rotation=0, ha="center")
    ax.set_ylim(0, 1.1 * max(t for _, rounds in ways for epochs in rounds for t in epochs))
    ax.set_ylabel("epoch, s")
    ax.legend(handles=[ax.collections[0], ax.collections[len(ways)]], labels=["first epoch of a round", "later epochs"],
              loc="lower right", fontsize=8)
    return plots.to_svg(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--graph", default="pubmed", help="a matrix name, a .npz path or a synthetic spec")
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--fanouts", default="10,5")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--features", type=int, default=128)
    parser.add_argument("--classes", type=int, default=16)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batches", type=int, help="batches per epoch (default: every node once)")
    parser.add_argument("--ways", default=",".join(WAYS), help=f"some of {','.join(WAYS)}")
    parser.add_argument("--rounds", type=int, default=1,
                        help="repeat the comparison from fresh runtimes, caches, weights and compiles (default: 1)")
    parser.add_argument("--prefetch", action="store_true",
                        help="every way moves the next batch to the device on a background thread "
                             "(torch_sparserl.data.prefetch) while the current one trains")
    parser.add_argument("--admit-calls", type=int, help="the runtime's jit.admit_calls (default: its setting)")
    parser.add_argument("--admit-age-s", type=float, help="the runtime's jit.admit_age_s (default: its setting)")
    parser.add_argument("--class-after", type=int, default=16,
                        help="the sparserl_classes way's jit.class_after (default: 16)")
    parser.add_argument("--breakdown", action="store_true",
                        help="also time the library's per-pattern host work in the sparserl ways")
    parser.add_argument("--buckets", type=int, default=0,
                        help="pad every batch to one of this many sizes fitted on the epoch's batches, and compile "
                             "sparserl_compiled with static shapes (default: 0, no padding)")
    parser.add_argument("--no-profile", dest="profile", action="store_false",
                        help="skip the extra profiled epoch per way that gives its device time per step (CUDA)")
    parser.add_argument("--device", default=None, help="cuda (default where there is one) or cpu")
    parser.add_argument("--out", default="benchmarks/results/", help="a .json file, or a folder for the default name")
    args = parser.parse_args(argv)
    ways = args.ways.split(",")
    if not set(ways) <= set(WAYS):
        parser.error(f"--ways: expected some of {','.join(WAYS)} (got {args.ways})")
    if args.buckets < 0:
        parser.error(f"--buckets: expected a count >= 0, 0 for none (got {args.buckets})")
    if CAPTURED in ways and not args.buckets:
        parser.error(f"--ways {CAPTURED} needs --buckets K: a captured step replays one graph per batch size")

    import numpy as np
    import torch

    from torch_sparserl.data.buckets import Buckets
    from torch_sparserl.data.sampling import neighbor_batches

    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    A = load_graph(args.graph)
    A = ((A + A.T) > 0).astype(np.float32).tocsr()  # neighbours both ways
    fanouts = [int(f) for f in args.fanouts.split(",")]
    sampled = list(neighbor_batches(A, args.batch_size, fanouts, seed=0, limit=args.batches))
    trained, padding = sampled, None
    if args.buckets:  # every way trains on the same padded batches
        buckets = Buckets.fit(sampled, count=args.buckets)
        trained = [buckets.pad(b) for b in sampled]
        padding = {"sizes": [list(size) for size in buckets.sizes],
                   "rows": sum(b.nodes.size for b in trained) / sum(b.nodes.size for b in sampled),
                   "nnz": sum(b.nnz for b in trained) / max(1, sum(b.nnz for b in sampled))}
    batches = [PreparedBatch(b, args.device) for b in trained]
    g = torch.Generator().manual_seed(0)
    features = torch.randn(A.shape[0], args.features, generator=g).to(args.device)
    labels = torch.randint(0, args.classes, (A.shape[0],), generator=g).to(args.device)
    torch.manual_seed(0)
    model0 = make_model(args.features, args.hidden, args.classes)
    env = environment()
    graph_slug = re.sub(r"[^a-z0-9]+", "-", args.graph.lower()).strip("-")
    path = results_path(args.out, f"minibatch-{graph_slug}", env["gpu"] if args.device == "cuda" else None,
                        dt.date.today().isoformat())
    doc = {"schema": SCHEMA, "env": env, "runs": [{"started": dt.datetime.now().isoformat(timespec="seconds"),
                                                   "command": " ".join(["python benchmarks/bench_minibatch.py"]
                                                                       + (argv if argv is not None else sys.argv[1:]))}],
           "setup": {"graph": args.graph, "nodes": A.shape[0], "edges": int(A.nnz), "batch_size": args.batch_size,
                     "fanouts": fanouts, "hidden": args.hidden, "epochs": args.epochs, "batches": len(batches),
                     "mean_rows": float(np.mean([b.nodes.size for b in sampled])),
                     "mean_nnz": float(np.mean([b.nnz for b in sampled])), "device": args.device,
                     "warmup_steps": len(batches), "rounds": args.rounds, "prefetch": args.prefetch,
                     "buckets": args.buckets, "padding": padding},
           "ways": {}}
    warm_up(batches, features, labels, model0, args.device)
    for round_number in range(args.rounds):  # each round from fresh runtimes, caches, weights and compiles
        torch._dynamo.reset()
        runs = [WayRun(way, batches, features, labels, model0, args) for way in ways]
        for _ in range(args.epochs):  # epoch e of every way, then epoch e + 1 of every way
            for run in runs:
                run.epoch()
        if round_number == 0 and args.profile:
            for run in runs:
                run.profile()
        for run in runs:
            result = run.finish()
            if round_number == 0:
                doc["ways"][run.way] = result
                if result.get("status") == "ok":
                    result["rounds_epoch_s"] = []
            if result.get("status") == "ok":
                doc["ways"][run.way]["rounds_epoch_s"].append(result["epoch_s"])
            print(f"round {round_number} {run.way}: {result.get('status')} "
                  + (" ".join(f"{s:.3f}" for s in result["epoch_s"]) + " s/epoch" if result.get("status") == "ok"
                     else str(result.get("error"))), flush=True)
    doc["summary"] = summary(doc)
    write_json_md(doc, path, markdown, plot)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
