"""Which part of fingerprinting a pattern holds up a training loop's epochs?

One variant per process (CUDA's lazy kernel loading is per process): a GCN-like loop on the
graph (two torch.sparse.mm products, dense layers, backward) runs 300 synchronized epochs; at
epoch 100 a background thread runs the variant on the graph's indices (int32). Prints one
JSON line: the loop's median epoch, how long the variant ran, the epochs it overlapped and
their excess over the median.

  gpu1       fingerprint.pattern_hash on the GPU, its first use in the process
  gpu2       the same, its kernels loaded beforehand (a hash of a tiny pattern)
  np         copy to the host on a side stream, hash there (numpy)
  copy       crow.cpu(), col.cpu() on the current stream (what the specializer did)
  copy_side  the same copies on a side stream
  pinned     copies into freshly pinned host memory on a side stream
  chunked    side-stream copies in chunks of 2^18 elements
  pinned_np  pinned copies, then the host hash
  none       nothing (the loop's own spread)

    for v in none gpu1 gpu2 np copy copy_side pinned chunked pinned_np; do
        python benchmarks/profile_fingerprint_stall.py $v pubmed; done

Results: ``benchmarks/results/fingerprint-stall-h100-2026-11-23.{jsonl,md}``.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np
import scipy.sparse as sp
import torch

from torch_sparserl import fingerprint as fp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kernels import select_matrices  # noqa: E402

VARIANTS = ("none", "gpu1", "gpu2", "np", "copy", "copy_side", "pinned", "chunked", "pinned_np")


def numpy_hash(crow: np.ndarray, col: np.ndarray) -> list[int]:
    """The four lane sums of fingerprint.pattern_hash in numpy's wrapping uint64 arithmetic."""
    sums = []
    with np.errstate(over="ignore"):
        for values, salt in ((crow, 1), (col, 2)):
            a = values.astype(np.uint64)
            pos = np.arange(len(values), dtype=np.uint64)
            for seed in fp._SEEDS:
                x = a * np.uint64(fp._GOLDEN) + pos * np.uint64((seed ^ salt) & fp._MASK64) + np.uint64(seed)
                x ^= x >> np.uint64(30)
                x *= np.uint64(fp._MIX1)
                x ^= x >> np.uint64(27)
                x *= np.uint64(fp._MIX2)
                x ^= x >> np.uint64(31)
                sums.append(int(x.sum(dtype=np.uint64)))
    return sums


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("variant", choices=VARIANTS)
    parser.add_argument("graph")
    parser.add_argument("--epochs", type=int, default=300)
    parser.add_argument("--start", type=int, default=100, help="the epoch at which the variant starts")
    args = parser.parse_args()

    M = sp.csr_matrix(select_matrices([args.graph])[0].load())
    crow = torch.from_numpy(M.indptr.astype(np.int64)).cuda()
    col = torch.from_numpy(M.indices.astype(np.int64)).cuda()
    A = torch.sparse_csr_tensor(crow, col, torch.ones(M.nnz, device="cuda"), M.shape)
    X = torch.randn(M.shape[0], 128, device="cuda")
    W1 = torch.randn(128, 128, device="cuda", requires_grad=True)
    W2 = torch.randn(128, 16, device="cuda", requires_grad=True)
    # the pattern's own index tensors, as a CSRMatrix holds them
    fcrow, fcol = crow.to(torch.int32).clone(), col.to(torch.int32).clone()
    side = torch.cuda.Stream()

    def side_copy(t):
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            return t.cpu()

    def pinned_copy(t):
        side.wait_stream(torch.cuda.current_stream())
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        with torch.cuda.stream(side):
            host.copy_(t, non_blocking=True)
        side.synchronize()
        return host

    def chunked_copy(t, step=1 << 18):
        side.wait_stream(torch.cuda.current_stream())
        host = torch.empty(t.shape, dtype=t.dtype)
        with torch.cuda.stream(side):
            for start in range(0, t.numel(), step):
                host[start:start + step].copy_(t[start:start + step])
        return host

    work = {
        "none": lambda: None,
        "gpu1": lambda: fp.pattern_hash(fcrow, fcol, M.shape[1]),
        "gpu2": lambda: fp.pattern_hash(fcrow, fcol, M.shape[1]),
        "np": lambda: numpy_hash(side_copy(fcrow).numpy(), side_copy(fcol).numpy()),
        "copy": lambda: (fcrow.cpu(), fcol.cpu()),
        "copy_side": lambda: (side_copy(fcrow), side_copy(fcol)),
        "pinned": lambda: (pinned_copy(fcrow), pinned_copy(fcol)),
        "chunked": lambda: (chunked_copy(fcrow), chunked_copy(fcol)),
        "pinned_np": lambda: numpy_hash(pinned_copy(fcrow).numpy(), pinned_copy(fcol).numpy()),
    }[args.variant]
    if args.variant == "gpu2":  # load the hash's kernels first
        fp.pattern_hash(fcrow[:5].clone(), fcol[:7].clone(), M.shape[1])
        torch.cuda.synchronize()

    def epoch():
        H = torch.relu(torch.sparse.mm(A, X @ W1))
        loss = torch.log_softmax(torch.sparse.mm(A, H @ W2), 1).mean()
        loss.backward()
        W1.grad = W2.grad = None

    for _ in range(30):
        epoch()
    torch.cuda.synchronize()
    starts, times, span = [], [], []

    def background():
        begun = time.perf_counter()
        work()
        span.extend([begun, time.perf_counter()])

    thread = threading.Thread(target=background)
    for i in range(args.epochs):
        if i == args.start:
            thread.start()
        begun = time.perf_counter()
        epoch()
        torch.cuda.synchronize()
        starts.append(begun)
        times.append(time.perf_counter() - begun)
    thread.join()
    median = statistics.median(times)
    over = [i for i in range(len(times)) if starts[i] < span[1] and starts[i] + times[i] > span[0]]
    print(json.dumps({"variant": args.variant, "graph": args.graph, "median_ms": median * 1e3,
                      "bg_ms": (span[1] - span[0]) * 1e3, "overlapped": len(over),
                      "overlap_ms": [round(times[i] * 1e3, 2) for i in over][:12],
                      "excess_ms": sum(times[i] - median for i in over) * 1e3}))


if __name__ == "__main__":
    main()
