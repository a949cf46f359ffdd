"""Which cuSPARSE SpMM algorithm and output type sum half-precision products in float32, and at
what time: the probe behind the C++ fast path's half-type cuSPARSE calls (``csrc/fastpath.cpp``,
``VendorTypes``).

For one real matrix with its row 0 replaced by 4096 ones, float16 and bfloat16 values and
operands, and each of cuSPARSE's CSR SpMM algorithms (DEFAULT, CSR_ALG1, CSR_ALG2, CSR_ALG3) with
a half and a float32 output, all with a float32 compute type: the time per call (CUDA events,
30 calls after 5), the relative error ‖Y − Y_ref‖ / ‖Y_ref‖ against the same product in float32
on the widened operands, and row 0 of an all-ones product (4096 when the sums are float32 sums).
The program is plain CUDA (``probe_half_cusparse.cu``, built here with ``nvcc -lcusparse``).

    python benchmarks/probes/probe_half_cusparse.py --matrix dblp-2010 --ns 32,128 --out benchmarks/results/
"""

from __future__ import annotations

import argparse
import datetime as dt
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # benchmarks/: the common core

from common import known_matrices  # noqa: E402

ONES = 4096  # row 0's length: a float16 running sum stalls at 2048, a bfloat16 one at 256


def write_pattern(matrix: str, folder: Path) -> tuple[int, int, int]:
    """The matrix's pattern with row 0 made of ``ONES`` columns, as the raw files the program reads."""
    from torch_sparserl.data.datasets import load_matrix

    known = known_matrices()
    M = (known[matrix].load() if matrix in known else load_matrix(matrix)).tocsr()
    lengths = np.diff(M.indptr)
    lengths[0] = ONES
    indptr = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    indices = np.concatenate([np.arange(ONES), M.indices[M.indptr[1]:]]).astype(np.int32)
    np.array([M.shape[0], max(M.shape[1], ONES), indices.size], dtype=np.int64).tofile(folder / "meta.bin")
    indptr.tofile(folder / "indptr.bin")
    indices.tofile(folder / "indices.bin")
    return M.shape[0], max(M.shape[1], ONES), int(indices.size)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--matrix", default="dblp-2010", help="a real matrix's name, or a .npz/.mtx file")
    parser.add_argument("--ns", default="32,128", help="dense widths N, comma-separated")
    parser.add_argument("--out", default="benchmarks/results/", help="the folder of the result's .md")
    args = parser.parse_args(argv)
    if shutil.which("nvcc") is None:
        print("probe_half_cusparse: needs nvcc (and a GPU to run the program)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        rows, cols, nnz = write_pattern(args.matrix, folder)
        program = folder / "probe"
        subprocess.run(["nvcc", "-O2", "-arch=sm_90", "-o", str(program), str(HERE / "probe_half_cusparse.cu"),
                        "-lcusparse"], check=True)
        lines = []
        for n in args.ns.split(","):
            done = subprocess.run([str(program), n, str(folder)], capture_output=True, text=True, check=True)
            lines += done.stdout.splitlines()
    print("\n".join(lines))
    write_markdown(lines, args, rows, nnz)
    return 0


def write_markdown(lines: list[str], args, rows: int, nnz: int) -> None:
    gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                         text=True).stdout.strip().splitlines()[0]
    day = dt.date.today().isoformat()
    out = Path(args.out)
    out = out / f"half-cusparse-{gpu.split()[1].lower()}-{day}.md" if out.is_dir() or not out.suffix else out
    table = ["| dtype | N | algorithm | output | µs per call | rel. error | row of 4096 ones |", "|---|---:|---|---|---:|---:|---:|"]
    for line in lines:
        parts = line.split()
        if len(parts) == 10 and parts[5] == "us":  # "bf16 N=128 DEFAULT out=half 194.3 us rel_err 2.31e-03 row_of_4096_ones 4768"
            table.append(f"| {parts[0]} | {parts[1][2:]} | {parts[2]} | {parts[3][4:]} | {parts[4]} | {parts[7]} | {parts[9]} |")
    out.write_text(f"# cuSPARSE SpMM on half data: {gpu}, {day}\n\n`{args.matrix}` ({rows} rows, {nnz} nonzeros, "
                   f"row 0 replaced by {ONES} ones); float32 compute type throughout.\n\n" + "\n".join(table)
                   + f"\n\nCommand: `python benchmarks/probes/probe_half_cusparse.py --matrix {args.matrix} --ns {args.ns}`\n")
    print(out)


if __name__ == "__main__":
    sys.exit(main())
