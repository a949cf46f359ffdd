"""What the backend's eager interception of raw CSR products costs the products it leaves alone.

Once ``torch.compile`` names the sparserl backend, ``aten::addmm`` / ``mv`` / ``addmv`` on
sparse CSR tensors are overridden for the rest of the process (``torch_sparserl.tensor.intercept``).
Outside a sparserl-compiled model the override hands every product back to torch. This
times eager products on the shipped ``cora`` matrix, per call, three ways:

* ``absent``: the override not installed (a process that never named the backend);
* ``installed``: installed; the product goes on through torch's ``out=`` overload;
* ``installed, old delegate``: installed, handing back as before the fix: taking the override
  out and putting it back around each call.

    python benchmarks/bench_intercept.py --out benchmarks/results/intercept-cpu-<date>.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import command_line, environment, tables, wall_us, write_json_md  # noqa: E402

SCHEMA = "torch_sparserl.bench_intercept/1"
STATES = ("absent", "installed", "installed, old delegate")


def _old_delegate(name, *args, **kwargs):
    from torch_sparserl.tensor import intercept
    import torch

    with intercept._suspended():
        return getattr(torch.ops.aten, name).default(*args, **kwargs)


def measure(device_name: str, n: int, calls: int, repeats: int) -> list[dict]:
    import torch
    from torch_sparserl.data.datasets import load_matrix
    from torch_sparserl.tensor import intercept

    device = torch.device(device_name)
    M = load_matrix("cora")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "sparse CSR support is in beta"
        A = torch.sparse_csr_tensor(torch.from_numpy(M.indptr).long(), torch.from_numpy(M.indices).long(),
                                    torch.from_numpy(M.data).float(), M.shape).to(device)
    g = torch.Generator().manual_seed(0)
    X = torch.randn(M.shape[1], n, generator=g).to(device)
    x = X[:, 0].contiguous()
    b = torch.randn(M.shape[0], n, generator=g).to(device)
    products = {"torch.sparse.mm(A, X)": lambda: torch.sparse.mm(A, X), "A @ X": lambda: A @ X,
                "torch.addmm(B, A, X)": lambda: torch.addmm(b, A, X), "torch.mv(A, x)": lambda: torch.mv(A, x)}
    rows = []
    original = intercept._delegate
    try:
        for state in STATES:
            intercept.deactivate_backend()
            intercept._delegate = _old_delegate if state.endswith("old delegate") else original
            if state != "absent":
                intercept.activate_for_backend()
            for name, fn in products.items():
                rows.append({"device": device_name, "product": name, "state": state,
                             "us_per_call": round(wall_us(fn, calls=calls, repeats=repeats,
                                                          warmup=max(10, calls // 10), device=device), 2)})
                print(f"{device_name:5s} {name:22s} {state:24s} {rows[-1]['us_per_call']:9.1f} us", flush=True)
    finally:
        intercept._delegate = original
        intercept.deactivate_backend()
    return rows


def markdown(doc: dict) -> str:
    env = doc["env"]
    lines = [f"# Eager CSR products with the sparserl interception installed — {env.get('cpu')}", "",
             f"torch {env['torch']}; the shipped `cora` matrix ({doc['matrix']}), N={doc['n']}; microseconds per "
             f"call, median of {doc['repeats']} loops of {doc['calls']} calls (synchronized at the end of each loop "
             "on CUDA). *absent*: a process that never named the backend; *installed*: the override hands the "
             "product back through torch's `out=` overload; *old delegate*: it takes itself out and puts itself "
             "back around each call, as before the fix.", "",
             *tables.header(["device", "product", *STATES], "ll" + "r" * len(STATES))]
    keys = list(dict.fromkeys((r["device"], r["product"]) for r in doc["rows"]))
    for device, product in keys:
        cells = {r["state"]: r["us_per_call"] for r in doc["rows"] if (r["device"], r["product"]) == (device, product)}
        lines.append(tables.row([device, product, *(f"{cells.get(s, float('nan')):.1f}" for s in STATES)]))
    lines += ["", command_line(doc["command"], doc["started"])]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", default=None, help="default: cpu, and cuda when there is one")
    parser.add_argument("--n", type=int, default=16)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", required=True, help="a .json path (.md beside it)")
    args = parser.parse_args(argv)
    import torch
    from torch_sparserl.data.datasets import load_matrix

    devices = args.devices.split(",") if args.devices else ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    M = load_matrix("cora")
    doc = {"schema": SCHEMA, "env": environment(), "matrix": f"{M.shape[0]}×{M.shape[1]}, {M.nnz} nonzeros",
           "n": args.n, "calls": args.calls, "repeats": args.repeats,
           "started": dt.datetime.now().isoformat(timespec="seconds"),
           "command": " ".join(["python benchmarks/bench_intercept.py"] + (argv if argv is not None else sys.argv[1:])),
           "rows": [row for device in devices for row in measure(device, args.n, args.calls, args.repeats)]}
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_md(doc, path, markdown)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
