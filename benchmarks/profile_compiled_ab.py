"""A/B of the compiled product's CPU trims, interleaved round by round (pubmed, N=128, CUDA by default).

One training step of ``mean(square(product(x)))``, forward + backward, compiled with the
sparserl backend, the product on the matrix's parts (``torch.ops.sparserl.spmm``) or on a
CSRMatrix (``A @ x``), in these configurations: the post-grad pass's retargeting to the
operators' implementation-only twins (``options={"direct_ops": ...}``) on or off, the
transposed values kept across steps (``Pattern.transposed_values``) or gathered every step,
and, for the CSRMatrix, the matrix handed to AOTAutograd as its parts or as the subclass
(``options={"flatten_matrices": ...}``; all the other trims on). Every configuration runs
once per round, in turn, so that the machine's drift falls on all alike; the median round is
kept. Writes ``$OUT/compiled-ab.json``. ``--flatten-only`` runs just the parts form and the
CSRMatrix flattened and as the subclass (all other trims on), ``--rounds`` sets the rounds.

    OUT=/tmp python benchmarks/profile_compiled_ab.py
    OUT=/tmp python benchmarks/profile_compiled_ab.py --flatten-only --rounds 31
    OUT=/tmp python benchmarks/profile_compiled_ab.py --flatten-only --device cpu --graph rmat:scale=6
"""
import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402

import bench_gnn as bench  # noqa: E402
from torch_sparserl import intercept  # noqa: E402
from torch_sparserl import pattern as patterns  # noqa: E402
from torch_sparserl import runtime as rt  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--rounds", type=int, default=11)
parser.add_argument("--flatten-only", action="store_true")
parser.add_argument("--graph", default="pubmed", help="a bench_gnn graph name (rmat:scale=6 is a 64-node one)")
parser.add_argument("--device", default="cuda")
args = parser.parse_args()
ROUNDS, STEPS = args.rounds, 200
dev = torch.device(args.device)
graph = bench.prepare_graph(args.graph, dev)
rt.configure(mode="sync")
A = graph["csr_matrix_gcn"]
n = graph["n"]
crow, col, val = A.crow, A.col, A.val
X = torch.randn(n, 128, device=dev, requires_grad=True)
A @ X.detach()
forms = {
    "parts": lambda x: torch.ops.sparserl.spmm(crow, col, val, n, x).square().mean(),
    "CSRMatrix": lambda x: (A @ x).square().mean(),
}
kept = patterns.Pattern.transposed_values


def gathered(self, val, perm):
    return val.index_select(0, perm)


def use_kept(on: bool) -> None:
    patterns.Pattern.transposed_values = kept if on else gathered


steps = {}
configs = [(form, direct, keep, True) for form in forms for direct in (True, False) for keep in (True, False)
           if not args.flatten_only or (direct and keep)]
configs.append(("CSRMatrix", True, True, False))
for form, direct, keep, flatten in configs:
    compiled = torch.compile(forms[form], backend="sparserl", options={"direct_ops": direct, "flatten_matrices": flatten})
    use_kept(keep)
    compiled(X).backward()
    intercept.deactivate_backend()
    steps[(form, direct, keep, flatten)] = compiled

times = {key: [] for key in steps}
for _ in range(ROUNDS):
    for key, compiled in steps.items():
        use_kept(key[2])
        for _ in range(20):
            compiled(X).backward()
        bench._sync(dev)
        start = time.perf_counter()
        for _ in range(STEPS):
            compiled(X).backward()
        bench._sync(dev)
        times[key].append((time.perf_counter() - start) / STEPS * 1e6)
use_kept(True)
result = {"rounds": ROUNDS, "steps_per_round": STEPS, "graph": args.graph,
          "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
          "torch": torch.__version__, "us_per_step": {}}
for (form, direct, keep, flatten), values in times.items():
    label = (f"{form}, direct_ops {'on' if direct else 'off'}, values {'kept' if keep else 'gathered'}"
             + ("" if form == "parts" else f", {'flattened' if flatten else 'subclass'}"))
    result["us_per_step"][label] = round(statistics.median(values), 1)
    result.setdefault("us_per_step_quartiles", {})[label] = [round(q, 1) for q in statistics.quantiles(values, n=4)]
# the flattening, paired round by round (adjacent in time): flattened minus subclass
flat, sub = times[("CSRMatrix", True, True, True)], times[("CSRMatrix", True, True, False)]
diffs = [a - b for a, b in zip(flat, sub)]
result["flattened_minus_subclass_us"] = {"median": round(statistics.median(diffs), 1),
                                         "rounds_flattened_faster": sum(d < 0 for d in diffs), "rounds": len(diffs)}
print(json.dumps(result, indent=1))
Path(os.environ.get("OUT", "/tmp"), "compiled-ab.json").write_text(json.dumps(result, indent=1) + "\n")
