"""Many distinct patterns through the library: the state they leave behind (issue 36).

Mini-batch training makes a new pattern every step and drops it after. This benchmark does the
same, ``--patterns`` times: a new random pattern of ``--rows`` rows and about ``--nnz``
nonzeros, ``ts.csr`` of it, one eager ``A @ X`` (N = ``--n``), then the matrix is dropped. The
runtime runs in sync mode with ``admit_calls=1``, so every pattern is decided and writes a
cache entry: the worst case for the disk cache, whose cap (``--cache-max-mb``) is set below
what the entries would take. At checkpoints it records:

* the disk cache: bytes of its entries, entry files, lock files;
* what the process holds per pattern: the pattern table, the runtime's decision table, the
  cache's in-memory entries, the C++ registry's entries (where the library is loaded);
* the process's resident memory (RSS), and host µs per step.

The stand-ins: each decision is a cache entry holding a real kernel source (the ``rowchunks``
family's, rendered for the request: the size an entry has), and its "kernel" is torch's own
product. So this measures the library's host-side bookkeeping, on any machine; the GPU memory
of installed kernels and their plan data is not in it.

    python benchmarks/bench_churn.py --out benchmarks/results/
    python benchmarks/bench_churn.py --patterns 300 --every 100 --out /tmp/churn.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import environment, results_path, rss_mb, tables, write_json_md  # noqa: E402

SCHEMA = "torch_sparserl.bench_churn/1"


def specializer_with_real_sources():
    """Decisions as the autotuner writes them (a rendered rowchunks source per key), made
    without a GPU."""
    from torch_sparserl.jit.cache import CacheEntry
    from torch_sparserl.specialize import families

    sources: dict = {}

    def specialize(key, crow, col, ncols):
        source = sources.get((key.op, key.dtype, key.n))
        if source is None:
            source = sources[(key.op, key.dtype, key.n)] = families.render(
                "rowchunks", None, op=key.op, dtype=key.dtype, n=key.n).source
        return CacheEntry(key, source, family="rowchunks", params={}, record={"runtime_us": 1.0},
                          reason="stand-in decision (bench_churn)")

    return specialize


def torch_installer(entry, crow, col, ncols):
    """The installed "kernel": torch's own product on the pattern."""
    import torch

    rows = crow.numel() - 1
    return lambda crow, col, val, X: torch.sparse.mm(
        torch.sparse_csr_tensor(crow, col, val, (rows, ncols), check_invariants=False), X)


def random_pattern(rng, rows: int, nnz: int):
    import numpy as np
    import scipy.sparse as sp

    r = rng.integers(0, rows, nnz)
    c = rng.integers(0, rows, nnz)
    return sp.csr_matrix((np.ones(nnz, dtype=np.float32), (r, c)), shape=(rows, rows))


def snapshot(step: int, started: float, cache, runtime, folder: Path) -> dict:
    import torch

    from torch_sparserl import pattern as patterns
    from torch_sparserl.jit import fastpath

    gc.collect()
    files = list(folder.iterdir())
    entries = [p for p in files if p.suffix == ".json"]
    return {"patterns": step, "seconds": time.perf_counter() - started, "rss_mb": rss_mb(),
            "cache_bytes": sum(p.stat().st_size for p in entries), "cache_entries": len(entries),
            "lock_files": sum(p.suffix == ".lock" for p in files),
            "memory_entries": len(cache._memory), "pattern_table": len(patterns._CACHE),
            "decision_table": len(runtime._decisions._patterns),
            "cxx_entries": int(torch.ops.sparserl_fastpath.entries()) if fastpath.loaded else None}


def run(args) -> dict:
    import numpy as np
    import torch

    import torch_sparserl as ts
    from torch_sparserl.config import JitOptions
    from torch_sparserl.jit import runtime as rt
    from torch_sparserl.jit.cache import KernelCache

    folder = Path(tempfile.mkdtemp(prefix="sparserl-churn-"))
    cache = KernelCache(folder, max_bytes=int(args.cache_max_mb * (1 << 20)))
    runtime = rt.Runtime(JitOptions(mode="sync", admit_calls=1), cache=cache,
                         specializer=specializer_with_real_sources(), installer=torch_installer, devices=("cpu",))
    previous = rt.set_active(runtime)
    rng = np.random.default_rng(0)
    X = torch.randn(args.rows, args.n)
    points = []
    try:
        # one pattern first: imports, the first decision's one-time costs, the allocator's pools
        A = ts.csr(random_pattern(rng, args.rows, args.nnz))
        A @ X
        del A
        gc.collect()
        rss0, started = rss_mb(), time.perf_counter()
        points.append(snapshot(0, started, cache, runtime, folder))
        for step in range(1, args.patterns + 1):
            A = ts.csr(random_pattern(rng, args.rows, args.nnz))
            A @ X
            del A
            if step % args.every == 0 or step == args.patterns:
                points.append(snapshot(step, started, cache, runtime, folder))
                print(f"{step} patterns: cache {points[-1]['cache_bytes'] / 2**20:.2f} MB in "
                      f"{points[-1]['cache_entries']} entries, RSS +{points[-1]['rss_mb'] - rss0:.1f} MB, "
                      f"pattern table {points[-1]['pattern_table']}", flush=True)
        stats = {k: v for k, v in runtime.stats.items() if isinstance(v, (int, float))}
        return {"rss0_mb": rss0, "points": points, "runtime": stats, "cache": dict(cache.stats),
                "cap_bytes": cache.max_bytes}
    finally:
        rt.set_active(previous)
        runtime.close()


