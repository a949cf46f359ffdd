"""A built kernel in the ABI, callable on torch tensors.

``Kernel(rowptr, col, val, x, y, prepared)`` zero-fills ``y`` when the plan says
``init=zero``, allocates the zeroed fp32 workspace the plan asks for, and launches on the
current stream. Operand checks here are cheap metadata checks (device, dtype, contiguity,
sizes): a launch with wrong operands would be a memory error, so it is refused instead.
"""

from __future__ import annotations

import ctypes
import math
import threading
from collections.abc import Callable

import torch

from ..abi import MAX_SMEM_BYTES, KernelSpec, operand_shapes
from ..abi.prepare import Prepared
from .driver import pack_params
from .errors import LaunchError

LaunchFn = Callable[[int, int, int, int, ctypes.Array], None]  # (grid, block, smem, stream, packed params)


def _expect(cond: bool, what: str) -> None:
    if not cond:
        raise LaunchError(f"sparserl kernel launch: {what}")


class Kernel:
    def __init__(self, spec: KernelSpec, launch: LaunchFn, backend: str,
                 registers: int | None = None, local_bytes: int = 0, max_threads: int = 1024,
                 static_smem: int = 0, keepalive=None, launcher: int | None = None,
                 function: int | None = None):
        self.spec = spec
        self.plan = spec.plan
        self.backend = backend
        self.registers = registers
        self.local_bytes = local_bytes
        self.max_threads = max_threads
        self.static_smem = static_smem
        self._launch = launch
        self._keepalive = keepalive  # module or shared library the launch function lives in
        # address of the C launcher `int(grid, block, smem, stream, params)` (inline builds; the
        # C++ fast path calls it), None where launches go through Python (the driver backend)
        self.launcher = launcher
        # the CUfunction of an NVRTC build (its module is `keepalive`): the C++ fast path launches
        # it with cuLaunchKernel
        self.function = function

    def allow_dynamic_smem(self, smem: int) -> None:
        """Prepare :attr:`function` for launches with ``smem`` bytes of dynamic shared memory
        that do not go through this object (the C++ fast path's)."""
        allow = getattr(self._keepalive, "allow_dynamic_smem", None)
        if allow is not None:
            allow(smem)

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
        _expect(rowptr.numel() == rows + 1 and col.numel() == nnz,
                f"pattern sizes changed since prepare (rows={rows}, nnz={nnz})")
        for name, t in (("val", val), ("x", x), ("y", y)):
            shape = operand_shapes(plan.op, rows, cols, nnz, n)[name]
            dims = " x ".join(map(str, shape)) + " = " if len(shape) > 1 else ""
            _expect(t.numel() == math.prod(shape),
                    f"{name} must have {dims}{math.prod(shape)} elements for op={plan.op} (got {t.numel()})")
        _expect(prepared.block <= self.max_threads,
                f"block={prepared.block} exceeds the {self.max_threads} threads this kernel can run "
                f"with {self.registers} registers per thread")

    def __call__(self, rowptr, col, val, x, y, prepared: Prepared, *, work: torch.Tensor | None = None,
                 stream: torch.cuda.Stream | None = None, check: bool = True,
                 bias: torch.Tensor | None = None, scale: torch.Tensor | None = None) -> torch.Tensor:
        if check:
            self.check_operands(rowptr, col, val, x, y, prepared)
            self.check_epilogue(bias, scale, prepared)
        if work is not None:
            _expect(work.numel() >= prepared.work_numel and work.dtype == torch.float32,
                    f"work must be float32 with >= {prepared.work_numel} elements")
        stream = stream if stream is not None else torch.cuda.current_stream(y.device)
        return self.bind(prepared)(rowptr, col, val, x, y, stream.cuda_stream, work=work, bias=bias, scale=scale)

    def check_epilogue(self, bias, scale, prepared: Prepared) -> None:
        """The epilogue's operands: bias (n values, 16-byte aligned: it is read in vectors) and
        scale (one per row), present exactly when the plan's epilogue has the step."""
        steps = self.plan.epilogue_steps
        for name, t, numel in (("bias", bias, prepared.n), ("scale", scale, prepared.rows)):
            if name not in steps:
                _expect(t is None, f"{name} given, but the plan's epilogue is {self.plan.epilogue}")
                continue
            _expect(t is not None, f"the plan's epilogue {self.plan.epilogue} needs {name}")
            _expect(t.device.type == "cuda", f"{name} must be a CUDA tensor (got {t.device})")
            _expect(t.dtype == self.plan.torch_dtype and t.is_contiguous() and t.numel() == numel,
                    f"{name} must be {numel} contiguous {self.plan.torch_dtype} values (got {t.numel()} "
                    f"{t.dtype}{'' if t.is_contiguous() else ', not contiguous'})")
            _expect(name != "bias" or t.data_ptr() % 16 == 0, "bias must be 16-byte aligned")

    def bind(self, prepared: Prepared) -> "BoundKernel":
        """This kernel with its plan data, ready for repeated launches (the runtime's hot path)."""
        return BoundKernel(self, prepared)


