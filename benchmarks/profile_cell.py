#!/usr/bin/env python3
"""Re-run one benchmark cell's best kernel and cuSPARSE, for a profiler (``ncu``) to read.

Takes the oracle's kernel for (matrix, op, n, dtype) from a results JSON of
``bench_kernels.py``, renders it again from its family and parameters, and launches it and
``torch.sparse.mm``/``mv`` ``--reps`` times each on the same data::

    ncu --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,\\
lts__t_sector_hit_rate.pct,dram__throughput.avg.pct_of_peak_sustained_elapsed \\
        python benchmarks/profile_cell.py RESULTS.json dblp-2010 spmv 1

ncu flushes the caches before each profiled launch (its default ``--cache-control all``),
the same cold-L2 condition as the benchmark's timing.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_kernels import known_matrices  # noqa: E402

from torch_sparserl import families  # noqa: E402
from torch_sparserl.build import load_kernel  # noqa: E402
from torch_sparserl.prepare import prepare  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", type=Path)
    parser.add_argument("matrix")
    parser.add_argument("op", choices=["spmv", "spmm"])
    parser.add_argument("n", type=int)
    parser.add_argument("--dtype", default="f32")
    parser.add_argument("--reps", type=int, default=2)
    args = parser.parse_args(argv)

    cells = json.loads(args.results.read_text())["cells"]
    cell = next((c for c in cells if (c["matrix"], c["op"], c["n"], c["dtype"])
                 == (args.matrix, args.op, args.n, args.dtype)), None)
    if cell is None or not cell.get("best"):
        parser.error(f"no cell with a best kernel for {args.matrix} {args.op} n={args.n} {args.dtype}")
    best = cell["best"]
    # JSON turned the tuple-valued parameters (binned edges and lanes) into lists.
    params = {k: tuple(v) if isinstance(v, list) else v for k, v in best["params"].items()}
    spec = families.render(best["family"], params, op=args.op, dtype=args.dtype, n=args.n)
    if spec.key != best["key"]:
        print(f"note: the re-rendered source differs from the benchmarked one ({spec.key} != {best['key']})")

    A = known_matrices()[args.matrix].load().tocsr()
    rowptr = torch.from_numpy(A.indptr.astype(np.int32)).cuda()
    col = torch.from_numpy(A.indices.astype(np.int32)).cuda()
    dtype = spec.plan.torch_dtype
    val = torch.randn(A.nnz, device="cuda").to(dtype)
    x_shape = (A.shape[1], args.n) if args.op == "spmm" else (A.shape[1],)
    y_shape = (A.shape[0], args.n) if args.op == "spmm" else (A.shape[0],)
    x = torch.randn(x_shape, device="cuda").to(dtype)
    y = torch.empty(y_shape, device="cuda", dtype=dtype)
    kernel = load_kernel(spec)
    prepared = prepare(spec.plan, rowptr, col, A.shape, args.n)
    csr = torch.sparse_csr_tensor(rowptr, col, val.float(), A.shape)
    out = torch.empty(y_shape, device="cuda")
    for _ in range(args.reps):
        kernel(rowptr, col, val, x, y, prepared)
        if args.op == "spmm":
            torch.addmm(out, csr, x.float(), beta=0, alpha=1, out=out)
        else:
            torch.addmv(out, csr, x.float(), beta=0, alpha=1, out=out)
    torch.cuda.synchronize()
    err = (y.float() - out).abs().max().item()
    print(f"{args.matrix} {args.op} n={args.n}: {spec.describe()} max |kernel - cuSPARSE| = {err:.3g}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