def summary(doc: dict) -> dict:
    result = doc["result"]
    last = result["points"][-1]
    rates = [(b["seconds"] - a["seconds"]) / (b["patterns"] - a["patterns"]) * 1e6
             for a, b in zip(result["points"], result["points"][1:])]
    return {"patterns": last["patterns"], "cap_mb": result["cap_bytes"] / 2**20,
            "max_cache_mb": max(p["cache_bytes"] for p in result["points"]) / 2**20,
            "within_cap": all(p["cache_bytes"] <= result["cap_bytes"] for p in result["points"]),
            "rss_growth_mb": last["rss_mb"] - result["rss0_mb"],
            "max_pattern_table": max(p["pattern_table"] for p in result["points"]),
            "max_decision_table": max(p["decision_table"] for p in result["points"]),
            "evicted": result["cache"].get("evicted", 0),
            "us_per_pattern_first": rates[0] if rates else None, "us_per_pattern_last": rates[-1] if rates else None}


def markdown(doc: dict) -> str:
    s, setup = doc["summary"], doc["setup"]
    lines = [f"# {s['patterns']:,} distinct patterns through the library ({doc['env'].get('cpu') or 'CPU'})", "",
             f"Each step: a new random {setup['rows']:,}-row pattern with about {setup['nnz']:,} nonzeros, "
             f"`ts.csr`, one eager `A @ X` at N = {setup['n']}, the matrix dropped. Sync mode, `admit_calls=1`: "
             "every pattern is decided and writes a cache entry (a real rowchunks source); torch's product "
             "stands in for the kernels. Host-side state only: no GPU memory is measured.", "",
             f"- disk cache: at most {s['max_cache_mb']:.2f} MB against a cap of {s['cap_mb']:.2f} MB "
             f"({'within' if s['within_cap'] else 'OVER'} the cap at every checkpoint); {s['evicted']:,} entries "
             "evicted, least recently used first",
             f"- resident memory: {s['rss_growth_mb']:+.1f} MB over the run",
             f"- left behind by the dropped matrices, at every checkpoint: at most {s['max_pattern_table']} "
             f"patterns in the pattern table, {s['max_decision_table']} in the runtime's decision table", ""]
    if s["us_per_pattern_first"] is not None:
        lines += [f"- host time per step: {s['us_per_pattern_first']:.0f} µs over the first checkpoint's "
                  f"steps, {s['us_per_pattern_last']:.0f} µs over the last's", ""]
    lines += tables.header(["patterns", "s", "RSS MB", "cache MB", "entries", "lock files", "in-memory entries",
                            "pattern table", "decision table", "C++ entries"], "r" * 10)
    for p in doc["result"]["points"]:
        lines.append(tables.row([f"{p['patterns']:,}", f"{p['seconds']:.1f}", f"{p['rss_mb']:.1f}",
                                 f"{p['cache_bytes'] / 2**20:.2f}", p["cache_entries"], p["lock_files"],
                                 p["memory_entries"], p["pattern_table"], p["decision_table"],
                                 "–" if p["cxx_entries"] is None else p["cxx_entries"]]))
    lines += ["", tables.runs_line(doc["runs"])]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--patterns", type=int, default=10_000)
    parser.add_argument("--every", type=int, default=1000, help="patterns between checkpoints")
    parser.add_argument("--rows", type=int, default=2048)
    parser.add_argument("--nnz", type=int, default=8192)
    parser.add_argument("--n", type=int, default=32)
    parser.add_argument("--cache-max-mb", type=float, default=32.0)
    parser.add_argument("--out", default="benchmarks/results/", help="a .json file, or a folder for the default name")
    args = parser.parse_args(argv)
    if min(args.patterns, args.every, args.rows, args.nnz, args.n) < 1 or args.cache_max_mb <= 0:
        parser.error("--patterns, --every, --rows, --nnz and --n must be >= 1 and --cache-max-mb > 0")

    env = environment()
    doc = {"schema": SCHEMA, "env": env,
           "runs": [{"started": dt.datetime.now().isoformat(timespec="seconds"),
                     "command": " ".join(["python benchmarks/bench_churn.py"] + (argv if argv is not None
                                                                                  else sys.argv[1:]))}],
           "setup": {"patterns": args.patterns, "rows": args.rows, "nnz": args.nnz, "n": args.n,
                     "cache_max_mb": args.cache_max_mb},
           "result": run(args)}
    doc["summary"] = summary(doc)
    path = results_path(args.out, "churn", None, dt.date.today().isoformat())
    write_json_md(doc, path, markdown)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
