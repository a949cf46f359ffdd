"""CPU products: the operators (torch's sparse kernels) against torch.sparse and the reference.

On the CPU no specialized kernel runs: ``A @ X`` on a ``CSRMatrix`` goes through the
``sparserl`` operator to torch's own CSR kernels (MKL's or torch's, ``kernels/vendor.py``).
This times, per matrix, dtype and N, the median of ``--repeats`` calls of:

* ``operator`` — ``A @ X`` on the ``CSRMatrix`` (the operator, its checks and the kernel);
* ``torch``    — ``torch.sparse.mm`` on a torch CSR tensor with the same int32 indices;
* ``reference``— the gather and ``index_add_`` of ``kernels/reference.py``, which served CPU
  products before (it stays as the float64 reference of the runtime's checks);

and SDDMM (N=64) through the vendor and the reference kernels.

    python benchmarks/bench_cpu.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import command_line, cpu_model, fmt, select_matrices, tables, wall_us  # noqa: E402

MATRICES = ["cora", "pubmed", "dblp-2010", "fb100_Cornell5"]


def _median_ms(fn, repeats: int) -> float:
    """Wall milliseconds of one call of ``fn``: the median of ``repeats`` calls after one untimed."""
    return wall_us(fn, repeats=repeats) / 1e3


def run(matrices, dtypes, ns, repeats: int) -> list[dict]:
    import torch
    import torch_sparserl as ts
    from torch_sparserl import pattern as patterns
    from torch_sparserl.kernels import reference, vendor

    rows = []
    for entry in select_matrices(matrices):
        M = entry.load().tocsr()
        for name in dtypes:
            dtype = getattr(torch, name)
            A = ts.csr(M, dtype=dtype)
            pattern = patterns.lookup(A.crow, A.col, A.shape[1])
            torch_csr = torch.sparse_csr_tensor(A.crow, A.col, A.val, tuple(A.shape))
            for n in ns:
                X = torch.randn(A.shape[1], n, dtype=dtype)
                row = {"matrix": entry.name, "nnz": int(M.nnz), "dtype": name, "op": "spmm", "n": n,
                       "operator_ms": _median_ms(lambda: A @ X, repeats),
                       "torch_ms": _median_ms(lambda: torch.sparse.mm(torch_csr, X), repeats)
                       if dtype in (torch.float32, torch.float64) else None,
                       "reference_ms": _median_ms(lambda: reference.spmm(pattern, A.crow, A.col, A.val, X), repeats)}
                rows.append(row)
                print(_line(row), flush=True)
            if dtype in (torch.float32, torch.float64):
                Y, X = torch.randn(A.shape[0], 64, dtype=dtype), torch.randn(A.shape[1], 64, dtype=dtype)
                row = {"matrix": entry.name, "nnz": int(M.nnz), "dtype": name, "op": "sddmm", "n": 64,
                       "operator_ms": _median_ms(lambda: vendor.sddmm(pattern, A.crow, A.col, Y, X), repeats),
                       "torch_ms": None,
                       "reference_ms": _median_ms(lambda: reference.sddmm(pattern, A.crow, A.col, Y, X), repeats)}
                rows.append(row)
                print(_line(row), flush=True)
    return rows


def _line(row: dict) -> str:
    return (f"{row['matrix']:16s} {row['dtype']:9s} {row['op']} n={row['n']:3d}: operator {row['operator_ms']:8.2f} ms, "
            f"torch {fmt(row['torch_ms'])} ms, reference {row['reference_ms']:8.2f} ms")


def markdown(doc: dict) -> str:
    env = doc["env"]
    lines = [f"# CPU products — {env['cpu']} ({env['threads']} threads)", "",
             f"torch {env['torch']}. Median of {doc['repeats']} calls each. *operator*: `A @ X` on a CSRMatrix "
             "(torch's sparse kernels behind the sparserl operator; for SDDMM the vendor kernel alone); "
             "*torch*: `torch.sparse.mm` on a torch CSR tensor with the same int32 indices; *reference*: the "
             "gather and `index_add_` that served CPU products before.", "",
             *tables.header(["matrix", "nnz", "dtype", "op", "N", "operator ms", "torch ms", "reference ms",
                             "operator vs torch", "reference / operator"], "lrllrrrrrr")]
    for r in doc["rows"]:
        vs_torch = r["torch_ms"] / r["operator_ms"] if r["torch_ms"] else None
        lines.append(tables.row([r["matrix"], f"{r['nnz']:,}", r["dtype"], r["op"], r["n"], f"{r['operator_ms']:.2f}",
                                 fmt(r["torch_ms"]), f"{r['reference_ms']:.2f}", fmt(vs_torch, ".2f", "×"),
                                 f"{r['reference_ms'] / r['operator_ms']:.2f}×"]))
    lines += ["", command_line(doc["command"], doc["date"], label=None), ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--matrices", default=",".join(MATRICES))
    parser.add_argument("--dtypes", default="float32,float64,bfloat16")
    parser.add_argument("--n", default="1,128")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--out", default="benchmarks/results", help="folder (a dated file in it) or a .json path")
    args = parser.parse_args(argv)
    import torch

    warnings.simplefilter("ignore", UserWarning)  # torch's "sparse CSR support is in beta" notes
    rows = run(args.matrices.split(","), args.dtypes.split(","), [int(n) for n in args.n.split(",")], args.repeats)
    env = {"torch": torch.__version__, "cpu": cpu_model() or platform.machine(),
           "threads": torch.get_num_threads(), "python": platform.python_version()}
    doc = {"schema": "torch_sparserl.bench_cpu/1", "env": env, "repeats": args.repeats, "rows": rows,
           "date": dt.datetime.now().isoformat(timespec="seconds"),
           "command": " ".join(["python benchmarks/bench_cpu.py"] + (argv if argv is not None else sys.argv[1:]))}
    out = Path(args.out)
    path = out if out.suffix == ".json" else out / f"cpu-products-{dt.date.today().isoformat()}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1))
    path.with_suffix(".md").write_text(markdown(doc))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
