"""A built kernel in the ABI, callable on torch tensors.

``Kernel(rowptr, col, val, x, y, prepared)`` zero-fills ``y`` when the plan says
``init=zero``, allocates the zeroed fp32 workspace the plan asks for, and launches on the
current stream. Operand checks here are cheap metadata checks (device, dtype, contiguity,
sizes): a launch with wrong operands would be a memory error, so it is refused instead.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch

from ..abi import KernelSpec
from ..prepare import Prepared
from .errors import LaunchError

LaunchFn = Callable[[int, int, int, int, list], None]  # (grid, block, smem, stream, params)


def _expect(cond: bool, what: str) -> None:
    if not cond:
        raise LaunchError(f"sparserl kernel launch: {what}")


class Kernel:
    def __init__(self, spec: KernelSpec, launch: LaunchFn, backend: str,
                 registers: int | None = None, local_bytes: int = 0, max_threads: int = 1024,
                 static_smem: int = 0, keepalive=None):
        self.spec = spec
        self.plan = spec.plan
        self.backend = backend
        self.registers = registers
        self.local_bytes = local_bytes
        self.max_threads = max_threads
        self.static_smem = static_smem
        self._launch = launch
        self._keepalive = keepalive  # module or shared library the launch function lives in

    def __repr__(self) -> str:
        return f"Kernel({self.spec.describe()}, key={self.spec.key}, backend={self.backend})"

    def check_operands(self, rowptr, col, val, x, y, prepared: Prepared) -> None:
        plan = self.plan
        dtype = plan.torch_dtype
        device = y.device
        _expect(device.type == "cuda", f"operands must be CUDA tensors (got y on {device})")
        for name, t, want in (("rowptr", rowptr, torch.int32), ("col", col, torch.int32),
                              ("val", val, dtype), ("x", x, dtype), ("y", y, dtype)):
            _expect(t.device == device, f"{name} is on {t.device}, expected {device}")
            _expect(t.dtype == want, f"{name} must be {want} (got {t.dtype})")
            _expect(t.is_contiguous(), f"{name} must be contiguous")
        _expect(prepared.plan == plan, "prepared for a different plan")
        rows, cols, nnz, n = prepared.rows, prepared.cols, prepared.nnz, prepared.n
        _expect(rowptr.numel() == rows + 1 and col.numel() == nnz and val.numel() == nnz,
                f"pattern sizes changed since prepare (rows={rows}, nnz={nnz})")
        _expect(x.numel() == cols * n, f"x must have cols*n = {cols * n} elements (got {x.numel()})")
        _expect(y.numel() == rows * n, f"y must have rows*n = {rows * n} elements (got {y.numel()})")
        _expect(prepared.block <= self.max_threads,
                f"block={prepared.block} exceeds the {self.max_threads} threads this kernel can run "
                f"with {self.registers} registers per thread")

    def __call__(self, rowptr, col, val, x, y, prepared: Prepared, *, work: torch.Tensor | None = None,
                 stream: torch.cuda.Stream | None = None, check: bool = True) -> torch.Tensor:
        if check:
            self.check_operands(rowptr, col, val, x, y, prepared)
        if prepared.init_zero:
            y.zero_()
        if prepared.work_numel and work is None:
            work = torch.zeros(prepared.work_numel, dtype=torch.float32, device=y.device)
        elif work is not None:
            _expect(work.numel() >= prepared.work_numel and work.dtype == torch.float32,
                    f"work must be float32 with >= {prepared.work_numel} elements")
            work.zero_()
        if prepared.grid == 0:
            return y
        aux = prepared.aux
        params = [ctypes.c_void_p(t.data_ptr() if t is not None and t.numel() else 0)
                  for t in (rowptr, col, val, x, y, aux, work)]
        params += [ctypes.c_int(v) for v in (prepared.rows, prepared.cols, prepared.n, prepared.nnz, prepared.parts)]
        stream = stream if stream is not None else torch.cuda.current_stream(y.device)
        self._launch(prepared.grid, prepared.block, prepared.smem, stream.cuda_stream, params)
        return y
