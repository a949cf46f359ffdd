"""Eager products end to end: ``ts.csr(A) @ X`` against torch's own call on the same matrix.

For every real matrix (../shared/matrices when present, else the shipped ones), each product
(SpMV, SpMM at N = 32, 128, 256), each value dtype the products serve (float32, bfloat16,
float16; int32 indices), and two runtimes — ``off`` (no
kernel: cuSPARSE serves every call, the library's fallback path) and ``default`` (the default
settings, in ``sync`` mode so that each decision lands before the timing) — one process measures:

* **wall** — time per call of ``A @ X`` and of ``torch.sparse.mm(A_torch, X)`` /
  ``torch.mv(A_torch, x)`` on a ``torch.sparse_csr`` tensor sharing A's parts, rounds
  interleaved, median round (:func:`torch_sparserl.cli.measure.compare_us`): host cost and
  GPU time together, as a training loop sees them;
* **gpu** — the device time per call of everything each call launches (kernels, memsets,
  copies), from the profiler;
* **host** — CPU microseconds per call of issuing the call (a loop of calls, no
  synchronization inside); where C++ serves, also the same calls looped in C++ alone
  (``cpp_us``: what the Python door adds is the difference), and where a kernel serves, the
  floor: bare launches of the same kernel from C++ into a preallocated output
  (``bare_launch_us``). These are timed in interleaved rounds (the best of each), before the
  profiler runs;
* **correct** — the first product against float64 SciPy.

    python benchmarks/bench_eager.py --out benchmarks/results/                  # everything
    python benchmarks/bench_eager.py --out R.json --resume --max-time-s 400     # in chunks
    python benchmarks/bench_eager.py --matrices cora,pubmed --products 1,32 --out /tmp/e.json
    python benchmarks/bench_eager.py --dtypes bfloat16 --products 64 --matrices cnr-2000 --out /tmp/b.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (compare_us, environment, geomean, gpu_us, host_us, known_matrices, plots,  # noqa: E402
                    results_path, tables, write_json_md)
from common.timing import HOST_CALLS  # noqa: E402

SCHEMA = "torch_sparserl.bench_eager/1"
PRODUCTS = (1, 32, 128, 256)  # 1: SpMV
MODES = ("off", "default")
DTYPES = ("float32", "bfloat16", "float16")


def measure_cell(M, name: str, n: int, mode: str, dtype_name: str = "float32") -> dict:
    import numpy as np
    import torch

    import torch_sparserl as ts
    from torch_sparserl import pattern as patterns
    from torch_sparserl.dtypes import close_to_reference
    from torch_sparserl.jit import fastpath
    from torch_sparserl.jit import runtime as rt

    dtype = getattr(torch, dtype_name)
    runtime = rt.configure(mode="off" if mode == "off" else "sync")
    A = ts.csr(M, dtype=dtype, index_dtype=torch.int32, device="cuda")
    raw = A.to_sparse_csr()
    generator = torch.Generator(device="cuda").manual_seed(n)
    X = torch.randn(M.shape[1], max(n, 1), device="cuda", generator=generator).to(dtype)
    operand = X[:, 0].contiguous() if n == 1 else X
    torch.cuda.synchronize()
    started = time.perf_counter()
    Y = A @ operand
    torch.cuda.synchronize()
    first_s = time.perf_counter() - started
    rounded = M.astype(np.float64)
    rounded.data = A.val.double().cpu().numpy()  # the values as the dtype holds them (SciPy's order is A's)
    reference = torch.from_numpy(np.asarray(rounded @ X.double().cpu().numpy()))
    ok, why = close_to_reference(Y.reshape(M.shape[0], -1).cpu(), reference[:, :max(n, 1)], dtype)
    ours = lambda: A @ operand  # noqa: E731
    theirs = (lambda: torch.mv(raw, operand)) if n == 1 else (lambda: torch.sparse.mm(raw, operand))  # noqa: E731
    before = fastpath.COUNTS.clone()
    ours()
    served_by_cpp = bool((fastpath.COUNTS - before).sum())
    wall = compare_us({"sparserl": ours, "torch": theirs})
    decision = runtime.explain("spmv" if n == 1 else "spmm", patterns.lookup(A._crow, A._col, M.shape[1]), n,
                               dtype)
    host = _host_rounds(A, operand, n, ours, theirs, served_by_cpp, served_by_cpp and decision.startswith("installed"))
    cell = {"matrix": name, "rows": M.shape[0], "cols": M.shape[1], "nnz": int(M.nnz), "n": n, "mode": mode,
            "dtype": dtype_name,
            "decision": decision, "served_by_cpp": served_by_cpp, "first_s": first_s,
            "correct": ok, "error": None if ok else why,
            "wall_us": wall["sparserl"], "torch_wall_us": wall["torch"],
            **host, "gpu_us": gpu_us(ours), "torch_gpu_us": gpu_us(theirs)}
    cell["speedup"] = cell["torch_wall_us"] / cell["wall_us"]
    cell["gpu_speedup"] = cell["torch_gpu_us"] / cell["gpu_us"] if cell["gpu_us"] > 0 else None
    return cell


def _host_rounds(A, operand, n: int, ours, theirs, served_by_cpp: bool, kernel_hit: bool,
                 rounds: int = 5) -> dict:
    """Host µs per call, the best of ``rounds`` interleaved rounds (the host's speed drifts):
    ours and torch's from Python, ours from C++ alone (``cpp_us``, where C++ serves) and bare
    launches of the kernel that serves (``bare_launch_us``, where one does; from its library's
    ``bare_launch_us``). None where the library cannot say."""
    import torch

    from torch_sparserl.jit import fastpath

    lib = torch.ops.sparserl_fastpath
    index = fastpath.OPS.index("spmv" if n == 1 else "spmm")
    args = (A._crow, A._col, A.val, A.shape[1], operand, index, HOST_CALLS)
    best = {"host_us": math.inf, "torch_host_us": math.inf, "cpp_us": None, "bare_launch_us": None}
    for _ in range(rounds):
        best["host_us"] = min(best["host_us"], host_us(ours, repeats=1))
        best["torch_host_us"] = min(best["torch_host_us"], host_us(theirs, repeats=1))
        for name, wanted, fn in (("cpp_us", served_by_cpp, lib.served_us), ("bare_launch_us", kernel_hit,
                                                                           lib.bare_launch_us)):
            if not wanted:
                continue
            try:
                value = float(fn(*args))
            except (RuntimeError, AttributeError):
                continue
            best[name] = value if best[name] is None else min(best[name], value)
    return best


def _dtype(cell: dict) -> str:
    return cell.get("dtype", "float32")  # cells of runs before the dtype was recorded: float32


def summary(doc: dict) -> dict:
    out = {}
    for mode, dtype, n in ((m, d, n) for m in MODES for d in DTYPES for n in PRODUCTS):
        cells = [c for c in doc["cells"] if c["mode"] == mode and c["n"] == n and _dtype(c) == dtype]
        if not cells:
            continue
        bare = [c for c in cells if c.get("bare_launch_us") is not None]
        over_bare = [c["host_us"] - c["bare_launch_us"] for c in bare]
        cpp_over_bare = [c["cpp_us"] - c["bare_launch_us"] for c in bare if c.get("cpp_us") is not None]
        out[f"{mode} {dtype} {'spmv' if n == 1 else f'spmm n={n}'}"] = {
            "cells": len(cells), "geomean": geomean(c["speedup"] for c in cells),
            "min": min(c["speedup"] for c in cells), "gpu_geomean": geomean(c["gpu_speedup"] for c in cells),
            "below_0.97": sum(c["speedup"] < 0.97 for c in cells),
            "host_us_median": statistics.median(c["host_us"] for c in cells),
            "torch_host_us_median": statistics.median(c["torch_host_us"] for c in cells),
            "over_bare_us_max": max(over_bare, default=None),
            "over_bare_us_median": statistics.median(over_bare) if over_bare else None,
            "cpp_over_bare_us_median": statistics.median(cpp_over_bare) if cpp_over_bare else None,
            "installed": sum(c["decision"].startswith("installed") for c in cells),
            "correct": sum(c["correct"] for c in cells)}
    return out


def markdown(doc: dict) -> str:
    env = doc["env"]
    lines = [f"# Eager products end to end: {env['gpu']}, torch {env['torch']}", "",
             "Speedup = torch's own call (`torch.sparse.mm` / `torch.mv` on the same CSR tensor) per call / "
             "`ts.csr(A) @ X` per call, wall time with host cost, rounds interleaved in one process; int32 "
             "indices. `off`: no kernel, cuSPARSE serves every call (the fallback path); `default`: the "
             "default settings in sync mode. GPU = profiler device time per call; host = CPU µs per call.", "",
             "Host over bare = host µs a C++ kernel hit took over bare launches of the same kernel (median, most); "
             "C++ over bare = the same for the hits looped in C++ alone (the rest is the Python door).",
             "",
             *tables.header(["runtime, product", "cells", "geomean", "min", "< 0.97×", "GPU geomean", "host µs (torch)",
                             "host over bare", "C++ over bare", "kernels", "correct"], "l" + "r" * 10)]
    for label, s in doc["summary"].items():
        lines.append(tables.row([
            label, s["cells"], f"{s['geomean']:.2f}×", f"{s['min']:.2f}×", s["below_0.97"], f"{s['gpu_geomean']:.2f}×",
            f"{s['host_us_median']:.1f} ({s['torch_host_us_median']:.1f})",
            "–" if s.get("over_bare_us_max") is None else f"{s['over_bare_us_median']:.1f}, {s['over_bare_us_max']:.1f} µs",
            "–" if s.get("cpp_over_bare_us_median") is None else f"{s['cpp_over_bare_us_median']:.1f} µs",
            s["installed"], f"{s['correct']}/{s['cells']}"]))
    lines += ["", *tables.header(["matrix", "n", "dtype", "runtime", "speedup", "wall µs (torch)", "GPU µs (torch)",
                                  "host µs (torch)", "served by"], "lrllrrrrl")]
    for c in doc["cells"]:
        lines.append(tables.row([c["matrix"], c["n"], _dtype(c), c["mode"], f"{c['speedup']:.2f}×",
                                 f"{c['wall_us']:.1f} ({c['torch_wall_us']:.1f})",
                                 f"{c['gpu_us']:.1f} ({c['torch_gpu_us']:.1f})",
                                 f"{c['host_us']:.1f} ({c['torch_host_us']:.1f})",
                                 c["decision"][:60] + (" (C++)" if c["served_by_cpp"] else "")]))
    lines += ["", tables.runs_line(doc["runs"])]
    return "\n".join(lines) + "\n"


def plot(doc: dict) -> str:
    """End-to-end speedup of every cell, one column per (dtype, product, runtime) that was run."""
    ran = {(_dtype(c), c["n"], c["mode"]) for c in doc["cells"]}
    columns = [(mode, n, d) for d in DTYPES for n in PRODUCTS for mode in MODES if (d, n, mode) in ran]
    colors = {"off": "#8c8c8c", "default": "#2b6cb0"}
    fig, (ax,) = plots.figure("ts.csr(A) @ X vs torch, end to end, per matrix — " + str(doc["env"].get("gpu")),
                              width=max(7.5, 1.5 + 0.6 * len(columns)), height=4.6)
    if not columns:
        plots.no_results(ax)
        return plots.to_svg(fig)
    strips = []
    for mode, n, dtype in columns:
        label = f"{'spmv' if n == 1 else f'n={n}'} {mode}"
        if dtype != "float32":
            label += f" {'bf16' if dtype == 'bfloat16' else 'f16'}"
        speedups = [c["speedup"] for c in doc["cells"] if (c["mode"], c["n"], _dtype(c)) == (mode, n, dtype)]
        strips.append((label, speedups, colors[mode]))
    plots.strip(ax, strips)
    plots.times_axis(ax)
    plots.unity(ax)
    ax.set_ylim(0, 1.05 * max([2.0] + [v for _, values, _ in strips for v in values]))
    return plots.to_svg(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="benchmarks/results/", help="a .json file, or a folder for the default name")
    parser.add_argument("--resume", help="a results .json to continue (its cells are skipped)")
    parser.add_argument("--matrices", help="comma-separated names (default: every real matrix)")
    parser.add_argument("--products", default=",".join(map(str, PRODUCTS)), help="N per product; 1 is SpMV")
    parser.add_argument("--modes", default=",".join(MODES), help=f"some of {','.join(MODES)}")
    parser.add_argument("--dtypes", default=",".join(DTYPES), help=f"value dtypes, some of {','.join(DTYPES)}")
    parser.add_argument("--max-time-s", type=float, default=math.inf, help="stop starting cells after this")
    parser.add_argument("--no-spmv-preprocess", dest="preprocess", action="store_false",
                        help="C++'s cuSPARSE SpMV entries skip cusparseSpMV_preprocess (to measure what it is worth)")
    args = parser.parse_args(argv)
    modes = args.modes.split(",")
    if not set(modes) <= set(MODES):
        parser.error(f"--modes: expected some of {','.join(MODES)} (got {args.modes})")
    dtypes = args.dtypes.split(",")
    if not set(dtypes) <= set(DTYPES):
        parser.error(f"--dtypes: expected some of {','.join(DTYPES)} (got {args.dtypes})")

    import torch

    from torch_sparserl.data.datasets import load_matrix

    if not torch.cuda.is_available():
        print("bench_eager: needs a CUDA GPU", file=sys.stderr)
        return 2
    env = environment()
    from torch_sparserl.jit import fastpath

    if fastpath.ensure(wait=True):
        torch.ops.sparserl_fastpath.cusparse_preprocess(args.preprocess)
    env["cusparse_spmv_preprocess"] = args.preprocess
    if args.resume:
        path = Path(args.resume)
        doc = json.loads(path.read_text())
    else:
        path = results_path(args.out, "eager", env["gpu"], dt.date.today().isoformat())
        doc = {"schema": SCHEMA, "env": env, "runs": [], "cells": []}
    doc["runs"].append({"started": dt.datetime.now().isoformat(timespec="seconds"),
                        "command": " ".join(["python benchmarks/bench_eager.py"]
                                            + (argv if argv is not None else sys.argv[1:]))})
    real = {name: entry for name, entry in known_matrices().items() if entry.group == "real"}
    names = args.matrices.split(",") if args.matrices else sorted(real)
    products = [int(n) for n in args.products.split(",")]
    done = {(c["matrix"], c["n"], c["mode"], _dtype(c)) for c in doc["cells"]}
    started = time.perf_counter()
    for name in names:
        M = (real[name].load() if name in real else load_matrix(name)).tocsr()
        for dtype, n, mode in ((d, n, m) for d in dtypes for n in products for m in modes):
            if (name, n, mode, dtype) in done:
                continue
            if time.perf_counter() - started > args.max_time_s:
                print("bench_eager: time is up; resume with --resume", path)
                doc["summary"] = summary(doc)
                write_json_md(doc, path, markdown, plot)
                return 0
            cell = measure_cell(M, name, n, mode, dtype)
            doc["cells"].append(cell)
            print(f"{name} n={n} {dtype} {mode}: {cell['speedup']:.2f}x ({cell['wall_us']:.1f} vs "
                  f"{cell['torch_wall_us']:.1f} us; host {cell['host_us']:.1f} vs {cell['torch_host_us']:.1f}) "
                  f"{cell['decision'][:50]}", flush=True)
            doc["summary"] = summary(doc)
            write_json_md(doc, path, markdown, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
