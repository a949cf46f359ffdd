"""Installers: a decided kernel turned into a launch bound to its pattern's plan data.

An installer is called as ``installer(entry, crow, col, ncols) -> launch`` by the runtime
(:mod:`~torch_sparserl.jit.runtime`) once a key's decision names a kernel, and returns
``launch(crow, col, val, X, bias=None, scale=None) -> Y``, which runs on the current stream.
It builds (or loads from disk) the kernel, prepares its plan data once on the host
(:mod:`~torch_sparserl.abi.prepare`) and binds them. Three are shipped:
:func:`inline_installer` (the kernel's library, built by the lean extension build),
:func:`nvrtc_installer` (the same source's NVRTC build, served while the library is built) and
:func:`fused_installer` (SpMM kernels rendered again with an epilogue, checked by
:func:`~torch_sparserl.jit.fused.check_fused` before their first use). A launch also carries what the C++ fast path
needs to repeat it without Python (``launch.fast``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable
from types import SimpleNamespace

import torch

from ..abi import DTYPES
from ..pattern import host_indices
from .cache import CacheEntry
from .decisions import SpecializationError

DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}  # torch dtype -> ABI name


def device_arch(device: torch.device) -> str:
    """The architecture kernels are built for on ``device`` (``sm_90``), or its type off CUDA."""
    if device.type != "cuda":
        return device.type
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}"


def on_device(t: torch.Tensor):
    """``t``'s GPU as the current device (a context manager; nothing for CPU tensors)."""
    return torch.cuda.device(t.device) if t.device.type == "cuda" else contextlib.nullcontext()


def entry_spec(entry: CacheEntry):
    """The :class:`~torch_sparserl.abi.KernelSpec` of a cache entry's kernel."""
    from ..abi import KernelSpec

    return KernelSpec(entry.spec_source, entry.family, tuple(sorted(entry.params.items())))


def library_built(entry: CacheEntry, arch: str) -> bool:
    from ..toolchain import inline

    return inline.is_built([entry_spec(entry)], arch)


def inline_installer(entry: CacheEntry, crow: torch.Tensor, col: torch.Tensor, ncols: int, *,
                     like: Callable | None = None) -> Callable:
    """Build (or load from disk) the entry's kernel, prepare its plan data once, bind them.
    ``like``: a launch of the same source on the same pattern (the interim NVRTC build's), whose
    plan data and index copies are taken instead of preparing them again."""
    return _bind_spec(entry_spec(entry), crow, col, ncols, entry.key.n, like=like)


def nvrtc_installer(entry: CacheEntry, crow: torch.Tensor, col: torch.Tensor, ncols: int) -> Callable:
    """The same as :func:`inline_installer` from the source's NVRTC build (held for the process's
    life by ``toolchain.load_kernel``): the interim installer, while the library is built."""
    from ..toolchain import load_kernel

    spec = entry_spec(entry)
    return _bind_spec(spec, crow, col, ncols, entry.key.n, kernel=load_kernel(spec, "nvrtc"))


def fused_installer(spec, crow: torch.Tensor, col: torch.Tensor, ncols: int, n: int) -> Callable:
    """The installer of kernels with an epilogue: ``launch(crow, col, val, X, bias, scale)``."""
    return _bind_spec(spec, crow, col, ncols, n)


def family_params(params: dict) -> dict:
    """A cache entry's family parameters as :func:`~torch_sparserl.specialize.families.render` takes them
    (entries of policy samples hold the text of their ``// family:`` line: ``"8"``, ``"(4,32)"``)."""
    out = {}
    for name, value in params.items():
        if isinstance(value, str) and value.isdigit():
            value = int(value)
        elif isinstance(value, str) and value.startswith("(") and value.endswith(")"):
            value = tuple(int(v) for v in value[1:-1].split(",") if v.strip())
        out[name] = value
    return out


def _stream_of(index: int) -> int:
    return torch.cuda.current_stream(index).cuda_stream


current_raw_stream: Callable[[int], int] = getattr(torch._C, "_cuda_getCurrentRawStream", None) or _stream_of
"""The current CUDA stream of device ``index`` as the address launches take (torch's raw getter,
without a Stream object, where this torch has it)."""


@functools.lru_cache(maxsize=None)
def _openmp() -> bool:
    return "OpenMP" in torch.__config__.parallel_info()


@contextlib.contextmanager
def one_cpu_thread():
    """torch's CPU operators called from this thread use one core inside the block.

    For the runtime's background threads: their host work on a large pattern, parallel over
    every core, takes the cores that the training loop's thread needs to launch its next step.
    torch's intra-op thread count is per thread under OpenMP (the training thread keeps its
    own); the process-wide default it also sets, read by threads that start their first
    parallel operator meanwhile, is restored on leaving. Under another threading backend the
    count is the process's, so nothing is changed there.
    """
    previous = torch.get_num_threads()
    if previous == 1 or not _openmp():
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def tf32_allowed() -> bool:
    """Whether torch lets float32 matrix products use TF32 (``torch.backends.cuda.matmul.allow_tf32``,
    ``torch.set_float32_matmul_precision("high")``): the opt-in a ``math=tf32`` kernel needs."""
    return torch.get_float32_matmul_precision() != "highest"


