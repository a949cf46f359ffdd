"""Minimal ctypes bindings to NVRTC and the CUDA driver: compile, load and launch one kernel.

No dependency beyond torch: the libraries are the ones torch itself loads (``libnvrtc``
next to torch's CUDA runtime or in ``$CUDA_HOME``; ``libcuda`` from the driver). Launches
go on torch's current stream, in torch's primary context.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import glob
import os
from pathlib import Path

from .errors import CompileError, LaunchError

# CUfunction_attribute values (cuda.h)
ATTR_MAX_THREADS_PER_BLOCK = 0
ATTR_SHARED_SIZE_BYTES = 1
ATTR_LOCAL_SIZE_BYTES = 3
ATTR_NUM_REGS = 4
ATTR_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8


def cuda_home() -> Path | None:
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var) and Path(os.environ[var]).exists():
            return Path(os.environ[var])
    for guess in ("/usr/local/cuda",):
        if Path(guess).exists():
            return Path(guess)
    return None


def _candidates(stem: str) -> list[str]:
    found = []
    try:  # the pip wheels torch depends on (nvidia-cuda-nvrtc-cu1x / cuda-nvrtc)
        import nvidia  # type: ignore
        for root in getattr(nvidia, "__path__", []):
            found += sorted(glob.glob(os.path.join(root, "**", f"lib{stem}.so*"), recursive=True))
    except ImportError:
        pass
    home = cuda_home()
    if home:
        for sub in ("lib64", "lib", "targets/x86_64-linux/lib", "targets/sbsa-linux/lib"):
            found += sorted(glob.glob(str(home / sub / f"lib{stem}.so*")))
    name = ctypes.util.find_library(stem)
    if name:
        found.append(name)
    return found


@functools.cache
def nvrtc() -> ctypes.CDLL:
    try:  # torch knows where its own NVRTC is; private, so only a first guess
        from torch.cuda._utils import _get_gpu_rtc_library
        return _get_gpu_rtc_library()
    except Exception:  # noqa: BLE001 - any failure: search ourselves
        pass
    for path in _candidates("nvrtc"):
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    raise CompileError("NVRTC: libnvrtc not found (install the CUDA toolkit or set CUDA_HOME)")


@functools.cache
def libcuda() -> ctypes.CDLL:
    for path in ("libcuda.so.1", "libcuda.so", *_candidates("cuda")):
        try:
            lib = ctypes.CDLL(path)
            break
        except OSError:
            continue
    else:
        raise LaunchError("CUDA driver: libcuda not found (no NVIDIA driver on this machine?)")
    lib.cuLaunchKernel.argtypes = [
        ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint,
        ctypes.c_uint, ctypes.c_uint, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    lib.cuModuleGetFunction.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p]
    lib.cuModuleLoadData.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    lib.cuFuncGetAttribute.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_void_p]
    lib.cuFuncSetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    lib.cuModuleUnload.argtypes = [ctypes.c_void_p]
    return lib


def _error_name(code: int) -> str:
    name = ctypes.c_char_p()
    libcuda().cuGetErrorName(code, ctypes.byref(name))
    return name.value.decode() if name.value else f"CUresult {code}"


def check(code: int, what: str) -> None:
    if code != 0:
        raise LaunchError(f"CUDA driver: {what} failed with {_error_name(code)} ({code})")


@functools.cache
def include_dirs() -> tuple[str, ...]:
    dirs = []
    home = cuda_home()
    if home and (home / "include").exists():
        dirs.append(str(home / "include"))
    try:
        import nvidia  # type: ignore
        for root in getattr(nvidia, "__path__", []):
            dirs += sorted({str(Path(p).parent) for p in glob.glob(os.path.join(root, "*", "include", "cuda_fp16.h"))})
            dirs += sorted({str(Path(p).parent) for p in glob.glob(os.path.join(root, "cu*", "include", "cuda_fp16.h"))})
    except ImportError:
        pass
    return tuple(dirs)


NVRTC_ERROR_INVALID_OPTION = 5
# ptxas's resource report (registers, spill bytes) in the program log, so that the evaluator
# reads spills from the build itself instead of building a local-memory kernel again with
# nvcc. Not every build has it: NVRTC 13 left the log empty for a program it had built before
# on the machine, and the evaluator then asks nvcc. Dropped for the process if this NVRTC
# refuses the option.
_PTXAS_REPORT = ["--ptxas-options=-v"]


def nvrtc_options(arch: str) -> list[str]:
    """The options :func:`nvrtc_compile` passes for ``arch`` now."""
    return [f"-I{d}" for d in include_dirs()] + [
        f"--gpu-architecture={arch}", "-std=c++17", "--device-as-default-execution-space", *_PTXAS_REPORT]


def nvrtc_compile(source: str, arch: str, name: str = "kernel.cu") -> tuple[bytes, str]:
    """Compile to a cubin for ``arch`` (e.g. ``sm_90``); return (cubin, log). The log holds
    ptxas's resource report where NVRTC takes ``--ptxas-options``."""
    global _PTXAS_REPORT
    lib = nvrtc()
    prog = ctypes.c_void_p()
    code = lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), name.encode(), 0, None, None)
    if code != 0:
        raise CompileError(f"NVRTC: nvrtcCreateProgram failed ({code})")
    try:
        report = _PTXAS_REPORT
        options = nvrtc_options(arch)
        array = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
        result = lib.nvrtcCompileProgram(prog, len(options), array)
        if result == NVRTC_ERROR_INVALID_OPTION and report:
            _PTXAS_REPORT = []
            return nvrtc_compile(source, arch, name)
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        buf = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, buf)
        log = buf.value.decode(errors="replace")
        if result != 0:
            raise CompileError(f"NVRTC: compilation failed ({result})", log=log)
        lib.nvrtcGetCUBINSize(prog, ctypes.byref(size))
        cubin = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetCUBIN(prog, cubin)
        return cubin.raw, log
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def ensure_context() -> None:
    """Make torch's primary context current on this thread (driver calls need one)."""
    import torch
    torch.cuda.init()
    torch.cuda.current_stream()  # creates the context lazily if needed
    current = ctypes.c_void_p()
    check(libcuda().cuCtxGetCurrent(ctypes.byref(current)), "cuCtxGetCurrent")
    if not current.value:
        device = ctypes.c_int()
        check(libcuda().cuDeviceGet(ctypes.byref(device), torch.cuda.current_device()), "cuDeviceGet")
        check(libcuda().cuDevicePrimaryCtxRetain(ctypes.byref(current), device), "cuDevicePrimaryCtxRetain")
        check(libcuda().cuCtxSetCurrent(current), "cuCtxSetCurrent")


