"""Kernel families: parameterized CUDA templates and the candidate space the autotuner screens.

A family is a template in ``csrc/families/`` (one per op: ``spmv_<name>.cu`` / ``spmm_<name>.cu``)
plus a checked parameter set. :func:`render` turns ``(family, params, op, dtype, n)`` into one
self-contained ABI translation unit (``csrc/README.md``)::

    // sparserl: op=spmm dtype=f32 n=32 rows=natural split=none block=256 grid=ceil(rows/32)
    #define SR_DTYPE 0
    #define SR_N 32
    ...                     <- parameters and baked geometry as #defines
    <prelude.cuh>           <- type T, fp32 accumulation, vector load/store/atomic helpers
    <spmm_common.cuh>       <- (spmm, sddmm) column-tile helpers
    <sddmm_common.cuh>      <- (sddmm only) a row of D in registers, group dot products
    <template body>         <- extern "C" __global__ void sparserl_kernel(...)

Parameters are validated before anything is compiled (the role of sputnik's ``SpmmConfig``
static_asserts): a bad combination raises :class:`ValueError` naming the family, the
parameter, what was expected and what came. :func:`space` lists the ``(family, params)``
candidates for a pattern, pruned by its structural features: a grid inside the wider domain the
checkers accept (:func:`domain` documents it, :func:`valid` says whether a parameter set is in it;
:mod:`.offgrid` proposes and gates kernels outside the grid).

Families and what they are for:

========================  =====  ==============================================================
family                    ops    for
========================  =====  ==============================================================
vector_row                spmv   V lanes per row (1..32); regular patterns, sorted for skew
nnz_split                 all    fixed nonzero chunks, atomics at chunk edges; any skew
merge_path                spmv   merge-path split over rows+nonzeros; skew + empty/short rows
sell                      spmv   SELL-C-sigma, thread per row; regular FEM/stencil/road
binned                    spmv   rows binned by length, lanes per bin, one persistent launch
rowchunks                 all    hub rows cut into segments of <= T nonzeros, atomics
group_row                 spmm,  G lanes per row x VEC columns per lane; short rows, small N
                          sddmm
warp_row_staged           spmm   coalesced (col,val) batches broadcast by shfl or smem; long rows
tc_tiles                  spmm   tensor cores on condensed 16/32-row x 8-column tiles; rows
                                 sharing columns (meshes, banded, web graphs), n % 16 == 0
========================  =====  ==============================================================

tc_tiles computes float32 exactly enough for the float32 tolerance with three TF32 products per
term (``math="ieee"``, the default); ``math="tf32"`` keeps one (plan ``math=tf32``: judged by the
TF32 tolerance, and run only where torch allows TF32). The half types use their native products.

The split families sum a row's pieces through atomics. Into a half-precision ``y`` that would
round every partial sum, where the ABI accumulates in float32: merge_path and nnz_split's spmv
take float32 only, and the half kernels of rowchunks and of nnz_split's spmm add the pieces of a
row stored in pieces (a hub) in float32 to a workspace slot (``work=hubs*...``), the group adding
the last piece storing the row once.

``sddmm`` (``y[k] = dot(D[row(k)], X[col(k)])``, the gradient of the values) reuses the SpMM
work partitions: a group of lanes keeps its row of D in registers and computes one dot
product per nonzero. It needs no atomics, and its tile must cover n in one pass.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable

from ..abi import HALF_DTYPES, MAX_BLOCK, KernelSpec, PlanError, parse_plan

OPS = ("spmm", "spmv", "sddmm")
# families whose spmm kernels store each row of y once, from registers: they can fuse an
# epilogue (render(..., {"epilogue": "bias+relu"})); the split families sum rows atomically
EPILOGUE_FAMILIES = ("group_row", "warp_row_staged")
DENSE_OPS = ("spmm", "sddmm")  # ops with n dense columns tiled across lanes (spmm_common.cuh)
DTYPE_CODES = {"f32": 0, "f16": 1, "bf16": 2}
TEMPLATE_DIR = Path(__file__).parents[1] / "_csrc" / "families"

LANES = (1, 2, 4, 8, 16, 32)
BLOCKS = (64, 128, 256, 512, 1024)  # the powers of two the grid draws from; the domain is wider:
# any whole number of warps from BLOCK_MIN to 1024 (every template divides the block by its lanes,
# a power of two <= 32, and reduces over whole warps). Below 64 threads the occupancy
# __launch_bounds__ asks for (SR_MINB, 1536 or 1024 threads per SM) would need more than the 32
# resident blocks an SM holds.
BLOCK_MIN = 64
ROW_ORDERS = ("natural", "sorted_desc")
UNROLLS = (1, 2, 4, 8)  # the grid's unroll factors; the templates take any whole number 1..UNROLL_MAX
# (SR_UNROLL independent gathers under #pragma unroll); beyond 8 the gathers' registers spill at
# the occupancy the kernels ask for
UNROLL_MAX = 8
# fp32 accumulators one lane holds per pass over a row (SR_TB tiles x SR_VEC columns)
ACC_BUDGET = 32
# persistent grids (binned): enough blocks to fill the 132 SMs of an H100 at 2048 threads/SM
SM_COUNT = 132
MAX_THREADS_PER_SM = 2048
MAX_CHUNK = 1 << 20
MAX_STATIC_SMEM = 48 * 1024


def _vecs(dtype: str) -> tuple[int, ...]:
    """Columns per lane: up to a 16-byte load (float4, or 8 half values)."""
    return (1, 2, 4) if dtype == "f32" else (1, 2, 4, 8)


# --------------------------------------------------------------------------- checking


class _Checker:
    """Validates one family's parameters; every failure names family, parameter, expected, got."""

    def __init__(self, family: str, params: dict[str, Any], defaults: dict[str, Any]):
        unknown = sorted(set(params) - set(defaults))
        if unknown:
            raise ValueError(f"family {family}: unknown parameter(s) {', '.join(map(repr, unknown))} "
                             f"(expected some of {', '.join(sorted(defaults))})")
        self.family = family
        self.p = {**defaults, **params}

    def fail(self, name: str, expected: str, got: Any = None):
        got = self.p.get(name) if got is None else got
        raise ValueError(f"family {self.family}: parameter '{name}' expected {expected}, got {got!r}")

    def int_(self, name: str, lo: int, hi: int) -> int:
        v = self.p[name]
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
            self.fail(name, f"an integer in {lo}..{hi}")
        return v

    def one_of(self, name: str, values: tuple) -> Any:
        v = self.p[name]
        if isinstance(v, bool) or v not in values:
            self.fail(name, f"one of {values}")
        return v

    def multiple(self, name: str, of: int, lo: int, hi: int) -> int:
        v = self.p[name]
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi or v % of:
            self.fail(name, f"a multiple of {of} in {lo}..{hi}")
        return v


