"""SDDMM, the gradient of a sparse matrix's values: specialized kernels against cuSPARSE.

``out[k] = dot(D[row(k)], X[col(k)])`` is what the backward of ``A @ X`` computes for the
values of A when they require grad (GAT-style attention, learned edge weights). For each
graph and N the runtime specializes ``sparserl::sddmm`` (the autotuner does: the learned
policy writes SpMM/SpMV kernels only), then four ways are timed in the same process,
interleaved round by round (``measure.compare_us``), per call:

* ``sparserl`` — ``torch.ops.sparserl.sddmm`` with the installed kernel (with cuSPARSE
  behind it when no candidate beat cuSPARSE by the runtime's margin);
* ``backward`` — the same product as the eager backward of ``A @ X`` calls it: the
  operator's implementation without the dispatcher (``ops.sampled._sddmm``);
* ``cusparse`` — ``torch.sparse.sampled_addmm``, which calls ``cusparseSDDMM``;
* ``gather`` — the torch-ops formulation that edge-level GNN code uses: gather both
  operands per nonzero, multiply, sum (``kernels/reference.py``).

Every result is checked against float64 first. Writes JSON and Markdown.

    python benchmarks/bench_sddmm.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import command_line, compare_us, geomean, load_graph, results_path, tables, write_json_md  # noqa: E402

SCHEMA = "torch_sparserl.bench_sddmm/1"
GRAPHS = ["pubmed", "dblp-2010", "fb100_Cornell5", "uk-2007-05_100000"]
NS = [32, 128]
DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


def run_row(name: str, M, n: int, dtype: torch.dtype, runtime) -> dict:
    import torch_sparserl as ts
    from torch_sparserl.ops import sampled
    from torch_sparserl import pattern as patterns
    from torch_sparserl.dtypes import close_to_reference
    from torch_sparserl.kernels import reference, vendor

    A = ts.csr(M, dtype=dtype, index_dtype=torch.int32, device="cuda")
    crow, col, ncols = A.crow, A.col, M.shape[1]
    entry = patterns.lookup(crow, col, ncols)
    generator = torch.Generator(device="cuda").manual_seed(n)
    D = torch.randn(M.shape[0], n, device="cuda", generator=generator).to(dtype)
    X = torch.randn(ncols, n, device="cuda", generator=generator).to(dtype)

    started = time.perf_counter()
    out = torch.ops.sparserl.sddmm(crow, col, D, X)  # sync mode: specializes first
    torch.cuda.synchronize()
    cold_s = time.perf_counter() - started
    ref = reference.sddmm(entry, crow, col, D.double(), X.double())
    ways = {
        "sparserl": lambda: torch.ops.sparserl.sddmm(crow, col, D, X),
        "backward": lambda: sampled._sddmm(crow, col, D, X),
        "cusparse": lambda: vendor.sddmm(entry, crow, col, D, X),
        "gather": lambda: reference.sddmm(entry, crow, col, D, X),
    }
    checks = {way: close_to_reference(fn() if way != "sparserl" else out, ref, dtype) for way, fn in ways.items()}
    times = compare_us(ways)
    state = runtime.state("sddmm", entry, n, dtype)
    record = None
    if getattr(state, "key", None) is not None:
        cached = runtime.cache.get(state.key)
        record = cached.record if cached is not None else None
    return {
        "graph": name, "rows": M.shape[0], "nnz": int(M.nnz), "n": n, "dtype": str(dtype).replace("torch.", ""),
        "decision": runtime.describe(state), "cold_s": round(cold_s, 2),
        "correct": {way: ok for way, (ok, _) in checks.items()},
        "errors": {way: why for way, (ok, why) in checks.items() if not ok},
        "us": {way: round(us, 2) for way, us in times.items()},
        "speedup_vs_cusparse": times["cusparse"] / times["sparserl"],
        "speedup_vs_gather": times["gather"] / times["sparserl"],
        "backward_speedup_vs_cusparse": times["cusparse"] / times["backward"],
        # the evaluator's kernel-only timings (L2 flushed), from the cache entry's record
        "kernel_us": record.get("runtime_us") if record else None,
        "kernel_cusparse_us": record.get("cusparse_us") if record else None,
    }


def markdown(doc: dict) -> str:
    rows = doc["rows"]
    lines = [f"# SDDMM (gradient of the values): sparserl vs cuSPARSE — {doc['device']}", "",
             command_line(doc["command"], label=None), "", f"torch {doc['torch']}, {doc['date']}. Times are per call (dispatch "
             "included), medians of interleaved rounds; *kernel* columns are the evaluator's L2-flushed "
             "kernel timings from the specialization run.", "",
             *tables.header(["graph", "nnz", "N", "dtype", "sparserl µs", "backward µs", "cuSPARSE µs", "gather µs",
                             "vs cuSPARSE", "backward vs cuSPARSE", "vs gather", "kernel µs", "kernel cuSPARSE µs",
                             "decision"])]
    for r in rows:
        if "error" in r:
            lines.append(tables.row([r["graph"], "", r["n"], "", f"failed: {r['error'][:120]}", *[""] * 9]))
            continue
        us = r["us"]
        fmt = lambda v, spec=".1f", unit="": f"{v:{spec}}{unit}" if isinstance(v, (int, float)) else "–"  # noqa: E731
        lines.append(tables.row([r["graph"], f"{r['nnz']:,}", r["n"], r["dtype"], f"{us['sparserl']:.1f}",
                                 fmt(us.get("backward")), f"{us['cusparse']:.1f}", f"{us['gather']:.1f}",
                                 f"{r['speedup_vs_cusparse']:.2f}×", fmt(r.get("backward_speedup_vs_cusparse"), ".2f", "×"),
                                 f"{r['speedup_vs_gather']:.2f}×", fmt(r["kernel_us"]), fmt(r["kernel_cusparse_us"]),
                                 r["decision"][:90]]))
    ok = [r for r in rows if "error" not in r]
    g1 = geomean(r["speedup_vs_cusparse"] for r in ok)
    g2 = geomean(r["speedup_vs_gather"] for r in ok)
    g3 = geomean(r.get("backward_speedup_vs_cusparse") for r in ok)
    if g1:
        lines += ["", f"Geometric mean over {len(ok)} rows: **{g1:.2f}× cuSPARSE**, {g2:.2f}× the gather formulation"
                  + (f"; as the eager backward calls it, {g3:.2f}× cuSPARSE." if g3 else ".")]
    wrong = [(r["graph"], r["n"], r["errors"]) for r in ok if r["errors"]]
    lines += ["", "Every way matched float64." if not wrong else f"Mismatches: {wrong}"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--graphs", default=",".join(GRAPHS))
    parser.add_argument("--n", default=",".join(map(str, NS)))
    parser.add_argument("--dtypes", default="f32")
    parser.add_argument("--budget-s", type=float, default=30.0, help="autotuning budget per key")
    parser.add_argument("--out", default="benchmarks/results", help="folder (a dated file in it) or a .json path")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_sddmm: needs a CUDA GPU (cuSPARSE is the baseline)", file=sys.stderr)
        return 2
    from torch_sparserl.jit import runtime as rt

    device = torch.cuda.get_device_name()
    out = results_path(args.out, "sddmm", device, dt.date.today().isoformat())
    runtime = rt.configure(mode="sync", policy="autotune", budget_s=args.budget_s)
    doc = {"schema": SCHEMA, "device": device, "torch": torch.__version__, "date": dt.date.today().isoformat(),
           "command": "python benchmarks/bench_sddmm.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "margin": runtime.settings.margin, "rows": []}
    for name in args.graphs.split(","):
        M = load_graph(name)
        for dtype_name in args.dtypes.split(","):
            for n in map(int, args.n.split(",")):
                try:
                    row = run_row(name, M, n, DTYPES[dtype_name], runtime)
                except Exception as exc:  # noqa: BLE001 - recorded, the grid goes on
                    traceback.print_exc()
                    row = {"graph": name, "n": n, "dtype": dtype_name, "error": f"{type(exc).__name__}: {exc}"}
                doc["rows"].append(row)
                print(json.dumps(row), flush=True)
                write_json_md(doc, out, markdown)
    runtime.close()
    print(markdown(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
