"""The C++ fast path of the products in compiled graphs.

A compiled GNN epoch on a small graph waits on the CPU, and each product's Python
implementation (checks, pattern lookup, the runtime's state, a ctypes launch) costs tens to
hundreds of microseconds of it. The backend's post-grad pass points a graph's ``spmm``,
``spmv`` and their transposes at ``sparserl_fast::<op>`` (:data:`~torch_sparserl.ops.FAST_OPS`):
the implementation-only operators, whose CUDA kernel is C++ (``csrc/fastpath.cpp`` and the parts
it includes, ``csrc/fastpath/*.h``: :func:`sources`) once this module has built and loaded it.
That kernel serves a call from a registry, without Python, when the Python implementation has
served the same call before: the same ``crow`` and ``col`` tensors (alive, unmodified), op,
``ncols``, N and dtype, operands of the same sizes. It then launches the installed kernel
through its library's C launcher (or, while that library is built, the NVRTC build's
CUfunction through the driver), or runs cuSPARSE where the runtime decided that no kernel
beats it. Anything else goes to ``sparserl_direct::<op>``, the Python
implementation, which checks, raises the operators' errors, decides, and records what served
the call (:func:`record`), cuSPARSE too while a decision is still pending. Nothing is decided
in C++: an entry repeats one of the runtime's decision records
(:class:`~torch_sparserl.jit.decisions.Decision`), and the registry is emptied by the runtime's one
invalidation hook (:meth:`Runtime.invalidate <torch_sparserl.jit.runtime.Runtime.invalidate>`:
the runtime changes, or a record's pending or installed state is replaced) through
:func:`forget`.

Young patterns are the exception that C++ serves without any record: a pattern ``ts.csr``
staged from host arrays (``stage_csr``, which checked them), while it is younger than the
runtime's admission age (:func:`young_ns`), has its products, and its first transposed product,
served by cuSPARSE on its own arrays, as the runtime would serve them; the registry's owner
counts them as young calls. A sampled mini-batch's products then cost no Python at all.

An entry keeps what it serves with (the indices its pattern validated: the pattern's own copy,
int32 copies or the transposed pattern; plan data), and only weak references to the call's
own ``crow`` and ``col``, which identify the pattern and are never read: once those die, the entry is dropped at the next recording or when the
runtime changes, and :func:`forget` drops every entry at once.

The library is built once per machine and torch version with torch's extension builder (C++
only, tens of seconds: it includes torch's operator headers), in a subprocess
so that no training loop stalls on the builder, and kept in the kernel cache directory
(``build/``); later processes load it in milliseconds, once its bytes match the keyed digest
its build recorded (:func:`~torch_sparserl.toolchain.inline.verified_build`: a library planted or
changed there is rebuilt, never loaded). Until it is loaded, ``sparserl_fast`` ops run the Python
implementation. Where torch has no CUDA, or with ``SPARSERL_FAST_PATH=0``, it is never built.

    sparserl fastpath        # build and load it now (else the first compiled graph starts that)
"""

from __future__ import annotations

import functools
import hashlib
import logging
import re
import subprocess
import sys
import threading
from pathlib import Path

import torch

from .. import config
from ..pattern import device_check
from ..toolchain.paths import build_root
from .decisions import Fallback, Installed, Pending

log = logging.getLogger("torch_sparserl.jit.fastpath")

CSRC = Path(__file__).resolve().parents[1] / "_csrc"
SOURCE = CSRC / "fastpath.cpp"
"""The library's one translation unit, which includes its parts (``csrc/fastpath/*.h``, one
concern each: csrc/README.md maps them); :func:`sources` lists them all."""
OPS = ("spmm", "spmv", "spmm_transposed", "spmv_transposed")  # in csrc/fastpath/registry.h's order (enum Op)
SDDMM = 4  # csrc/fastpath/registry.h's op of sparserl::sddmm (crow, col, Y, X): installed kernels only

loaded = False
"""Whether the library is loaded in this process (the ops' Python implementations read it on
every call: a plain attribute)."""

