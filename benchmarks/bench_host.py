"""Where the host time of an eager ``A @ X`` served from C++ goes.

For each cell (a real matrix, a product), one process measures the host microseconds per call
of a loop of calls with no synchronization inside, the best of interleaved rounds:

* ``bare`` — bare launches of the serving kernel from C++ into one preallocated output (the
  floor: ``torch.ops.sparserl_fastpath.bare_launch_us``);
* ``cpp`` — the same hits looped in C++ alone: the registry's lookup and checks, the output's
  allocation and free, every launch (``served_us``);
* ``python`` — ``A @ X`` from Python: the above, the door (``CSRMatrix.__matmul__``) and the
  output's Python object;
* ``alloc``, ``launch`` — one allocation and one ``cudaMemsetAsync`` from C++
  (``host_costs_us``), and ``empty`` — ``torch.empty`` of the output from Python.

Two parts: the runtime's own decisions (``default``; ``off``: cuSPARSE through C++), and an A/B
of the ``rowchunks`` family with its kept workspace (``work_init=once``, one launch per call)
against the same kernel zero-filled before every call (``init=zero``, as before the fold).

    python benchmarks/bench_host.py --out benchmarks/results/
"""

from __future__ import annotations

import argparse
import datetime as dt
import math
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import command_line, environment, host_us, known_matrices, results_path, tables, write_json_md  # noqa: E402

SCHEMA = "torch_sparserl.bench_host/1"
CALLS = 200
DEFAULT_CELLS = "bcsstk13:1,bcsstk13:32,cora:32,cora:128,ca-CondMat:1,arrow:32,musae_github:128"
FOLD_CELLS = "cora:128,arrow:32,musae_github:128,ca-CondMat:32,pubmed:1"
TIMES = ("bare", "cpp", "python", "alloc", "launch", "empty")


def measure(M, name: str, n: int, part: str, runtime, rounds: int = 5) -> dict:
    import numpy as np
    import torch

    import torch_sparserl as ts
    from torch_sparserl import pattern as patterns
    from torch_sparserl.dtypes import close_to_reference
    from torch_sparserl.jit import fastpath

    lib = torch.ops.sparserl_fastpath
    A = ts.csr(M, dtype=torch.float32, index_dtype=torch.int32, device="cuda")
    X = torch.randn(M.shape[1], n, device="cuda", generator=torch.Generator(device="cuda").manual_seed(n))
    operand = X[:, 0].contiguous() if n == 1 else X
    A @ operand  # the Python path decides and records
    Y = A @ operand  # C++
    reference = torch.from_numpy(np.asarray(M.astype(np.float64) @ X.double().cpu().numpy()))
    ok, _ = close_to_reference(Y.reshape(M.shape[0], -1).cpu(), reference, torch.float32)
    args = (A.crow, A.col, A.val, A.shape[1], operand, fastpath.OPS.index("spmv" if n == 1 else "spmm"), CALLS)
    shape = (M.shape[0], n) if n > 1 else (M.shape[0],)
    like = torch.empty(1, device="cuda")
    best = {k: math.inf for k in TIMES}
    for _ in range(rounds):
        try:
            best["bare"] = min(best["bare"], float(lib.bare_launch_us(*args)))
        except RuntimeError:  # cuSPARSE serves: no kernel to launch bare
            pass
        best["cpp"] = min(best["cpp"], float(lib.served_us(*args)))
        best["python"] = min(best["python"], host_us(lambda: A @ operand, CALLS, repeats=1))
        alloc, launch = lib.host_costs_us(like, CALLS)[:2]
        best["alloc"], best["launch"] = min(best["alloc"], alloc), min(best["launch"], launch)
        best["empty"] = min(best["empty"], host_us(lambda: torch.empty(shape, device="cuda"), CALLS, repeats=1))
    decision = runtime.explain("spmv" if n == 1 else "spmm", patterns.lookup(A.crow, A.col, M.shape[1]), n,
                               torch.float32)
    cell = {"matrix": name, "n": n, "part": part, "decision": decision, "correct": ok,
            **{k: (v if math.isfinite(v) else None) for k, v in best.items()}}
    return cell


def _forced_rowchunks(variant: str):
    """A specializer that installs rowchunks at its defaults: as rendered (``once``), or with its
    plan zero-filling y and the workspace before every call (``zero``)."""
    from torch_sparserl.jit.cache import CacheEntry
    from torch_sparserl.specialize import families

    def specializer(key, crow, col, ncols):
        spec = families.render("rowchunks", None, op=key.op, dtype=key.dtype, n=key.n)
        source = spec.source if variant == "once" else spec.source.replace("work_init=once", "init=zero", 1)
        return CacheEntry(key, source, family="rowchunks", reason=f"bench_host: {variant}")
    return specializer