def _tiles(n: int, lanes: int, vec: int) -> tuple[int, int]:
    """(tiles per pass, passes) for n columns in tiles of lanes*vec, <= ACC_BUDGET accumulators."""
    width = lanes * vec
    tiles = -(-n // width)
    max_tb = max(1, ACC_BUDGET // vec)
    passes = -(-tiles // max_tb)
    return -(-tiles // passes), passes


def _spmm_geometry(c: _Checker, dtype: str, n: int, lanes_choices=LANES) -> dict[str, int]:
    lanes = c.one_of("lanes", lanes_choices)
    vec = c.one_of("vec", _vecs(dtype))
    if n % vec:
        c.fail("vec", f"a divisor of n={n} (vector loads need n % vec == 0)")
    tb, passes = _tiles(n, lanes, vec)
    return {"SR_N": n, "SR_LANES": lanes, "SR_VEC": vec, "SR_TB": tb, "SR_PASSES": passes}


def _sddmm_geometry(c: _Checker, dtype: str, n: int) -> dict[str, int]:
    """The SpMM tile geometry, in one pass: an SDDMM group holds its whole row of D."""
    geo = _spmm_geometry(c, dtype, n)
    if geo["SR_PASSES"] != 1:
        most = geo["SR_LANES"] * geo["SR_VEC"] * max(1, ACC_BUDGET // geo["SR_VEC"])
        c.fail("lanes", f"lanes*vec*{max(1, ACC_BUDGET // geo['SR_VEC'])} >= n={n} for op=sddmm "
                        f"(a row of D is held in {ACC_BUDGET} registers; this tile covers {most} columns)")
    return geo


def _dense_geometry(op: str, c: _Checker, dtype: str, n: int) -> dict[str, int]:
    return _sddmm_geometry(c, dtype, n) if op == "sddmm" else _spmm_geometry(c, dtype, n)


def _block(c: _Checker) -> int:
    return c.multiple("block", 32, BLOCK_MIN, MAX_BLOCK)


def _unroll(c: _Checker) -> int:
    return c.int_("unroll", 1, UNROLL_MAX)


@dataclass(frozen=True)
class _Rendered:
    plan: dict[str, str]      # plan keys other than op/dtype/n
    defines: dict[str, Any]   # SR_* macros
    params: dict[str, Any]    # the full, checked parameter set
    occupancy_quarters: int | None = None  # resident threads per SM the register budget keeps, in quarters


# --------------------------------------------------------------------------- families


def _vector_row(op, dtype, n, params) -> _Rendered:
    c = _Checker("vector_row", params, {"lanes": 32, "block": 256, "rows": "natural", "unroll": 2})
    lanes = c.one_of("lanes", LANES)
    block = _block(c)
    rows = c.one_of("rows", ROW_ORDERS)
    unroll = _unroll(c)
    per = block // lanes
    return _Rendered(
        plan={"rows": rows, "split": "none", "block": str(block), "grid": f"ceil(rows/{per})"},
        defines={"SR_BLOCK": block, "SR_LANES": lanes, "SR_UNROLL": unroll,
                 "SR_SORTED": int(rows == "sorted_desc")},
        params=c.p)


def _summed_in_pieces(family: str, op: str, dtype: str) -> None:
    """merge_path, and nnz_split's spmv, sum a row's pieces atomically into y: float32 only,
    since half-precision atomics would round every partial sum (the ABI's plan check).
    rowchunks, and nnz_split's spmm, sum a half-precision row's pieces in a float32 workspace
    instead (:func:`_hub_work`)."""
    if op != "sddmm" and dtype in HALF_DTYPES:
        raise ValueError(f"family {family}: parameter 'dtype' expected f32 for op={op} (a row's pieces are "
                         f"summed through atomics into y, which for a half dtype would not accumulate in "
                         f"float32), got {dtype!r}")


def _hub_work(op: str, dtype: str, n: int, *, every_dtype: bool = False) -> dict[str, str]:
    """The plan's float32 workspace where a row stored in pieces (a hub) meets: per hub, the
    sums (spmm: n, padded to 16 bytes) and a counter (the kernels' SR_HUB layout). The group
    adding a hub's last piece zeroes its slot again, so the workspace is zeroed once, not per
    call (work_init=once). Half-precision rows always meet there (atomics into y would round
    every partial sum); float32 ones where the family stores hubs from it (``every_dtype``:
    rowchunks, whose every row then is stored once and needs no zero-fill), else they are added
    atomically into zero-filled y. Nothing for sddmm (no pieces)."""
    if op == "sddmm" or (dtype not in HALF_DTYPES and not every_dtype):
        return {}
    return {"work": "hubs*2" if op == "spmv" else f"hubs*{(n + 3) // 4 * 4 + 4}", "work_init": "once"}


def _atomic_init(op: str) -> dict[str, str]:
    """Split plans sum a row's pieces atomically into zero-filled output; sddmm writes each
    output element once, from the one work item holding its nonzero."""
    return {} if op == "sddmm" else {"init": "zero"}


def _nnz_split(op, dtype, n, params) -> _Rendered:
    if op == "spmv":
        _summed_in_pieces("nnz_split", op, dtype)
        c = _Checker("nnz_split", params, {"chunk": 256, "block": 256})
        chunk = c.multiple("chunk", 32, 32, MAX_CHUNK)
        block = _block(c)
        return _Rendered(
            plan={"rows": "natural", "split": f"nnz({chunk})", "block": str(block),
                  "grid": f"ceil(parts/{block // 32})", "init": "zero"},
            defines={"SR_BLOCK": block, "SR_CHUNK": chunk}, params=c.p)
    c = _Checker("nnz_split", params, {"lanes": 8, "vec": 4, "chunk": 64, "block": 256, "unroll": 2})
    geo = _dense_geometry(op, c, dtype, n)
    chunk = c.int_("chunk", 1, MAX_CHUNK)
    block = _block(c)
    unroll = _unroll(c)
    return _Rendered(
        plan={"rows": "natural", "split": f"nnz({chunk})", "block": str(block),
              "grid": f"ceil(parts/{block // geo['SR_LANES']})", **_atomic_init(op), **_hub_work(op, dtype, n)},
        defines={"SR_BLOCK": block, **geo, "SR_UNROLL": unroll, "SR_CHUNK": chunk}, params=c.p)


def _merge_path(op, dtype, n, params) -> _Rendered:
    _summed_in_pieces("merge_path", op, dtype)
    c = _Checker("merge_path", params, {"items": 16, "block": 256})
    items = c.int_("items", 1, 4096)
    block = _block(c)
    return _Rendered(
        plan={"rows": "natural", "split": f"merge({items})", "block": str(block),
              "grid": f"ceil(parts/{block})", "init": "zero"},
        defines={"SR_BLOCK": block, "SR_ITEMS": items}, params=c.p)


def _sell(op, dtype, n, params) -> _Rendered:
    c = _Checker("sell", params, {"c": 32, "sigma": 1024, "block": 256, "unroll": 2})
    chunk = c.one_of("c", (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024))
    sigma = c.int_("sigma", 1, 1 << 30)
    if sigma % chunk:
        c.fail("sigma", f"a positive multiple of c={chunk}")
    block = _block(c)
    unroll = _unroll(c)
    return _Rendered(
        plan={"rows": f"sell({chunk},{sigma})", "split": "none", "block": str(block),
              "grid": f"ceil(rows/{block})"},
        defines={"SR_BLOCK": block, "SR_C": chunk, "SR_UNROLL": unroll}, params=c.p)


def _binned(op, dtype, n, params) -> _Rendered:
    c = _Checker("binned", params, {"edges": (4, 32, 1024), "lanes": (2, 8, 32, 256), "block": 256,
                                    "unroll": 2})
    block = _block(c)
    edges = c.p["edges"]
    if (not isinstance(edges, tuple) or not 1 <= len(edges) <= 7
            or not all(isinstance(e, int) and not isinstance(e, bool) and e >= 1 for e in edges)
            or any(b <= a for a, b in zip(edges, edges[1:]))):
        c.fail("edges", "a tuple of 1..7 strictly increasing positive integers")
    lanes = c.p["lanes"]
    allowed = tuple(sorted({*LANES, block}))
    if not isinstance(lanes, tuple) or len(lanes) != len(edges) + 1:
        c.fail("lanes", f"a tuple of {len(edges) + 1} lane counts (one per bin)")
    for v in lanes:
        if isinstance(v, bool) or v not in allowed:
            c.fail("lanes", f"lane counts from {allowed} (block={block} = one block per row)")
    unroll = _unroll(c)
    # Virtual blocks per bin are bounded by rows and by nnz/e_b (a row of bin b has >= e_b nonzeros);
    # the grid is that bound capped to one full wave: the kernel strides over the rest.
    terms = [f"ceil(rows/{block // lanes[0]})"]
    terms += [f"ceil(min(rows,nnz/{e})/{block // v})" for e, v in zip(edges, lanes[1:])]
    cap = SM_COUNT * (MAX_THREADS_PER_SM // block)
    defines = {"SR_BLOCK": block, "SR_NBINS": len(lanes), "SR_UNROLL": unroll}
    for b in range(9):
        defines[f"SR_LANES_{b}"] = lanes[b] if b < len(lanes) else 1
    return _Rendered(
        plan={"rows": f"binned({','.join(map(str, edges))})", "split": "none", "block": str(block),
              "grid": f"min({'+'.join(terms)},{cap})"},
        defines=defines, params=c.p, occupancy_quarters=2)  # many bins: 40 registers spill


def _rowchunks(op, dtype, n, params) -> _Rendered:
    if op == "spmv":
        c = _Checker("rowchunks", params, {"lanes": 32, "seg": 1024, "block": 256, "unroll": 2})
        lanes = c.one_of("lanes", LANES)
        geo = {"SR_LANES": lanes}
    else:
        c = _Checker("rowchunks", params, {"lanes": 8, "vec": 4, "seg": 256, "block": 256, "unroll": 2})
        geo = _dense_geometry(op, c, dtype, n)
        lanes = geo["SR_LANES"]
    seg = c.int_("seg", 1, MAX_CHUNK)
    block = _block(c)
    unroll = _unroll(c)
    # every row is a segment or more, and hubs are stored from the workspace: no zero-fill
    plan = {"rows": "natural", "split": f"rowchunks({seg})", "block": str(block),
            "grid": f"ceil(parts/{block // lanes})", **_hub_work(op, dtype, n, every_dtype=True)}
    return _Rendered(plan=plan, defines={"SR_BLOCK": block, **geo, "SR_UNROLL": unroll, "SR_SEG": seg},
                     params=c.p)


def _group_row(op, dtype, n, params) -> _Rendered:
    c = _Checker("group_row", params, {"lanes": 8, "vec": 4, "block": 256, "rows": "natural", "unroll": 2})
    geo = _dense_geometry(op, c, dtype, n)
    block = _block(c)
    rows = c.one_of("rows", ROW_ORDERS)
    unroll = _unroll(c)
    return _Rendered(
        plan={"rows": rows, "split": "none", "block": str(block),
              "grid": f"ceil(rows/{block // geo['SR_LANES']})"},
        defines={"SR_BLOCK": block, **geo, "SR_UNROLL": unroll, "SR_SORTED": int(rows == "sorted_desc")},
        params=c.p)


TC_WINDOWS = (16, 32)  # rows per window: one or two 16-row tensor-core tiles (abi.TILE_WINDOWS)
TC_SLICES = (1, 2, 4)  # 16-column accumulator tiles per warp
TC_KSPLITS = (1, 2, 4, 8, 16)  # warps sharing a window's steps (float32: partial tiles added atomically)


def _tc_tiles(op, dtype, n, params) -> _Rendered:
    c = _Checker("tc_tiles", params, {"window": 16, "j": 1, "ksplit": 1, "math": "ieee", "block": 128})
    window = c.one_of("window", TC_WINDOWS)
    j = c.one_of("j", TC_SLICES)
    ksplit = c.one_of("ksplit", TC_KSPLITS)
    math_ = c.one_of("math", ("ieee", "tf32"))
    block = _block(c)
    if math_ == "tf32" and dtype != "f32":
        c.fail("math", f"'ieee' for dtype={dtype} (its tensor-core products are native)")
    if ksplit > 1 and dtype != "f32":
        c.fail("ksplit", f"1 for dtype={dtype} (a window's warps add their partial tiles atomically into y, "
                         f"which for a half dtype would not accumulate in float32)")
    if n % (16 * j):
        c.fail("j", f"a divisor of n/16 (n={n} must be a multiple of 16*j = {16 * j}: whole 16-column tiles)")
    kk = 32  # columns a step (SR_KK): A tile, staged X rows, a 16x16 output tile, A as T (half types)
    floats = window * kk + kk * 16 * j * (4 if dtype == "f32" else 2) // 4 + 256 + (0 if dtype == "f32" else window * kk // 2)
    if block // 32 * floats * 4 > MAX_STATIC_SMEM:
        fits = MAX_STATIC_SMEM // (floats * 4) * 32
        c.fail("block", f"at most {fits} threads for window={window}, j={j}, "
                        f"dtype={dtype} ({floats * 4} bytes of shared memory a warp)")
    slices = n // (16 * j)
    plan = {"rows": "natural", "split": f"tiles({window})", "block": str(block),
            "grid": f"ceil(parts*{slices * ksplit}/{block // 32})"}
    if ksplit > 1:
        plan["init"] = "zero"
    if math_ == "tf32":
        plan["math"] = "tf32"
    acc_regs = 16 * (window // 16) * j  # the window's accumulators and a step's partial sums
    return _Rendered(
        plan=plan,
        defines={"SR_BLOCK": block, "SR_N": n, "SR_WIN": window, "SR_J": j, "SR_SLICES": slices, "SR_KSPLIT": ksplit,
                 "SR_MATH": 0 if dtype != "f32" else 3 if math_ == "ieee" else 1},
        params=c.p, occupancy_quarters=2 if acc_regs <= 32 else 1)


def _warp_row_staged(op, dtype, n, params) -> _Rendered:
    c = _Checker("warp_row_staged", params, {"lanes": 32, "vec": 1, "block": 256, "rows": "natural",
                                             "stage": "shfl"})
    geo = _spmm_geometry(c, dtype, n, lanes_choices=(8, 16, 32))
    block = _block(c)
    rows = c.one_of("rows", ROW_ORDERS)
    stage = c.one_of("stage", ("shfl", "smem"))
    if stage == "smem" and (block // geo["SR_LANES"]) * 33 * 8 > MAX_STATIC_SMEM:
        c.fail("block", f"at most {MAX_STATIC_SMEM // (33 * 8) * geo['SR_LANES']} threads with stage=smem")
    return _Rendered(
        plan={"rows": rows, "split": "none", "block": str(block),
              "grid": f"ceil(rows/{block // geo['SR_LANES']})"},
        defines={"SR_BLOCK": block, **geo, "SR_SORTED": int(rows == "sorted_desc"),
                 "SR_STAGE_SMEM": int(stage == "smem")},
        params=c.p)


@dataclass(frozen=True)
class Family:
    """A kernel template and its checked parameter space.

    ``template`` is the file name with ``{op}`` standing for the op (``spmv_vector_row.cu``);
    ``grid(op, dtype, n, features)`` lists the parameter dicts :func:`space` screens.
    """

    name: str
    ops: frozenset
    template: str
    doc: str
    grid: Callable[[str, str, int, dict], list[dict]]
    build: Callable[[str, str, int, dict], _Rendered]
    dense_helpers: bool = True  # includes spmm_common.cuh (lane x vector column tiles, epilogues)

    def template_path(self, op: str) -> Path:
        return TEMPLATE_DIR / self.template.format(op=op)


# --------------------------------------------------------------------------- the space


def _pow2_ceil(v: float) -> int:
    return 1 << max(0, math.ceil(math.log2(max(v, 1))))


def _feat(features: dict | None) -> dict:
    return dict(features or {})


def _skewed(f: dict) -> bool:
    """Row lengths spread enough that sorting/splitting can pay (True without features)."""
    if not f:
        return True
    return f.get("row_cv", 1.0) > 0.5 or f.get("row_max", 0) > 8 * max(f.get("row_mean", 1.0), 1.0)


def _spmm_shapes(dtype: str, n: int, limit: int = 3) -> list[tuple[int, int]]:
    """(lanes, vec) pairs whose tile width fits n well: widest vectors first."""
    target = _pow2_ceil(n)
    shapes = []
    for vec in sorted(_vecs(dtype), reverse=True):
        if n % vec:
            continue
        for lanes in LANES:
            width = lanes * vec
            if width <= target and (width >= target // 4 or lanes == 32):
                shapes.append((lanes, vec))
    # prefer tile width == pow2ceil(n), then wider vectors
    shapes.sort(key=lambda lv: (abs(math.log2(lv[0] * lv[1]) - math.log2(target)), -lv[1]))
    return shapes[:limit] if limit else shapes


def _grid_vector_row(op, dtype, n, features):
    f = _feat(features)
    mean = f.get("row_mean")
    lanes = list(LANES) if mean is None else [v for v in LANES if _pow2_ceil(mean) // 8 <= v <= 2 * _pow2_ceil(mean)]
    orders = ["natural", "sorted_desc"] if _skewed(f) else ["natural"]
    out = []
    for v in lanes or [32]:
        unrolls = (1, 4) if mean is None or mean / v >= 2 else (1,)
        for rows in orders:
            for u in unrolls:
                out.append({"lanes": v, "block": 256, "rows": rows, "unroll": u})
    return out


def _grid_nnz_split(op, dtype, n, features):
    f = _feat(features)
    if f and not _skewed(f) and f.get("row_max", 0) < 64:
        chunks_v, chunks_m = (256,), (64,)
    else:
        chunks_v, chunks_m = (64, 128, 256, 512, 1024), (16, 32, 64, 128, 256)
    if op == "spmv":
        if dtype != "f32":  # shared rows are summed with 16-bit atomics: keep the pieces few
            chunks_v = tuple(sorted({max(ch, 256) for ch in chunks_v} | {2048}))
        return [{"chunk": ch, "block": 256} for ch in chunks_v]
    if op == "spmm" and dtype in HALF_DTYPES:
        # Its half kernels (float32 hubs) render and are correct, but lose the half-precision
        # cells of the real matrices to rowchunks or group_row (benchmarks/bench_kernels.py):
        # nearly every chunk shares its first and last rows, and each shared row pays the
        # workspace's fence, counter and re-read. The screened space leaves them out; a policy may still write one.
        return []
    return [{"lanes": lanes, "vec": vec, "chunk": ch, "block": 256, "unroll": 2}
            for lanes, vec in _spmm_shapes(dtype, n, limit=2) for ch in chunks_m]


def _grid_merge_path(op, dtype, n, features):
    f = _feat(features)
    items = (8, 16, 32) if f and not _skewed(f) else (4, 8, 16, 32, 64)
    if dtype != "f32":  # rows crossing threads are summed with 16-bit atomics: keep the pieces few
        items = (64, 256, 1024)
    return [{"items": it, "block": 256} for it in items]


def _grid_sell(op, dtype, n, features):
    f = _feat(features)
    if f and f.get("row_cv", 0.0) > 2.0:
        return []  # padding explodes: leave skewed patterns to the split families
    out = []
    for chunk in (32, 128):
        for ratio in (4, 64):
            for u in (1, 4):
                out.append({"c": chunk, "sigma": chunk * ratio, "block": 256, "unroll": u})
    return out


_BIN_EDGES = ((4, 32, 1024), (2, 8, 32, 256, 4096), (8, 64, 2048), (16, 128, 8192), (4, 16, 64, 512))


def _bin_lanes(edges: tuple[int, ...], block: int, wide: bool) -> tuple[int, ...]:
    """Lanes per bin: about a quarter (narrow) or half (wide) of the bin's upper edge, hubs per block."""
    lanes = []
    for upper in edges:
        want = upper // (2 if wide else 4)
        lanes.append(max(1, min(32, 1 << max(0, int(math.log2(max(want, 1)))))))
    lanes.append(block if edges[-1] >= 512 else 32)
    return tuple(lanes)


def _grid_binned(op, dtype, n, features):
    f = _feat(features)
    if f and not _skewed(f):
        return []
    out = []
    row_max = f.get("row_max")
    for edges in _BIN_EDGES:
        if row_max is not None and edges[-1] > 4 * row_max and len(edges) > 1 and edges[-2] > row_max:
            continue  # the upper bins would stay empty: a coarser scheme covers it
        for wide in (False, True):
            out.append({"edges": edges, "lanes": _bin_lanes(edges, 256, wide), "block": 256, "unroll": 2})
    return out


def _grid_rowchunks(op, dtype, n, features):
    f = _feat(features)
    row_max = f.get("row_max")
    if f and not _skewed(f):
        return []
    out = []
    if op == "spmv":
        mean = f.get("row_mean", 8.0)
        lanes_set = sorted({max(1, min(32, _pow2_ceil(mean))), 32})
        for seg in (256, 1024, 4096):
            if row_max is not None and seg >= row_max:
                continue
            for lanes in lanes_set:
                out.append({"lanes": lanes, "seg": seg, "block": 256, "unroll": 2})
        return out
    for seg in (32, 128, 512):
        if row_max is not None and seg >= row_max:
            continue
        for lanes, vec in _spmm_shapes(dtype, n, limit=2):
            out.append({"lanes": lanes, "vec": vec, "seg": seg, "block": 256, "unroll": 2})
    return out


def _grid_group_row(op, dtype, n, features):
    f = _feat(features)
    orders = ["natural", "sorted_desc"] if _skewed(f) else ["natural"]
    mean = f.get("row_mean")
    unrolls = (1, 4) if mean is None or mean >= 4 else (1, 2)
    out = []
    for lanes, vec in _spmm_shapes(dtype, n, limit=4):
        tb, _ = _tiles(n, lanes, vec)
        # a full accumulator tile plus 4 rows of X in flight would spill
        for u in (unrolls if tb * vec < ACC_BUDGET else (1,) if vec == 8 else (1, 2)):
            out += [{"lanes": lanes, "vec": vec, "block": 256, "rows": rows, "unroll": u} for rows in orders]
    return out


def _grid_warp_row_staged(op, dtype, n, features):
    f = _feat(features)
    if f and f.get("row_mean", 0.0) < 6:
        return []  # the staged batch would be mostly empty
    orders = ["natural", "sorted_desc"] if _skewed(f) else ["natural"]
    shapes = [(lanes, vec) for lanes, vec in _spmm_shapes(dtype, n, limit=0) if lanes >= 8][:2] or [(32, 1)]
    return [{"lanes": lanes, "vec": vec, "block": 256, "rows": rows, "stage": st}
            for lanes, vec in shapes for rows in orders for st in ("shfl", "smem")]


# Families left out of the space the autotuner screens unless named (space(opt_in=...),
# tune(opt_in=...), bench_kernels --opt-in): correct and tested, but slower than the screened
# families in every cell measured (benchmarks/results/tc-tiles-*.md), so screening them would only
# spend the budget.
OPT_IN_FAMILIES = ("tc_tiles",)
TC_MIN_REUSE = 1.3  # tc_tiles: nonzeros per distinct column of a 16-row window below which X is not reused
TC_MAX_STEPS = 8  # tc_tiles: most steps (32 columns each) one warp runs for a hub row's window


def _grid_tc_tiles(op, dtype, n, features):
    f = _feat(features)
    if n % 16 or (f and f.get("window_reuse", 0.0) < TC_MIN_REUSE):
        return []  # whole 16-column tiles only; rows that share no columns gain nothing from a tile
    slices = [j for j in (2, 1) if n % (16 * j) == 0]
    hub_steps = -(-int(f.get("row_max", 0)) // 32)
    splits = [k for k in ((1, 4, 16) if dtype == "f32" else (1,)) if hub_steps <= TC_MAX_STEPS * k]
    return [{"window": w, "j": j, "ksplit": k, "math": "ieee", "block": 128}
            for w in TC_WINDOWS for j in slices for k in splits]


FAMILIES: dict[str, Family] = {fam.name: fam for fam in (
    Family("vector_row", frozenset({"spmv"}), "{op}_vector_row.cu",
           "SpMV, V lanes per row (1..32), natural or length-sorted rows, unrolled gathers",
           _grid_vector_row, _vector_row),
    Family("nnz_split", frozenset({"spmv", "spmm", "sddmm"}), "{op}_nnz_split.cu",
           "fixed nonzero chunks per warp/lane group, segmented reduction, atomics at chunk edges",
           _grid_nnz_split, _nnz_split),
    Family("merge_path", frozenset({"spmv"}), "{op}_merge_path.cu",
           "SpMV merge-path: equal rows+nonzeros per thread, atomics for rows crossing threads",
           _grid_merge_path, _merge_path),
    Family("sell", frozenset({"spmv"}), "{op}_sell.cu",
           "SpMV SELL-C-sigma, thread per row, column-major slices sorted in windows of sigma rows",
           _grid_sell, _sell),
    Family("binned", frozenset({"spmv"}), "{op}_binned.cu",
           "SpMV rows binned by length; thread/vector/block per row by bin, one persistent launch",
           _grid_binned, _binned),
    Family("rowchunks", frozenset({"spmv", "spmm", "sddmm"}), "{op}_rowchunks.cu",
           "rows cut into segments of <= seg nonzeros (hub split), atomics for multi-segment rows",
           _grid_rowchunks, _rowchunks),
    Family("group_row", frozenset({"spmm", "sddmm"}), "{op}_group_row.cu",
           "G lanes per row, VEC consecutive columns per lane, column tiles (SpMM: of Y, SDDMM: of D) "
           "in registers",
           _grid_group_row, _group_row),
    Family("warp_row_staged", frozenset({"spmm"}), "{op}_warp_row_staged.cu",
           "SpMM, coalesced (col,val) batches broadcast by __shfl_sync or shared memory",
           _grid_warp_row_staged, _warp_row_staged),
    Family("tc_tiles", frozenset({"spmm"}), "{op}_tc_tiles.cu",
           "SpMM on tensor cores (wmma): per 16/32-row window, its distinct columns condensed into "
           "8-column blocks; dense tiles of A times the staged rows of X",
           _grid_tc_tiles, _tc_tiles, dense_helpers=False),
)}


# --------------------------------------------------------------------------- rendering


@lru_cache(maxsize=None)
def _read(name: str) -> str:
    path = TEMPLATE_DIR / name
    if not path.exists():
        raise FileNotFoundError(f"families: template {path} is missing (is torch_sparserl/_csrc -> ../csrc there?)")
    return path.read_text()


def _check_call(family: str, op: str, dtype: str, n: int) -> Family:
    if family not in FAMILIES:
        raise ValueError(f"render: unknown family {family!r} (expected one of {', '.join(FAMILIES)})")
    fam = FAMILIES[family]
    if op not in fam.ops:
        raise ValueError(f"family {family}: parameter 'op' expected one of {sorted(fam.ops)}, got {op!r}")
    if dtype not in DTYPE_CODES:
        raise ValueError(f"family {family}: parameter 'dtype' expected one of {tuple(DTYPE_CODES)}, got {dtype!r}")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"family {family}: parameter 'n' expected an integer >= 1, got {n!r}")
    if op == "spmv" and n != 1:
        raise ValueError(f"family {family}: parameter 'n' expected 1 for op=spmv, got {n!r}")
    return fam


# The shared headers of the ABI: a kernel may include them by these names instead of carrying
# their text (the policy writes the short form); expand_headers() inlines them before a build.
HEADERS = {"sparserl/prelude.cuh": "prelude.cuh", "sparserl/spmm_common.cuh": "spmm_common.cuh",
           "sparserl/sddmm_common.cuh": "sddmm_common.cuh"}
_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*"(sparserl/[^"]*)"[ \t]*$', re.M)


def expand_headers(source: str) -> str:
    """Inline ``#include "sparserl/prelude.cuh"``-style lines with the shipped headers' text.

    The result is the self-contained translation unit the builders take; a compact source
    from :func:`render` ``(compact=True)`` expands to exactly the full rendering. An unknown
    ``sparserl/`` header raises :class:`~torch_sparserl.abi.PlanError` (a compile-tier failure).
    """

    def _sub(match: re.Match) -> str:
        name = match.group(1)
        if name not in HEADERS:
            raise PlanError(f"source: unknown ABI header {name!r} (expected one of {', '.join(HEADERS)})")
        return _read(HEADERS[name])

    return _INCLUDE.sub(_sub, source)


def render(family: str, params: dict | None = None, *, op: str, dtype: str, n: int,
           compact: bool = False) -> KernelSpec:
    """One ABI translation unit for ``family`` with ``params`` (missing ones take defaults).

    ``compact=True`` names the shared headers with ``#include "sparserl/..."`` lines instead of
    inlining them: the text the policy learns to write. Pass it through :func:`expand_headers`
    before building (``KernelSpec.source`` of a compact spec is not self-contained).
    """
    fam = _check_call(family, op, dtype, n)
    if params is not None and not isinstance(params, dict):
        raise ValueError(f"family {family}: params expected a dict, got {type(params).__name__}")
    params = dict(params or {})
    epilogue = params.pop("epilogue", "none")
    if epilogue != "none" and (family not in EPILOGUE_FAMILIES or op != "spmm"):
        raise ValueError(f"family {family}: parameter 'epilogue' expected 'none' for op={op} (epilogues are "
                         f"fused into the row stores of {', '.join(EPILOGUE_FAMILIES)} for op=spmm), got {epilogue!r}")
    r = fam.build(op, dtype, n, params)
    plan = {"op": op, "dtype": dtype, "n": str(n), **r.plan}
    if epilogue != "none":
        plan["epilogue"] = epilogue
    line = "// sparserl: " + " ".join(f"{k}={v}" for k, v in plan.items())
    try:
        parsed = parse_plan(line)  # a renderer bug must never reach the compiler
    except PlanError as exc:
        if epilogue == "none":
            raise
        raise ValueError(f"family {family}: parameter 'epilogue' {exc}") from None
    full = tuple(sorted({**r.params, **({"epilogue": epilogue} if epilogue != "none" else {})}.items()))
    desc = ",".join(f"{k}={v}" for k, v in full).replace(" ", "")
    # min blocks per SM for __launch_bounds__: ptxas (CUDA 13) otherwise squeezes to 32 registers
    # and spills; SpMV keeps >= 75% occupancy for its latency-bound gathers (<= 40 registers at
    # block 256), SpMM >= 50% for its register tiles (<= 64 registers).
    quarters = r.occupancy_quarters or (3 if op == "spmv" else 2)
    minb = max(1, (MAX_THREADS_PER_SM * quarters // 4) // r.defines["SR_BLOCK"])
    defines = {"SR_DTYPE": DTYPE_CODES[dtype], **r.defines, "SR_MINB": minb}
    if parsed.epilogue_bits:
        defines["SR_EPILOGUE"] = parsed.epilogue_bits
    parts = [line, f"// family: {family}({desc})"]
    parts += [f"#define {k} {v}" for k, v in defines.items()]
    header = (lambda name: f'#include "sparserl/{name}"') if compact else _read
    parts.append(header("prelude.cuh"))
    if op in DENSE_OPS and fam.dense_helpers:
        parts.append(header("spmm_common.cuh"))
    if op == "sddmm":
        parts.append(header("sddmm_common.cuh"))
    parts.append(_read(fam.template.format(op=op)))
    return KernelSpec(source="\n".join(parts), family=family, params=full)


def space(op: str, dtype: str, n: int, features: dict | None = None,
          opt_in: tuple[str, ...] | list[str] = ()) -> list[tuple[str, dict]]:
    """All ``(family, params)`` candidates for one (op, dtype, n), pruned by ``features``.

    ``features`` holds structural statistics of the pattern (rows, cols, nnz, row_mean,
    row_max, row_cv, window_reuse); without them a default grid covering every screened
    family is returned. The families of :data:`OPT_IN_FAMILIES` are listed only when named in
    ``opt_in``. Every candidate renders without error.
    """
    if op not in OPS:
        raise ValueError(f"space: op expected one of {OPS}, got {op!r}")
    unknown = sorted(set(opt_in) - set(OPT_IN_FAMILIES))
    if unknown:
        raise ValueError(f"space: opt_in expected names from {OPT_IN_FAMILIES}, got {unknown}")
    out: list[tuple[str, dict]] = []
    seen = set()
    for name, fam in FAMILIES.items():
        if op not in fam.ops or (name in OPT_IN_FAMILIES and name not in opt_in):
            continue
        for params in fam.grid(op, dtype, n, _feat(features)):
            try:
                r = fam.build(op, dtype, n, dict(params))
            except ValueError:
                continue  # e.g. vec that does not divide this n
            key = (name, tuple(sorted(r.params.items())))
            if key not in seen:
                seen.add(key)
                out.append((name, dict(params)))
    return out


# --------------------------------------------------------------------------- the domain

_LANES_TEXT = f"one of {LANES} (a power of two dividing a warp: the group's shuffles)"
_BLOCK_TEXT = (f"a multiple of 32 in {BLOCK_MIN}..{MAX_BLOCK} (whole warps; below {BLOCK_MIN} the occupancy "
               f"__launch_bounds__ asks for needs more blocks than an SM holds)")
_UNROLL_TEXT = f"an integer in 1..{UNROLL_MAX} (independent gathers in flight; more spill)"
_VEC_TEXT = "1, 2 or 4 for f32, also 8 for the half types (a load of at most 16 bytes), dividing n"
_ROWS_TEXT = f"one of {ROW_ORDERS}"
_TILE_TEXT = (f"lanes*vec*tiles covering n within {ACC_BUDGET} float32 accumulators a lane (more passes "
              f"otherwise); op=sddmm needs one pass")


@dataclass(frozen=True)
class Domain:
    """What a family's template accepts: each parameter's values and the constraints joining them.

    The families' checkers (:func:`render`) enforce exactly this, and :func:`space`'s grid is a
    subset of it; :func:`valid` says whether one parameter set is inside, and if not, why."""

    family: str
    params: dict[str, str]
    constraints: tuple[str, ...] = ()


DOMAINS: dict[str, Domain] = {d.family: d for d in (
    Domain("vector_row", {"lanes": _LANES_TEXT, "block": _BLOCK_TEXT, "rows": _ROWS_TEXT, "unroll": _UNROLL_TEXT}),
    Domain("nnz_split", {
        "chunk": f"spmv: a multiple of 32 in 32..{MAX_CHUNK} (a warp per chunk); spmm, sddmm: 1..{MAX_CHUNK} "
                 "nonzeros per lane group",
        "block": _BLOCK_TEXT, "lanes": "spmm, sddmm: " + _LANES_TEXT, "vec": "spmm, sddmm: " + _VEC_TEXT,
        "unroll": "spmm, sddmm: " + _UNROLL_TEXT},
        (_TILE_TEXT, "spmv: dtype f32 only (a row's pieces meet through atomics into y)")),
    Domain("merge_path", {"items": "an integer in 1..4096 (merge items a thread)", "block": _BLOCK_TEXT},
           ("dtype f32 only (rows crossing threads meet through atomics into y)",)),
    Domain("sell", {"c": "a power of two in 1..1024 (rows a slice)", "sigma": "a positive multiple of c "
                    "(rows sorted by length within windows of sigma)", "block": _BLOCK_TEXT, "unroll": _UNROLL_TEXT}),
    Domain("binned", {"edges": "1..7 strictly increasing positive integers (row-length bin edges)",
                      "lanes": f"one lane count a bin (len(edges)+1), each from {LANES} or the block "
                               "(a whole block per row)",
                      "block": _BLOCK_TEXT, "unroll": _UNROLL_TEXT}),
    Domain("rowchunks", {"seg": f"an integer in 1..{MAX_CHUNK} (most nonzeros a segment)", "lanes": _LANES_TEXT,
                         "vec": "spmm, sddmm: " + _VEC_TEXT, "block": _BLOCK_TEXT, "unroll": _UNROLL_TEXT},
           (_TILE_TEXT,)),
    Domain("group_row", {"lanes": _LANES_TEXT, "vec": _VEC_TEXT, "block": _BLOCK_TEXT, "rows": _ROWS_TEXT,
                         "unroll": _UNROLL_TEXT}, (_TILE_TEXT,)),
    Domain("warp_row_staged", {"lanes": "one of (8, 16, 32)", "vec": _VEC_TEXT, "block": _BLOCK_TEXT,
                               "rows": _ROWS_TEXT, "stage": "one of ('shfl', 'smem')"},
           (_TILE_TEXT, f"stage=smem: block/lanes*33*8 bytes of staged batches within {MAX_STATIC_SMEM}")),
    Domain("tc_tiles", {"window": f"one of {TC_WINDOWS}", "j": f"one of {TC_SLICES}, 16*j dividing n",
                        "ksplit": f"one of {TC_KSPLITS}; 1 for the half types", "math": "'ieee', or 'tf32' for f32",
                        "block": _BLOCK_TEXT},
           (f"the warps' tiles in shared memory within {MAX_STATIC_SMEM} bytes", "n a multiple of 16")),
)}


def domain(family: str) -> Domain:
    """The parameter domain of ``family`` (a named ValueError for an unknown family)."""
    if family not in DOMAINS:
        raise ValueError(f"domain: unknown family {family!r} (expected one of {', '.join(FAMILIES)})")
    return DOMAINS[family]


def valid(family: str, params: dict, *, op: str, dtype: str, n: int) -> str | None:
    """None when ``params`` (missing ones take defaults) is inside ``family``'s domain for the
    request, else why not: the message names the family, the parameter and the constraint."""
    try:
        render(family, params, op=op, dtype=dtype, n=n, compact=True)
    except ValueError as exc:  # PlanError too: an epilogue the plan refuses
        return str(exc)
    return None
