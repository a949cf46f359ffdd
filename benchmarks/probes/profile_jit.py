#!/usr/bin/env python3
"""Where the learned policy's JIT time goes (GPU).

Runs ``policy_tune`` (the runtime's path: rank, compile together, screen, validate) in one
sandbox on pubmed, ca-CondMat and rajat01 at SpMV, N=32 and N=256 and prints, per cell, the
wall time, the problem / scoring / compile stages, the evaluations' summed sandbox time and
each evaluation's stages in the worker and its round trip; before them, the sandbox's release
after a decision; after them, a cProfile of the parent's side::

    SPARSERL_SHARED=../shared python benchmarks/probes/profile_jit.py

Needs a GPU and the real matrices (``../shared`` or ``./shared``). Prints; writes nothing.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: training.common

CELLS = [(m, n) for m in ("pubmed", "ca-CondMat", "rajat01") for n in (1, 32, 256)]


def _triple(patterns, name):
    rowptr, col, shape, _ = patterns.get(name)
    return rowptr.astype("int32"), col.astype("int32"), shape


def main(argv=None) -> int:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("profile_jit: needs a CUDA GPU", file=sys.stderr)
        return 2
    from torch_sparserl.evaluate.sandbox import Sandbox
    from torch_sparserl.specialize.policy import load_default
    from torch_sparserl.specialize.policy.propose import policy_tune
    from training.common import Patterns

    policy, patterns, box = load_default("cuda"), Patterns(), Sandbox()
    try:
        policy_tune(_triple(patterns, "cora"), op="spmm", n=32, policy=policy, k=4, sandbox=box)  # warm-up
        for label in ("release ms", "release again ms"):
            start = time.perf_counter()
            box.release()
            print(label, round((time.perf_counter() - start) * 1e3, 1))
        profile = cProfile.Profile()
        for name, n in CELLS:
            start = time.perf_counter()
            profile.enable()
            result, _, _ = policy_tune(_triple(patterns, name), op="spmv" if n == 1 else "spmm", n=n,
                                       policy=policy, k=4, sandbox=box)
            profile.disable()
            wall = time.perf_counter() - start
            first = result.table[0].timing
            print(name, n, f"wall {wall * 1e3:.0f}ms",
                  {k: first.get(k) for k in ("problem_s", "generate_s", "prebuild_s")},
                  "sandbox", round(sum(r.timing.get("sandbox_s", 0) for r in result.table) * 1e3, 1),
                  "compiled", [r.timing["stages_s"].get("compiled") for r in result.table])
            for r in result.table:  # the worker's stages, and the round trip around them
                print(f"   {r.timing.get('stage')}: sandbox {r.timing.get('sandbox_s', 0) * 1e3:.1f} ms, in the worker "
                      f"{(r.elapsed_s or 0) * 1e3:.1f} ms", {k: round(v * 1e3, 1) for k, v in r.timing["stages_s"].items()})
        pstats.Stats(profile).sort_stats("cumtime").print_stats(30)
    finally:
        box.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
