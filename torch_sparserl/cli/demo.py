"""``sparserl demo``: the README's main job on a shipped matrix: the operators against float64, a
two-layer GCN compiled whole, and the JIT pipeline (on a GPU) or its compile tier (without one)."""

from __future__ import annotations

import argparse
import time

from ..data.datasets import DEFAULT_MATRIX
from .common import MAX_N, CommandError, _columns, _count, _matrix, _note, _seconds


def _device(text: str) -> str:
    if text == "auto":
        return text
    import torch

    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"expected cpu, cuda, cuda:INDEX or auto (got {text!r})")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise argparse.ArgumentTypeError(f"expected a CUDA device this machine has ({torch.cuda.device_count()} "
                                         f"visible) (got {text!r})")
    return text


def _gcn(features: int, hidden: int, classes: int):
    """A two-layer GCN (``adj @ lin(x)``, twice) for the demo's compile step."""
    import torch

    class GCN(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin1 = torch.nn.Linear(features, hidden)
            self.lin2 = torch.nn.Linear(hidden, classes)

        def forward(self, x, adj):
            h = (adj @ self.lin1(x)).relu()
            return adj @ self.lin2(h)

    return GCN()


def demo(args) -> int:
    import numpy as np
    import torch

    import torch_sparserl as ts

    from ..dtypes import close_to_reference

    device = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    M = _matrix(args.matrix, "--matrix")
    if M.shape[0] != M.shape[1]:  # checked before any output: the GCN step multiplies by it twice
        raise CommandError(f"--matrix: expected a square matrix, the graph's adjacency of the GCN step "
                           f"(got {M.shape[0]} x {M.shape[1]} in {args.matrix!r})")
    lengths = np.diff(M.indptr)
    print(f"matrix   {args.matrix}: {M.shape[0]} x {M.shape[1]}, nnz {M.nnz}, "
          f"row length mean {lengths.mean():.1f} max {lengths.max()}")
    print(f"device   {device}" + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""))
    failures = 0

    if device.type == "cuda":
        from ..jit import runtime as rt

        rt.configure(mode="off")  # the first check is cuSPARSE's; the JIT section below times its own cold start
    A = ts.csr(M, dtype=torch.float32, index_dtype=torch.int32, device=device)
    X = torch.randn(M.shape[1], args.n, device=device)
    reference = torch.from_numpy(np.asarray(M.astype(np.float64) @ X.double().cpu().numpy()))
    ok, reason = close_to_reference(A @ X, reference, torch.float32)
    failures += not ok
    print(f"check    A @ X against float64, N={args.n}: {'ok' if ok else 'FAILED: ' + reason}")
    # The JIT first: the compile below starts specializations of its own (hidden and class
    # widths) and installs the raw-sparse interception, which would change what is timed here.
    failures += _demo_kernels(args, M, A, X, device)
    if device.type == "cuda":
        rt.configure(mode="off")  # keep the compile step short: its widths would each take a budget
        print("note     the GCN below runs with the JIT runtime off (cuSPARSE), to keep the demo short")

    torch.manual_seed(0)
    model = _gcn(args.n, 64, 8).to(device)
    eager_out = model(X, A)
    eager_out.square().mean().backward()
    eager_grad = model.lin1.weight.grad.clone()
    model.zero_grad()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(model, backend="sparserl", fullgraph=True)
    _note("compile  torch.compile of a 2-layer GCN, forward and backward (tens of seconds the first time; "
          "Inductor caches it)")
    t0 = time.perf_counter()
    out = compiled(X, A)
    out.square().mean().backward()
    compile_s = time.perf_counter() - t0
    breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
    ok_fwd, why_fwd = close_to_reference(out, eager_out.double(), torch.float32)
    ok_bwd, why_bwd = close_to_reference(model.lin1.weight.grad, eager_grad.double(), torch.float32)
    failures += not (ok_fwd and ok_bwd and breaks == 0)
    print(f"compile  2-layer GCN, torch.compile(backend='sparserl', fullgraph=True): {compile_s:.1f} s, "
          f"{breaks} graph breaks")
    print(f"check    compiled GCN against the same model run without compiling (float32 tolerance): output "
          f"{'ok' if ok_fwd else 'FAILED: ' + why_fwd}, lin1.weight's gradient {'ok' if ok_bwd else 'FAILED: ' + why_bwd}")

    print("result   " + ("all checks passed" if not failures else f"{failures} check(s) FAILED"))
    return 1 if failures else 0


