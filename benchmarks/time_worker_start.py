"""How long before the sandbox's worker can answer the first run's first question?

A first run's kernels are decided in the sandbox's worker: a fresh interpreter that imports
torch and this package, creates a CUDA context, loads the learned policy and samples it. Until
then the training loop runs on cuSPARSE. This times, on an idle GPU:

* the worker's imports, each in a fresh interpreter (``--reps`` times): torch alone, the
  evaluation harness, the harness with the policy loaded on the CPU;
* from this process: the worker's start (``Sandbox.worker_info``), the policy's load in it,
  and its first and second samples (K=4) for one graph.

    python benchmarks/time_worker_start.py --graph pubmed --n 128
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

IMPORTS = {
    "torch": "import torch",
    "harness": "import torch_sparserl.evaluate.harness",
    "harness + policy": "import torch_sparserl.evaluate.harness, torch_sparserl.policy.propose; "
                        "from torch_sparserl.policy import load_default; load_default('cpu')",
}


def matrix_path(name: str) -> Path:
    for folder in (ROOT / "shared" / "matrices", ROOT.parent / "shared" / "matrices"):
        if (folder / f"{name}.npz").exists():
            return folder / f"{name}.npz"
    return Path(name)  # a path, or a matrix shipped in the package (load_matrix says which)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--graph", default="pubmed")
    parser.add_argument("--n", type=int, default=128)
    parser.add_argument("--reps", type=int, default=2)
    args = parser.parse_args(argv)

    for label, statement in IMPORTS.items():
        for _ in range(args.reps):
            start = time.perf_counter()
            subprocess.run([sys.executable, "-W", "ignore", "-c", statement], check=True)
            print(f"{time.perf_counter() - start:6.2f} s  import: {label}", flush=True)

    import torch

    from torch_sparserl.datasets import load_matrix
    from torch_sparserl.evaluate.sandbox import Sandbox
    from torch_sparserl.policy import CHECKPOINT_DIR
    from torch_sparserl.policy.propose import SandboxedPolicy, propose

    if not torch.cuda.is_available():
        print("no CUDA device: the worker's start is not timed")
        return 0
    M = load_matrix(matrix_path(args.graph))
    torch.zeros(1, device="cuda")  # the parent's context, as a training process has one
    sandbox = Sandbox()
    try:
        marks = [time.perf_counter()]
        sandbox.worker_info  # noqa: B018 - starts the worker
        marks.append(time.perf_counter())
        policy = SandboxedPolicy(sandbox, CHECKPOINT_DIR)
        policy.load()
        marks.append(time.perf_counter())
        for _ in range(2):
            propose(policy, M.indptr, M.indices, M.shape, op="spmm", n=args.n, k=4)
            marks.append(time.perf_counter())
    finally:
        sandbox.close()
    steps = ("worker start", "policy load in the worker", f"first sample (K=4, {args.graph}, N={args.n})",
             "second sample")
    for step, (a, b) in zip(steps, zip(marks, marks[1:])):
        print(f"{b - a:6.2f} s  {step}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
