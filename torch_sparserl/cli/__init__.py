"""The ``sparserl`` command (also ``python -m torch_sparserl``).

Pipeline stage 13 of 14: the ``sparserl`` command (also ``python -m torch_sparserl``) and the
end-to-end measurements that ``sparserl bench`` reports (:mod:`.measure`).
May import: config, dtypes, data, pattern, kernels, abi, toolchain, evaluate, specialize, jit,
ops, tensor, compiler, integrations, torch_sparserl.

``sparserl demo`` is the README's main job: on a shipped matrix it checks the operators
against a float64 reference, compiles a two-layer GCN whole with the ``sparserl`` backend
(its output and gradient compared with the same model run without compiling), and runs the
JIT pipeline: on a GPU it specializes ``A @ X``, shows the kernel and times it against
``torch.sparse.mm`` (the C++ fast path built first); without one it generates the candidate
kernels and compiles them with nvcc.

``tune`` searches the kernel space for a matrix; ``bench`` measures the runtime end to end;
``explain`` says which kernel serves a matrix's products and why; ``cache`` manages the
specialization cache. ``SPARSERL_LOG=info`` (or ``debug``) logs the runtime's decisions.

A bad invocation (an argument out of range, a file that is not a matrix, a broken cache
folder) prints one line, ``sparserl COMMAND: what was expected (got what came)``, and exits
with status 2, as does a command that needs what the machine lacks (a CUDA GPU, a CUDA build
of torch, nvcc); ``SPARSERL_DEBUG=1`` shows the traceback instead (:data:`EXIT_STATUSES`).

Results go to stdout; a line on stderr before each slow step says what starts (:func:`_note`).
Parsing imports neither torch nor NumPy: ``--help`` and usage errors answer at once, and the
package defers its operators to the command (``torch_sparserl/__init__.py``, :func:`_run`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import stat
import sys
import time
from pathlib import Path

# Only what parsing needs is imported here: ``sparserl --help`` and a usage error answer without
# importing torch, NumPy or SciPy (tests/test_cli.py checks it); each command imports its own.
from .. import config
from ..data.datasets import DEFAULT_MATRIX

# The help's first paragraph (plain text: argparse prints it as it is).
DESCRIPTION = ("sparserl: sparse CSR products for PyTorch on CUDA kernels specialized to each matrix's sparsity "
               "pattern. The commands check them, tune and time them, and show what the runtime decided "
               "(also run as python -m torch_sparserl).")

# The help's epilog: what every command's exit status means.
EXIT_STATUSES = ("Exit status: 0 done; 1 a check failed (a wrong result, a kernel that did not compile) or an "
                 "internal error; 2 a bad invocation, or a command that needs what this machine lacks (a CUDA "
                 "GPU, a CUDA build of torch, nvcc), one line on stderr saying what; 130 interrupted. "
                 "SPARSERL_DEBUG=1 shows the traceback of any error.")

MAX_N = 65536  # dense columns: --n beyond this is a typo, not a product anyone runs


class CommandError(Exception):
    """A bad invocation found after parsing; its message is the line the user sees."""


# What a bad invocation or a broken file raises: one line, exit status 2 (the library's own
# errors too: any exception class defined in torch_sparserl). Anything else is a bug.
_EXPECTED = (CommandError, ValueError, TypeError, OSError, EOFError, RecursionError)


def _matrix(name: str, what: str = "matrix"):
    """A matrix named on the command line, loaded and checked: a real-valued CSR matrix with at
    least one row, one column and one nonzero."""
    from ..data.datasets import load_matrix

    try:
        M = load_matrix(name).tocsr()
    except (FileNotFoundError, ValueError) as exc:
        raise CommandError(f"{what}: {str(exc).removeprefix('load_matrix: ')}") from exc
    if M.dtype.kind not in "biuf":
        raise CommandError(f"{what}: expected real values in {name!r} (got {M.dtype})")
    if min(M.shape) == 0 or M.nnz == 0:
        raise CommandError(f"{what}: expected a matrix with at least one row, column and nonzero in {name!r} "
                           f"(got {M.shape[0]} x {M.shape[1]}, {M.nnz} nonzeros)")
    return M


def _columns(text: str) -> int:
    """--n: dense columns."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= MAX_N:
        raise argparse.ArgumentTypeError(f"expected a positive integer up to {MAX_N} (got {text!r})")
    return value


