"""The fused intake kernel of CUDA indices: copy, check, repair and verdict in one launch.

:mod:`torch_sparserl.pattern.device_check` copies and checks a matrix's CUDA indices with about
ten small torch operations, each a dispatch and a launch of host time. This module builds the one
kernel that does all of it (:data:`SOURCE`) with NVRTC, in a background thread started by the
first CUDA intake (a first ``ts.csr`` never waits for a compile), loads it on the caller's thread
at a later intake (never during a CUDA graph capture, where loading a module is not allowed), and
launches it with the driver's ``cuLaunchKernel``. It registers itself with ``device_check``
(:func:`~torch_sparserl.pattern.device_check.register_fused`), which serves every intake the
torch way until the kernel is there, and wherever anything about it fails.
"""

from __future__ import annotations

import ctypes
import logging
import threading

import torch

from ..pattern import device_check
from . import driver, nvrtc

log = logging.getLogger("torch_sparserl.toolchain.intake")

KERNELS = {torch.int32: "sparserl_intake_i32", torch.int64: "sparserl_intake_i64"}
BLOCK = 256
MAX_GRID = 1024  # enough blocks to fill an H200 several times; each thread then loops (grid-stride)
PER_THREAD = 4  # indices a thread handles at least before a launch adds a block

# Flag bits: bit k is device_check._CHECKS[k]. The last block to finish reads them, repairs the copy
# where any is set (the valid structure DeviceCheck leaves: every nonzero in the last row, column 0),
# writes the verdict for the products (result[0]: bad, 0 or 1; result[1]: the bits) and, where a
# host slot is given, the bits and then a done marker into pinned host memory, and finally zeroes
# its two work words (flags, blocks done), so the same words serve the next launch or graph replay.
SOURCE = r"""
template <typename I>
__device__ __forceinline__ void intake(const I* __restrict__ crow_src, const I* __restrict__ col_src,
                                       I* crow_dst, I* col_dst, long long rows, long long nnz,
                                       long long ncols, long long copy, int* work, int* result,
                                       volatile int* host) {
    __shared__ int block_flags;
    __shared__ int is_last;
    if (threadIdx.x == 0) block_flags = 0;
    __syncthreads();
    const long long stride = (long long)gridDim.x * blockDim.x;
    const long long first = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    int flags = 0;
    for (long long i = first; i <= rows; i += stride) {
        const I v = crow_src[i];
        if (copy) crow_dst[i] = v;
        if (i == 0 && v != 0) flags |= 1;
        if (i == rows) {
            if ((long long)v != nnz) flags |= 2;
        } else if (crow_src[i + 1] < v) {
            flags |= 4;
        }
    }
    for (long long k = first; k < nnz; k += stride) {
        const I c = col_src[k];
        if (copy) col_dst[k] = c;
        if (c < 0) flags |= 8;
        if ((long long)c >= ncols) flags |= 16;
    }
    if (flags) atomicOr(&block_flags, flags);
    __threadfence();  // every thread's copies before the count: the repair below is written after them
    __syncthreads();
    if (threadIdx.x == 0) {
        if (block_flags) atomicOr(&work[0], block_flags);
        __threadfence();  // this block's flags before its count: the last block sees every flag
        const unsigned int done = atomicAdd((unsigned int*)&work[1], 1u);
        is_last = done == gridDim.x - 1;
    }
    __syncthreads();
    if (!is_last) return;
    __threadfence();
    const int all = atomicOr(&work[0], 0);
    if (all) {  // the failure path only: one block is fast enough
        for (long long i = threadIdx.x; i < rows; i += blockDim.x) crow_dst[i] = 0;
        for (long long k = threadIdx.x; k < nnz; k += blockDim.x) col_dst[k] = 0;
        if (threadIdx.x == 0) crow_dst[rows] = (I)nnz;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        result[0] = all != 0;
        result[1] = all;
        work[0] = 0;
        work[1] = 0;
        __threadfence_system();
        if (host) {
            host[0] = all;
            __threadfence_system();  // the bits before the marker: a host that sees the marker sees them
            host[1] = 1;
        }
    }
}

#define SPARSERL_INTAKE(name, I)                                                                      \
extern "C" __global__ void name(const I* crow_src, const I* col_src, I* crow_dst, I* col_dst,           \
                                long long rows, long long nnz, long long ncols, long long copy,         \
                                int* work, int* result, int* host) {                                   \
    intake<I>(crow_src, col_src, crow_dst, col_dst, rows, nnz, ncols, copy, work, result, host);       \
}

SPARSERL_INTAKE(sparserl_intake_i32, int)
SPARSERL_INTAKE(sparserl_intake_i64, long long)
"""

_PARAMS = 11  # every kernel parameter is 8 bytes: pointers and long longs


