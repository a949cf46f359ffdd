#!/usr/bin/env python3
"""Label the synthetic training patterns with the exhaustive autotuner (the SFT teacher).

A thin front end of ``benchmarks/bench_kernels.py`` over :func:`training.data.synthetic_specs`
at the (op, n) cells of ``LABEL_NS``; the real training matrices were labelled by the kernel
benchmark (kept in ``training/labels/kernels-*-tables.jsonl``). Resumable in chunks::

    python training/label.py --out /tmp/labels --max-time-s 540     # again to resume
    cp /tmp/labels/*-tables.jsonl training/labels/

Exit status as bench_kernels: 0 done, 3 cells remain, 4 CUDA context broke (run again). A cell
any of whose evaluations found no free device memory (another process held it) is no label: it
is recorded ``transient``, leaves no rows in the tables, and runs again on the next call.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]

from training.data import LABEL_NS, synthetic_specs  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="label.py", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="results folder (resumes what is there)")
    parser.add_argument("--count", type=int, default=96, help="synthetic patterns (default 96)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--n", default=",".join(map(str, LABEL_NS)))
    parser.add_argument("--dtypes", default="f32")
    parser.add_argument("--budget-s", type=float, default=6.0, help="autotuner budget per cell")
    parser.add_argument("--max-time-s", type=float, default=540.0)
    parser.add_argument("--list", action="store_true")
    args = parser.parse_args(argv)
    import bench_kernels

    specs = synthetic_specs(args.count, args.seed)
    bench_argv = ["--matrices", ",".join(specs), "--n", args.n, "--dtypes", args.dtypes,
                  "--budget-s", str(args.budget_s), "--max-time-s", str(args.max_time_s),
                  "--out", str(args.out), "--no-progress"]
    args.out.mkdir(parents=True, exist_ok=True)
    if any(args.out.glob("kernels-*.json")):
        bench_argv.append("--resume")
    if args.list:
        bench_argv.append("--list")
    return bench_kernels.main(bench_argv)


if __name__ == "__main__":
    sys.exit(main())