def _finite(text: str, expected: str, *, zero: bool) -> float:
    """``text`` as a finite number > 0 (>= 0 with ``zero``); else argparse's error saying ``expected``."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (0 <= value if zero else 0 < value) or not value < math.inf:
        raise argparse.ArgumentTypeError(f"expected {expected} (got {text!r})")
    return value


def _seconds(text: str) -> float:
    return _finite(text, "a positive number of seconds", zero=False)


def _megabytes(text: str) -> float:
    """--max-mb: from 0 (remove every entry) to the largest cap SPARSERL_CACHE_MAX_MB takes."""
    expected = f"a number of megabytes >= 0 and <= {config.MAX_CACHE_MAX_MB:.0f}"
    value = _finite(text, expected, zero=True)
    if value > config.MAX_CACHE_MAX_MB:
        raise argparse.ArgumentTypeError(f"expected {expected} (got {text!r})")
    return value


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


# --dtype: the documented names, and the ABI's short ones, which tune once took (accepted as well).
DTYPES = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}
_DTYPE_METAVAR = "{" + ",".join(DTYPES) + "}"
_DTYPE_HELP = "value dtype (default float32; f32, f16, bf16 are accepted too)"
_OP_HELP = "the product: spmm (A @ X, the default) or spmv (A @ x)"


def _dtype(text: str) -> str:
    """--dtype: a documented name (float32, float16, bfloat16), or its short form, as the documented name."""
    for name, short in DTYPES.items():
        if text in (name, short):
            return name
    raise argparse.ArgumentTypeError(f"expected one of {', '.join(DTYPES)} (got {text!r})")


def _families(text: str) -> list[str]:
    from ..specialize.families import FAMILIES

    names = [name.strip() for name in text.split(",")]
    unknown = [name for name in names if name not in FAMILIES]
    if unknown:
        raise argparse.ArgumentTypeError(f"expected comma-separated names among {', '.join(FAMILIES)} "
                                         f"(got {', '.join(map(repr, unknown))})")
    return names


def _folder(text: str) -> str:
    if os.path.exists(text) and not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"expected a folder (got a file: {text!r})")
    return text


def _output_file(text: str) -> str:
    parent = os.path.dirname(text) or "."
    if os.path.isdir(text) or not os.path.isdir(parent):
        raise argparse.ArgumentTypeError(f"expected a file to write in an existing folder (got {text!r})")
    return text


def _cache(args):
    """The command's cache folder (--dir, else $SPARSERL_CACHE_DIR or the default)."""
    from ..jit.cache import KernelCache

    configured = None if args.dir else config.read("cache.dir")
    where = (f"--dir {args.dir!r}" if args.dir else f"$SPARSERL_CACHE_DIR={str(configured)!r}"
             if configured is not None else "the default cache folder")
    try:
        cache = KernelCache(args.dir) if args.dir else KernelCache()
    except OSError as exc:
        got = (f"a file in the way: {exc.filename}" if isinstance(exc, (FileExistsError, NotADirectoryError))
               else _describe(exc))
        raise CommandError(f"expected a usable cache folder at {where} (got {got})") from exc
    if not cache.disk:  # the library runs on without it (memory only); a command about it cannot
        raise CommandError(f"expected a usable cache folder at {where} (got {cache.root}: {cache.problem})")
    return cache


def _entry(cache, path: Path) -> Path:
    """``path`` once checked to be a file: a FIFO would block its read, a link to /dev/zero
    would never end."""
    if not stat.S_ISREG(path.stat().st_mode):
        raise CommandError(f"expected cache entries to be files in {cache.root} (got "
                           f"{'a folder' if path.is_dir() else 'a FIFO or device'} {path.name}: remove it)")
    return path


def _listing(cache):
    """``cache.listing()``, every entry checked first (:func:`_entry`). An entry removed between
    the folder's listing and its reading (by another process's write, prune or clear) is left
    out, as it would be had the listing come a moment later."""
    for path in cache.entries():
        try:
            _entry(cache, path)
        except FileNotFoundError:
            continue
    return cache.listing()  # lists an entry it cannot read (corrupt, nested too deeply) with why


def _removal_failed(cache, failures, done: str) -> CommandError:
    """The error of a clear or prune that left entries it could not remove (a read-only folder)."""
    _, exc = failures[0]  # the first says why (the same for all, in a read-only folder)
    return CommandError(f"expected to remove entries from {cache.root}, but {len(failures)} could not be removed "
                        f"({_describe(exc)}); {done}")