def grid(rows: int, nnz: int) -> int:
    """Blocks for ``rows`` rows and ``nnz`` nonzeros: a thread per :data:`PER_THREAD` indices of
    the longer array, at most :data:`MAX_GRID` blocks."""
    threads = -(-max(rows + 1, nnz) // PER_THREAD)
    return max(1, min(MAX_GRID, -(-threads // BLOCK)))


class _Launcher:
    """The loaded module of one device and a launch of it with parameters written into one
    preallocated buffer (no ctypes objects made per launch)."""

    def __init__(self, cubin: bytes):
        driver.ensure_context()
        lib = self._lib = driver.libcuda()
        self._module = ctypes.c_void_p()
        driver.check(lib.cuModuleLoadData(ctypes.byref(self._module), cubin), "cuModuleLoadData(intake)")
        self._functions = {}
        for dtype, name in KERNELS.items():
            function = ctypes.c_void_p()
            driver.check(lib.cuModuleGetFunction(ctypes.byref(function), self._module, name.encode()),
                         f"cuModuleGetFunction({name})")
            self._functions[dtype] = function.value
        self._values = (ctypes.c_uint64 * _PARAMS)()
        base = ctypes.addressof(self._values)
        self._pointers = (ctypes.c_void_p * _PARAMS)(*[base + 8 * i for i in range(_PARAMS)])
        self.geometry = (BLOCK, PER_THREAD, MAX_GRID)  # the C++ library's launch (device_check.intake)
        self._lock = threading.Lock()
        self._launch = lib.cuLaunchKernel
        self._thread = threading.local()  # .ready: the primary context made current on this thread

    def function(self, dtype) -> int | None:
        """The kernel's ``CUfunction`` address for index dtype ``dtype``, or None."""
        return self._functions.get(dtype)

    def __call__(self, dtype, crow_src: int, col_src: int, crow_dst: int, col_dst: int, rows: int, nnz: int,
                 ncols: int, copy: bool, work: int, result: int, host: int, stream: int) -> bool:
        """Queue the kernel on ``stream``; False where the driver refused the launch."""
        function = self._functions.get(dtype)
        if function is None:
            return False
        blocks = grid(rows, nnz)
        if not getattr(self._thread, "ready", False):
            # a driver launch needs a current context, which a thread whose CUDA calls all hit
            # torch's caches (its allocations, its streams) may not have made current yet
            driver.ensure_context()
            self._thread.ready = True
        with self._lock:  # one parameter buffer: the driver copies it during the call
            self._values[:] = (crow_src, col_src, crow_dst, col_dst, rows, nnz, ncols, int(copy), work, result,
                               host)
            code = self._launch(function, blocks, 1, 1, BLOCK, 1, 1, 0, stream, self._pointers, None)
        if code != 0:
            log.warning("the fused intake kernel's launch failed (CUresult %d): the torch way serves intake", code)
            return False
        return True

    def __del__(self):
        try:
            if self._module:
                self._lib.cuModuleUnload(self._module)
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


def _nvrtc_cubin(source: str, arch: str) -> bytes:
    return nvrtc.compile(source, arch)[0]


class Provider:
    """The fused kernel per CUDA device, for :mod:`~torch_sparserl.pattern.device_check`: built in
    a background thread on first request, loaded on a later request, None until then and for
    good where the build or the load failed."""

    def __init__(self, compile_fn=None):
        self._compile = compile_fn  # (source, arch) -> cubin; NVRTC through the cubin cache by default
        self._lock = threading.Lock()
        self._builds: dict[int, object] = {}  # device -> threading.Thread (building), bytes (built), None (failed)
        self._launchers: dict[int, _Launcher | None] = {}

    def launcher(self, index: int):
        """The launcher of device ``index``, or None: still building (the build starts here on
        the first call), failed, or not loadable now (a CUDA graph capture is under way)."""
        found = self._launchers.get(index, False)
        if found is not False:
            return found
        with self._lock:
            build = self._builds.get(index, False)
            if build is False:
                thread = threading.Thread(target=self._build, args=(index,), name="sparserl-intake-build",
                                          daemon=True)
                self._builds[index] = thread
                thread.start()
                return None
        if isinstance(build, threading.Thread):
            return None
        launcher = None
        if build is not None:
            if torch.cuda.is_current_stream_capturing():  # loading a module would break the capture
                return None
            try:
                launcher = _Launcher(build)
            except Exception as exc:  # noqa: BLE001 - the torch way serves intake
                log.warning("the fused intake kernel could not be loaded (%s): the torch way serves intake", exc)
        self._launchers[index] = launcher
        return launcher

    def _build(self, index: int) -> None:
        try:
            major, minor = torch.cuda.get_device_capability(index)
            arch = f"sm_{major}{minor}"
            cubin = (self._compile or _nvrtc_cubin)(SOURCE, arch)
        except Exception as exc:  # noqa: BLE001 - the torch way serves intake
            log.warning("the fused intake kernel could not be built (%s): the torch way serves intake", exc)
            cubin = None
        with self._lock:
            self._builds[index] = cubin

    def mapped(self, host_address: int) -> int:
        """The device address of pinned host memory at ``host_address`` (the kernel writes its
        verdicts there)."""
        pointer = ctypes.c_void_p()
        driver.check(driver.libcuda().cuMemHostGetDevicePointer_v2(ctypes.byref(pointer),
                                                                    ctypes.c_void_p(host_address), 0),
                     "cuMemHostGetDevicePointer")
        return pointer.value


PROVIDER = Provider()
device_check.register_fused(PROVIDER)
