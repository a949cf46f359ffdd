"""The JIT runtime end to end on a GPU: ``A @ X`` through torch-sparserl against ``torch.sparse.mm``.

For every real matrix (../shared/matrices when present, else the shipped ones) and each
product (SpMV, SpMM at the chosen N), in one process with an empty kernel cache and the
runtime in ``sync`` mode:

* **cold** — the first ``A @ X``: fingerprint, autotuning in the sandbox under the budget,
  the extension build, plan preparation, the launch;
* **hot** — time per call of ``A @ X`` (CSRMatrix, eager, dispatch included) against
  ``torch.sparse.mm`` on the same CSR tensor, rounds interleaved
  (:func:`torch_sparserl.cli.measure.product`); also ``torch.ops.sparserl.spmm`` through the
  dispatcher; the speedup counts every call, those cuSPARSE serves too;
* **correct** — against a float64 SciPy reference;

then **warm** starts (a new process, decisions on disk: the first ``A @ X`` of each cell)
and the **dispatch overhead** per layer on a small matrix.

    python benchmarks/bench_runtime.py --out benchmarks/results/runtime-<gpu>.json           # everything
    python benchmarks/bench_runtime.py --out R.json --resume --max-time-s 500                # in chunks
    python benchmarks/bench_runtime.py --matrices cora --ops spmm --n 32 --out /tmp/r.json   # one cell

Chunks resume from the JSON file (the kernel cache stays in ``--cache-dir`` between them, so
a resumed run's warm and overhead phases see every earlier decision).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import geomean, select_matrices, tables  # noqa: E402

SCHEMA = "torch_sparserl.bench_runtime/1"


def _cells(matrices, ops, ns):
    for entry in matrices:
        for op in ops:
            for n in ([1] if op == "spmv" else ns):
                yield entry, op, n


def _summary(document: dict) -> dict:
    summary = {}
    cells = [c for c in document["cells"] if "speedup" in c]
    for label in sorted({(c["op"], c["n"]) for c in cells}):
        group = [c for c in cells if (c["op"], c["n"]) == label]
        summary[f"{label[0]} n={label[1]}"] = {
            "cells": len(group), "geomean_speedup": geomean(c["speedup"] for c in group),
            "installed": sum(c["installed"] for c in group), "correct": sum(c["correct"] for c in group),
            "slower_than_cusparse": sum(c["speedup"] < 0.97 for c in group),
            "cold_s_median": sorted(c["cold_s"] for c in group)[len(group) // 2],
        }
    if cells:
        summary["all"] = {"cells": len(cells), "geomean_speedup": geomean(c["speedup"] for c in cells),
                          "correct": sum(c["correct"] for c in cells)}
    return summary


def markdown(document: dict) -> str:
    env = document["env"]
    lines = [f"# JIT runtime end to end: {env['gpu']}, torch {env['torch']}", "",
             f"Command: `{document['command']}`. Runtime in sync mode, autotuning budget "
             f"{document['budget_s']:g} s per product, cold cache. Speedup = `torch.sparse.mm` time per call / "
             "`A @ X` time per call, both with dispatch, in the same rounds.", "",
             *tables.header(["product", "cells", "geomean speedup", "kernels installed", "correct",
                             "slower than cuSPARSE", "median cold"])]
    for label, s in document["summary"].items():
        if label == "all":
            continue
        lines.append(tables.row([label, s["cells"], f"{s['geomean_speedup']:.2f}x", s["installed"], s["correct"],
                                 s["slower_than_cusparse"], f"{s['cold_s_median']:.1f} s"]))
    lines += ["", *tables.header(["matrix", "product", "rows", "nnz", "cold s", "warm ms", "A @ X us", "op us",
                                  "torch.sparse us", "speedup", "decision"])]
    warm = {(w["matrix"], w["op"], w["n"]): w for w in document.get("warm", {}).get("cells", []) if w.get("from_disk", True)}
    for c in document["cells"]:
        if "speedup" not in c:
            lines.append(tables.row([c["matrix"], f"{c['op']} n={c['n']}", *[""] * 8, f"failed: {c.get('failure')}"]))
            continue
        w = warm.get((c["matrix"], c["op"], c["n"]))
        lines.append(tables.row([c["matrix"], f"{c['op']} n={c['n']}", c["rows"], c["nnz"], f"{c['cold_s']:.1f}",
                                 f"{w['warm_ms']:.0f}" if w else "", f"{c['hot_us']:.1f}", f"{c['op_us']:.1f}",
                                 f"{c['torch_sparse_us']:.1f}", f"{c['speedup']:.2f}x",
                                 f"{'' if c['correct'] else 'WRONG: '}{c['decision']}"]))
    overhead = document.get("overhead")
    if overhead and overhead.get("installed"):
        lines += ["", f"Dispatch overhead, CPU us per call on {document['overhead_matrix']} (SpMM N={overhead['n']}, "
                  f"{overhead['decision']}):", "",
                  *tables.header(["layer", "us per call"])]
        for name in ("raw_launch", "installed", "runtime_call", "direct", "operator", "torch_sparse"):
            lines.append(tables.row([name, f"{overhead[name]:.2f}"]))
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--matrices", nargs="*", help="names or globs of known matrices (default: every real one)")
    parser.add_argument("--ops", default="spmv,spmm")
    parser.add_argument("--n", default="32,128", help="N for spmm, comma-separated")
    parser.add_argument("--budget-s", type=float, default=8.0, help="autotuning budget per product (default 8)")
    parser.add_argument("--out", required=True, help="results JSON (Markdown written beside it)")
    parser.add_argument("--resume", action="store_true", help="continue the cells of --out")
    parser.add_argument("--max-time-s", type=float, default=None, help="stop starting cells after this long")
    parser.add_argument("--cache-dir", default=None, help="kernel cache of this run (default: a new temporary folder)")
    parser.add_argument("--overhead-matrix", default="cora")
    parser.add_argument("--no-warm", action="store_true")
    args = parser.parse_args(argv)

    start = time.monotonic()
    out = Path(args.out)
    previous = json.loads(out.read_text()) if out.exists() and args.resume else None
    if out.exists() and not args.resume:
        print(f"bench_runtime: {out} exists; pass --resume to continue it", file=sys.stderr)
        return 2
    cache_root = args.cache_dir or (previous or {}).get("cache_dir") or tempfile.mkdtemp(prefix="sparserl-bench-")
    os.environ["SPARSERL_CACHE_DIR"] = cache_root  # cold: nothing built or decided before this run

    import torch

    from torch_sparserl.cli import measure
    from torch_sparserl.data.datasets import load_matrix
    from torch_sparserl.jit import runtime as rt

    if not torch.cuda.is_available():
        print("bench_runtime: needs a CUDA GPU", file=sys.stderr)
        return 2
    matrices = list(select_matrices(args.matrices or ["real"]))
    ops = args.ops.split(",")
    ns = [int(v) for v in args.n.split(",")]
    if previous is not None:
        document = previous
    else:
        document = {"schema": SCHEMA, "env": {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                                              "cuda": torch.version.cuda},
                    "command": "python benchmarks/bench_runtime.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                    "budget_s": args.budget_s, "cache_dir": cache_root, "cells": []}
    done = {(c["matrix"], c["op"], c["n"]) for c in document["cells"]}
    runtime = rt.configure(mode="sync", budget_s=args.budget_s, strict=False)
    finished = True
    for entry, op, n in _cells(matrices, ops, ns):
        if (entry.name, op, n) in done:
            continue
        if args.max_time_s is not None and time.monotonic() - start > args.max_time_s:
            finished = False
            break
        cell = {"matrix": entry.name, "op": op, "n": n}
        try:
            cell.update(measure.product(load_matrix(entry.source), op, n, runtime=runtime))
        except Exception as exc:  # noqa: BLE001 - one failed cell is reported, not fatal
            cell["failure"] = f"{type(exc).__name__}: {exc}"
        document["cells"].append(cell)
        print(json.dumps(cell), flush=True)
        document["summary"] = _summary(document)
        out.write_text(json.dumps(document, indent=1))
    if finished:
        overhead_entry = select_matrices([args.overhead_matrix])[0]
        document["overhead_matrix"] = overhead_entry.name
        document["overhead"] = measure.dispatch_overhead(load_matrix(overhead_entry.source), runtime=runtime)
        print("overhead", json.dumps(document["overhead"]), flush=True)
        if not args.no_warm:
            installed = [(c["matrix"], c["op"], c["n"]) for c in document["cells"] if c.get("installed")]
            sources = {m.name: m.source for m in matrices}
            cells = [(sources.get(m, m), op, n) for m, op, n in installed]
            runtime.close()
            warm = measure.warm_start(cells, str(Path(cache_root) / "kernels"))
            names = {sources.get(m, m): m for m, _, _ in installed}
            for w in warm["cells"]:
                w["matrix"] = names.get(w["matrix"], w["matrix"])
            document["warm"] = warm
            print("warm", json.dumps(warm), flush=True)
    document["summary"] = _summary(document)
    out.write_text(json.dumps(document, indent=1))
    out.with_suffix(".md").write_text(markdown(document))
    print(json.dumps(document["summary"], indent=1))
    return 0 if finished else 3


if __name__ == "__main__":
    sys.exit(main())
