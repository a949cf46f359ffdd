"""Class kernels: what one product of a young sampled subgraph costs, served three ways.

For each width N, the batches of a graph are sampled (``torch_sparserl.data.sampling``) and sent
to the GPU; a runtime with ``class_after=3`` meets the first patterns and decides their class in
the background (the search is timed, then waited for). Then, over every batch, per product:

* ``torch`` — ``torch.sparse.mm`` on a ``torch.sparse_csr`` tensor (cuSPARSE);
* ``young`` — ``ts.csr(...) @ X`` on a young pattern, class kernels off (the default): cuSPARSE,
  called from C++ without Python;
* ``class`` — the same with the class decided: its kernel serves.

Host µs per product: a loop over the batches with no synchronization inside, the best of
``--repeats``. GPU µs per product: the kernels' device time under ``torch.profiler``, summed
over a loop and divided by the products. Every ``class`` product is checked against ``torch``'s.

    python benchmarks/bench_classes.py --graph dblp-2010 --out benchmarks/results/
"""

from __future__ import annotations

import argparse
import datetime as dt
import re
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import environment, gpu_us, host_us, load_graph, results_path, tables, write_json_md  # noqa: E402
from common.gnn import PreparedBatch  # noqa: E402

SCHEMA = "torch_sparserl.bench_classes/1"
WAYS = ("torch", "young", "class")


def _per_product(products, fn):
    """A call of ``fn`` on every product's operands in turn (timed whole, divided by their count)."""
    def loop():
        for operands in products:
            fn(*operands)
    return loop


def measure(batches, n: int, repeats: int, budget_s: float) -> dict:
    """One width: the class's decision, then host and GPU µs per product of each way."""
    import torch

    import torch_sparserl as ts
    from torch_sparserl.config import JitOptions
    from torch_sparserl.jit import runtime as rt
    from torch_sparserl.jit.cache import KernelCache

    device = torch.device("cuda")
    classed = rt.Runtime(JitOptions(mode="background", admit_age_s=1e9, class_after=3, budget_s=budget_s),
                         cache=KernelCache(tempfile.mkdtemp(prefix="sparserl-classes-")))
    plain = rt.Runtime(JitOptions(mode="background", admit_age_s=1e9, class_after=0),
                       cache=KernelCache(tempfile.mkdtemp(prefix="sparserl-young-")))
    previous = rt.set_active(classed)
    try:
        products = [(torch.sparse_csr_tensor(*(t.to(device) for t in b.csr), (b.n, b.n)),
                     ts.csr(b.csr, (b.n, b.n), device=device), torch.randn(b.n, n, device=device)) for b in batches]
        for _, A, X in products[:3]:
            A @ X
        started = time.perf_counter()
        classed.wait(600)
        decided_s = time.perf_counter() - started
        classes = [{"class": key.pattern, "op": key.op, "n": key.n, "served_by": what}
                   for key, what in classed.classes()]
        ways = {"torch": lambda T, A, X: torch.sparse.mm(T, X), "class": lambda T, A, X: A @ X}
        out = {"n": n, "decision_wait_s": decided_s, "classes": classes, "host_us": {}, "gpu_us": {}}
        before = classed.stats["class_calls"]
        for way in ("torch", "class"):
            out["host_us"][way] = host_us(_per_product(products, ways[way]), calls=1, repeats=repeats) / len(products)
            out["gpu_us"][way] = gpu_us(_per_product(products, ways[way]), calls=1) / len(products)
        out["class_calls"] = classed.stats["class_calls"] - before
        out["max_abs_diff"] = max(float((A @ X - torch.sparse.mm(T, X)).abs().max()) for T, A, X in products)
        rt.set_active(plain)  # matrices staged under it: young in C++ (fastpath.young_ns)
        products = [(T, ts.csr(b.csr, (b.n, b.n), device=device), X) for (T, _, X), b in zip(products, batches)]
        out["host_us"]["young"] = host_us(_per_product(products, ways["class"]), calls=1, repeats=repeats) / len(products)
        out["gpu_us"]["young"] = gpu_us(_per_product(products, ways["class"]), calls=1) / len(products)
        out["young_calls"] = plain.stats["young_calls"]
        return out
    finally:
        rt.set_active(previous)
        classed.close()
        plain.close()