def _demo_kernels(args, M, A, X, device: torch.device) -> int:
    """The JIT pipeline on the demo matrix: on a GPU, specialize ``A @ X`` with the learned
    policy and time it against ``torch.sparse.mm``; without one, sample the policy's kernels on
    the CPU and compile them with nvcc."""
    import torch

    from .. import pattern as patterns
    from ..config import JitOptions
    from ..jit import runtime as rt
    from ..pattern.features import structural_features
    from ..pattern.fingerprint import fingerprint
    from . import measure

    features = structural_features(M.indptr, M.indices, M.shape)
    entry = patterns.lookup(A._crow, A._col, M.shape[1])
    print(f"pattern  fingerprint {fingerprint(entry, A._crow, A._col)}; row mean {features['row_mean']:.1f}, "
          f"max {features['row_max']}, cv {features['row_cv']:.2f}")
    settings = JitOptions(mode="sync", budget_s=args.budget_s)
    print(f"policy   {rt.settings_policy_id(settings)}: its {settings.k} likeliest kernels per product, "
          f"validated, the fastest installed if it beats cuSPARSE by {settings.margin}x")
    if device.type != "cuda":
        return _demo_compile_tier(M, args.n, settings.k)
    fast = _demo_fast_path()
    runtime = rt.configure(mode="sync", budget_s=args.budget_s)
    _note(f"jit      specializing A @ X: loading the policy, starting the sandbox, checking and timing its "
          f"kernels (within the {args.budget_s:g} s budget)")
    result = measure.product(M, "spmm", args.n, runtime=runtime)
    failures = 0 if result["correct"] else 1
    print(f"jit      first A @ X specialized in {result['cold_s']:.1f} s (one-time: loading the policy and "
          f"starting the sandbox): {result['decision']}")
    print(f"check    specialized A @ X against float64: {'ok' if result['correct'] else 'FAILED: ' + str(result['error'])}")
    cached = runtime.cache.get(runtime._key("spmm", args.n, entry, A._crow, A._col, torch.float32))
    if cached is not None and cached.spec_source:
        source = cached.spec_source.splitlines()
        shown = source if args.show_source else source[:12]
        print("kernel   " + "\n         ".join(shown) + ("" if args.show_source else
                                                       f"\n         ... ({len(source)} lines; --show-source for all)"))
    print(f"time     A @ X {result['hot_us']:.1f} us, torch.sparse.mm {result['torch_sparse_us']:.1f} us per call "
          f"(dispatch included): {result['speedup']:.2f}x; torch.ops.sparserl.spmm {result['op_us']:.1f} us; "
          f"A @ X served {fast}")
    return failures


def _demo_fast_path() -> str:
    """Build and load the C++ fast path before the demo times ``A @ X`` (else, with a fresh cache,
    the Python path would be timed while it builds); which path the timing measures."""
    from ..jit import fastpath

    if fastpath.unavailable() is None and not fastpath.loaded:
        _note("fastpath building the C++ fast path of CUDA products (once per machine and torch version, "
              "about a minute), so that the timing below measures it")
        started = time.perf_counter()
        fastpath.ensure(wait=True)
        print(f"fastpath {fastpath.status()} ({time.perf_counter() - started:.1f} s)")
    return ("by the C++ fast path" if fastpath.loaded else
            f"by the Python path (C++ fast path: {fastpath.status()})")


def _demo_compile_tier(M, n: int, k: int) -> int:
    """No GPU: the policy picks its K likeliest kernels on the CPU; each is compiled by nvcc."""
    import time

    from ..evaluate.compile_tier import compile_only
    from ..specialize.policy import load_default
    from ..toolchain import nvcc
    from ..specialize.policy.propose import propose

    _note("rank     the policy writes its likeliest kernels for this pattern on the CPU (5-20 s on a small CPU)")
    start = time.monotonic()
    proposals = propose(load_default("cpu"), M.indptr, M.indices, M.shape, op="spmm", n=n, k=k)
    print(f"rank     the policy's {len(proposals)} likeliest kernels, scored on the CPU in "
          f"{time.monotonic() - start:.1f} s; the first would be tried first")
    if nvcc.nvcc_path() is None:
        print("note     no GPU and no nvcc: kernels are neither built nor run here")
        return 0
    first: dict = {}  # each kernel once: the policy may write one kernel twice
    for p in proposals:
        first.setdefault(p.spec.key, p)
    distinct = list(first.values())
    _note(f"compile  {len(distinct)} kernels with nvcc for sm_90 (usually under a second each)")
    bad = 0
    for done, p in enumerate(distinct, 1):
        record = compile_only(p.spec) if p.error is None else None
        ok = record is not None and record.compiled and record.error_kind is None
        bad += not ok
        why = p.error if record is None else record.error_kind
        print(f"compile  {_count(done, len(distinct))} {p.spec.describe():64s} {'ok' if ok else why} (nvcc, sm_90, "
              f"{record.registers if record else '-'} registers)")
    print(f"plan     {proposals[0].spec.source.splitlines()[0]}")
    print("note     no GPU: kernels compiled for sm_90 but not run; on a GPU the runtime validates "
          "them and times them against cuSPARSE")
    return 1 if bad else 0


def add_command(commands) -> None:
    """Add this command and its options to the command line's subcommands."""
    p = commands.add_parser("demo", help="check, compile and time the operators on a shipped matrix", description=(
        "Check A @ X against a float64 reference on a shipped matrix (or a .npz/.mtx file), compile a two-layer "
        "GCN with torch.compile(backend='sparserl') and compare its output and gradient with the same model run "
        "without compiling, then run the JIT: on a GPU it specializes A @ X and times it against torch.sparse.mm; "
        "without one the learned policy picks its kernels on the CPU and nvcc, if present, compiles them."))
    p.add_argument("--matrix", default=DEFAULT_MATRIX, help=f"shipped name or .npz/.mtx path (default {DEFAULT_MATRIX})")
    p.add_argument("--n", type=_columns, default=32, help=f"dense columns N, 1 to {MAX_N} (default 32)")
    p.add_argument("--device", type=_device, default="auto", help="cpu, cuda, cuda:INDEX or auto (default)")
    p.add_argument("--budget-s", type=_seconds, default=20.0, help="autotuning budget of the JIT (default 20)")
    p.add_argument("--show-source", action="store_true", help="print the whole specialized kernel")
    p.set_defaults(run=demo)
