"""The learned policy's search for one graph's products, alone in a fresh sandbox: every record.

For ``A`` (GCN-normalized, as ``bench_gnn`` builds it) at N=128 and 256 and for ``Aᵀ`` at
N=128: the policy's 4 samples, then each evaluation's stage, family, parameters, verdict,
error kind, time against cuSPARSE and log. Written to see why a search inside a training run
ended without a kernel (its decision then said only "no correct policy sample"; it now names
the kinds of its failures).

    OUT=/tmp python benchmarks/profile_policy_search.py rmat:scale=22,edge_factor=16

With ``--autotune-n N --budget-s S`` it then runs the exhaustive autotuner on ``A`` at that N
for S seconds in the same sandbox: whether the kernel space holds a kernel that beats
cuSPARSE where the policy's samples do not.
"""
import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np
import torch

import bench_gnn as bench
from torch_sparserl.autotune import tune
from torch_sparserl.evaluate.sandbox import Sandbox
from torch_sparserl.policy import load_default
from torch_sparserl.policy.propose import policy_tune

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("graph", nargs="?", default="rmat:scale=22,edge_factor=16")
parser.add_argument("--autotune-n", type=int, help="also autotune A @ X at this N")
parser.add_argument("--budget-s", type=float, default=120.0)
parser.add_argument("--skip-policy", action="store_true")
args = parser.parse_args()
OUT = Path(os.environ.get("OUT", "/tmp"))
t0 = time.time()
A = bench.normalized(bench.load_graph(args.graph), "gcn")
print("graph", A.shape, A.nnz, "rows max", np.diff(A.indptr).max(), f"{time.time()-t0:.1f}s", flush=True)
out = {}
box = Sandbox()
if not args.skip_policy:
    policy = load_default("cuda")
    AT = A.T.tocsr()
    AT.sort_indices()
FIELDS = ("family", "params", "compiled", "correct", "runtime_us", "cusparse_us", "max_error", "trials", "registers",
          "elapsed_s")


def rows_of(table):
    return [{k: getattr(r, k) for k in FIELDS} | {"error_kind": str(r.error_kind), "log": r.log[:1500],
                                                  "stage": r.timing.get("stage")} for r in table]


for name, M in (() if args.skip_policy else (("A", A), ("At", AT))):
    crow = torch.from_numpy(M.indptr.astype(np.int32))
    col = torch.from_numpy(M.indices.astype(np.int32))
    for n in (128, 256):
        if name == "At" and n == 256:
            continue
        t = time.time()
        result, proposals, records = policy_tune((crow, col, M.shape), op="spmm", n=n, dtype="f32", policy=policy,
                                                 k=4, sandbox=box)
        rows = rows_of(result.table)
        out[f"{name} n={n}"] = {"best": result.best.family if result.best else None, "s": time.time() - t,
                                "proposals": [(p.spec.family if p.spec else None, p.error) for p in proposals],
                                "records": rows}
        print(json.dumps(out[f"{name} n={n}"], indent=1, default=str)[:6000], flush=True)
if args.autotune_n:
    crow = torch.from_numpy(A.indptr.astype(np.int32))
    col = torch.from_numpy(A.indices.astype(np.int32))
    t = time.time()
    result = tune((crow, col, A.shape), op="spmm", n=args.autotune_n, dtype="f32", budget_s=args.budget_s, sandbox=box)
    ranked = sorted(rows_of(result.table), key=lambda r: r["runtime_us"] or float("inf"))
    out[f"autotune A n={args.autotune_n}"] = {
        "best": result.best.family if result.best else None, "best_speedup": result.speedup, "s": time.time() - t,
        "screened": result.screened, "candidates": result.candidates, "budget_exhausted": result.budget_exhausted,
        "cusparse_us": result.cusparse_us, "records": ranked}
    print(json.dumps({k: v for k, v in out[f"autotune A n={args.autotune_n}"].items() if k != "records"}, default=str),
          [(r["family"], r["params"], r["runtime_us"], r["stage"], r["error_kind"]) for r in ranked[:12]], flush=True)
box.close()
(OUT / "policy-search.json").write_text(json.dumps(out, indent=1, default=str))
