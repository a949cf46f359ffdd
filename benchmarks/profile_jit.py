#!/usr/bin/env python3
"""Where the JIT time of one graph goes: each key specialized cold, then installed from a warm cache.

For each product a GNN on ``--graph`` asks for (``A @ X`` and, with ``--transpose``, the
backward's ``Aᵀ @ dY``, for every ``--n``), a fresh runtime in sync mode with an empty kernel
cache decides the kernel under ``cProfile``; then another fresh runtime reading the same cache
folder installs it again (what the next training run on this graph pays). Printed per key:
the total, the parent's most expensive functions, and each candidate's stages in the sandbox
(``compiled``, ``prepared``, ``correct``, ``timed``: ``EvalRecord.timing["stages_s"]``).

    python benchmarks/profile_jit.py --graph rmat:scale=22,edge_factor=8 --n 128,16 --transpose \\
        --out /tmp/jit.json
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _top(profile: cProfile.Profile, limit: int) -> list[dict]:
    """The parent's functions with the most cumulative time, outside the profiler's own frames."""
    stats = pstats.Stats(profile)
    rows = []
    for (file, line, name), (_, calls, _, cum, _) in stats.stats.items():  # type: ignore[attr-defined]
        if "cProfile" in file or name.startswith("<"):
            continue
        rows.append({"function": f"{Path(file).name}:{line}:{name}", "calls": calls, "cum_s": round(cum, 3)})
    return sorted(rows, key=lambda r: -r["cum_s"])[:limit]


def profile_key(label, op, n, A, policy, cache_root, top) -> dict:
    import torch
    import torch_sparserl.policy.propose as propose
    from torch_sparserl import runtime as rt
    from torch_sparserl.cache import KernelCache
    from torch_sparserl.pattern import lookup

    crow, col = A.crow, A.col
    pattern = lookup(crow, col, A.shape[1])
    if label == "At":
        pattern, crow, col, _ = pattern.transpose(crow, col)
    tables = []
    original = propose.policy_tune

    def captured(*args, **kwargs):
        result = original(*args, **kwargs)
        tables.append(result[0])
        return result

    import torch_sparserl.autotune as autotune
    original_tune = autotune.tune

    def captured_tune(*args, **kwargs):
        result = original_tune(*args, **kwargs)
        tables.append(result)
        return result

    folder = Path(cache_root) / f"{label}-{op}-{n}"
    out = {"pattern": label, "op": op, "n": n}
    propose.policy_tune, autotune.tune = captured, captured_tune
    try:
        runtime = rt.Runtime(rt.RuntimeSettings(mode="sync", policy=policy), cache=KernelCache(folder))
        prewarm = runtime.prewarm(col.device)
        out["prewarm_s"] = prewarm
        profile = cProfile.Profile()
        started = time.perf_counter()
        profile.enable()
        state = runtime.prespecialize(op, pattern, crow, col, n, torch.float32)
        profile.disable()
        out["cold_s"] = round(time.perf_counter() - started, 3)
        out["decision"] = runtime.describe(state)
        out["parent_top"] = _top(profile, top)
        runtime.close()
    finally:
        propose.policy_tune, autotune.tune = original, original_tune
    out["candidates"] = [{"family": r.family, "stage": r.timing.get("stage"), "ok": r.ok,
                          "error": (r.error_kind.value if r.error_kind else None),
                          "elapsed_s": r.elapsed_s, "sandbox_s": r.timing.get("sandbox_s"),
                          "generate_s": r.timing.get("generate_s"), "stages_s": r.timing.get("stages_s"),
                          "runtime_us": r.runtime_us, "cusparse_us": r.cusparse_us}
                         for result in tables for r in result.table]
    # The next process on this graph: a fresh runtime, the same cache folder.
    warm = rt.Runtime(rt.RuntimeSettings(mode="sync", policy=policy), cache=KernelCache(folder))
    started = time.perf_counter()
    state = warm.prespecialize(op, pattern, crow, col, n, torch.float32)
    torch.cuda.synchronize()
    out["warm_s"] = round(time.perf_counter() - started, 3)
    out["warm_decision"] = warm.describe(state)
    warm.close()
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--graph", default="rmat:scale=22,edge_factor=8")
    parser.add_argument("--model", default="gcn", choices=["gcn", "sage"])
    parser.add_argument("--n", default="128,16")
    parser.add_argument("--transpose", action="store_true", help="also the transposed pattern (the backward)")
    parser.add_argument("--policy", default="learned", choices=["learned", "autotune"])
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)

    import numpy as np
    import torch
    import torch_sparserl as ts
    from bench_gnn import load_graph, normalized

    device = torch.device("cuda")
    started = time.perf_counter()
    M = normalized(load_graph(args.graph), args.model)
    A = ts.csr((torch.from_numpy(M.indptr.astype(np.int32)).to(device),
                torch.from_numpy(M.indices.astype(np.int32)).to(device),
                torch.from_numpy(M.data).to(device)), shape=M.shape)
    doc = {"graph": args.graph, "rows": M.shape[0], "nnz": int(M.nnz), "load_s": round(time.perf_counter() - started, 1),
           "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "keys": []}
    print(f"{args.graph}: {M.shape[0]:,} rows, {M.nnz:,} nnz, loaded in {doc['load_s']} s", flush=True)
    labels = ["A", "At"] if args.transpose else ["A"]
    with tempfile.TemporaryDirectory(prefix="sparserl-jit-") as cache_root:
        for label in labels:
            for n in (int(v) for v in args.n.split(",")):
                op = "spmv" if n == 1 else "spmm"
                key = profile_key(label, op, n, A, args.policy, cache_root, args.top)
                doc["keys"].append(key)
                print(f"\n== {label} {op} n={n}: cold {key['cold_s']} s, warm {key['warm_s']} s; {key['decision']}")
                for c in key["candidates"]:
                    print(f"   {c['stage']:<6} {c['family']:<18} ok={c['ok']!s:<5} elapsed {c['elapsed_s'] or 0:7.2f} s "
                          f"sandbox {c['sandbox_s'] or 0:7.2f} s stages {c['stages_s']}")
                for row in key["parent_top"]:
                    print(f"   {row['cum_s']:9.3f} s {row['calls']:>7}  {row['function']}")
                if args.out:
                    args.out.write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
