"""Where the learned policy's one-time start and its sampling take their time: in this
process (``load_default``) against in the sandbox's worker (``SandboxedPolicy``, what the
runtime uses for CUDA patterns), on an idle GPU and while this process keeps the GPU busy
with a stream of small kernels (as a training loop does).

    python benchmarks/profile_policy.py --matrix pubmed --n 128 --out /tmp/policy.json
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _busy(stop: threading.Event, device) -> int:
    """Small GPU kernels back to back until ``stop``: a stand-in for a training loop."""
    import torch

    x = torch.randn(4096, 128, device=device)
    steps = 0
    while not stop.is_set():
        for _ in range(50):
            x = torch.relu(x @ torch.ones(128, 128, device=device) * 1e-3 + 1e-3)
        torch.cuda.synchronize(device)
        steps += 1
    return steps


def measure(where: str, matrix, n: int, k: int, busy: bool) -> dict:
    import torch

    from torch_sparserl.evaluate.sandbox import Sandbox
    from torch_sparserl.policy import CHECKPOINT_DIR
    from torch_sparserl.policy.encoder import PatternInput
    from torch_sparserl.policy.propose import SandboxedPolicy, _sample

    rowptr, col, shape = matrix.indptr, matrix.indices, matrix.shape
    stop = threading.Event()
    loop = threading.Thread(target=_busy, args=(stop, torch.device("cuda")), daemon=True) if busy else None
    if loop:
        loop.start()
    out = {"where": where, "busy_gpu": busy}
    box = None
    try:
        start = time.perf_counter()
        if where == "worker":
            box = Sandbox()
            box.worker_info  # noqa: B018 - starts the worker
            out["worker_start_s"] = time.perf_counter() - start
            policy = SandboxedPolicy(box, CHECKPOINT_DIR)
            t = time.perf_counter()
            policy.load()
        else:
            from torch_sparserl.policy.model import KernelPolicy

            t = time.perf_counter()
            import torch_sparserl.policy.decoder  # noqa: F401 - timed apart: only the first load in a process pays it

            out["import_s"] = time.perf_counter() - t
            t = time.perf_counter()
            policy = KernelPolicy.load(CHECKPOINT_DIR, "cuda")
        out["load_s"] = time.perf_counter() - t
        inp = PatternInput.from_pattern(rowptr, col, shape, "spmm", "f32", n, policy.config.samples)
        times = []
        for seed in range(3):
            t = time.perf_counter()
            if where == "worker":
                policy.sample(inp, "spmm", "f32", n, k=k, temperature=1.0, seed=seed)
            else:
                _sample(policy, inp, "spmm", "f32", n, k, 1.0, seed)
            times.append(time.perf_counter() - t)
        out["sample_s"] = times
    finally:
        stop.set()
        if loop:
            loop.join()
        if box is not None:
            box.close()
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--matrix", default="pubmed")
    parser.add_argument("--n", type=int, default=128)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)

    from bench_kernels import select_matrices

    matrix = select_matrices([args.matrix])[0].load().tocsr()
    rows = [measure(where, matrix, args.n, args.k, busy) for busy in (False, True) for where in ("worker", "process")]
    doc = {"matrix": args.matrix, "n": args.n, "k": args.k, "rows": rows,
           "command": " ".join(["python benchmarks/profile_policy.py"] + (argv if argv is not None else sys.argv[1:]))}
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    for r in rows:
        print(f"{r['where']:8s} busy={r['busy_gpu']!s:5s} start {r.get('worker_start_s', 0):5.1f} s, "
              f"import {r.get('import_s', 0):5.2f} s, load {r['load_s']:5.2f} s, "
              f"samples {', '.join(f'{s:.3f}' for s in r['sample_s'])} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
