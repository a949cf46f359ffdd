"""Fused epilogues, layer by layer: ``relu(D^-1/2 A (H) + b)`` compiled with the fusion on and off.

For each graph and N: the runtime decides the SpMM kernel (sync mode, the learned policy by
default), then the GCN layer tail ``relu((A @ H) * d[:, None] + b)`` is compiled twice with
``backend="sparserl"``: ``fuse_epilogues=True`` (the post-grad pass writes
``sparserl::spmm_epilogue`` when the installed kernel stores each row once: group_row,
warp_row_staged) and ``False`` (Inductor's fused pointwise kernel after the product). Both
are checked against float64 and timed per call, interleaved (``measure.compare_us``), forward
only. Rows whose kernel is a split family (rows summed atomically) cannot fuse; they are
listed with the family, and both timings then measure the same program (a noise floor).

    python benchmarks/bench_epilogue.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import traceback
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import command_line, compare_us, geomean, load_graph, results_path, tables, write_json_md  # noqa: E402

SCHEMA = "torch_sparserl.bench_epilogue/1"
GRAPHS = ["cora", "citeseer", "pubmed", "dblp-2010", "fb100_Cornell5", "uk-2007-05_100000"]
NS = [32, 128]


def run_row(name, M, n, runtime) -> dict:
    import torch_sparserl as ts
    from torch_sparserl import pattern as patterns
    from torch_sparserl.compiler import passes
    from torch_sparserl.dtypes import close_to_reference

    A = ts.csr(M, dtype=torch.float32, index_dtype=torch.int32, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(n)
    H = torch.randn(M.shape[1], n, device="cuda", generator=g)
    d = torch.rand(M.shape[0], device="cuda", generator=g) + 0.5
    b = torch.randn(n, device="cuda", generator=g)
    A @ H  # decide the product's kernel first (sync mode)
    entry = patterns.lookup(A.crow, A.col, M.shape[1])
    fusable = runtime.fusable(M.shape[0], M.nnz, M.shape[1], n, torch.float32)

    def layer(h):
        return torch.relu((A @ h) * d.unsqueeze(1) + b)

    ref = np.maximum((M.astype(np.float64) @ H.double().cpu().numpy()) * d.double().cpu().numpy()[:, None]
                     + b.double().cpu().numpy(), 0.0)
    ways, fused_lines, checks = {}, {}, {}
    for way, fuse in (("fused", True), ("unfused", False)):
        torch._dynamo.reset()
        passes.REPORTS.clear()
        with torch._inductor.config.patch(force_disable_caches=True):
            fn = torch.compile(layer, backend="sparserl", options={"fuse_epilogues": fuse})
            out = fn(H)
        fused_lines[way] = [line for report in passes.REPORTS for line in report.fused]
        checks[way] = close_to_reference(out, torch.from_numpy(np.asarray(ref)), torch.float32)
        ways[way] = (lambda fn=fn: fn(H))
    times = compare_us(ways)  # nothing requires grad: the compiled graphs are inference graphs
    torch._dynamo.reset()
    return {
        "graph": name, "rows": M.shape[0], "nnz": int(M.nnz), "n": n,
        "kernel": runtime.describe(runtime.state("spmm", entry, n, torch.float32)),
        "fusable": fusable, "fused_chains": fused_lines["fused"],
        "fused_kernel": runtime.describe(runtime.state("spmm+scale+bias+relu", entry, n, torch.float32)),
        "correct": {w: ok for w, (ok, _) in checks.items()},
        "errors": {w: why for w, (ok, why) in checks.items() if not ok},
        "us": {w: round(v, 2) for w, v in times.items()},
        "fusion_speedup": times["unfused"] / times["fused"],
    }


def markdown(doc: dict) -> str:
    lines = [f"# Fused epilogue, one GCN layer tail: fused vs Inductor's pointwise kernel — {doc['device']}", "",
             command_line(doc["command"], label=None), "",
             f"torch {doc['torch']}, {doc['date']}. `relu((A @ H) * d[:, None] + b)` compiled with "
             "`backend=\"sparserl\"`, `fuse_epilogues` on and off; forward per call, medians of interleaved rounds.",
             "", *tables.header(["graph", "nnz", "N", "product kernel", "fused?", "fused µs", "unfused µs",
                                 "fusion speedup"], "lrrllrrr")]
    fused_rows = []
    for r in doc["rows"]:
        if "error" in r:
            lines.append(tables.row([r["graph"], "", r["n"], f"failed: {r['error'][:100]}", "", "", "", ""]))
            continue
        kernel = r["kernel"].split(" (")[0].replace("installed: ", "")
        lines.append(tables.row([r["graph"], f"{r['nnz']:,}", r["n"], kernel[:70], "yes" if r["fused_chains"] else "no",
                                 f"{r['us']['fused']:.1f}", f"{r['us']['unfused']:.1f}", f"{r['fusion_speedup']:.3f}×"]))
        if r["fused_chains"]:
            fused_rows.append(r["fusion_speedup"])
    if fused_rows:
        lines += ["", f"Geometric mean over the {len(fused_rows)} rows that fused: **{geomean(fused_rows):.3f}×**."]
    bad = [(r["graph"], r["n"], r["errors"]) for r in doc["rows"] if r.get("errors")]
    lines += ["", "Both ways matched float64 on every row." if not bad else f"Mismatches: {bad}"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--graphs", default=",".join(GRAPHS))
    parser.add_argument("--n", default=",".join(map(str, NS)))
    parser.add_argument("--policy", default="learned", choices=("learned", "autotune"))
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_epilogue: needs a CUDA GPU", file=sys.stderr)
        return 2
    import torch_sparserl as ts
    from torch_sparserl.jit import runtime as rt

    device = torch.cuda.get_device_name()
    out = results_path(args.out, "epilogue", device, dt.date.today().isoformat())
    runtime = rt.configure(mode="sync", policy=args.policy)
    doc = {"schema": SCHEMA, "device": device, "torch": torch.__version__, "date": dt.date.today().isoformat(),
           "command": "python benchmarks/bench_epilogue.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "rows": []}
    for name in args.graphs.split(","):
        M = ts.load_matrix(name) if name in ts.list_matrices() else load_graph(name)
        for n in map(int, args.n.split(",")):
            try:
                row = run_row(name, M.tocsr(), n, runtime)
            except Exception as exc:  # noqa: BLE001 - recorded, the grid goes on
                traceback.print_exc()
                row = {"graph": name, "n": n, "error": f"{type(exc).__name__}: {exc}"}
            doc["rows"].append(row)
            print(json.dumps(row), flush=True)
            write_json_md(doc, out, markdown)
    runtime.close()
    print(markdown(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