def _finish_copies(device: torch.device) -> None:
    """Wait for the copies this thread queued on ``device``: they ran on its current stream (maybe
    a background thread's), and must be done before any stream uses their data. That stream
    only: a device-wide wait would break a CUDA graph that another thread is capturing."""
    torch.cuda.current_stream(device).synchronize()


def _bind_spec(spec, crow: torch.Tensor, col: torch.Tensor, ncols: int, n: int, kernel=None,
               like: Callable | None = None) -> Callable:
    """``spec``'s kernel (``kernel``, else its library's, built or loaded) with its plan data for
    this pattern: ``launch(crow, col, val, X, bias, scale)``. ``like``: a launch this function
    returned for the same source and the same pattern and width, whose plan data are reused.
    A ``math=tf32`` kernel is refused (the caller serves the product otherwise) unless torch
    allows TF32 when it is installed."""
    from ..abi import operand_shapes
    from ..abi.prepare import prepare
    from ..toolchain import inline

    if spec.plan.math == "tf32" and not tf32_allowed():
        raise SpecializationError(
            f"kernel {spec.key}: its plan says math=tf32, and torch does not allow TF32 for float32 "
            f"products (torch.get_float32_matmul_precision() is 'highest'; set "
            f"torch.backends.cuda.matmul.allow_tf32 = True to opt in)")
    if kernel is None:
        kernel = inline.build([spec])[spec.key]
    rows = crow.numel() - 1
    # What the kernel reads besides the operands (plan data, int32 copies of int64 indices) is
    # computed on the host, from the copy the fingerprint and the specializer read
    # (Pattern.host_indices), then copied over. On the device, prepare() would launch torch
    # kernels (a sort, a scan, repeat_interleave) that a training process has mostly never
    # launched, and CUDA's lazy module loading holds every launch in the process while it loads
    # them, stalling the training step beside the background install. On the host its time
    # goes mostly to torch ops that release the interpreter lock. They run on one core
    # (one_cpu_thread), so that they do not take the cores the training thread launches from.
    plan_data = (spec.key, n, ncols, crow.data_ptr(), col.data_ptr(), col.device)
    reused = getattr(like, "plan_data", None)
    if reused is not None and reused[0] == plan_data:
        prepared, copies = reused[1]
    else:
        with one_cpu_thread():
            host_crow, host_col = host_indices(crow, col, ncols)
            prepared = prepare(spec.plan, host_crow, host_col, (rows, ncols), n)
            if prepared.aux is not None:
                prepared = dataclasses.replace(prepared, aux=prepared.aux.to(col.device))
            # int64 patterns get int32 copies, owned here; int32 ones are used as passed, never
            # held, so an installed kernel does not keep the user's adjacency alive.
            copies = None
            if crow.dtype != torch.int32 or col.dtype != torch.int32:
                copies = tuple(t.to(torch.int32).contiguous().to(col.device) for t in (host_crow, host_col))
            del host_crow, host_col
        _finish_copies(col.device)
    bound = kernel.bind(prepared)
    shape = operand_shapes(spec.plan.op, rows, ncols, col.numel(), n)["y"]
    device_index = col.device.index if col.device.index is not None else torch.cuda.current_device()
    current_stream = functools.partial(current_raw_stream, device_index)

    init_zero = prepared.init_zero

    def launch(crow: torch.Tensor, col: torch.Tensor, val: torch.Tensor, X: torch.Tensor,
               bias: torch.Tensor | None = None, scale: torch.Tensor | None = None) -> torch.Tensor:
        if copies is not None:
            crow, col = copies
        # X has the dtype and device of val; one allocation call, zeroed when the plan says so
        y = X.new_zeros(shape) if init_zero else X.new_empty(shape)
        return bound(crow, col, val, X, y, current_stream(), zeroed=init_zero, bias=bias, scale=scale)

    launch.kernel = bound  # for explain and the benchmarks
    launch.plan_data = (plan_data, (prepared, copies))  # for the same source's next install (like=)
    if (kernel.launcher is not None or kernel.function is not None) and spec.plan.epilogue == "none":
        # what the C++ fast path needs to launch it without Python (fastpath.record): the C
        # launcher of a library, or the CUfunction of an NVRTC build (its shared memory limit
        # raised here, since its launches then bypass the module's)
        if kernel.launcher is None:
            kernel.allow_dynamic_smem(prepared.smem)
        launch.fast = SimpleNamespace(
            launcher=kernel.launcher or 0, function=kernel.function or 0, grid=prepared.grid, block=prepared.block,
            smem=prepared.smem,
            aux=prepared.aux, ints=(prepared.rows, prepared.cols, prepared.n, prepared.nnz, prepared.parts),
            init_zero=init_zero, work_numel=prepared.work_numel, work_once=prepared.work_once, copies=copies)
    return launch
