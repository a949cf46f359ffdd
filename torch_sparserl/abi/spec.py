"""The kernel spec: a candidate kernel's source and origin, the checks a source passes before
any compiler sees it, and the shapes of its operand slots."""

from __future__ import annotations

import functools
import hashlib
import re
from dataclasses import dataclass

from .device_scan import check_device_only
from .plan import KERNEL_NAME, OPS, PLAN_PREFIX, Plan, PlanError, parse_plan, plan_line

# extern "C" __global__ void [__launch_bounds__(...)] sparserl_kernel(  (qualifiers in any order)
_KERNEL_DEF = re.compile(
    r'extern\s+"C"\s+(?:(?:__global__|void|__launch_bounds__\s*\([^)]*\))\s*)+' + KERNEL_NAME + r"\s*\(")



def check_source(source: str) -> Plan:
    """Check what can be checked without a compiler; return the parsed plan."""
    if not isinstance(source, str):
        raise PlanError(f"check_source: expected the kernel source as a str, got {type(source).__name__}")
    first = plan_line(source)
    if not first.startswith(PLAN_PREFIX):
        raise PlanError(f"source: the first line must be the plan ({PLAN_PREFIX} ...), got {first[:60]!r}")
    plan = parse_plan(first)
    if not _KERNEL_DEF.search(source):
        raise PlanError(f'source: no definition of extern "C" __global__ void {KERNEL_NAME}(...)')
    if re.search(r'#\s*include\s*["<](?:torch|ATen|c10)/', source):
        raise PlanError("source: torch headers are not allowed in a kernel (the ABI is header-lean)")
    check_device_only(source)
    return plan


def operand_shapes(op: str, rows: int, cols: int, nnz: int, n: int) -> dict[str, tuple[int, ...]]:
    """The shapes of the kernel's ``val``, ``x`` and ``y`` slots for ``op`` (``csrc/README.md`` §2).

    ``spmm``/``spmv``: ``val`` holds the nonzeros' values, ``y = A @ x``. ``sddmm``: ``val``
    holds the left dense operand D (rows x n), ``x`` the right one (cols x n), and ``y`` one
    value per nonzero, ``y[k] = dot(D[row(k)], x[col(k)])``.
    """
    if op == "spmm":
        return {"val": (nnz,), "x": (cols, n), "y": (rows, n)}
    if op == "spmv":
        return {"val": (nnz,), "x": (cols,), "y": (rows,)}
    if op == "sddmm":
        return {"val": (rows, n), "x": (cols, n), "y": (nnz,)}
    raise PlanError(f"operand_shapes: op must be one of {', '.join(OPS)} (got {op!r})")


@dataclass(frozen=True)
class KernelSpec:
    """A candidate kernel: its source, and where it came from (family and parameters)."""

    source: str
    family: str = ""
    params: tuple = ()

    @functools.cached_property
    def plan(self) -> Plan:
        return check_source(self.source)

    @functools.cached_property
    def key(self) -> str:
        """Content hash of the source: names built modules and cache entries."""
        return hashlib.sha256(self.source.encode()).hexdigest()[:20]

    def describe(self) -> str:
        params = ",".join(f"{k}={v}" for k, v in self.params)
        return f"{self.family or 'custom'}({params})"
