"""Offline compilation with ``nvcc``: the compile tier without a GPU (CI) and resource usage.

``compile(source)`` builds one ABI source to a cubin (or PTX) for ``sm_90`` and reads
``ptxas -v``'s report: registers, spill bytes, static shared memory, stack frame. It needs
only the CUDA toolkit, so the compile tier of the reward is tested on machines with no GPU.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from .errors import CompileError

DEFAULT_ARCH = "sm_90"
_FLAGS = ("-std=c++17", "-O3", "-Xptxas", "-v")


@dataclass(frozen=True)
class NvccResult:
    binary: bytes
    log: str
    registers: int | None
    spill_bytes: int
    smem_static: int
    stack_bytes: int
    seconds: float


def nvcc_path() -> str | None:
    """The nvcc to use: ``$CUDA_HOME/bin/nvcc`` when set, else the one on PATH."""
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home and Path(home, "bin", "nvcc").exists():
        return str(Path(home, "bin", "nvcc"))
    return shutil.which("nvcc")


_REGS = re.compile(r"Used (\d+) registers")
_SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_SMEM = re.compile(r"(\d+) bytes smem")
_STACK = re.compile(r"(\d+) bytes stack frame")


def _resources(log: str) -> dict[str, int | None]:
    regs = _REGS.findall(log)
    spills = _SPILL.findall(log)
    return {
        "registers": max(map(int, regs)) if regs else None,
        "spill_bytes": sum(int(a) + int(b) for a, b in spills),
        "smem_static": max(map(int, _SMEM.findall(log)), default=0),
        "stack_bytes": max(map(int, _STACK.findall(log)), default=0),
    }


def compile(source: str, arch: str = DEFAULT_ARCH, fmt: str = "cubin", timeout_s: float = 120,
            extra_flags: tuple[str, ...] = ()) -> NvccResult:  # noqa: A001 - mirrors nvrtc.compile
    """Compile one translation unit; raise :class:`CompileError` with nvcc's log on failure."""
    if fmt not in ("cubin", "ptx"):
        raise ValueError(f"nvcc.compile: fmt must be 'cubin' or 'ptx' (got {fmt!r})")
    if not re.fullmatch(r"sm_\d+a?", arch):
        raise ValueError(f"nvcc.compile: arch must look like 'sm_90' (got {arch!r})")
    exe = nvcc_path()
    if exe is None:
        raise CompileError("nvcc.compile: nvcc not found (set CUDA_HOME or put nvcc on PATH)", log="")
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="sparserl-nvcc-") as tmp:
        src, out = Path(tmp, "kernel.cu"), Path(tmp, f"kernel.{fmt}")
        src.write_text(source)
        cmd = [exe, f"-{fmt}", f"-arch={arch}", *_FLAGS, *extra_flags, "-o", str(out), str(src)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, cwd=tmp)
        except subprocess.TimeoutExpired as exc:
            raise CompileError(f"nvcc.compile: nvcc took more than {timeout_s} s", log=str(exc)) from None
        log = (proc.stdout + proc.stderr).replace(str(src), "kernel.cu")
        if proc.returncode != 0 or not out.exists():
            raise CompileError(f"nvcc.compile: nvcc failed (exit {proc.returncode})", log=log)
        binary = out.read_bytes()
    return NvccResult(binary=binary, log=log, seconds=time.perf_counter() - start, **_resources(log))
