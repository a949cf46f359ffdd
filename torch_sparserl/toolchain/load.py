"""Loading kernels once per process: :func:`load_kernel` builds an ABI source with a backend and
keeps what it built, by source hash (and for NVRTC by GPU); :func:`prebuild_nvrtc` compiles many
at once ahead of it."""

from __future__ import annotations

from ..abi import KernelSpec, PlanError
from .errors import CompileError
from .kernel import Kernel

BACKENDS = ("nvrtc", "inline")

_LOADED: dict[tuple[str, str, int | None], Kernel] = {}  # (source key, backend, GPU for NVRTC)


def load_kernel(spec: KernelSpec, backend: str = "nvrtc") -> Kernel:
    """Build ``spec`` with ``backend`` (memoized per process by source hash, and for NVRTC per
    GPU: its module, and the CUfunction the C++ fast path launches, belong to the current
    device's context)."""
    if backend not in BACKENDS:
        raise ValueError(f"load_kernel: backend must be one of {BACKENDS} (got {backend!r})")
    try:
        spec.plan  # noqa: B018
    except PlanError as exc:
        raise CompileError(f"load_kernel: {exc}") from exc
    device = None
    if backend == "nvrtc":
        import torch

        device = torch.cuda.current_device() if torch.cuda.is_available() else None
    cache_key = (spec.key, backend, device)
    if cache_key not in _LOADED:
        if backend == "nvrtc":
            from . import nvrtc
            _LOADED[cache_key] = nvrtc.load(spec)
        else:
            from . import inline
            _LOADED[cache_key] = inline.build([spec])[spec.key]
    return _LOADED[cache_key]


def prebuild_nvrtc(specs: list[KernelSpec], workers: int = 4) -> dict[str, float]:
    """Compile the NVRTC kernels of ``specs`` not yet loaded, up to ``workers`` at once, so
    that :func:`load_kernel` then finds them; returns each built key's compile seconds.

    NVRTC compiles distinct programs concurrently and ``ctypes`` releases the interpreter
    lock around the call, so K candidates cost about one compile on K cores. Modules are
    loaded on the calling thread (the CUDA context is current there). A spec that does not
    compile is left out: :func:`load_kernel` compiles it again and raises its error where
    the evaluation records it.
    """
    import os
    from concurrent.futures import ThreadPoolExecutor

    import torch

    from . import nvrtc

    if workers < 1:
        raise ValueError(f"prebuild_nvrtc: workers must be >= 1 (got {workers})")
    device = torch.cuda.current_device()
    todo = {}
    for spec in specs:
        try:
            spec.plan  # noqa: B018
        except PlanError:
            continue
        if (spec.key, "nvrtc", device) not in _LOADED:
            todo.setdefault(spec.key, spec)
    if not todo:
        return {}
    arch = nvrtc.device_arch(device)

    def build(spec):
        try:
            return nvrtc.compile(spec.source, arch)
        except CompileError:
            return None

    threads = min(workers, len(todo), os.cpu_count() or 1)
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="sparserl-nvrtc") as pool:
        built = list(pool.map(build, todo.values()))
    seconds = {}
    for spec, result in zip(todo.values(), built):
        if result is not None:
            _LOADED[(spec.key, "nvrtc", device)] = nvrtc.from_cubin(spec, *result)
            seconds[spec.key] = round(result[2], 4)
    return seconds
