"""``load_inline``-style builds of installed kernels: lean, content-hashed, many per module.

Each kernel source keeps its own translation unit (its ``#define``s and helpers would clash
in one file), with ``sparserl_kernel`` renamed to ``sparserl_kernel_<key>`` and a C launcher
appended; all of them link into one shared library built by torch's extension builder
(``torch.utils.cpp_extension.load``, the files-on-disk sibling of ``load_inline``). The
sources include no torch header, which keeps a build at seconds instead of the tens of
seconds that parsing ``torch/extension.h`` adds.

* The module name is a hash of the sources, the architecture and the torch/CUDA versions,
  so a changed kernel can never reuse a stale library, and an unchanged one is loaded from
  disk without a build.
* A killed build leaves torch's ``lock`` file behind and torch then waits on it forever.
  Builds here hold an ``flock`` on a separate file, which the OS releases when its holder
  dies; whoever holds it may delete a leftover ``lock``, since no one else can be building.
  The lock file is opened without following a symbolic link and without truncating it.
* A library is loaded only when its marker (``<name>.ok``, written after a complete build)
  holds the keyed digest of its bytes (:mod:`~torch_sparserl.toolchain.trust`); one without it (planted,
  changed, from an older version) is rebuilt from scratch, never loaded.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import os
import re
from contextlib import contextmanager
from pathlib import Path

import torch

from ..abi import KERNEL_NAME, KernelSpec
from . import trust
from .errors import CompileError, LaunchError
from .kernel import Kernel
from .paths import build_root

_LAUNCHER = """
// ---- appended by torch_sparserl.toolchain.inline ----
#include <cuda_runtime.h>
extern "C" int sparserl_launch_{key}(unsigned grid, unsigned block, unsigned smem, void* stream,
                                     void** params) {{
  if (smem > 48 * 1024) {{
    cudaError_t e = cudaFuncSetAttribute((const void*){kernel}, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    if (e != cudaSuccess) return (int)e;
  }}
  cudaError_t e = cudaLaunchKernel((const void*){kernel}, dim3(grid), dim3(block), params, smem, (cudaStream_t)stream);
  return (int)e;
}}
extern "C" int sparserl_attributes_{key}(int* out) {{
  cudaFuncAttributes a;
  cudaError_t e = cudaFuncGetAttributes(&a, (const void*){kernel});
  out[0] = a.numRegs; out[1] = (int)a.localSizeBytes; out[2] = a.maxThreadsPerBlock; out[3] = (int)a.sharedSizeBytes;
  return (int)e;
}}
"""


def _translation_unit(spec: KernelSpec) -> str:
    spec.plan  # noqa: B018 - malformed plans fail before nvcc runs
    kernel = f"{KERNEL_NAME}_{spec.key}"
    source = re.sub(rf"\b{KERNEL_NAME}\b", kernel, spec.source)
    return source + _LAUNCHER.format(key=spec.key, kernel=kernel)


def _arch_flags(arch: str) -> list[str]:
    number = arch.removeprefix("sm_")
    return [f"-gencode=arch=compute_{number},code=sm_{number}"]


def module_name(specs: list[KernelSpec], arch: str) -> str:
    h = hashlib.sha256()
    # the launcher is part of the library: a changed one (its C signature) must never load an old build
    for part in (arch, torch.__version__, str(torch.version.cuda), _LAUNCHER, *sorted(s.key for s in specs)):
        h.update(part.encode() + b"\0")
    return f"sparserl_{h.hexdigest()[:16]}"


LOCK_NAME = "sparserl.flock"


@contextmanager
def exclusive(build_dir: Path):
    build_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = trust.open_lock(build_dir / LOCK_NAME)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            stale = build_dir / "lock"  # torch's FileBaton file; nobody else can hold it now
            if stale.exists():
                stale.unlink()
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def verified_build(library: Path, done: Path, compile_fn) -> bytes:
    """The bytes of ``library``, built by ``compile_fn()`` first unless its marker ``done`` holds
    their keyed digest; call under :func:`exclusive`. A library without a valid digest is
    never reused: its folder is emptied (but for the lock) and it is built again."""
    data = trust.library_bytes(library, done)
    if data is None:
        trust.clear_build(library.parent, keep=(LOCK_NAME,))
        compile_fn()
        trust.write_marker(library, done)
        data = trust.library_bytes(library, done)
        if data is None:
            raise OSError(f"{library}: the library changed while it was signed")
    return data


def load_verified(library: Path, data: bytes, load):
    """``load(path)`` of a path holding exactly ``data`` (:func:`~torch_sparserl.toolchain.trust.loadable_path`)."""
    path, _ = trust.loadable_path(library, data)
    return load(path)


def _bind(lib: ctypes.CDLL, spec: KernelSpec) -> Kernel:
    launch_fn = getattr(lib, f"sparserl_launch_{spec.key}")
    launch_fn.argtypes = [ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_void_p, ctypes.c_void_p]
    launch_fn.restype = ctypes.c_int
    attrs = (ctypes.c_int * 4)()
    code = getattr(lib, f"sparserl_attributes_{spec.key}")(attrs)
    if code != 0:
        raise CompileError(f"inline build: cudaFuncGetAttributes failed ({code}) for {spec.describe()}")

    def launch(grid: int, block: int, smem: int, stream: int, params: ctypes.Array) -> None:
        err = launch_fn(grid, block, smem, stream, params)
        if err != 0:
            raise LaunchError(f"sparserl kernel launch: cudaLaunchKernel failed with cudaError {err} "
                              f"(grid={grid}, block={block}, smem={smem})")

    return Kernel(spec, launch, backend="inline", registers=attrs[0], local_bytes=attrs[1],
                  max_threads=attrs[2], static_smem=attrs[3], keepalive=lib,
                  launcher=ctypes.cast(launch_fn, ctypes.c_void_p).value)


def _distinct(specs: list[KernelSpec]) -> list[KernelSpec]:
    """One spec per key, in first-seen order: a library holds each kernel once."""
    return list({s.key: s for s in specs}.values())


def _current_arch() -> str:
    major, minor = torch.cuda.get_device_capability()
    return f"sm_{major}{minor}"


def _paths(specs: list[KernelSpec], arch: str, directory: Path | None) -> tuple[str, Path, Path, Path]:
    name = module_name(specs, arch)
    build_dir = (directory or build_root()) / name
    # the .ok file is written after a complete build: a half-linked .so never loads
    return name, build_dir, build_dir / f"{name}.so", build_dir / f"{name}.ok"


def is_built(specs: list[KernelSpec], arch: str, *, directory: Path | None = None) -> bool:
    """Whether the library of ``specs`` for ``arch`` is on disk, complete and verified: :func:`build`
    then only loads it (no compiler, no import of torch's extension builder)."""
    specs = _distinct(specs)
    if not specs:
        return False
    _, _, library, done = _paths(specs, arch, directory)
    return trust.is_verified(library, done)


def prebuild(specs: list[KernelSpec], arch: str) -> str:
    """Build the library of ``specs`` (a task for the sandbox's worker, so that the process
    that will load it never runs the builder: importing torch's extension builder and driving
    it hold the interpreter lock for hundreds of milliseconds, which a training loop in that
    process would feel as stalled steps). Returns the library's name."""
    build(specs, arch)
    return module_name(_distinct(specs), arch)


def build(specs: list[KernelSpec], arch: str | None = None, *, directory: Path | None = None,
          verbose: bool = False) -> dict[str, Kernel]:
    """Build (or load from disk) one library holding ``specs``; return kernels by spec key."""
    if not specs:
        return {}
    specs = _distinct(specs)
    if arch is None:
        arch = _current_arch()
    name, build_dir, library, done = _paths(specs, arch, directory)
    units = [_translation_unit(spec) for spec in specs]  # every source passes the ABI check first

    def compile_library() -> None:
        # Imported here: loading a built library must not pay for torch's builder.
        from torch.utils.cpp_extension import load

        sources = []
        for spec, unit in zip(specs, units):
            path = build_dir / f"k_{spec.key}.cu"
            path.write_text(unit)
            sources.append(str(path))
        try:
            load(name=name, sources=sources, build_directory=str(build_dir), verbose=verbose,
                 is_python_module=False, extra_cuda_cflags=["-O3", "-std=c++17", *_arch_flags(arch)],
                 extra_cflags=["-O2"])
        except (RuntimeError, OSError, ImportError) as exc:
            raise CompileError(f"inline build of {len(specs)} kernel(s) as {name} failed "
                               f"(build files in {build_dir})", log=str(exc)) from exc

    with exclusive(build_dir):
        data = verified_build(library, done, compile_library)
    lib = load_verified(library, data, _load)
    return {spec.key: _bind(lib, spec) for spec in specs}


def _load(library: Path | str) -> ctypes.CDLL:
    """dlopen the built library (its fatbinary is registered here; with CUDA's lazy loading the
    module itself is loaded by the first call that needs a kernel: ``_bind``'s attribute query)."""
    return ctypes.CDLL(str(library), mode=os.RTLD_LOCAL)