serve = None
"""Once the library is loaded, its ``serve(op, crow, col, val, ncols, X) -> Tensor | None``: an
eager CSRMatrix product (``op`` an index into :data:`OPS`) served from the registry without
the dispatcher, or None where the call is not the registry's or needs autograd, autocast or a
mode (the caller then runs the Python path, which records it)."""

cusparse_once = None
"""Once the library is loaded, its ``cusparse_once(crow, col, val, ncols, X, transposed) ->
Tensor | None``: ``A @ X`` (or ``Aᵀ @ X``, no transpose computed) by cuSPARSE on A's own arrays,
with nothing kept for the pattern (None where cuSPARSE cannot do it there): the cuSPARSE
products the Python path serves (``ops.common._vendor``, ``ops.products._transposed_once``)."""

stage_csr = None
"""Once the library is loaded, its ``stage_csr(crow, col, val, nrows, ncols, device, young_ns=0)
-> list[Tensor]``: host CSR arrays sent to a CUDA device (``[crow, col]``, then the values if
given), the metadata checked and the indices checked on their private pinned copy; ``[]`` where
it does not apply or a check fails (``ts.csr``'s Python path then names the error).
``young_ns`` > 0 (:func:`young_ns`): the pattern is young that long, and C++ serves its
products by cuSPARSE meanwhile, as the runtime would, without Python."""

COUNTS = torch.zeros(3, dtype=torch.int64)
"""Calls the C++ path served with a kernel, with cuSPARSE, and of them young patterns' (the
runtime folds them into its stats: installed, fallback and young calls)."""
_COUNTS = COUNTS.numpy()  # shares COUNTS' memory: read without a torch call

_lock = threading.Lock()
_builder: threading.Thread | None = None
_failure: str | None = None
_owner = None  # the runtime whose decisions the registry holds
_taken = [0, 0, 0]  # COUNTS already folded into _owner's stats
_epoch = 0  # bumped by forget(): a decision's marks (Decision.fast) of an older epoch are stale


def unavailable() -> str | None:
    """Why the fast path cannot run in this process, or None."""
    if not config.read("fast_path.enabled"):
        return "turned off by SPARSERL_FAST_PATH"
    if torch.version.cuda is None:
        return "this torch has no CUDA"
    if _failure is not None:
        return _failure
    return None


# Hidden symbols: the library exports its module's init function only, so the pybind11 and
# torch inline functions it instantiates never interpose on another library's (it is loaded
# with local symbols too: _load_library).
CFLAGS = ("-O3", "-std=c++17", "-fvisibility=hidden")


_INCLUDE = re.compile(r'^#include "([^"]+)"', re.MULTILINE)


def sources() -> list[Path]:
    """Every file the library is compiled from: :data:`SOURCE`, then each file it includes with
    ``#include "..."`` (relative to the including file, followed into the parts' own includes),
    in the order the compiler meets them. A missing one raises FileNotFoundError."""
    found: list[Path] = []

    def visit(path: Path) -> None:
        if path in found:
            return
        found.append(path)
        for name in _INCLUDE.findall(path.read_text()):
            visit(path.parent / name)

    visit(SOURCE)
    return found


def _name() -> str:
    # every source by its place under csrc/ and its text: a change to any part is a new library
    h = hashlib.sha256()
    texts = [f"{path.relative_to(CSRC).as_posix()}\n{path.read_text()}" for path in sources()]
    for part in (*texts, torch.__version__, str(torch.version.cuda), " ".join(CFLAGS)):
        h.update(part.encode() + b"\0")
    return f"sparserl_fastpath_{h.hexdigest()[:16]}"


def library(directory: Path | None = None) -> tuple[Path, Path]:
    """``(shared library, marker written after a complete build)``."""
    name = _name()
    folder = (directory or build_root()) / name
    return folder / f"{name}.so", folder / f"{name}.ok"


def is_built() -> bool:
    from ..toolchain import trust

    return trust.is_verified(*library())