def markdown(doc: dict) -> str:
    setup = doc["setup"]
    lines = [f"# Class kernels: {setup['graph']} on {doc['env'].get('gpu')}", "",
             f"{setup['batches']} sampled subgraphs of {setup['batch_size']} seeds, fanouts {setup['fanouts']} "
             f"({setup['mean_rows']:.0f} rows, {setup['mean_nnz']:.0f} nonzeros on average), float32. Per product: "
             "host µs (a loop with no synchronization, the best of the repeats) and GPU µs (the kernels' device "
             "time under torch.profiler). `torch`: `torch.sparse.mm`; `young`: `ts.csr(...) @ X` with class "
             "kernels off (the default: cuSPARSE, called from C++ without Python); `class`: the same with the "
             "class's kernel.",
             "", *tables.header(["N", "host µs torch / young / class", "GPU µs torch / young / class",
                                 "class GPU speedup over torch", "class calls", "decision waited s", "max abs diff"],
                                "rllrrrr")]
    for r in doc["widths"]:
        h, g = r["host_us"], r["gpu_us"]
        lines.append(tables.row([r["n"], f"{h['torch']:.1f} / {h['young']:.1f} / {h['class']:.1f}",
                                 f"{g['torch']:.1f} / {g['young']:.1f} / {g['class']:.1f}",
                                 f"{g['torch'] / g['class']:.2f}×", r["class_calls"], f"{r['decision_wait_s']:.1f}",
                                 f"{r['max_abs_diff']:.1e}"]))
    lines += ["", "Classes decided:", ""]
    for r in doc["widths"]:
        lines += [f"- N={r['n']}: `{c['class']}` {c['op']} n={c['n']}: {c['served_by']}" for c in r["classes"]]
    lines += ["", tables.runs_line(doc["runs"])]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--graph", default="dblp-2010", help="a matrix name, a .npz path or a synthetic spec")
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--fanouts", default="10,5")
    parser.add_argument("--batches", type=int, default=40)
    parser.add_argument("--n", default="32,128", help="widths, comma-separated")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--budget-s", type=float, default=20.0, help="the class search's budget (jit.budget_s)")
    parser.add_argument("--out", default="benchmarks/results/", help="a .json file, or a folder for the default name")
    args = parser.parse_args(argv)

    import numpy as np
    import torch

    if not torch.cuda.is_available():
        parser.error("bench_classes measures GPU products: no CUDA device here")
    from torch_sparserl.data.sampling import neighbor_batches

    A = load_graph(args.graph)
    A = ((A + A.T) > 0).astype(np.float32).tocsr()
    fanouts = [int(f) for f in args.fanouts.split(",")]
    env = environment()
    slug = re.sub(r"[^a-z0-9]+", "-", args.graph.lower()).strip("-")
    path = results_path(args.out, f"classes-{slug}", env["gpu"], dt.date.today().isoformat())
    doc = {"schema": SCHEMA, "env": env,
           "runs": [{"started": dt.datetime.now().isoformat(timespec="seconds"),
                     "command": " ".join(["python benchmarks/bench_classes.py"]
                                         + (argv if argv is not None else sys.argv[1:]))}],
           "setup": {"graph": args.graph, "batch_size": args.batch_size, "fanouts": fanouts}, "widths": []}
    for i, n in enumerate(int(v) for v in args.n.split(",")):
        sampled = list(neighbor_batches(A, args.batch_size, fanouts, seed=i, limit=args.batches))
        doc["setup"].update(batches=len(sampled), mean_rows=float(np.mean([b.nodes.size for b in sampled])),
                            mean_nnz=float(np.mean([b.nnz for b in sampled])))
        batches = [PreparedBatch(b, "cuda") for b in sampled]
        doc["widths"].append(measure(batches, n, args.repeats, args.budget_s))
        print(f"N={n}: {doc['widths'][-1]['host_us']} host us, {doc['widths'][-1]['gpu_us']} GPU us", flush=True)
    write_json_md(doc, path, markdown)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
