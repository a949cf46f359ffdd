#!/usr/bin/env python3
"""Scoring the kernel space with the policy on the GPU: time and peak memory per request.

The runtime ranks a request's kernel space (30-44 kernels, up to ~500 tokens each) by the
policy's log-probabilities (``KernelPolicy.score_ids``). This times one scoring per request on
pubmed, ca-CondMat and rajat01 at SpMV and SpMM N = 32, 128, 256, in one process, for fixed
batches of 8 and 32 completions in the order given and for length-sorted groups under a budget
of float32 logits (``model.SCORE_LOGIT_BYTES``, 128 MB and 32 MB), and prints the median and
largest time, the peak memory the scoring added, and the largest score difference from the first
batching (floating-point order only)::

    SPARSERL_SHARED=../shared python benchmarks/bench_scoring.py

Needs a GPU and the real matrices (``../shared`` or ``./shared``). Prints; writes nothing.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MATRICES = ("pubmed", "ca-CondMat", "rajat01")
REQUESTS = (("spmv", 1), ("spmm", 32), ("spmm", 128), ("spmm", 256))
WAYS = {"rows 8": (8, 1 << 40), "rows 32": (32, 1 << 40), "budget 128 MB": (None, 128 << 20),
        "budget 32 MB": (None, 32 << 20)}  # (rows per pass, float32 logits per pass)


def main(argv=None) -> int:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("bench_scoring: needs a CUDA GPU", file=sys.stderr)
        return 2
    from torch_sparserl.pattern.features import structural_features
    from torch_sparserl.specialize import families as fam
    from torch_sparserl.specialize.policy import load_default
    from torch_sparserl.specialize.policy import model as M
    from torch_sparserl.specialize.policy.corpus import completion_text, render_compact
    from torch_sparserl.specialize.policy.encoder import PatternInput
    from training.common import Patterns

    policy, patterns = load_default("cuda"), Patterns()
    cells = []
    for name in MATRICES:
        rowptr, col, shape, _ = patterns.get(name)
        features = structural_features(rowptr, col, shape)
        for op, n in REQUESTS:
            inp = PatternInput.from_pattern(rowptr, col, shape, op, "f32", n, policy.config.samples, seed=0,
                                            features=features)
            texts = list(dict.fromkeys(completion_text(render_compact(f, p, op, "f32", n), op, "f32", n)
                                       for f, p in fam.space(op, "f32", n, features)))
            cells.append((inp, op, n, policy.completion_ids(texts)))
    saved, reference = M.SCORE_LOGIT_BYTES, None
    try:
        for rep in range(3):  # the first two warm up every batching's shapes
            for way, (rows, budget) in WAYS.items():
                M.SCORE_LOGIT_BYTES = {"cuda": budget, "cpu": budget}
                times, peaks, scores = [], [], []
                for inp, op, n, ids in cells:
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                    base = torch.cuda.memory_allocated()
                    start = time.perf_counter()
                    scores.append(policy.score_ids(inp, op, "f32", n, ids, batch=rows))
                    times.append(time.perf_counter() - start)
                    peaks.append((torch.cuda.max_memory_allocated() - base) / 2**20)
                reference = reference or scores
                diff = max(abs(a - b) for s, r in zip(scores, reference) for a, b in zip(s, r))
                if rep == 2:
                    print(f"{way:14s} median {statistics.median(times) * 1e3:.1f} ms, max {max(times) * 1e3:.1f} ms; "
                          f"peak extra memory median {statistics.median(peaks):.0f} MB, max {max(peaks):.0f} MB; "
                          f"max score diff {diff:.2e}")
    finally:
        M.SCORE_LOGIT_BYTES = saved
    print("kernels per request:", [len(c[3]) for c in cells], "longest:", max(max(map(len, c[3])) for c in cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