def _describe(exc: BaseException) -> str:
    """An exception as part of one line."""
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror + (f": {exc.filename}" if exc.filename else "")
    return " ".join(str(exc).split()) or type(exc).__name__


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
    from ..jit import runtime as rt
    from ..pattern.features import structural_features
    from ..pattern.fingerprint import fingerprint
    from . import measure

    features = structural_features(M.indptr, M.indices, M.shape)
    entry = patterns.lookup(A._crow, A._col, M.shape[1])
    print(f"pattern  fingerprint {fingerprint(entry, A._crow, A._col)}; row mean {features['row_mean']:.1f}, "
          f"max {features['row_max']}, cv {features['row_cv']:.2f}")
    settings = rt.RuntimeSettings(mode="sync", budget_s=args.budget_s)
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


def info(args) -> int:
    import torch

    import torch_sparserl as ts

    from ..data.datasets import list_matrices

    print(f"torch-sparserl {ts.__version__}, torch {torch.__version__}, "
          f"CUDA {'available: ' + torch.cuda.get_device_name() if torch.cuda.is_available() else 'not available'}")
    print("operators: " + ", ".join(f"sparserl::{op}" for op in ts.ops.registered_ops()))
    print("shipped matrices: " + ", ".join(list_matrices()))
    print(f"C++ fast path: {ts.jit.fastpath.status()}")
    jit = config.from_environment().jit
    print(f"JIT runtime (from the environment): mode={jit.mode}, policy={jit.policy}, margin={jit.margin}, "
          f"admit_calls={jit.admit_calls}, queue={jit.queue}")
    from ..jit.cache import ENTRY_NAME
    from ..toolchain.paths import configured_cache_dir

    folder = configured_cache_dir() / "kernels"  # read only: info creates nothing
    try:
        sizes = [entry.lstat().st_size for entry in folder.iterdir() if ENTRY_NAME.match(entry.name)]
    except OSError:
        sizes = None
    print(f"kernel cache: {folder}, " + (f"{len(sizes)} entries, {sum(sizes) / 2**20:.2f} MB" if sizes is not None
                                         else "not created yet")
          + f" (at most {config.read('cache.max_mb'):g} MB)")
    from ..toolchain import cubins

    built, size = cubins.count()
    print(f"cubin cache: {configured_cache_dir() / cubins.FOLDER}, " + (
        f"{built} kernels, {size / 2**20:.2f} MB" if config.read("cache.cubins") else "off (SPARSERL_CACHE_CUBINS=0)"))
    return 0


def fastpath_command(args) -> int:
    """Build (once per machine and torch version) and load the C++ fast path of compiled products."""
    from ..jit import fastpath

    why = fastpath.unavailable()
    if why is not None:
        raise CommandError(f"needs a CUDA build of torch, with the fast path not turned off (here: {why})")
    started = time.perf_counter()
    ok = fastpath.ensure(wait=True)
    print(f"C++ fast path: {fastpath.status()} ({time.perf_counter() - started:.1f} s)")
    return 0 if ok else 1


# Results go to stdout, a line as soon as it is known; a line before each slow step, saying what
# starts and roughly how long it takes, goes to stderr, as does the progress of a loop that prints
# nothing per item (_progress). A loop that prints a line per item counts in it ("12/30").
def _note(text: str) -> None:
    """A line on stderr before a slow step: what starts and roughly how long it takes."""
    print(text, file=sys.stderr, flush=True)


def _count(done: int, total: int) -> str:
    """``done/total``, as wide for every ``done``."""
    return f"{done:>{len(str(total))}}/{total}"


def _progress(what: str, *, every_s: float = 10.0):
    """``report(done, total)`` for a loop's progress on stderr: a bar rewritten in place on a
    terminal; elsewhere (a log) a line at most every ``every_s`` seconds and at the end."""
    start = time.monotonic()
    last = [start]

    def report(done: int, total: int) -> None:
        now = time.monotonic()
        if sys.stderr.isatty():
            width = 30
            filled = width * done // max(total, 1)
            sys.stderr.write(f"\r{what} [{'#' * filled}{'.' * (width - filled)}] {done}/{total} "
                             f"{now - start:5.1f} s" + ("\n" if done >= total else ""))
        elif done >= total or now - last[0] >= every_s:
            last[0] = now
            sys.stderr.write(f"{what} {done}/{total}, {now - start:.1f} s\n")
        sys.stderr.flush()

    return report