class BoundKernel:
    """A kernel bound to one pattern's :class:`Prepared` data, its argument array packed once.

    A call writes five pointers into the packed array and launches: no per-call ctypes
    objects, no checks. The caller (the runtime) guarantees the operands: the pattern's own
    int32 indices, and ``val``, ``x``, ``y`` contiguous, of the plan's dtype, on the device.
    """

    __slots__ = ("kernel", "prepared", "_slots", "_ints", "_epilogue", "_params", "_lock", "_geometry")

    def __init__(self, kernel: Kernel, prepared: Prepared):
        _expect(prepared.plan == kernel.plan, "prepared for a different plan")
        _expect(prepared.block <= kernel.max_threads,
                f"block={prepared.block} exceeds the {kernel.max_threads} threads this kernel can run "
                f"with {kernel.registers} registers per thread")
        self.kernel = kernel
        self.prepared = prepared
        self._slots = [ctypes.c_void_p(0) for _ in range(7)]  # rowptr col val x y aux work
        aux = prepared.aux
        self._slots[5].value = aux.data_ptr() if aux is not None and aux.numel() else 0
        self._ints = [ctypes.c_int(v) for v in (prepared.rows, prepared.cols, prepared.n, prepared.nnz,
                                                prepared.parts)]
        # plans with an epilogue take two more pointers after `parts`: bias, scale
        self._epilogue = [ctypes.c_void_p(0), ctypes.c_void_p(0)] if kernel.plan.epilogue != "none" else []
        self._params = pack_params(self._slots + self._ints + self._epilogue)  # addresses of the objects above
        self._geometry = (prepared.grid, prepared.block, prepared.smem)
        self._lock = threading.Lock()  # the pointer slots are shared: one launch at a time

    def __call__(self, rowptr, col, val, x, y, stream: int, *, work: torch.Tensor | None = None,
                 zeroed: bool = False, bias: torch.Tensor | None = None,
                 scale: torch.Tensor | None = None) -> torch.Tensor:
        """Launch on ``stream``; ``zeroed=True`` says ``y`` is already zero (plans with ``init=zero``);
        ``bias`` and ``scale`` are the epilogue's operands (plans with one). ``work`` is zeroed here
        before the launch, except under ``work_init=once``, where a caller's workspace is zero
        already (zeroed once; every launch leaves it zero); without one, a zeroed one is made."""
        prepared = self.prepared
        if prepared.init_zero and not zeroed:
            y.zero_()
        if prepared.work_numel:
            if work is None:
                work = torch.zeros(prepared.work_numel, dtype=torch.float32, device=y.device)
            elif not prepared.work_once:
                work.zero_()
        if prepared.grid == 0:
            return y
        with self._lock:
            slots = self._slots
            slots[0].value = rowptr.data_ptr()
            slots[1].value = col.data_ptr()
            slots[2].value = val.data_ptr() if val.numel() else 0
            slots[3].value = x.data_ptr() if x.numel() else 0
            slots[4].value = y.data_ptr()
            slots[6].value = work.data_ptr() if work is not None else 0
            if self._epilogue:
                self._epilogue[0].value = bias.data_ptr() if bias is not None else 0
                self._epilogue[1].value = scale.data_ptr() if scale is not None else 0
            grid, block, smem = self._geometry
            self.kernel._launch(grid, block, smem, stream, self._params)
        return y