def summary(doc: dict) -> dict:
    def median(values):
        values = [v for v in values if v is not None]
        return statistics.median(values) if values else None

    out = {}
    for part in ("default", "once", "zero"):
        cells = [c for c in doc["cells"] if c["part"] == part and c["bare"] is not None]
        if cells:
            out[part] = {"cells": len(cells),
                         "cpp_over_bare_us": median(c["cpp"] - c["bare"] for c in cells),
                         "python_over_bare_us": median(c["python"] - c["bare"] for c in cells),
                         "door_us": median(c["python"] - c["cpp"] for c in cells),
                         "empty_us": median(c["empty"] for c in cells)}
    return out


def markdown(doc: dict) -> str:
    env = doc["env"]
    lines = [f"# Host time of a served eager call: {env['gpu']}, torch {env['torch']}", "",
             "Host µs per call, the best of interleaved rounds of loops with no synchronization. bare: the "
             "serving kernel launched from C++ into one output; C++: the hit looped in C++ (lookup, checks, "
             "allocation, every launch); Python: `A @ X`; empty: `torch.empty` of the output from Python; "
             "alloc, launch: one allocation and one `cudaMemsetAsync` from C++. `once`/`zero`: rowchunks "
             "with its kept workspace (one launch) / the same kernel zero-filled before every call.", "",
             *tables.header(["part", "cells", "C++ over bare", "Python over bare", "door (Python − C++)", "torch.empty"],
                            "lrrrrr")]
    for part, s in doc["summary"].items():
        lines.append(tables.row([part, s["cells"], f"{s['cpp_over_bare_us']:.2f}", f"{s['python_over_bare_us']:.2f}",
                                 f"{s['door_us']:.2f}", f"{s['empty_us']:.2f}"]))
    lines += ["", *tables.header(["matrix", "n", "part", "bare", "C++", "Python", "alloc", "launch", "empty", "correct",
                                  "decision"], "lrlrrrrrrll")]
    fmt = lambda v: "–" if v is None else f"{v:.2f}"  # noqa: E731
    for c in doc["cells"]:
        lines.append(tables.row([c["matrix"], c["n"], c["part"], *(fmt(c[k]) for k in TIMES), c["correct"],
                                 c["decision"][:50]]))
    lines += ["", command_line(doc["command"], doc["started"]), ""]
    return "\n".join(lines)


def _cells(text: str) -> list[tuple[str, int]]:
    return [(name, int(n)) for name, n in (item.rsplit(":", 1) for item in text.split(",") if item)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cells", default=DEFAULT_CELLS, help="matrix:n,... under the runtime's own decisions")
    parser.add_argument("--off-cells", default="bcsstk13:1,bcsstk13:32", help="matrix:n,... with the runtime off")
    parser.add_argument("--fold-cells", default=FOLD_CELLS, help="matrix:n,... of the rowchunks A/B")
    parser.add_argument("--out", default="benchmarks/results/", help="a .json file, or a folder for the default name")
    args = parser.parse_args(argv)

    import torch

    from torch_sparserl.config import JitOptions
    from torch_sparserl.data.datasets import load_matrix
    from torch_sparserl.jit import fastpath
    from torch_sparserl.jit import runtime as rt
    from torch_sparserl.jit.cache import KernelCache

    if not torch.cuda.is_available() or not fastpath.ensure(wait=True):
        print("bench_host: needs a CUDA GPU and the C++ library", file=sys.stderr)
        return 2
    env = environment()
    real = known_matrices()
    load = lambda name: (real[name].load() if name in real else load_matrix(name)).tocsr()  # noqa: E731
    doc = {"schema": SCHEMA, "env": env, "started": dt.datetime.now().isoformat(timespec="seconds"),
           "command": " ".join(["python benchmarks/bench_host.py"] + (argv if argv is not None else sys.argv[1:])),
           "cells": []}
    for part, cells in (("default", args.cells), ("off", args.off_cells)):
        runtime = rt.configure(mode="sync" if part == "default" else "off")
        for name, n in _cells(cells):
            doc["cells"].append(measure(load(name), name, n, part, runtime))
    for name, n in _cells(args.fold_cells):
        for variant in ("once", "zero"):
            with tempfile.TemporaryDirectory() as folder:
                runtime = rt.Runtime(JitOptions(mode="sync"), cache=KernelCache(folder),
                                     specializer=_forced_rowchunks(variant))
                previous = rt.set_active(runtime)
                try:
                    doc["cells"].append(measure(load(name), name, n, variant, runtime))
                finally:
                    rt.set_active(previous)
                    runtime.close()
    for c in doc["cells"]:
        print(f"{c['part']:7} {c['matrix']:14} {c['n']:4} " + " ".join(
            f"{k}={c[k]:.2f}" for k in TIMES if c[k] is not None) + f" {c['decision'][:40]}", flush=True)
    doc["summary"] = summary(doc)
    path = results_path(args.out, "host", env["gpu"], dt.date.today().isoformat())
    write_json_md(doc, path, markdown)
    print(f"bench_host: wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
