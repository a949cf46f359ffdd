"""The compile tier of the reward, without a GPU: plan check and an offline ``nvcc`` build.

Fills ``compiled``, the resource usage ptxas reports, and ``error_kind`` in
{``plan``, ``compile``, ``resources``}; ``correct`` stays ``None`` (nothing ran).
"""

from __future__ import annotations

import time

from ..abi import MAX_SMEM_BYTES, KernelSpec, PlanError
from ..toolchain import CompileError
from ..toolchain import nvcc
from .record import ErrorKind, EvalRecord

REGISTERS_PER_SM = 65536      # sm_90: a block's threads × registers must fit in one SM's file
MAX_REGISTERS_PER_THREAD = 255
MAX_STATIC_SMEM = 48 * 1024   # statically declared shared memory (more needs dynamic smem)


def compile_only(spec: KernelSpec, arch: str = nvcc.DEFAULT_ARCH, timeout_s: float = 120) -> EvalRecord:
    """Check the plan and compile ``spec`` with nvcc for ``arch``; never raises for the candidate's faults."""
    start = time.perf_counter()
    record = EvalRecord(key=spec.key, family=spec.family, params=spec.params, device=f"nvcc:{arch}")
    try:
        plan = spec.plan
    except PlanError as exc:
        record.fail(ErrorKind.PLAN, str(exc))
        record.elapsed_s = time.perf_counter() - start
        return record
    record.op, record.dtype, record.n = plan.op, plan.dtype, plan.n
    try:
        result = nvcc.compile(spec.source, arch=arch, timeout_s=timeout_s)
    except CompileError as exc:
        record.fail(ErrorKind.COMPILE, str(exc).split("\n", 1)[0])
        record.add_log(exc.log or str(exc))
        record.elapsed_s = time.perf_counter() - start
        return record
    record.compiled = True
    record.registers = result.registers
    record.spill_bytes = result.spill_bytes
    record.smem_static = result.smem_static
    record.local_bytes = result.stack_bytes
    record.add_log(result.log.strip())
    record.timing = {"compile_s": result.seconds}

    over = []
    if result.spill_bytes > 0:
        over.append(f"{result.spill_bytes} bytes of register spills (stores + loads)")
    if result.registers is not None and result.registers * plan.block > REGISTERS_PER_SM:
        over.append(f"{result.registers} registers × block={plan.block} threads > {REGISTERS_PER_SM} per SM "
                    f"(the launch would fail)")
    if result.smem_static > MAX_STATIC_SMEM:
        over.append(f"{result.smem_static} bytes of static shared memory > {MAX_STATIC_SMEM}")
    smem = _constant(plan.smem)
    if smem is not None and smem + result.smem_static > MAX_SMEM_BYTES:
        over.append(f"{result.smem_static} static + {smem} dynamic bytes of shared memory > {MAX_SMEM_BYTES}")
    if over:
        # correct stays None: the kernel never ran; the reward applies the resource penalty.
        record.error_kind = ErrorKind.RESOURCES
        record.add_log("resources: " + "; ".join(over))
    record.elapsed_s = time.perf_counter() - start
    return record


def _constant(expr) -> int | None:
    """The value of a plan expression that names no pattern size, else None."""
    try:
        return expr.evaluate({})
    except (KeyError, PlanError):
        return None
