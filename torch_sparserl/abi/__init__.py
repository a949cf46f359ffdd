"""The kernel ABI: the plan line, its strict parser, and the kernel spec.

Pipeline stage 4 of 14: the kernel ABI every specialized kernel follows: the plan line and its
parser (:mod:`.plan`), the kernel spec and the checks of a source (:mod:`.spec`, the device-only
scan in :mod:`.device_scan`), and the per-pattern preprocessing a plan names (:mod:`.prepare`).
May import: config, dtypes, data, pattern, kernels.

A specialized kernel is one complete CUDA translation unit whose first line is a plan
(``csrc/README.md`` is the contract)::

    // sparserl: op=spmm dtype=f32 n=32 rows=natural split=none block=256 grid=ceil(rows/8)

Everything here is pure Python and runs without a GPU. A malformed plan raises
:class:`PlanError`, which the evaluator scores as a compile-tier failure; nothing in a plan
is ever passed to ``eval``.
"""

from __future__ import annotations

from .device_scan import DEVICE_INCLUDES, check_device_only
from .plan import (DTYPES, EPILOGUE_BITS, EPILOGUE_STEPS, EXPR_NAMES, HALF_DTYPES, HUB_SPLITS, INITS, KERNEL_NAME,
                   MATHS, MAX_BINS, MAX_BLOCK, MAX_CHUNK, MAX_SMEM_BYTES, OPS, PLAN_PREFIX, ROW_ORDERS, SPLITS,
                   TILE_WINDOWS, WORK_INITS, Expr, Plan, PlanError, parse_expr, parse_plan, plan_line)
from .spec import KernelSpec, check_source, operand_shapes

__all__ = ["DEVICE_INCLUDES", "DTYPES", "EPILOGUE_BITS", "EPILOGUE_STEPS", "EXPR_NAMES", "HALF_DTYPES", "HUB_SPLITS",
           "INITS", "KERNEL_NAME", "MATHS", "MAX_BINS", "MAX_BLOCK", "MAX_CHUNK", "MAX_SMEM_BYTES", "OPS",
           "PLAN_PREFIX", "ROW_ORDERS", "SPLITS", "TILE_WINDOWS", "WORK_INITS", "Expr", "KernelSpec", "Plan",
           "PlanError", "check_device_only", "check_source", "operand_shapes", "parse_expr", "parse_plan",
           "plan_line"]