def pack_params(params: list) -> ctypes.Array:
    """The ``void**`` array of argument addresses that cuLaunchKernel / cudaLaunchKernel take."""
    return (ctypes.c_void_p * len(params))(*[ctypes.cast(ctypes.byref(p), ctypes.c_void_p) for p in params])


class Module:
    """A loaded cubin and one function of it."""

    def __init__(self, image: bytes, function_name: str):
        ensure_context()
        lib = libcuda()
        self._module = ctypes.c_void_p()
        check(lib.cuModuleLoadData(ctypes.byref(self._module), image), "cuModuleLoadData")
        self.function = ctypes.c_void_p()
        check(lib.cuModuleGetFunction(ctypes.byref(self.function), self._module, function_name.encode()),
              f"cuModuleGetFunction({function_name})")
        self._dynamic_smem = 48 * 1024

    def attribute(self, which: int) -> int:
        value = ctypes.c_int()
        check(libcuda().cuFuncGetAttribute(ctypes.byref(value), which, self.function), "cuFuncGetAttribute")
        return value.value

    def allow_dynamic_smem(self, smem: int) -> None:
        """Let launches use ``smem`` bytes of dynamic shared memory (over 48 KiB needs the
        attribute raised first; launches from elsewhere, such as the C++ fast path, rely on it)."""
        if smem > self._dynamic_smem:
            check(libcuda().cuFuncSetAttribute(self.function, ATTR_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem),
                  f"raising dynamic shared memory to {smem} bytes")
            self._dynamic_smem = smem

    def launch(self, grid: int, block: int, smem: int, stream: int, params: ctypes.Array) -> None:
        """Launch with ``params`` already packed by :func:`pack_params`."""
        lib = libcuda()
        if smem > self._dynamic_smem:  # checked here first: this is every Python launch's path
            self.allow_dynamic_smem(smem)
        check(lib.cuLaunchKernel(self.function, grid, 1, 1, block, 1, 1, smem, stream, params, None),
              f"cuLaunchKernel(grid={grid}, block={block}, smem={smem})")

    def __del__(self):
        try:
            if self._module:
                libcuda().cuModuleUnload(self._module)
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
