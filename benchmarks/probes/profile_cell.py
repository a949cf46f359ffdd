"""Re-run one kernel-benchmark cell's best kernel and cuSPARSE once each, for ``ncu`` to read.

Takes the oracle's kernel for (matrix, op, n, f32) from a ``bench_kernels.py`` results JSON,
renders it again from its family and parameters, and launches it and ``torch.addmm`` /
``torch.addmv`` (cuSPARSE) on the same random operands; prints the largest difference::

    ncu --clock-control none --csv --metrics gpu__time_duration.sum,dram__bytes_read.sum,\\
dram__bytes_write.sum,lts__t_sector_hit_rate.pct,dram__throughput.avg.pct_of_peak_sustained_elapsed,\\
l1tex__t_sector_hit_rate.pct,sm__warps_active.avg.pct_of_peak_sustained_active,\\
lts__t_sectors_srcunit_tex_op_read.sum \\
        python benchmarks/probes/profile_cell.py benchmarks/results/kernels-h100-80gb-hbm3-2026-11-26.json \\
        rmat-s20-ef16 spmm 256

ncu flushes the caches before each profiled launch (its default ``--cache-control all``), the
cold-L2 condition of the benchmark's timing.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the common core

from common import known_matrices  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", type=Path, help="a bench_kernels results JSON")
    parser.add_argument("matrix")
    parser.add_argument("op", choices=("spmv", "spmm"))
    parser.add_argument("n", type=int)
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--family", help="profile this family instead of the cell's oracle (with --params)")
    parser.add_argument("--params", default="{}", help="the family's parameters as JSON (with --family)")
    args = parser.parse_args(argv)

    import numpy as np
    import torch

    if not torch.cuda.is_available():
        parser.error("profile_cell launches GPU kernels: no CUDA device here")
    from torch_sparserl.abi.prepare import prepare
    from torch_sparserl.specialize import families
    from torch_sparserl.toolchain import load_kernel

    cells = json.loads(args.results.read_text())["cells"]
    cell = next((c for c in cells if (c["matrix"], c["op"], c["n"], c["dtype"]) == (args.matrix, args.op, args.n, "f32")
                 and c.get("best")), None)
    if cell is None:
        parser.error(f"{args.results}: no f32 cell with a best kernel for {args.matrix} {args.op} n={args.n}")
    best = cell["best"]
    family, params = best["family"], best["params"]
    if args.family:
        try:
            family, params = args.family, json.loads(args.params)
        except json.JSONDecodeError as exc:
            parser.error(f"--params: expected a JSON object, got {args.params!r} ({exc})")
        if not isinstance(params, dict):
            parser.error(f"--params: expected a JSON object, got {args.params!r}")
    params = {k: tuple(v) if isinstance(v, list) else v for k, v in params.items()}  # JSON made lists
    try:
        spec = families.render(family, params, op=args.op, dtype="f32", n=args.n)
    except ValueError as exc:
        parser.error(str(exc))
    A = known_matrices()[args.matrix].load().tocsr()
    rowptr = torch.from_numpy(A.indptr.astype(np.int32)).cuda()
    col = torch.from_numpy(A.indices.astype(np.int32)).cuda()
    val = torch.randn(A.nnz, device="cuda")
    x = torch.randn((A.shape[1], args.n) if args.op == "spmm" else (A.shape[1],), device="cuda")
    shape = (A.shape[0], args.n) if args.op == "spmm" else (A.shape[0],)
    y, out = torch.empty(shape, device="cuda"), torch.empty(shape, device="cuda")
    kernel, prepared = load_kernel(spec), prepare(spec.plan, rowptr, col, A.shape, args.n)
    csr = torch.sparse_csr_tensor(rowptr, col, val, A.shape)
    vendor = torch.addmm if args.op == "spmm" else torch.addmv
    for _ in range(args.reps):
        kernel(rowptr, col, val, x, y, prepared)
        vendor(out, csr, x, beta=0, alpha=1, out=out)
    torch.cuda.synchronize()
    print(f"{args.matrix} {args.op} n={args.n}: {spec.describe()}, max |kernel - cuSPARSE| = "
          f"{float((y - out).abs().max()):.3g}, X {x.numel() * 4 / 1e6:.0f} MB, nnz {A.nnz}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
