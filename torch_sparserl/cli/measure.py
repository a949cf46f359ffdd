"""End-to-end measurements of the runtime on a GPU: what ``sparserl bench`` and
``benchmarks/bench_runtime.py`` report.

For one (matrix, op, N, dtype):

* **cold** — the first ``A @ X`` with an empty cache in ``sync`` mode: fingerprint,
  autotuning in the sandbox, the extension build, plan preparation and the launch;
* **hot** — time per call of ``A @ X`` once decided, dispatch included (``CSRMatrix``,
  eager), against ``torch.sparse.mm`` on the same CSR tensor, in the same process and the
  same rounds; and of ``torch.ops.sparserl.spmm`` (the operator through the dispatcher);
* **correct** — the result against a float64 SciPy reference.

Times per call are means over a loop of back-to-back calls between two CUDA events, so a
call's CPU cost (Python, dispatch, launch) counts wherever it exceeds its GPU time — as it
does in a training loop. Rounds alternate between the contenders; the median round is kept.
*Warm* start (a new process finding the decision on disk) needs a new process:
:func:`warm_start` runs one.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import textwrap
import time

import numpy as np
import torch

from .. import pattern as patterns
from ..dtypes import close_to_reference
from ..jit import runtime as rt

ROUNDS = 7


def _per_call_us(fn, calls: int) -> float:
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    stop.record()
    stop.synchronize()
    return start.elapsed_time(stop) * 1e3 / calls


def compare_us(contenders: dict, *, rounds: int = ROUNDS, target_ms: float = 20.0) -> dict[str, float]:
    """Median over ``rounds`` of the mean time per call of each contender, interleaved."""
    for fn in contenders.values():  # warm-up, and the size of a loop of about target_ms
        fn()
    torch.cuda.synchronize()
    probe = {name: _per_call_us(fn, 5) for name, fn in contenders.items()}
    calls = {name: int(min(2000, max(10, target_ms * 1e3 / max(us, 1.0)))) for name, us in probe.items()}
    samples: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(rounds):
        for name, fn in contenders.items():
            samples[name].append(_per_call_us(fn, calls[name]))
    return {name: statistics.median(values) for name, values in samples.items()}


def torch_csr(A) -> torch.Tensor:
    """The same matrix as a ``torch.sparse_csr`` tensor sharing A's parts."""
    from ..kernels.vendor import as_torch_csr

    return as_torch_csr(patterns.lookup(A._crow, A._col, A.shape[1]), A._crow, A._col, A.val)


def product(M, op: str, n: int, dtype: torch.dtype = torch.float32, *, runtime: rt.Runtime | None = None,
            seed: int = 0, rounds: int = ROUNDS) -> dict:
    """Cold, hot and correctness of ``A @ X`` for the SciPy matrix ``M`` on the active runtime."""
    import torch_sparserl as ts

    runtime = runtime or rt.active()
    device = torch.device("cuda")
    A = ts.csr(M, dtype=dtype, index_dtype=torch.int32, device=device)
    generator = torch.Generator(device=device).manual_seed(seed)
    X = torch.randn(M.shape[1], n, device=device, dtype=torch.float32, generator=generator).to(dtype)
    operand = X[:, 0].contiguous() if op == "spmv" else X
    torch.cuda.synchronize()

    start = time.perf_counter()
    Y = A @ operand
    torch.cuda.synchronize()
    cold_s = time.perf_counter() - start

    reference = torch.from_numpy(np.asarray(M.astype(np.float64) @ X.double().cpu().numpy()))
    ok, why = close_to_reference(Y.reshape(M.shape[0], -1).cpu(), reference, dtype)
    entry = patterns.lookup(A._crow, A._col, M.shape[1])
    state = runtime.state(op, entry, n, dtype)
    raw = torch_csr(A)
    op_fn = getattr(torch.ops.sparserl, op)
    times = compare_us({
        "sparserl": lambda: A @ operand,
        "sparserl_op": lambda: op_fn(A._crow, A._col, A.val, M.shape[1], operand),
        "torch_sparse": (lambda: torch.sparse.mm(raw, operand)) if op == "spmm" else (lambda: torch.mv(raw, operand)),
    }, rounds=rounds)
    record = None
    if state is not None and getattr(state, "key", None) is not None:
        cached = runtime.cache.get(state.key)
        record = cached.record if cached is not None else None
    return {
        "op": op, "n": n, "dtype": str(dtype).replace("torch.", ""),
        "rows": M.shape[0], "cols": M.shape[1], "nnz": int(M.nnz),
        "correct": ok, "error": None if ok else why,
        "decision": runtime.explain(op, entry, n, dtype),
        "installed": isinstance(state, rt.Installed),
        "cold_s": cold_s,
        "hot_us": times["sparserl"], "op_us": times["sparserl_op"], "torch_sparse_us": times["torch_sparse"],
        "speedup": times["torch_sparse"] / times["sparserl"],
        "kernel_us": record.get("runtime_us") if record else None,
        "kernel_cusparse_us": record.get("cusparse_us") if record else None,
    }


