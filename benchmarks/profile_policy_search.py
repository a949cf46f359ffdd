"""The learned policy's search for one graph's products, alone in a fresh sandbox: every record.

For ``A`` (GCN-normalized, as ``bench_gnn`` builds it) at N=128 and 256 and for ``Aᵀ`` at
N=128: the policy's 4 samples, then each evaluation's stage, family, parameters, verdict,
error kind, time against cuSPARSE and log. Written to see why a search inside a training run
ended without a kernel (the run's decision string says only "no correct policy sample").

    OUT=/tmp python benchmarks/profile_policy_search.py rmat:scale=22,edge_factor=16
"""
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np
import torch

import bench_gnn as bench
from torch_sparserl.evaluate.sandbox import Sandbox
from torch_sparserl.policy import load_default
from torch_sparserl.policy.propose import policy_tune

OUT = Path(os.environ.get("OUT", "/tmp"))
t0 = time.time()
A = bench.normalized(bench.load_graph(sys.argv[1] if len(sys.argv) > 1 else "rmat:scale=22,edge_factor=16"), "gcn")
print("graph", A.shape, A.nnz, "rows max", np.diff(A.indptr).max(), f"{time.time()-t0:.1f}s", flush=True)
out = {}
box = Sandbox()
policy = load_default("cuda")
AT = A.T.tocsr()
AT.sort_indices()
for name, M in (("A", A), ("At", AT)):
    crow = torch.from_numpy(M.indptr.astype(np.int32))
    col = torch.from_numpy(M.indices.astype(np.int32))
    for n in (128, 256):
        if name == "At" and n == 256:
            continue
        t = time.time()
        result, proposals, records = policy_tune((crow, col, M.shape), op="spmm", n=n, dtype="f32", policy=policy,
                                                 k=4, sandbox=box)
        rows = []
        for r in result.table:
            rows.append({k: getattr(r, k) for k in ("family", "params", "compiled", "correct", "runtime_us", "cusparse_us",
                                                     "max_error", "trials", "registers", "elapsed_s")}
                        | {"error_kind": str(r.error_kind), "log": r.log[:1500], "stage": r.timing.get("stage")})
        out[f"{name} n={n}"] = {"best": result.best.family if result.best else None, "s": time.time() - t,
                                "proposals": [(p.spec.family if p.spec else None, p.error) for p in proposals],
                                "records": rows}
        print(json.dumps(out[f"{name} n={n}"], indent=1, default=str)[:6000], flush=True)
box.close()
(OUT / "policy-search.json").write_text(json.dumps(out, indent=1, default=str))
