"""Probe (tried, not adopted): the SpMM kernel space on a matrix in its natural row order and
in reverse Cuthill-McKee order, as an upper bound of what a locality row order could give.

Issue 37's lever for large N: rows that share columns, run together, would find their rows of
X in L1. The probe relabels a copy of the pattern (rows in RCM order of A + Aᵀ), so every
family runs unchanged on it, with no indirection: what a kernel reading a permutation would
gain at most. Each candidate of the default space is checked against the float64 product and
timed as the harness times kernels (L2 flushed before each run, median), the natural order's
cuSPARSE (``torch.addmm``) beside it::

    python benchmarks/probes/probe_row_order.py ca-HepPh,pubmed --ns 64,128,256 --out row-order.json

Needs a CUDA GPU; matrices are named as the benchmarks name them (``common.known_matrices``; square ones).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the common core

from common import kernel_us, known_matrices  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("matrices", help="comma-separated names of known square matrices")
    parser.add_argument("--ns", default="64,128,256", help="dense columns, comma-separated")
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--out", type=Path, help="write the timings as JSON here")
    args = parser.parse_args(argv)

    import numpy as np
    import torch
    from scipy.sparse.csgraph import reverse_cuthill_mckee

    if not torch.cuda.is_available():
        parser.error("probe_row_order launches GPU kernels: no CUDA device here")
    from torch_sparserl.abi.prepare import prepare
    from torch_sparserl.pattern.features import structural_features
    from torch_sparserl.specialize.autotune import candidates
    from torch_sparserl.toolchain import load_kernel

    entries = known_matrices()
    names = args.matrices.split(",")
    unknown = [m for m in names if m not in entries]
    if unknown:
        parser.error(f"unknown matrices: {', '.join(unknown)}")
    ns = [int(v) for v in args.ns.split(",")]
    def median_us(fn):  # the evaluator's timing: L2 flushed and the GPU kept busy before each run
        return kernel_us(fn, args.reps, warmup=2)

    def best_of_space(M, x, n):
        """(µs, kernel) of the fastest correct candidate, and each family's best µs."""
        rowptr = torch.from_numpy(M.indptr.astype(np.int32)).cuda()
        col = torch.from_numpy(M.indices.astype(np.int32)).cuda()
        val = torch.randn(M.nnz, device="cuda")
        ref = torch.sparse_csr_tensor(rowptr.long(), col.long(), val.double(), M.shape) @ x.double()
        scale = max(1.0, float(ref.abs().max()))
        y = torch.empty(M.shape[0], n, device="cuda")
        best, per_family = None, {}
        for spec in candidates("spmm", n, "f32", structural_features(M.indptr, M.indices, M.shape)):
            kernel, prepared = load_kernel(spec), prepare(spec.plan, rowptr, col, M.shape, n)
            run = lambda: kernel(rowptr, col, val, x, y, prepared)  # noqa: E731
            y.fill_(float("nan"))
            run()
            torch.cuda.synchronize()
            if not float((y.double() - ref).abs().max()) / scale < 1e-4:
                continue  # NaN (unwritten) or wrong: not a candidate
            us = median_us(run)
            family = spec.describe().split("(")[0]
            per_family[family] = min(per_family.get(family, math.inf), us)
            if best is None or us < best[0]:
                best = (us, spec.describe())
        return best, per_family, (rowptr, col, val)

    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "command": sys.argv, "cells": []}
    for name in names:
        A = entries[name].load().tocsr()
        A.sort_indices()
        if A.shape[0] != A.shape[1]:
            parser.error(f"{name}: RCM needs a square pattern (got {A.shape})")
        order = reverse_cuthill_mckee((A + A.T).tocsr(), symmetric_mode=True)
        R = A[order].tocsr()
        R.sort_indices()
        for n in ns:
            x = torch.randn(A.shape[1], n, device="cuda")
            natural, natural_families, (rowptr, col, val) = best_of_space(A, x, n)
            csr = torch.sparse_csr_tensor(rowptr, col, val, A.shape)
            out = torch.empty(A.shape[0], n, device="cuda")
            cusparse = median_us(lambda: torch.addmm(out, csr, x, beta=0, alpha=1, out=out))
            rcm, rcm_families, _ = best_of_space(R, x, n)
            cell = {"matrix": name, "n": n, "nnz": A.nnz, "cusparse_us": cusparse,
                    "natural": {"us": natural[0], "kernel": natural[1], "families": natural_families},
                    "rcm": {"us": rcm[0], "kernel": rcm[1], "families": rcm_families}}
            results["cells"].append(cell)
            print(f"{name:20s} n={n:3d} cuSPARSE {cusparse:7.1f} us | natural {natural[0]:7.1f} us "
                  f"({cusparse / natural[0]:.2f}x) | rcm {rcm[0]:7.1f} us ({cusparse / rcm[0]:.2f}x) | "
                  f"natural / rcm {natural[0] / rcm[0]:.2f}", flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