def tune_command(args) -> int:
    """Search the kernel space for one matrix: on a GPU the exhaustive autotuner (candidates
    run in the sandbox, timed against cuSPARSE); without one, the compile tier with nvcc."""
    from concurrent.futures import ThreadPoolExecutor

    import torch

    from ..pattern.features import structural_features
    from ..specialize.autotune import candidates, tune

    from ..specialize.families import FAMILIES
    from ..toolchain import nvcc

    A = _matrix(args.matrix)
    n = 1 if args.op == "spmv" else args.n
    serving = [name for name, family in FAMILIES.items() if args.op in family.ops]
    if args.families and not set(args.families) <= set(serving):
        raise CommandError(f"--families: expected families that serve {args.op} ({', '.join(serving)}) "
                           f"(got {', '.join(f for f in args.families if f not in serving)})")
    on_gpu = torch.cuda.is_available() and not args.compile_only
    if not on_gpu and nvcc.nvcc_path() is None:
        raise CommandError(f"needs nvcc to compile the candidates {'(--compile-only)' if args.compile_only else 'without a GPU'}"
                           " (none in $CUDA_HOME/bin or on PATH): install the CUDA toolkit "
                           "(https://developer.nvidia.com/cuda-downloads), then put its bin/ on PATH or set CUDA_HOME")
    features = structural_features(A.indptr, A.indices, A.shape)
    print(f"matrix   {args.matrix}: {A.shape[0]} x {A.shape[1]}, {A.nnz} nonzeros, "
          f"row mean {features['row_mean']:.1f}, max {features['row_max']}, cv {features['row_cv']:.2f}")
    if on_gpu:
        _note(f"tune     screening the candidates on the GPU, each checked and timed in the sandbox "
              f"(within the {args.budget_s:g} s budget), then timing the finalists")
        result = tune(A, op=args.op, n=n, dtype=DTYPES[args.dtype], budget_s=args.budget_s,
                      families=args.families, progress=_progress("screening"))
        finals = sorted((r for r in result.table if r.timing.get("stage") == "final" and r.ok),
                        key=lambda r: r.runtime_us)
        for r in finals:
            print(f"final    {r.family:16s} {r.runtime_us:9.2f} us  cuSPARSE {r.cusparse_us:9.2f} us  "
                  f"{r.speedup:5.2f}x  {r.params}")
        failed = [r for r in result.table if not r.ok]
        print(f"result   {result.summary()}; {len(failed)} candidate(s) rejected")
        if result.best_spec is not None and args.show_source:
            print(result.best_spec.source)
        return 0 if result.best is not None else 1

    from ..evaluate.compile_tier import compile_only

    specs = candidates(args.op, n, DTYPES[args.dtype], features, args.families)
    print(f"note     no GPU{' (or --compile-only)' if torch.cuda.is_available() else ''}: compiling the "
          f"{len(specs)} candidates with nvcc for sm_90, not running them")
    workers = max(1, min(4, os.cpu_count() or 1))
    _note(f"compile  {len(specs)} candidates with nvcc, {workers} at a time (usually under a second each)")
    records = []
    with ThreadPoolExecutor(max_workers=workers) as pool:
        for spec, record in zip(specs, pool.map(compile_only, specs)):  # in order, each as soon as it is done
            records.append(record)
            status = "ok" if record.compiled and record.error_kind is None else str(record.error_kind)
            print(f"compile  {_count(len(records), len(specs))} {spec.describe():70s} {status:9s} "
                  f"regs={record.registers} spills={record.spill_bytes}")
    bad = [r for r in records if not r.compiled or r.error_kind is not None]
    print(f"result   {len(records) - len(bad)}/{len(records)} candidates compile cleanly")
    return 1 if bad else 0


