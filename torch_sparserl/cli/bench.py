"""``sparserl bench``: the runtime end to end on a GPU against ``torch.sparse.mm``."""

from __future__ import annotations

import argparse
import json
import os

from .common import (_DTYPE_HELP, _DTYPE_METAVAR, _OP_HELP, MAX_N, CommandError, _columns, _dtype, _matrix, _note,
                     _seconds)


def _output_file(text: str) -> str:
    parent = os.path.dirname(text) or "."
    if os.path.isdir(text) or not os.path.isdir(parent):
        raise argparse.ArgumentTypeError(f"expected a file to write in an existing folder (got {text!r})")
    return text


def bench_command(args) -> int:
    """The runtime end to end on a GPU: cold specialization, correctness, and the time per call
    of ``A @ X`` against ``torch.sparse.mm``, dispatch included."""
    import torch

    from ..dtypes import VALUE_DTYPES
    from ..jit import runtime as rt
    from . import measure

    matrices = {name: _matrix(name) for name in args.matrices}  # every name checked before any work
    if not torch.cuda.is_available():
        raise CommandError("needs a CUDA GPU (the runtime specializes CUDA kernels); "
                           "`sparserl tune MATRIX` compiles the kernel space without one")
    dtype = {str(d).replace("torch.", ""): d for d in VALUE_DTYPES}[args.dtype]
    runtime = rt.configure(mode="sync", budget_s=args.budget_s)
    n = 1 if args.op == "spmv" else args.n
    rows, failures = [], 0
    for name in args.matrices:
        _note(f"bench    {name}: specializing {args.op} (within the {args.budget_s:g} s budget), then timing it")
        result = {"matrix": name, **measure.product(matrices[name], args.op, n, dtype, runtime=runtime)}
        rows.append(result)
        failures += not result["correct"]
        print(f"{name:24s} {args.op} n={n:<4d} cold {result['cold_s']:6.1f} s  A@X {result['hot_us']:9.1f} us  "
              f"torch.sparse {result['torch_sparse_us']:9.1f} us  {result['speedup']:5.2f}x  "
              f"{'ok' if result['correct'] else 'WRONG'}  {result['decision']}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, handle, indent=1)
    return 1 if failures else 0


def add_command(commands) -> None:
    """Add this command and its options to the command line's subcommands."""
    p = commands.add_parser("bench", help="the runtime end to end against torch.sparse.mm (GPU)", description=(
        "Needs a CUDA GPU. For each matrix: the first A @ X with its specialization (cold start), the result "
        "against float64, and the time per call of A @ X against torch.sparse.mm, dispatch included."))
    p.add_argument("matrices", nargs="+", help="shipped names or .npz/.mtx paths")
    p.add_argument("--op", choices=["spmm", "spmv"], default="spmm", help=_OP_HELP)
    p.add_argument("--n", type=_columns, default=32, help=f"dense columns for spmm, 1 to {MAX_N} (default 32)")
    p.add_argument("--dtype", type=_dtype, default="float32", metavar=_DTYPE_METAVAR, help=_DTYPE_HELP)
    p.add_argument("--budget-s", type=_seconds, default=20.0, help="autotuning budget per product (default 20)")
    p.add_argument("--json", type=_output_file, help="write the results to this file")
    p.set_defaults(run=bench_command)