def cusparse_direct() -> bool:
    """Whether the loaded library calls cuSPARSE directly where the runtime decided for it, with
    descriptors kept per pattern and operand shape (else through ``at::addmm``/``at::addmv``,
    which make them every call): it needs the cuSPARSE header at build time."""
    return loaded and bool(torch.ops.sparserl_fastpath.cusparse_direct())


def status() -> str:
    """One line: loaded (from where), or why not."""
    if loaded:
        return f"loaded from {library()[0]}" + ("" if cusparse_direct() else " (cuSPARSE through torch's calls)")
    why = unavailable()
    if why is not None:
        return f"not available: {why}"
    return f"built, not loaded yet: {library()[0]}" if is_built() else "not built yet"


def build() -> Path:
    """Build the library here (:func:`ensure` runs this in a subprocess); returns its path."""
    from ..toolchain.inline import exclusive, verified_build

    path, done = library()

    def compile_library() -> None:
        from torch.utils.cpp_extension import load

        for source in sources():  # laid out in the build folder as under csrc/, for the includes
            copy = path.parent / source.relative_to(CSRC)
            copy.parent.mkdir(parents=True, exist_ok=True)
            copy.write_text(source.read_text())
        load(name=path.stem, sources=[str(path.parent / SOURCE.name)], build_directory=str(path.parent),
             with_cuda=True, is_python_module=False, extra_cflags=list(CFLAGS), verbose=False)

    with exclusive(path.parent):
        verified_build(path, done, compile_library)
    return path


def _load() -> bool:
    global loaded, serve, cusparse_once, stage_csr
    with _lock:
        if loaded:
            return True
        from ..toolchain import trust
        from ..toolchain.inline import load_verified

        path, done = library()
        data = trust.library_bytes(path, done)
        if data is None:  # not built, or not verified: built again (in a subprocess) before it loads
            return False
        module = load_verified(path, data, functools.partial(_load_library, path.stem))
        torch.ops.loaded_libraries.add(str(path))
        torch.ops.sparserl_fastpath.bind_counters(COUNTS)
        serve = module.serve
        device_check.register_door(module.intake)  # ts.csr of CUDA indices: one call (pattern.intake)
        # None where the library cannot say (then the transpose is computed, as without it)
        cusparse_once = getattr(torch.ops.sparserl_fastpath, "cusparse_once", None)
        stage_csr = getattr(torch.ops.sparserl_fastpath, "stage_csr", None)
        loaded = True
    log.info("sparserl: C++ fast path loaded from %s", path)
    return True


def _load_library(name: str, path: str):
    """Import the library at ``path`` as the Python module ``name``, which also registers its
    operators (its static initializers run as ``torch.ops.load_library``'s would). Its symbols
    stay local (Python's default ``dlopen`` flags, not ``RTLD_GLOBAL``): nothing resolves
    against them, and global pybind11 symbols would interpose on other extensions' (Triton's).
    The path is used as given: resolving it would take a sealed memory file's
    ``/proc/self/fd`` link to a name that does not exist."""
    import importlib.machinery
    import importlib.util

    loader = importlib.machinery.ExtensionFileLoader(name, path)
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    module = importlib.util.module_from_spec(spec)  # the dlopen
    loader.exec_module(module)
    return module