def dispatch_overhead(M, n: int = 32, *, runtime: rt.Runtime | None = None) -> dict:
    """CPU microseconds per call of each layer over an installed kernel, on a small matrix
    (the GPU work per call is a few microseconds, so the loop measures the issuing cost).

    ``raw_launch``: the bound kernel with its output preallocated (the floor);
    ``installed``: the runtime's launch closure (output allocation included);
    ``runtime_call``: :meth:`Runtime.call` (state lookup included);
    ``direct``: ``A @ X`` on a CSRMatrix (checks, pattern lookup, the direct eager path);
    ``operator``: ``torch.ops.sparserl.spmm`` through the dispatcher;
    ``torch_sparse``: ``torch.sparse.mm`` on the same CSR tensor (cuSPARSE).
    """
    import torch_sparserl as ts

    runtime = runtime or rt.active()
    A = ts.csr(M, dtype=torch.float32, index_dtype=torch.int32, device="cuda")
    X = torch.randn(M.shape[1], n, device="cuda")
    A @ X
    entry = patterns.lookup(A._crow, A._col, M.shape[1])
    state = runtime.state("spmm", entry, n, torch.float32)
    if not isinstance(state, rt.Installed):
        return {"installed": False, "decision": runtime.explain("spmm", entry, n, torch.float32)}
    bound = state.launch.kernel
    Y = torch.empty(M.shape[0], n, device="cuda")
    stream = torch.cuda.current_stream().cuda_stream
    raw = torch_csr(A)
    layers = {
        "raw_launch": lambda: bound(A._crow, A._col, A.val, X, Y, stream),
        "installed": lambda: state.launch(A._crow, A._col, A.val, X),
        "runtime_call": lambda: runtime.call("spmm", entry, A._crow, A._col, A.val, X),
        "direct": lambda: A @ X,
        "operator": lambda: torch.ops.sparserl.spmm(A._crow, A._col, A.val, M.shape[1], X),
        "torch_sparse": lambda: torch.sparse.mm(raw, X),
    }
    result = {}
    for name, fn in layers.items():
        for _ in range(200):
            fn()
        torch.cuda.synchronize()
        samples = []
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(2000):
                fn()
            samples.append((time.perf_counter() - start) / 2000 * 1e6)
            torch.cuda.synchronize()
        result[name] = min(samples)
    result["added_by_runtime_us"] = result["runtime_call"] - result["raw_launch"]
    result["added_by_direct_path_us"] = result["direct"] - result["raw_launch"]
    return {"installed": True, "decision": state.description, "n": n, **result}


_WARM_SCRIPT = textwrap.dedent("""
    import json, sys, time
    import torch
    import torch_sparserl as ts
    from torch_sparserl.config import JitOptions
    from torch_sparserl.jit import runtime as rt
    from torch_sparserl.jit.cache import KernelCache
    from torch_sparserl.data.datasets import load_matrix

    cells = json.loads(sys.argv[1])
    def refuse(*args):
        raise RuntimeError("specialized again: the disk cache did not serve")
    runtime = rt.Runtime(JitOptions(mode="sync", policy=sys.argv[3]),
                         cache=KernelCache(sys.argv[2]) if sys.argv[2] else None, specializer=refuse)
    rt.set_active(runtime)
    torch.zeros(1, device="cuda"); torch.cuda.synchronize()
    out = []
    for matrix, op, n in cells:
        M = load_matrix(matrix)
        A = ts.csr(M, dtype=torch.float32, index_dtype=torch.int32, device="cuda")
        X = torch.randn(M.shape[1], n, device="cuda")
        operand = X[:, 0].contiguous() if op == "spmv" else X
        torch.cuda.synchronize()
        installs = runtime.stats["installs"]
        start = time.perf_counter()
        Y = A @ operand
        torch.cuda.synchronize()
        first_ms = (time.perf_counter() - start) * 1e3
        from_disk = runtime.stats["installs"] == installs + 1  # else the cache missed (refused to specialize)
        start = time.perf_counter()
        A @ operand
        torch.cuda.synchronize()
        second_ms = (time.perf_counter() - start) * 1e3
        reference = M.astype("float64") @ X.double().cpu().numpy()
        error = float(abs(Y.reshape(M.shape[0], -1).double().cpu().numpy() - reference).max())
        out.append({"matrix": matrix, "op": op, "n": n, "warm_ms": first_ms, "second_ms": second_ms,
                    "from_disk": from_disk, "max_abs_err": error})
    print("WARM " + json.dumps({"cells": out, "cache": runtime.cache.stats}))
""")


def warm_start(cells: list[tuple[str, str, int]], cache_root: str | None = None, timeout_s: float = 600,
               policy: str = "learned") -> dict:
    """In a new process, the first ``A @ X`` of each cell with the decisions on disk.

    ``policy``: the ``JitOptions.policy`` whose decisions are looked up (the cache keys
    name where candidates came from).

    ``warm_ms`` of the first cell includes the process's one-time costs (loading the
    extension machinery); the others are per pattern. ``from_disk`` is False where the
    cache held no kernel (that cell then ran on cuSPARSE; the child never specializes).
    """
    result = subprocess.run([sys.executable, "-c", _WARM_SCRIPT, json.dumps(cells), cache_root or "", policy],
                            capture_output=True, text=True, timeout=timeout_s)
    for line in result.stdout.splitlines():
        if line.startswith("WARM "):
            return json.loads(line[5:])
    raise RuntimeError(f"warm_start: the child failed (rc {result.returncode}): {result.stderr[-2000:]}")
