"""The kernel ABI: plan grammar, strict parser, and the per-pattern preprocessing it names.

Each aux layout is checked against a plain-Python construction of the layout described in
csrc/README.md, on every named pattern, on CPU and (on the device) on CUDA.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from torch_sparserl.abi import KernelSpec, Plan, PlanError, check_source, parse_expr, parse_plan
from torch_sparserl.abi.prepare import prepare

from helpers import PATTERNS, make_pattern

BASE = "// sparserl: op=spmm dtype=f32 block=256 grid=ceil(rows/8)"
KERNEL = ('extern "C" __global__ void sparserl_kernel(const int* rowptr, const int* col, const float* val,'
          ' const float* x, float* y, const int* aux, float* work, int rows, int cols, int n, int nnz,'
          ' int parts) {}\n')


# ----------------------------------------------------------------------------- parser

@pytest.mark.parametrize("line", [
    BASE,
    "// sparserl: op=spmv dtype=f16 n=1 rows=sorted_desc block=128 grid=ceil(rows/4)",
    "// sparserl: op=spmm dtype=bf16 n=64 rows=binned(4,32,512) block=256 grid=max(1,parts*2)",
    "// sparserl: op=spmv dtype=f32 rows=sell(32,256) block=128 grid=ceil(parts/4)",
    "// sparserl: op=spmm dtype=f32 n=32 split=nnz(128) block=256 grid=ceil(parts/8) init=zero",
    "// sparserl: op=spmv dtype=f32 split=merge(512) block=256 grid=ceil(parts/8) init=zero",
    "// sparserl: op=spmm dtype=f32 split=rowchunks(1024) block=64 grid=parts init=zero smem=4*n*64 work=rows",
])
def test_valid_plans_parse_and_round_trip(line):
    plan = parse_plan(line)
    assert parse_plan(plan.format()) == plan
    assert parse_plan(line.removeprefix("// sparserl:")) == plan


@pytest.mark.parametrize("line, message", [
    ("", "missing required key(s) op, dtype, block, grid"),
    ("op=spmm dtype=f32 block=256", "missing required key(s) grid"),
    ("// not a plan", "expected a line starting with"),
    (BASE + " op=spmv", "key 'op' given twice"),
    (BASE + " colour=red", "unknown key 'colour'"),
    (BASE + " init", "expected key=value, got 'init'"),
    ("op=spmm dtype=f64 block=256 grid=1", "dtype must be f32 or f16 or bf16 (got 'f64')"),
    ("op=spgemm dtype=f32 block=256 grid=1", "op must be spmm or spmv or sddmm"),
    ("op=spmm dtype=f32 block=48 grid=1", "block must be a multiple of 32 in 32..1024 (got 48)"),
    ("op=spmm dtype=f32 block=2048 grid=1", "(got 2048)"),
    ("op=spmm dtype=f32 block=-32 grid=1", "block must be a non-negative integer (got '-32')"),
    ("op=spmv n=4 dtype=f32 block=32 grid=1", "n must be 1 for op=spmv (got 4)"),
    ("op=spmm n=0 dtype=f32 block=32 grid=1", "n must be an integer >= 1 (got 0)"),
    ("op=spmm dtype=f32 block=32 grid=rows rows=diagonal", "rows must be natural or sorted_desc"),
    ("op=spmm dtype=f32 block=32 grid=rows rows=binned(8,4)", "strictly increasing positive edges"),
    ("op=spmm dtype=f32 block=32 grid=rows rows=binned()", "must be a non-negative integer (got '')"),
    ("op=spmm dtype=f32 block=32 grid=rows rows=sell(24,48)", "C must be a power of two"),
    ("op=spmm dtype=f32 block=32 grid=rows rows=sell(32,48)", "S must be a positive multiple of C=32"),
    ("op=spmm dtype=f32 block=32 grid=rows rows=sorted_desc(2)", "rows=sorted_desc must be no arguments"),
    ("op=spmm dtype=f32 block=32 grid=rows split=nnz", "split=nnz(C) must be an integer in 1..1048576"),
    ("op=spmm dtype=f32 block=32 grid=rows split=nnz(0)", "(got 0)"),
    ("op=spmm dtype=f32 block=32 grid=rows split=nnz(4,5)", "takes one integer"),
    ("op=spmm dtype=f32 block=32 grid=rows split=none(4)", "split=none must be no argument"),
    ("op=spmm dtype=f32 block=32 grid=parts split=nnz(64) rows=sorted_desc", "rows must be natural with split=nnz"),
    ("op=spmm dtype=f32 block=32 grid=rows init=ones", "init must be none or zero"),
    ("op=spmm dtype=f32 block=32 grid=rows**2", "unexpected '*'"),
    ("op=spmm dtype=f32 block=32 grid=__import__('os')", "unexpected character"),
    ("op=spmm dtype=f32 block=32 grid=os.system", "unexpected character '.'"),
    ("op=spmm dtype=f32 block=32 grid=warps", "unknown name 'warps'"),
    ("op=spmm dtype=f32 block=32 grid=ceil(rows)", "ceil takes a division"),
    ("op=spmm dtype=f32 block=32 grid=min(rows)", "expected ','"),
    ("op=spmm dtype=f32 block=32 grid=(rows", "expected ')'"),
    ("op=spmm dtype=f32 block=32 grid=rows)", "unexpected ')'"),
])
def test_malformed_plans_are_named(line, message):
    with pytest.raises(PlanError) as info:
        parse_plan(line)
    assert message in str(info.value)


def test_expressions_evaluate_with_integer_semantics():
    env = {"rows": 10, "cols": 7, "nnz": 33, "n": 32, "parts": 5}
    assert parse_expr("ceil(rows/4)").evaluate(env) == 3
    assert parse_expr("rows/4").evaluate(env) == 2
    assert parse_expr("2+3*4-(1+1)").evaluate(env) == 12
    assert parse_expr("max(1,min(nnz,parts*n))").evaluate(env) == 33
    assert parse_expr("ceil(nnz/(n-32+1))").evaluate(env) == 33
    with pytest.raises(PlanError, match="division by zero"):
        parse_expr("rows/(n-32)").evaluate(env)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(list("=(),+-*/ 0123456789") + [
    "op", "spmm", "spmv", "dtype", "f32", "block", "grid", "rows", "split", "nnz", "ceil", "n", "sell",
    "init", "zero", "merge", "binned", "// sparserl:"]), max_size=40).map("".join))
def test_parser_raises_only_plan_errors(text):
    try:
        plan = parse_plan(text)
    except PlanError:
        return
    assert isinstance(plan, Plan)


def test_check_source_requires_plan_first_and_the_abi_kernel():
    assert check_source(BASE + "\n" + KERNEL).op == "spmm"
    assert check_source("\n\n  " + BASE + "\n" + KERNEL).block == 256
    with pytest.raises(PlanError, match="first line must be the plan"):
        check_source("#include <cuda_fp16.h>\n" + BASE + "\n" + KERNEL)
    with pytest.raises(PlanError, match="no definition of extern"):
        check_source(BASE + "\n" + KERNEL.replace("sparserl_kernel", "my_kernel"))
    with pytest.raises(PlanError, match="torch headers are not allowed"):
        check_source(BASE + "\n#include <torch/extension.h>\n" + KERNEL)
    with pytest.raises(PlanError, match="empty"):
        check_source("   \n")
    with pytest.raises(PlanError, match="expected the kernel source as a str"):
        check_source(b"// sparserl:")


def test_kernel_spec_hashes_its_source():
    a, b = KernelSpec(BASE + "\n" + KERNEL), KernelSpec(BASE + "\n" + KERNEL + "\n")
    assert a.key != b.key and len(a.key) == 20 and a.plan == b.plan
    assert KernelSpec(BASE + "\n" + KERNEL, family="x", params=(("v", 4),)).describe() == "x(v=4)"


# ----------------------------------------------------------------------------- preprocessing

def _lengths(A):
    return np.diff(A.indptr)


def _expected_aux(plan: Plan, A, n):
    """The aux layout of csrc/README.md, built with plain Python loops."""
    rows, nnz = A.shape[0], A.nnz
    lengths = _lengths(A)
    rowptr = A.indptr
    if plan.rows == "sorted_desc":
        return sorted(range(rows), key=lambda r: -lengths[r]), 0
    if plan.rows == "binned":
        edges = [0, *plan.rows_args, math.inf]
        bins = [[r for r in range(rows) if edges[b] <= lengths[r] < edges[b + 1]] for b in range(len(edges) - 1)]
        starts = np.cumsum([0] + [len(b) for b in bins]).tolist()
        return starts + [r for b in bins for r in b], len(bins)
    if plan.rows == "sell":
        c, s = plan.rows_args
        perm = []
        for w in range(0, rows, s):
            perm += sorted(range(w, min(w + s, rows)), key=lambda r: -lengths[r])
        slices = -(-rows // c)
        slice_ptr, cols_, nzs = [0], [], []
        for sl in range(slices):
            members = perm[sl * c:(sl + 1) * c]
            width = max((lengths[r] for r in members), default=0)
            block_col = [[0] * c for _ in range(width)]
            block_nz = [[-1] * c for _ in range(width)]
            for t, r in enumerate(members):
                for k in range(lengths[r]):
                    block_nz[k][t] = rowptr[r] + k
                    block_col[k][t] = A.indices[rowptr[r] + k]
            cols_ += [v for row in block_col for v in row]
            nzs += [v for row in block_nz for v in row]
            slice_ptr.append(slice_ptr[-1] + width * c)
        return slice_ptr + perm + cols_ + nzs, slices
    if plan.split == "nnz":
        chunk = plan.split_arg
        parts = -(-nnz // chunk)
        part_row = [next(r for r in range(rows) if rowptr[r] <= p * chunk < rowptr[r + 1]) for p in range(parts)]
        if "hubs" not in plan.work.text:
            return part_row + [rows], parts
        row_hub, hubs = [], 0
        for r in range(rows):  # a row whose nonzeros meet more than one chunk: a hub, numbered in row order
            chunks_met = {k // chunk for k in range(rowptr[r], rowptr[r + 1])}
            row_hub.append(hubs if len(chunks_met) > 1 else -1)
            hubs += len(chunks_met) > 1
        return part_row + [rows] + row_hub, parts
    if plan.split == "merge":
        chunk = plan.split_arg
        parts = -(-(rows + nnz) // chunk)
        merged = sorted([(rowptr[r + 1] + r, "end", r) for r in range(rows)]
                        + [(k + sum(rowptr[r + 1] <= k for r in range(rows)), "nz", k) for k in range(nnz)])
        assert [m[0] for m in merged] == list(range(rows + nnz))  # positions form the merged path
        coords = []
        for p in range(parts + 1):
            d = min(p * chunk, rows + nnz)
            consumed_rows = sum(1 for m in merged[:d] if m[1] == "end")
            coords.append((consumed_rows, d - consumed_rows))
        return [c[0] for c in coords] + [c[1] for c in coords], parts
    if plan.split == "rowchunks":
        t = plan.split_arg
        seg_row, seg_start, seg_hub, hubs = [], [], [], 0
        for r in range(rows):
            pieces = range(rowptr[r], rowptr[r + 1], t) or [rowptr[r]]  # an empty row: one empty segment
            for start in pieces:
                seg_row.append(r)
                seg_start.append(start)
                seg_hub.append(hubs if len(pieces) > 1 else -1)  # hubs numbered in row order
            hubs += len(pieces) > 1
        return seg_row + seg_start + seg_hub, len(seg_row)
    return None, 0


PLANS = [
    "rows=natural split=none grid=ceil(rows/8)",
    "rows=sorted_desc grid=ceil(rows/8)",
    "rows=binned(2,5) grid=parts",
    "rows=binned(1) grid=parts",
    "rows=sell(4,8) grid=parts",
    "rows=sell(1,1) grid=parts",
    "split=nnz(7) grid=parts init=zero",
    "split=nnz(1) grid=parts init=zero",
    "split=merge(9) grid=parts init=zero",
    "split=merge(1) grid=parts init=zero",
    "split=rowchunks(3) grid=parts init=zero",
    "dtype=f16 split=rowchunks(3) grid=parts init=zero work=hubs*8",
    "dtype=bf16 split=nnz(7) grid=parts init=zero work=hubs*8",
    "dtype=f16 split=nnz(1) grid=parts init=zero work=hubs*8",
]


def _hubs(plan, A) -> int:
    """The rows a split plan stores in more than one piece."""
    spans = [range(A.indptr[r], A.indptr[r + 1]) for r in range(A.shape[0])]
    if plan.split == "rowchunks":
        return sum(len(span) > plan.split_arg for span in spans)
    if plan.split == "nnz":
        return sum(len({k // plan.split_arg for k in span}) > 1 for span in spans)
    return 0


@pytest.mark.parametrize("pattern", [p for p in PATTERNS if p != "cora (real)"])
@pytest.mark.parametrize("plan_text", PLANS)
def test_prepare_builds_the_documented_layout(device, pattern, plan_text):
    A = make_pattern(pattern)
    plan = parse_plan(f"op=spmm block=64 {plan_text}" + ("" if "dtype=" in plan_text else " dtype=f32"))
    rowptr = torch.from_numpy(A.indptr.astype(np.int32)).to(device)
    col = torch.from_numpy(A.indices.astype(np.int32)).to(device)
    prep = prepare(plan, rowptr, col, A.shape, n=3)
    expected, parts = _expected_aux(plan, A, 3)
    assert prep.parts == parts
    if expected is None:
        assert prep.aux is None
    else:
        assert prep.aux.dtype == torch.int32 and prep.aux.device.type == device.type
        assert prep.aux.tolist() == [int(v) for v in expected]
    assert prep.grid == plan.grid.evaluate(prep.env)
    assert prep.init_zero == (plan.init == "zero")
    assert prep.hubs == _hubs(plan, A)
    assert prep.work_numel == plan.work.evaluate(prep.env)


def test_prepare_rejects_what_the_pattern_cannot_take():
    A = make_pattern("random")
    rowptr = torch.from_numpy(A.indptr.astype(np.int32))
    col = torch.from_numpy(A.indices.astype(np.int32))
    with pytest.raises(PlanError, match="written for n=32"):
        prepare(parse_plan("op=spmm dtype=f32 n=32 block=32 grid=rows"), rowptr, col, A.shape, n=16)
    with pytest.raises(PlanError, match="grid=rows-1000 evaluates to -940"):
        prepare(parse_plan("op=spmm dtype=f32 block=32 grid=rows-1000"), rowptr, col, A.shape, n=1)
    with pytest.raises(PlanError, match="smem=rows\\*10000 evaluates to 600000 bytes"):
        prepare(parse_plan("op=spmm dtype=f32 block=32 grid=1 smem=rows*10000"), rowptr, col, A.shape, n=1)
    with pytest.raises(PlanError, match="rowptr must have rows \\+ 1 = 61 entries"):
        prepare(parse_plan("op=spmm dtype=f32 block=32 grid=1"), rowptr[:-1], col, A.shape, n=1)
    with pytest.raises(PlanError, match="op=spmv takes n=1"):
        prepare(parse_plan("op=spmv dtype=f32 block=32 grid=1"), rowptr, col, A.shape, n=2)


def test_prepare_on_a_real_graph_matches_the_layout():
    A = make_pattern("cora (real)")
    rowptr = torch.from_numpy(A.indptr.astype(np.int32))
    col = torch.from_numpy(A.indices.astype(np.int32))
    for text in ("split=merge(256) grid=parts init=zero", "rows=binned(4,32) grid=parts"):
        plan = parse_plan(f"op=spmv dtype=f32 block=64 {text}")
        expected, parts = _expected_aux(plan, A, 1)
        prep = prepare(plan, rowptr, col, A.shape, n=1)
        assert prep.parts == parts and prep.aux.tolist() == [int(v) for v in expected]


def test_work_init_says_whether_the_workspace_is_zeroed_per_launch_or_once():
    once = parse_plan("// sparserl: op=spmv dtype=f32 split=rowchunks(8) block=256 grid=parts work=hubs*2 "
                      "work_init=once")
    assert once.work_init == "once" and parse_plan(once.format()) == once and "work_init=once" in once.format()
    plain = parse_plan("// sparserl: op=spmv dtype=f32 split=rowchunks(8) block=256 grid=parts work=hubs*2")
    assert plain.work_init == "zero" and "work_init" not in plain.format()
    with pytest.raises(PlanError, match=r"work_init must be zero \(the default\) for a plan without a workspace"):
        parse_plan("// sparserl: op=spmv dtype=f32 block=256 grid=rows work_init=once")
    with pytest.raises(PlanError, match="work_init must be zero or once"):
        parse_plan("// sparserl: op=spmv dtype=f32 block=256 grid=rows work=rows work_init=never")
    A = make_pattern("short and huge rows")
    rowptr, col = torch.from_numpy(A.indptr.astype(np.int32)), torch.from_numpy(A.indices.astype(np.int32))
    prep = prepare(once, rowptr, col, A.shape, n=1)
    assert prep.work_once and prep.work_numel == 2 * prep.hubs > 0
    assert prep.parts == int(np.maximum(-(-np.diff(A.indptr) // 8), 1).sum())  # an empty row is a segment
    assert not prepare(plain, rowptr, col, A.shape, n=1).work_once