def _build_and_load() -> None:
    global _failure
    try:
        done = subprocess.run([sys.executable, "-c", "from torch_sparserl.jit.fastpath import build; build()"],
                              capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(done.stderr.strip()[-2000:] or f"exit status {done.returncode}")
        _load()
    except Exception as exc:  # noqa: BLE001 - the Python path serves on
        _failure = f"building the C++ fast path failed: {exc}"
        log.warning("sparserl: %s; products run through the Python path", _failure)


_started = False


def start() -> None:
    """What the first CUDA product of a process calls: :func:`ensure` once (loaded now if it is
    on disk, else built in the background while Python serves); later calls return at once."""
    global _started
    if _started or loaded:
        return
    _started = True
    try:
        ensure()
    except Exception as exc:  # noqa: BLE001 - the Python path serves on
        log.warning("sparserl: the C++ fast path could not be loaded: %s; products run through the Python path", exc)


def ensure(*, wait: bool = False) -> bool:
    """Load the library, building it first (in a subprocess) when it is not on disk: in a
    background thread unless ``wait``. Returns whether it is loaded now. Safe to call often."""
    global _builder
    if loaded:
        return True
    if unavailable() is not None:
        return False
    if _load():
        return True
    with _lock:
        if _builder is None:
            _builder = threading.Thread(target=_build_and_load, name="sparserl-fastpath-build", daemon=True)
            _builder.start()
        builder = _builder
    if wait:
        builder.join()
    return loaded


# ------------------------------------------------------------------ the registry

_driver_functions: bool | None = None


def driver_functions() -> bool:
    """Whether the loaded library can launch an NVRTC build's CUfunction: it looks the driver's
    ``cuLaunchKernel`` up through the CUDA runtime (12.5 or later). Where not, such a kernel is
    served by Python until its library's kernel replaces it."""
    global _driver_functions
    if _driver_functions is None:
        _driver_functions = bool(torch.ops.sparserl_fastpath.driver_functions())
    return _driver_functions


def record(runtime, op: str, crow: torch.Tensor, col: torch.Tensor, val: torch.Tensor, ncols: int,
           X: torch.Tensor) -> None:
    """After the Python implementation served ``sparserl_fast::<op>`` (or ``sparserl_direct``, or
    an eager product) on these CUDA operands, let the C++ path serve the next such call the same way, as
    ``runtime``'s decision record says: its installed kernel, or cuSPARSE where it decided for
    cuSPARSE, where the decision is still pending (the runtime's invalidation hook drops the
    registry when it lands), or where the runtime is off. Nothing is recorded inside a CUDA
    graph capture, or for what C++ does not serve (inference-mode indices, SDDMM by cuSPARSE,
    kernels with neither a C launcher nor a CUfunction it can launch). C++ runs cuSPARSE's half
    products with float32 sums, as the Python path does (:mod:`torch_sparserl.kernels.vendor`).
    Every door calls it through :func:`torch_sparserl.ops.doors.record`, the one place."""
    global _owner
    from .. import pattern as patterns

    entry = patterns.validated(crow, col, ncols)
    if (runtime is None or entry is None or entry.transient or entry.overfull
            or entry.check is not None and not entry.settle()):
        return  # what C++ cannot serve (nor a pattern whose device check has not come back): Python serves
    sddmm = op == "sddmm"  # val is Y (rows, n) and ncols X's rows; only an installed kernel is recorded
    transposed = op.endswith("_transposed")
    if transposed and not entry.has_transpose:
        return  # served without one (a first transposed product): the next call computes it and records
    base = op.removesuffix("_transposed")
    n = X.shape[1] if base in ("spmm", "sddmm") else 1
    form = entry.transpose(crow, col) if transposed else None  # (pattern_t, crow_t, col_t, perm)
    used = form[0] if transposed else entry
    if runtime.young(used):
        return  # not admitted (jit.admit_age_s): no decision record, nothing for C++
    decision = runtime.decision(base, used, n, val.dtype)
    if decision.state is None and runtime.decides_on(X.device):
        return  # not decided, nor asked to be (a call the runtime did not admit): the next call records
    # recorded already: the common case of a call C++ leaves to Python (a fast_path=False
    # graph), so it is checked first
    if ((_epoch, op) in decision.fast or crow.is_inference() or col.is_inference()
            or torch.cuda.is_current_stream_capturing()):
        return
    # C++ serves with the indices the pattern validated (Pattern.indices): its private copy of a
    # caller's tensors; where they are the call's own (the library's tensors), none is handed
    # over, so that the entry keeps no strong reference to them
    if transposed:
        _, rowptr, colidx, perm = form
    else:
        (rowptr, colidx), perm = entry.indices(crow, col), None
        if rowptr is crow and colidx is col:
            rowptr = colidx = None
    # the state is read under the lock that forget() takes: a decision landing meanwhile is
    # either read here or empties the registry after this entry is in
    with _lock:
        state = decision.state
        epoch = _epoch
        args = None
        if isinstance(state, Installed):
            fast = getattr(state.launch, "fast", None)
            if fast is not None:
                if fast.copies is not None:
                    rowptr, colidx = fast.copies
                if fast.launcher or driver_functions():
                    args = (fast.launcher, [fast.grid, fast.block, fast.smem], fast.aux, list(fast.ints),
                            fast.init_zero, fast.work_numel, fast.function, fast.work_once)
        elif not sddmm and (
                (isinstance(state, Fallback) and (state.decided or not runtime.settings.strict))
                or isinstance(state, Pending)
                or (state is None and not runtime.decides_on(X.device))):
            args = (0, [0, 0, 0], None, [0] * 5, False, 0, 0, False)
        if args is None:
            return
        launcher, geometry, aux, ints, init_zero, work_numel, function, work_once = args
        if _owner is not runtime:
            _forget_locked()
            _owner = runtime
            epoch = _epoch
        torch.ops.sparserl_fastpath.install(
            crow, col, ncols, SDDMM if sddmm else OPS.index(op), n, val.dtype, entry.nnz, X.shape[0], used.nrows,
            rowptr, colidx,
            perm, launcher, geometry, aux, ints, init_zero, work_numel, used.ncols, function, work_once)
        decision.fast.add((epoch, op))


def _forget_locked() -> None:
    global _owner, _epoch
    if _owner is not None:
        _fold_locked(_owner)
    _owner = None
    _epoch += 1
    if loaded:
        torch.ops.sparserl_fastpath.forget()


def forget(runtime=None) -> None:
    """Empty the registry (the runtime changed or closed; ``runtime``: only if it is the one
    whose decisions the registry holds), its calls folded into that runtime's stats first."""
    if not loaded:
        return
    with _lock:
        if runtime is None or _owner is runtime:
            _forget_locked()


def _fold_locked(runtime) -> None:
    kernel, vendor, young = int(_COUNTS[0]), int(_COUNTS[1]), int(_COUNTS[2])
    runtime._stats["installed_calls"] += kernel - _taken[0]
    runtime._stats["fallback_calls"] += vendor - _taken[1]
    runtime._stats["young_calls"] += young - _taken[2]
    _taken[0], _taken[1], _taken[2] = kernel, vendor, young


def young_served() -> int:
    """How many calls C++ has served as young (by cuSPARSE, before their pattern's admission age)
    in this process: C++ does not say which pattern, so a warm-up counts them all."""
    return int(_COUNTS[2]) if loaded else 0


def fold(runtime) -> None:
    """Add the calls C++ served since the last fold to ``runtime``'s stats, if its decisions
    are the ones the registry holds."""
    # read without the lock first: nothing to add on most reads (the eager path reads stats per call)
    if _owner is runtime and runtime is not None and (_COUNTS[0] != _taken[0] or _COUNTS[1] != _taken[1]
                                                      or _COUNTS[2] != _taken[2]):
        with _lock:
            if _owner is runtime:
                _fold_locked(runtime)


def young_ns(runtime) -> int:
    """How long (ns) a pattern staged now stays young for ``runtime``, the active one: C++ then
    serves its products by cuSPARSE meanwhile (``stage_csr``'s ``young_ns``), and counts them
    into ``runtime``'s stats, which this makes the registry's owner. 0 where the runtime wants to
    see young calls itself or has none: not background mode, no admission age, class kernels on
    (``jit.class_after``: it counts a class's patterns), not deciding on CUDA."""
    global _owner
    settings = runtime.settings
    if settings.mode != "background" or not settings.admit_age_s or settings.class_after \
            or "cuda" not in runtime.devices:
        return 0
    if _owner is not runtime:
        with _lock:
            if _owner is not runtime:
                _forget_locked()
                _owner = runtime
    return int(settings.admit_age_s * 1e9)


def entries() -> int:
    """Live entries in the registry (0 when the library is not loaded)."""
    return int(torch.ops.sparserl_fastpath.entries()) if loaded else 0

