"""The build stage: ABI sources → launchable kernels.

Pipeline stage 5 of 14: an ABI source becomes a launchable kernel: NVRTC, torch's extension
builder, offline nvcc; where built files live (:mod:`.paths`) and which may be loaded
(:mod:`.trust`).
May import: config, dtypes, data, pattern, kernels, abi.

Three builders, one source format (``csrc/README.md``):

* :mod:`.nvrtc` — NVRTC, tens of milliseconds: screening, autotuning, RL rollouts.
* :mod:`.inline` — torch's extension builder, lean and batched: installed kernels.
* :mod:`.nvcc` — offline ``nvcc`` to cubin/PTX for ``sm_90``: the compile tier with no GPU.
"""

from __future__ import annotations

from ..abi import KernelSpec, PlanError
from .errors import BuildError, CompileError, LaunchError
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


__all__ = ["BACKENDS", "BuildError", "CompileError", "Kernel", "LaunchError", "load_kernel"]
