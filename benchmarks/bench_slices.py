"""Column slices for wide SpMM: group_row's best kernel with and without them, against cuSPARSE.

For each matrix and width N, the autotuner screens group_row's candidates twice in the
evaluator's sandbox (the same timing as the kernel benchmark, cuSPARSE timed in the same
evaluations): once those without column slices, once those with (``slices`` 2 and 4, slice-major
grids that keep their part of X in L2). The report gives each side's best kernel, its GPU
time, and its speedup over cuSPARSE.

    python benchmarks/bench_slices.py --matrices uk-2007-05_100000,dblp-2010 --n 128,256 --out benchmarks/results/
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

SCHEMA = "torch_sparserl.bench_slices/1"
DEFAULT_MATRICES = "uk-2007-05_100000,dblp-2010,usroads-48,p2p-Gnutella31,musae_github"


def _sliced(spec) -> bool:
    return dict(spec.params).get("slices", 1) > 1


def _best(result) -> dict | None:
    best = result.best
    if best is None:
        return None
    return {"params": best.params, "us": best.runtime_us, "cusparse_us": best.cusparse_us, "speedup": best.speedup}


def markdown(doc: dict) -> str:
    lines = [f"# Column slices for wide SpMM on {doc['env'].get('gpu')}", "",
             "group_row's best kernel without and with column slices (the autotuner's screen and final "
             "evaluation in the sandbox, f32), GPU µs and speedup over cuSPARSE timed in the same evaluations.", "",
             "| matrix | N | without: µs (× cuSPARSE) | with slices: µs (× cuSPARSE) | sliced / unsliced | best sliced |",
             "|---|---:|---|---|---:|---|"]
    for r in doc["cells"]:
        plain, sliced = r.get("plain"), r.get("sliced")
        cell = lambda b: "–" if b is None else f"{b['us']:.1f} ({b['speedup']:.2f}×)"  # noqa: E731
        ratio = f"{plain['us'] / sliced['us']:.2f}×" if plain and sliced else "–"
        params = "" if sliced is None else ", ".join(f"{k}={v}" for k, v in sliced["params"].items()
                                                       if k in ("lanes", "vec", "slices", "rows"))
        lines.append(f"| {r['matrix']} | {r['n']} | {cell(plain)} | {cell(sliced)} | {ratio} | {params} |")
    lines += ["", "Runs: " + "; ".join(f"`{r['command']}` ({r['started']})" for r in doc["runs"])]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--matrices", default=DEFAULT_MATRICES)
    parser.add_argument("--n", default="128,256", help="widths, comma-separated")
    parser.add_argument("--budget-s", type=float, default=30.0, help="the autotuner's budget per side and cell")
    parser.add_argument("--out", default="benchmarks/results/", help="a .json file, or a folder for the default name")
    args = parser.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        parser.error("bench_slices times GPU kernels: no CUDA device here")
    from bench_kernels import environment, select_matrices
    from report import results_path, write_json_md
    from torch_sparserl.evaluate.sandbox import Sandbox
    from torch_sparserl.specialize.autotune import tune

    env = environment()
    path = results_path(args.out, "slices", env["gpu"], dt.date.today().isoformat())
    doc = {"schema": SCHEMA, "env": env,
           "runs": [{"started": dt.datetime.now().isoformat(timespec="seconds"),
                     "command": " ".join(["python benchmarks/bench_slices.py"]
                                         + (argv if argv is not None else sys.argv[1:]))}], "cells": []}
    box = Sandbox()
    try:
        for entry in select_matrices(args.matrices.split(",")):
            A = entry.load().tocsr()
            for n in (int(v) for v in args.n.split(",")):
                cell = {"matrix": entry.name, "n": n}
                for side, only in (("plain", lambda s: not _sliced(s)), ("sliced", _sliced)):
                    result = tune(A, op="spmm", n=n, dtype="f32", budget_s=args.budget_s, sandbox=box,
                                  families=["group_row"], only=only)
                    cell[side] = _best(result)
                doc["cells"].append(cell)
                print(entry.name, n, cell, flush=True)
                write_json_md(doc, path, markdown)
    finally:
        box.close()
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