def pattern_free(plan) -> bool:
    """Whether a plan's kernel takes nothing from the pattern but its sizes: natural row order,
    no split, no plan data and no workspace, no epilogue. Such a kernel serves any pattern of
    its (op, dtype, n) without preparation (:class:`SizedKernel`)."""
    return (plan.rows == "natural" and plan.split == "none" and plan.work.text.strip() == "0"
            and plan.epilogue == "none")


class SizedKernel:
    """A :func:`pattern_free` kernel launched on any pattern: the sizes and the launch geometry
    are read from the operands at each call (the plan's expressions over ``rows cols nnz n``),
    not bound once as :class:`BoundKernel` binds them.

    ``__call__(rowptr, col, val, x, stream, y=None)`` launches on ``stream`` and returns ``y``
    (allocated when not given; zeroed when the plan says ``init=zero``), or None where the
    geometry is out of the kernel's range (the caller's other path serves). The caller guarantees
    the operands as for :class:`BoundKernel`: int32 indices of a validated pattern, ``val`` and
    ``x`` contiguous, of the plan's dtype, on the current device, with ``x`` 16-byte aligned.
    """

    __slots__ = ("kernel", "_slots", "_ints", "_params", "_lock", "_shape_of", "_spmv")

    def __init__(self, kernel: Kernel):
        plan = kernel.plan
        _expect(pattern_free(plan), f"the plan of {kernel.spec.describe()} needs data of its pattern")
        self.kernel = kernel
        self._slots = [ctypes.c_void_p(0) for _ in range(7)]  # rowptr col val x y aux work
        self._ints = [ctypes.c_int(0) for _ in range(5)]  # rows cols n nnz parts
        self._params = pack_params(self._slots + self._ints)
        self._lock = threading.Lock()
        self._spmv = plan.op == "spmv"
        _expect(plan.op in ("spmm", "spmv"), f"sized launches take spmm and spmv plans (got {plan.op})")

    def geometry(self, rows: int, cols: int, nnz: int, n: int) -> tuple[int, int] | None:
        """(grid, smem) of a launch on these sizes, or None where they are out of range."""
        plan = self.kernel.plan
        if max(rows, cols, nnz, n) >= 2**31 or (plan.n is not None and plan.n != n):
            return None
        env = {"rows": rows, "cols": cols, "nnz": nnz, "n": n, "parts": 0, "hubs": 0}
        grid, smem = plan.grid.evaluate(env), plan.smem.evaluate(env)
        if not 0 <= grid < 2**31 or not 0 <= smem <= MAX_SMEM_BYTES or plan.block > self.kernel.max_threads:
            return None
        return grid, smem

    def __call__(self, rowptr, col, val, x, stream: int, y: torch.Tensor | None = None) -> torch.Tensor | None:
        rows, nnz, cols = rowptr.shape[0] - 1, col.shape[0], x.shape[0]
        n = 1 if self._spmv else x.shape[1]
        geometry = self.geometry(rows, cols, nnz, n)
        if geometry is None:
            return None
        plan = self.kernel.plan
        if y is None:
            shape = (rows,) if self._spmv else (rows, n)
            y = x.new_zeros(shape) if plan.init == "zero" else x.new_empty(shape)
        elif plan.init == "zero":
            y.zero_()
        grid, smem = geometry
        if grid == 0:
            return y
        with self._lock:
            # BoundKernel's pointer writes, repeated inline: a method shared by both classes cost
            # this path 0.11-0.15 us (5%) more per call (CPU microbenchmark, a no-op launch)
            slots, ints = self._slots, self._ints
            slots[0].value = rowptr.data_ptr()
            slots[1].value = col.data_ptr()
            slots[2].value = val.data_ptr() if nnz else 0
            slots[3].value = x.data_ptr() if x.numel() else 0
            slots[4].value = y.data_ptr()
            for slot, value in zip(ints, (rows, cols, n, nnz, 0)):
                slot.value = value
            self.kernel._launch(grid, plan.block, smem, stream, self._params)
        return y
