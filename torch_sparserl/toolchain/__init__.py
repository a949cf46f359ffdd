"""The build stage: ABI sources → launchable kernels.

Pipeline stage 5 of 14: an ABI source becomes a launchable kernel: NVRTC, torch's extension
builder, offline nvcc; where built files live (:mod:`.paths`), which may be loaded
(:mod:`.trust`), and NVRTC's builds kept across processes (:mod:`.cubins`); the fused intake kernel
of CUDA indices (:mod:`.intake`), registered with :mod:`~torch_sparserl.pattern.device_check`.
May import: config, dtypes, data, pattern, kernels, abi.

Three builders, one source format (``csrc/README.md``):

* :mod:`.nvrtc` — NVRTC, tens of milliseconds (a source built before on the machine: read
  from :mod:`.cubins`): screening, autotuning, RL rollouts.
* :mod:`.inline` — torch's extension builder, lean and batched: installed kernels.
* :mod:`.nvcc` — offline ``nvcc`` to cubin/PTX for ``sm_90``: the compile tier with no GPU.
"""

from __future__ import annotations

from .errors import BuildError, CompileError, LaunchError
from .intake import PROVIDER as INTAKE_KERNEL  # registers the fused intake kernel with pattern.device_check
from .kernel import Kernel
from .load import BACKENDS, load_kernel, prebuild_nvrtc

__all__ = ["BACKENDS", "BuildError", "CompileError", "INTAKE_KERNEL", "Kernel", "LaunchError", "load_kernel",
           "prebuild_nvrtc"]