def bench_command(args) -> int:
    """The runtime end to end on a GPU: cold specialization, correctness, and the time per call
    of ``A @ X`` against ``torch.sparse.mm``, dispatch included."""
    import torch

    from ..dtypes import VALUE_DTYPES
    from ..jit import runtime as rt
    from . import measure

    matrices = {name: _matrix(name) for name in args.matrices}  # every name checked before any work
    if not torch.cuda.is_available():
        raise CommandError("needs a CUDA GPU (the runtime specializes CUDA kernels); "
                           "`sparserl tune MATRIX` compiles the kernel space without one")
    dtype = {str(d).replace("torch.", ""): d for d in VALUE_DTYPES}[args.dtype]
    runtime = rt.configure(mode="sync", budget_s=args.budget_s)
    n = 1 if args.op == "spmv" else args.n
    rows, failures = [], 0
    for name in args.matrices:
        _note(f"bench    {name}: specializing {args.op} (within the {args.budget_s:g} s budget), then timing it")
        result = {"matrix": name, **measure.product(matrices[name], args.op, n, dtype, runtime=runtime)}
        rows.append(result)
        failures += not result["correct"]
        print(f"{name:24s} {args.op} n={n:<4d} cold {result['cold_s']:6.1f} s  A@X {result['hot_us']:9.1f} us  "
              f"torch.sparse {result['torch_sparse_us']:9.1f} us  {result['speedup']:5.2f}x  "
              f"{'ok' if result['correct'] else 'WRONG'}  {result['decision']}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, handle, indent=1)
    return 1 if failures else 0


def explain_command(args) -> int:
    """What the cache says about a matrix: which kernel serves each product, or why none does."""
    import numpy as np
    import torch

    from ..pattern.fingerprint import pattern_hash

    M = _matrix(args.matrix)
    if args.transposed:
        M = M.T.tocsr()
    hashes = {}
    for index_dtype in (torch.int32, torch.int64):
        crow = torch.from_numpy(M.indptr.astype(np.int64)).to(index_dtype)
        col = torch.from_numpy(M.indices.astype(np.int64)).to(index_dtype)
        hashes[pattern_hash(crow, col, M.shape[1])] = str(index_dtype).replace("torch.", "")
    cache = _cache(args)
    listing = _listing(cache)
    print(f"matrix   {args.matrix}{' (transposed)' if args.transposed else ''}: {M.shape[0]} x {M.shape[1]}, "
          f"{M.nnz} nonzeros; fingerprints " + ", ".join(f"{h[:12]} ({d})" for h, d in hashes.items()))
    found = 0
    for path, entry, _ in listing:
        if entry is None:
            continue
        key = entry.key
        if key.pattern not in hashes or (args.op and key.op != args.op) or (args.n and key.n != args.n):
            continue
        found += 1
        what = f"kernel {entry.family}{entry.params}" if entry.spec_source else "cuSPARSE"
        record = entry.record or {}
        timing = ""
        if record.get("runtime_us") and record.get("cusparse_us"):
            timing = f"; measured {record['runtime_us']:.1f} us vs cuSPARSE {record['cusparse_us']:.1f} us"
        print(f"{key.op} n={key.n} {key.dtype} {hashes[key.pattern]} indices, {key.arch}, policy {key.policy}, "
              f"torch {key.torch_version}: {what} because {entry.reason}{timing}  [{path.stem[:12]}]")
    if not found:
        # only a command that runs here: bench needs a GPU
        now = (f"(or run `sparserl bench {args.matrix}` now)" if torch.cuda.is_available() else
               "(this machine has none: `sparserl bench`, which decides it now, needs one)")
        print(f"no decision in {cache.root} for this pattern"
              f"{' and ' + args.op if args.op else ''}{f' n={args.n}' if args.n else ''}: it is decided the first "
              f"time the product runs on a GPU {now}")
    return 0


def cache_command(args) -> int:
    cache = _cache(args)
    if args.key is not None and args.action != "info":
        raise CommandError(f"{args.action}: expected no KEY (only `cache info KEY` takes one) (got {args.key!r})")
    if args.max_mb is not None and args.action != "prune":
        raise CommandError(f"{args.action}: expected no --max-mb (only `cache prune` takes it) (got {args.max_mb:g})")
    failures = []
    if args.action == "clear":
        removed = cache.clear(failures)
        if failures:
            raise _removal_failed(cache, failures, f"{removed} removed")
        print(f"removed {removed} entries from {cache.root}")
        if not args.dir:  # the cubins live in the user's own cache folder only
            from ..toolchain import cubins

            removed = cubins.clear(failures)
            if failures:
                raise _removal_failed(cache, failures, f"{removed} built kernels removed from "
                                      f"{cache.root.parent / cubins.FOLDER}")
            print(f"removed {removed} built kernels from {cache.root.parent / cubins.FOLDER}")
        return 0
    if args.action == "prune":
        limit = int(args.max_mb * (1 << 20)) if args.max_mb is not None else None
        removed, freed, kept = cache.prune(limit, failures)
        done = (f"removed {removed} least recently used entries ({freed / 2**20:.2f} MB) from {cache.root}; "
                f"{kept / 2**20:.2f} MB kept (limit {(limit if limit is not None else cache.max_bytes) / 2**20:g} MB)")
        if failures:
            raise _removal_failed(cache, failures, done)
        print(done)
        return 0
    if args.action == "list":
        listing = _listing(cache)
        size = cache.disk_bytes()
        print(f"{len(listing)} entries in {cache.root} ({size / 2**20:.2f} MB of at most {cache.max_bytes / 2**20:g} MB)")
        for path, entry, problem in listing:
            if entry is None:
                print(f"{path.stem}  unreadable: {problem}")
                continue
            key = entry.key
            what = entry.family + str(entry.params) if entry.spec_source else "cuSPARSE"
            print(f"{path.stem}  {key.op} n={key.n} {key.dtype} {key.arch} "
                  f"pattern={key.pattern[:12]}  -> {what}  ({entry.reason})")
        return 0
    if args.key is None:
        raise CommandError("info: expected the KEY of an entry, its digest or a prefix of it "
                           "(`sparserl cache list` shows them)")
    matches = [path for path in cache.entries() if path.stem.startswith(args.key)]
    if len(matches) != 1:
        raise CommandError(f"info: expected one entry starting with {args.key!r}, found {len(matches)}")
    document = _entry_document(matches[0])
    print(json.dumps(document, indent=1))
    return 0


def _entry_document(path: Path):
    """The JSON of the entry at ``path``, read as the cache reads entries: a regular file of
    bounded size, never through a symbolic link, never blocking."""
    from ..jit.cache import MAX_ENTRY_BYTES
    from ..toolchain.trust import UnsafeFile, read_regular

    try:
        raw = read_regular(path, MAX_ENTRY_BYTES)
    except FileNotFoundError as exc:
        raise CommandError(f"info: expected the entry {path.name} (got nothing: removed meanwhile, by a prune, a "
                           "clear or a write that found it unusable)") from exc
    except UnsafeFile as exc:
        raise CommandError(f"info: expected a regular file of at most {MAX_ENTRY_BYTES} bytes at {path} (got "
                           f"{exc}, which the cache refuses to read; `sparserl cache clear` removes it)") from exc
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise CommandError(f"info: expected JSON in {path} (got {_describe(exc)})") from exc


class _Parser(argparse.ArgumentParser):
    """argparse's own errors as one line too (``sparserl tune: argument --n: ...``), status 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: {' '.join(message.split())} (`{self.prog} --help` for usage)\n")


def _run(args) -> int:
    """Run a subcommand: an expected error is one line on stderr and exit status 2, anything
    else (a bug) one line and status 1; ``SPARSERL_DEBUG=1`` raises either with its traceback."""
    command = f"sparserl {args.command}"
    try:
        debug = config.from_environment(warn=False).log.debug  # every variable checked: none is read half way
    except ValueError as exc:  # a variable cannot be read, or is out of its range
        print(f"{command}: {exc}", file=sys.stderr)
        return 2
    if hasattr(sys.stdout, "reconfigure"):  # each result line as it is printed, also into a pipe
        sys.stdout.reconfigure(line_buffering=True)
    try:
        from .. import ops  # noqa: F401  the operators: ``import torch_sparserl`` defers them in the command
        return args.run(args)
    except KeyboardInterrupt:
        print(f"{command}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        if debug:
            raise
        if isinstance(exc, _EXPECTED) or type(exc).__module__.startswith(__name__.partition(".")[0] + "."):
            print(f"{command}: {_describe(exc)}", file=sys.stderr)
            return 2
        print(f"{command}: internal error, {type(exc).__name__}: {_describe(exc)} "
              "(SPARSERL_DEBUG=1 shows its traceback)", file=sys.stderr)
        return 1


def _parser() -> _Parser:
    """The command line: every command and option with its help text."""
    parser = _Parser(prog="sparserl", description=DESCRIPTION, epilog=EXIT_STATUSES)
    commands = parser.add_subparsers(dest="command", required=True, help="sparserl COMMAND --help describes each")
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
    p = commands.add_parser("info", help="versions, operators and shipped matrices", description=(
        "Versions, the registered operators, the shipped matrices, the C++ fast path's state, the JIT runtime's "
        "settings from the environment, and the caches' folders and sizes."))
    p.set_defaults(run=info)
    p = commands.add_parser("tune", help="search the kernel space for a matrix (GPU), or compile it (no GPU)",
                            description=(
        "Search the kernel space for one matrix. On a GPU: the exhaustive autotuner, each candidate run in a "
        "sandbox, checked against float64 and timed against cuSPARSE. Without one (or with --compile-only): each "
        "candidate compiled with nvcc for sm_90 and not run, which needs nvcc."))
    p.add_argument("matrix", help="shipped name or .npz/.mtx path")
    p.add_argument("--op", choices=["spmm", "spmv"], default="spmm", help=_OP_HELP)
    p.add_argument("--n", type=_columns, default=32, help=f"dense columns for spmm, 1 to {MAX_N} (default 32)")
    p.add_argument("--dtype", type=_dtype, default="float32", metavar=_DTYPE_METAVAR, help=_DTYPE_HELP)
    p.add_argument("--budget-s", type=_seconds, default=60.0, help="screening budget in seconds (default 60)")
    p.add_argument("--families", type=_families, help="comma-separated families to search (default: all)")
    p.add_argument("--compile-only", action="store_true", help="only the compile tier, even with a GPU")
    p.add_argument("--show-source", action="store_true", help="print the best kernel's source")
    p.set_defaults(run=tune_command)
    p = commands.add_parser("bench", help="the runtime end to end against torch.sparse.mm (GPU)", description=(
        "Needs a CUDA GPU. For each matrix: the first A @ X with its specialization (cold start), the result "
        "against float64, and the time per call of A @ X against torch.sparse.mm, dispatch included."))
    p.add_argument("matrices", nargs="+", help="shipped names or .npz/.mtx paths")
    p.add_argument("--op", choices=["spmm", "spmv"], default="spmm", help=_OP_HELP)
    p.add_argument("--n", type=_columns, default=32, help=f"dense columns for spmm, 1 to {MAX_N} (default 32)")
    p.add_argument("--dtype", type=_dtype, default="float32", metavar=_DTYPE_METAVAR, help=_DTYPE_HELP)
    p.add_argument("--budget-s", type=_seconds, default=20.0, help="autotuning budget per product (default 20)")
    p.add_argument("--json", type=_output_file, help="write the results to this file")
    p.set_defaults(run=bench_command)
    p = commands.add_parser("explain", help="why a kernel was or was not installed for a matrix", description=(
        "Which kernel the specialization cache says serves each product of a matrix's pattern, and why; or that "
        "none was decided yet."))
    p.add_argument("matrix", help="shipped name or .npz/.mtx path")
    p.add_argument("--op", choices=["spmm", "spmv"], help="only this op")
    p.add_argument("--n", type=_columns, help="only this N")
    p.add_argument("--transposed", action="store_true", help="the transposed pattern (what the backward uses)")
    p.add_argument("--dir", type=_folder,
                   help="cache folder (default: $SPARSERL_CACHE_DIR or ~/.cache/torch_sparserl/kernels)")
    p.set_defaults(run=explain_command)
    p = commands.add_parser("fastpath", help="build and load the C++ fast path of compiled products now (CUDA torch)",
                            description=(
        "Build (once per machine and torch version) and load the C++ library that serves products once Python "
        "has served the same call; needs a CUDA build of torch."))
    p.set_defaults(run=fastpath_command)
    p = commands.add_parser("cache", help="the specialization cache: list, info KEY, clear, prune", description=(
        "The specialization cache's decisions: list them, show one (info KEY), remove them all (clear), or "
        "remove the least recently used down to a size (prune)."))
    p.add_argument("action", choices=["list", "info", "clear", "prune"], help="what to do")
    p.add_argument("key", nargs="?", help="entry digest (or its prefix) for info")
    p.add_argument("--dir", type=_folder,
                   help="cache folder (default: $SPARSERL_CACHE_DIR or ~/.cache/torch_sparserl/kernels)")
    p.add_argument("--max-mb", type=_megabytes,
                   help="prune: keep at most this many megabytes of entries (default: cache.max_mb, "
                        "$SPARSERL_CACHE_MAX_MB)")
    p.set_defaults(run=cache_command)
    return parser


def main(argv: list[str] | None = None) -> int:
    return _run(_parser().parse_args(argv))

if __name__ == "__main__":
    sys.exit(main())
