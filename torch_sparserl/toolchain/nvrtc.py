"""NVRTC builds: fast (tens of milliseconds), for screening, autotuning and RL rollouts."""

from __future__ import annotations

import time

import torch

from ..abi import KERNEL_NAME, KernelSpec
from . import cubins, driver
from .kernel import Kernel


def device_arch(device: torch.device | int | None = None) -> str:
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}"


def compile(source: str, arch: str | None = None) -> tuple[bytes, str, float]:  # noqa: A001
    """Compile ``source`` to a cubin; return (cubin, log, seconds). Raises CompileError. A build
    made before on this machine is read from the cubin cache (:mod:`.cubins`) instead."""
    start = time.perf_counter()
    arch = arch or device_arch()
    found = cubins.lookup(source, arch, driver.nvrtc_options(arch))
    if found is None:
        found = driver.nvrtc_compile(source, arch)
        # the options asked again: a build NVRTC refused the ptxas report for ran without it
        cubins.store(source, arch, driver.nvrtc_options(arch), *found)
    return *found, time.perf_counter() - start


def load(spec: KernelSpec, arch: str | None = None) -> Kernel:
    spec.plan  # noqa: B018 - a malformed plan fails before the compiler runs
    return from_cubin(spec, *compile(spec.source, arch))


def from_cubin(spec: KernelSpec, cubin: bytes, log: str, seconds: float) -> Kernel:
    """The kernel of a cubin :func:`compile` built from ``spec``'s source, loaded into the
    current context."""
    module = driver.Module(cubin, KERNEL_NAME)
    kernel = Kernel(
        spec, module.launch, backend="nvrtc",
        registers=module.attribute(driver.ATTR_NUM_REGS),
        local_bytes=module.attribute(driver.ATTR_LOCAL_SIZE_BYTES),
        max_threads=module.attribute(driver.ATTR_MAX_THREADS_PER_BLOCK),
        static_smem=module.attribute(driver.ATTR_SHARED_SIZE_BYTES),
        keepalive=module, function=module.function.value)
    kernel.compile_log, kernel.compile_seconds = log, seconds
    return kernel
