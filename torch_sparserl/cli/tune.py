"""``sparserl tune``: the kernel space searched for one matrix, on a GPU or by the compile tier."""

from __future__ import annotations

import argparse
import os

from .common import (_DTYPE_HELP, _DTYPE_METAVAR, _OP_HELP, DTYPES, MAX_N, CommandError, _columns, _count, _dtype,
                     _matrix, _note, _progress, _seconds)


def _families(text: str) -> list[str]:
    from ..specialize.families import FAMILIES

    names = [name.strip() for name in text.split(",")]
    unknown = [name for name in names if name not in FAMILIES]
    if unknown:
        raise argparse.ArgumentTypeError(f"expected comma-separated names among {', '.join(FAMILIES)} "
                                         f"(got {', '.join(map(repr, unknown))})")
    return names


def tune_command(args) -> int:
    """Search the kernel space for one matrix: on a GPU the exhaustive autotuner (candidates
    run in the sandbox, timed against cuSPARSE); without one, the compile tier with nvcc."""
    from concurrent.futures import ThreadPoolExecutor

    import torch

    from ..pattern.features import structural_features
    from ..specialize.autotune import candidates, tune

    from ..specialize.families import FAMILIES
    from ..toolchain import nvcc

    A = _matrix(args.matrix)
    n = 1 if args.op == "spmv" else args.n
    serving = [name for name, family in FAMILIES.items() if args.op in family.ops]
    if args.families and not set(args.families) <= set(serving):
        raise CommandError(f"--families: expected families that serve {args.op} ({', '.join(serving)}) "
                           f"(got {', '.join(f for f in args.families if f not in serving)})")
    on_gpu = torch.cuda.is_available() and not args.compile_only
    if not on_gpu and nvcc.nvcc_path() is None:
        raise CommandError(f"needs nvcc to compile the candidates {'(--compile-only)' if args.compile_only else 'without a GPU'}"
                           " (none in $CUDA_HOME/bin or on PATH): install the CUDA toolkit "
                           "(https://developer.nvidia.com/cuda-downloads), then put its bin/ on PATH or set CUDA_HOME")
    features = structural_features(A.indptr, A.indices, A.shape)
    print(f"matrix   {args.matrix}: {A.shape[0]} x {A.shape[1]}, {A.nnz} nonzeros, "
          f"row mean {features['row_mean']:.1f}, max {features['row_max']}, cv {features['row_cv']:.2f}")
    if on_gpu:
        _note(f"tune     screening the candidates on the GPU, each checked and timed in the sandbox "
              f"(within the {args.budget_s:g} s budget), then timing the finalists")
        result = tune(A, op=args.op, n=n, dtype=DTYPES[args.dtype], budget_s=args.budget_s,
                      families=args.families, progress=_progress("screening"))
        finals = sorted((r for r in result.table if r.timing.get("stage") == "final" and r.ok),
                        key=lambda r: r.runtime_us)
        for r in finals:
            print(f"final    {r.family:16s} {r.runtime_us:9.2f} us  cuSPARSE {r.cusparse_us:9.2f} us  "
                  f"{r.speedup:5.2f}x  {r.params}")
        failed = [r for r in result.table if not r.ok]
        print(f"result   {result.summary()}; {len(failed)} candidate(s) rejected")
        if result.best_spec is not None and args.show_source:
            print(result.best_spec.source)
        return 0 if result.best is not None else 1

    from ..evaluate.compile_tier import compile_only

    specs = candidates(args.op, n, DTYPES[args.dtype], features, args.families)
    print(f"note     no GPU{' (or --compile-only)' if torch.cuda.is_available() else ''}: compiling the "
          f"{len(specs)} candidates with nvcc for sm_90, not running them")
    workers = max(1, min(4, os.cpu_count() or 1))
    _note(f"compile  {len(specs)} candidates with nvcc, {workers} at a time (usually under a second each)")
    records = []
    with ThreadPoolExecutor(max_workers=workers) as pool:
        for spec, record in zip(specs, pool.map(compile_only, specs)):  # in order, each as soon as it is done
            records.append(record)
            status = "ok" if record.compiled and record.error_kind is None else str(record.error_kind)
            print(f"compile  {_count(len(records), len(specs))} {spec.describe():70s} {status:9s} "
                  f"regs={record.registers} spills={record.spill_bytes}")
    bad = [r for r in records if not r.compiled or r.error_kind is not None]
    print(f"result   {len(records) - len(bad)}/{len(records)} candidates compile cleanly")
    return 1 if bad else 0


def add_command(commands) -> None:
    """Add this command and its options to the command line's subcommands."""
    p = commands.add_parser("tune", help="search the kernel space for a matrix (GPU), or compile it (no GPU)",
                            description=(
        "Search the kernel space for one matrix. On a GPU: the exhaustive autotuner, each candidate run in a "
        "sandbox, checked against float64 and timed against cuSPARSE. Without one (or with --compile-only): each "
        "candidate compiled with nvcc for sm_90 and not run, which needs nvcc."))
    p.add_argument("matrix", help="shipped name or .npz/.mtx path")
    p.add_argument("--op", choices=["spmm", "spmv"], default="spmm", help=_OP_HELP)
    p.add_argument("--n", type=_columns, default=32, help=f"dense columns for spmm, 1 to {MAX_N} (default 32)")
    p.add_argument("--dtype", type=_dtype, default="float32", metavar=_DTYPE_METAVAR, help=_DTYPE_HELP)
    p.add_argument("--budget-s", type=_seconds, default=60.0, help="screening budget in seconds (default 60)")
    p.add_argument("--families", type=_families, help="comma-separated families to search (default: all)")
    p.add_argument("--compile-only", action="store_true", help="only the compile tier, even with a GPU")
    p.add_argument("--show-source", action="store_true", help="print the best kernel's source")
    p.set_defaults(run=tune_command)
