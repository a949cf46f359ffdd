"""Kernel families (CPU): every family renders a valid ABI source, bad parameters are refused
before nvcc runs, the candidate space is sane, and a representative subset compiles for sm_90."""

from __future__ import annotations

import re
import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest

from torch_sparserl.abi import PlanError, check_source, parse_plan, plan_line
from torch_sparserl.specialize import families as F

DTYPES = ("f32", "f16", "bf16")
SPMM_NS = (1, 7, 32, 128)


def _cases():
    """(family, op, dtype, n) for every family, op and dtype at a few n."""
    for name, fam in F.FAMILIES.items():
        for op in sorted(fam.ops):
            for dtype in DTYPES:
                for n in ((1,) if op == "spmv" else SPMM_NS):
                    yield name, op, dtype, n


SPLIT_FAMILIES = ("nnz_split", "merge_path")  # a row's pieces summed atomically into y


def float32_only(name: str, op: str) -> bool:
    """Whether a family's ``op`` kernels take float32 only: a split family's spmv sums a row's
    pieces atomically into y. The spmm of nnz_split (and rowchunks everywhere) sums a
    half-precision row's pieces in a float32 workspace instead; sddmm has no pieces."""
    return name in SPLIT_FAMILIES and op == "spmv"


def test_half_precision_plans_sum_no_pieces_into_y():
    """A split spmm/spmv plan of a half dtype is refused by the ABI's plan check (and so is a
    policy-written kernel with one), since atomics into y would round every partial sum of a
    row; rowchunks, and nnz for spmm, with a float32 workspace for their hubs are the exception."""
    for op, dtype, split in (("spmm", "bf16", "rowchunks(64)"), ("spmv", "f16", "rowchunks(64)"),
                             ("spmm", "f16", "nnz(64)"), ("spmv", "bf16", "merge(16)")):
        line = f"// sparserl: op={op} dtype={dtype} n={32 if op == 'spmm' else 1} split={split} block=256 " \
               f"grid=ceil(parts/8) init=zero"
        with pytest.raises(PlanError, match=f"split for op={op} dtype={dtype} must be none, or rowchunks"):
            parse_plan(line)
    with pytest.raises(PlanError, match=r"must be none, or rowchunks\(T\) with a float32"):  # spmv: no nnz hubs
        parse_plan("// sparserl: op=spmv dtype=f16 n=1 split=nnz(64) block=256 grid=ceil(parts/8) init=zero "
                   "work=hubs*2")
    with pytest.raises(PlanError, match=r"must be none, or rowchunks\(T\) or nnz\(T\)"):  # a workspace, not hubs
        parse_plan("// sparserl: op=spmm dtype=f16 n=32 split=merge(64) block=256 grid=ceil(parts/8) init=zero "
                   "work=hubs*36")
    parse_plan("// sparserl: op=spmm dtype=f16 n=32 split=nnz(64) block=256 grid=ceil(parts/8) init=zero "
               "work=hubs*36")
    parse_plan("// sparserl: op=spmm dtype=bf16 n=32 split=rowchunks(64) block=256 grid=ceil(parts/8) init=zero "
               "work=hubs*36")
    parse_plan("// sparserl: op=sddmm dtype=bf16 n=32 split=rowchunks(64) block=256 grid=ceil(parts/8)")
    parse_plan("// sparserl: op=spmm dtype=f32 n=32 split=rowchunks(64) block=256 grid=ceil(parts/8) init=zero")
    spec = F.render("rowchunks", {"vec": 2, "lanes": 32}, op="spmm", dtype="bf16", n=130)
    assert parse_plan(plan_line(spec.source)).work.evaluate({"hubs": 3}) == 3 * (132 + 4)  # SR_HUB floats a hub


def _default_params(name: str, op: str, dtype: str, n: int) -> dict:
    """The family's first candidate for this shape (defaults may not fit every n, e.g. vec=4,
    n=7), else float32's (nnz_split's half spmm is not screened, but renders)."""
    grid = F.FAMILIES[name].grid(op, dtype, n, {}) or F.FAMILIES[name].grid(op, "f32", n, {})
    return grid[0] if grid else {}


@pytest.mark.parametrize("name,op,dtype,n", list(_cases()))
def test_renders_a_valid_abi_source(name, op, dtype, n):
    if name == "tc_tiles" and n % 16:
        with pytest.raises(ValueError, match=f"family tc_tiles: parameter 'j' expected a divisor of n/16 .n={n}"):
            F.render(name, {"j": 1}, op=op, dtype=dtype, n=n)
        return
    if float32_only(name, op) and dtype != "f32":
        with pytest.raises(ValueError, match=f"family {name}: parameter 'dtype' expected f32 for op={op}"):
            F.render(name, _default_params(name, op, "f32", n), op=op, dtype=dtype, n=n)
        return
    spec = F.render(name, _default_params(name, op, dtype, n), op=op, dtype=dtype, n=n)
    plan = check_source(spec.source)
    assert parse_plan(plan_line(spec.source)) == plan
    assert (plan.op, plan.dtype, plan.n) == (op, dtype, n)
    assert spec.family == name and spec.params == tuple(sorted(spec.params))
    # self-contained: only CUDA's own half-precision and (tensor-core families) warp-matrix headers
    includes = re.findall(r'#\s*include\s*([<"][^>"]+[>"])', spec.source)
    assert set(includes) <= {"<cuda_fp16.h>", "<cuda_bf16.h>", "<mma.h>"}, includes
    assert '#include "' not in spec.source
    assert 'extern "C" __global__' in spec.source and "sparserl_kernel(" in spec.source
    if plan.split != "none":
        assert plan.rows == "natural"
        # spmm/spmv pieces of a row meet atomically in zeroed output, or (rowchunks) in a float32
        # workspace that every launch leaves zero, every row stored once; sddmm outputs are per nonzero
        if op == "sddmm" or plan.split == "tiles":  # one output element (tiles: row) per work item
            assert plan.init == "none" and plan.work.text == "0"
        elif name == "rowchunks":
            assert plan.init == "none" and "hubs" in plan.work.text and plan.work_init == "once"
        else:
            assert plan.init == "zero"
    if op == "sddmm":
        assert "sparserl SDDMM helpers" in spec.source and "SR_PASSES 1\n" in spec.source
    # the grid evaluates for an empty and for an ordinary pattern
    for env in ({"rows": 0, "cols": 0, "nnz": 0, "n": n, "parts": 0},
                {"rows": 1000, "cols": 700, "nnz": 9000, "n": n, "parts": 40}):
        assert plan.grid.evaluate(env) >= 0
    assert plan.grid.evaluate({"rows": 0, "cols": 0, "nnz": 0, "n": n, "parts": 0}) == 0


def test_every_family_has_both_templates_it_claims():
    for fam in F.FAMILIES.values():
        assert fam.ops <= {"spmm", "spmv", "sddmm"} and fam.doc
        for op in fam.ops:
            assert fam.template_path(op).exists(), fam.template_path(op)
    assert (F.TEMPLATE_DIR / "prelude.cuh").exists()


def test_rendered_source_bakes_geometry():
    spec = F.render("group_row", {"lanes": 8, "vec": 4}, op="spmm", dtype="f32", n=32)
    src = spec.source
    for line in ("#define SR_N 32", "#define SR_LANES 8", "#define SR_VEC 4", "#define SR_TB 1",
                 "#define SR_DTYPE 0"):
        assert line in src
    assert spec.plan.grid.text == "ceil(rows/32)"
    assert F.render("group_row", {"lanes": 8, "vec": 4}, op="spmm", dtype="f32", n=32).key == spec.key


@pytest.mark.parametrize("name,params,op,dtype,n,words", [
    ("group_row", {"vec": 4}, "spmm", "f32", 7, ("group_row", "'vec'", "divisor of n=7", "4")),
    ("group_row", {"vec": 8}, "spmm", "f32", 32, ("group_row", "'vec'", "(1, 2, 4)", "8")),
    ("group_row", {"lanes": 3}, "spmm", "f32", 32, ("group_row", "'lanes'", "3")),
    ("group_row", {"rows": "sell"}, "spmm", "f32", 32, ("group_row", "'rows'", "'sell'")),
    ("group_row", {"block": 100}, "spmm", "f32", 32, ("group_row", "'block'", "100")),
    ("group_row", {"bogus": 1}, "spmm", "f32", 32, ("group_row", "unknown parameter", "'bogus'")),
    ("vector_row", {"lanes": 64}, "spmv", "f32", 1, ("vector_row", "'lanes'", "64")),
    ("vector_row", {"unroll": 9}, "spmv", "f32", 1, ("vector_row", "'unroll'", "1..8", "9")),
    ("vector_row", {}, "spmm", "f32", 32, ("vector_row", "'op'", "'spmm'")),
    ("vector_row", {}, "spmv", "f32", 4, ("vector_row", "'n'", "1 for op=spmv")),
    ("vector_row", {}, "spmv", "f64", 1, ("vector_row", "'dtype'", "'f64'")),
    ("nnz_split", {"chunk": 100}, "spmv", "f32", 1, ("nnz_split", "'chunk'", "multiple of 32", "100")),
    ("nnz_split", {"chunk": 0}, "spmm", "f32", 32, ("nnz_split", "'chunk'", "0")),
    ("sell", {"c": 32, "sigma": 48}, "spmv", "f32", 1, ("sell", "'sigma'", "multiple of c=32", "48")),
    ("sell", {"c": 24}, "spmv", "f32", 1, ("sell", "'c'", "24")),
    ("binned", {"edges": (8, 4)}, "spmv", "f32", 1, ("binned", "'edges'", "strictly increasing")),
    ("binned", {"edges": (4, 32), "lanes": (1, 2)}, "spmv", "f32", 1, ("binned", "'lanes'", "3 lane counts")),
    ("binned", {"edges": (4,), "lanes": (1, 512)}, "spmv", "f32", 1, ("binned", "'lanes'", "512")),
    ("warp_row_staged", {"lanes": 4}, "spmm", "f32", 32, ("warp_row_staged", "'lanes'", "(8, 16, 32)")),
    ("warp_row_staged", {"stage": "regs"}, "spmm", "f32", 32, ("warp_row_staged", "'stage'", "'regs'")),
    ("rowchunks", {"seg": 0}, "spmv", "f32", 1, ("rowchunks", "'seg'", "0")),
    ("merge_path", {"items": 0}, "spmv", "f32", 1, ("merge_path", "'items'", "0")),
    ("nosuch", {}, "spmv", "f32", 1, ("unknown family", "'nosuch'")),
    ("group_row", {"lanes": 1, "vec": 1}, "sddmm", "f32", 128,
     ("group_row", "'lanes'", "lanes*vec*32 >= n=128 for op=sddmm", "got 1")),
    ("vector_row", {}, "sddmm", "f32", 32, ("vector_row", "'op'", "['spmv']", "'sddmm'")),
])
def test_invalid_params_raise_a_clear_value_error(name, params, op, dtype, n, words):
    with pytest.raises(ValueError) as info:
        F.render(name, params, op=op, dtype=dtype, n=n)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


FEATURES = {
    "road": {"rows": 1_000_000, "cols": 1_000_000, "nnz": 2_800_000, "row_mean": 2.8, "row_max": 9, "row_cv": 0.3},
    "fem": {"rows": 100_000, "cols": 100_000, "nnz": 2_700_000, "row_mean": 27.0, "row_max": 40, "row_cv": 0.2},
    "powerlaw": {"rows": 500_000, "cols": 500_000, "nnz": 5_000_000, "row_mean": 10.0, "row_max": 46_500,
                 "row_cv": 6.0},
}


@pytest.mark.parametrize("op,n", [("spmv", 1), ("spmm", 1), ("spmm", 7), ("spmm", 32), ("spmm", 64),
                                  ("spmm", 128), ("spmm", 256), ("sddmm", 16), ("sddmm", 128), ("sddmm", 256)])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("features", [None, *FEATURES])
def test_space_is_sized_renderable_and_pruned(op, n, dtype, features):
    feats = FEATURES.get(features) if features else None
    candidates = F.space(op, dtype, n, feats)
    # spmm with n=1 is a matrix-vector product in disguise: only the lane-per-row shapes fit;
    # half-precision spmm/spmv screen no split family but rowchunks (float32 accumulation;
    # nnz_split's half spmm renders, but never won: families._grid_nnz_split)
    fewest = 3 if (op, n) == ("spmm", 1) else 8
    if dtype != "f32" and op != "sddmm":
        fewest -= 1 if (op, n) == ("spmm", 1) else 2
    assert fewest <= len(candidates) <= 120, len(candidates)
    keys = set()
    for name, params in candidates:
        spec = F.render(name, params, op=op, dtype=dtype, n=n)
        keys.add(spec.key)
    assert len(keys) == len(candidates), "duplicate candidates"
    families = {name for name, _ in candidates}
    if features == "road":
        assert "binned" not in families and "rowchunks" not in families  # nothing to split
        if op == "spmv":
            assert all(p["lanes"] <= 8 for name, p in candidates if name == "vector_row")
    if dtype != "f32" and op != "sddmm":
        assert not families & set(SPLIT_FAMILIES), families  # float32 accumulation: no atomics into y
    if features == "powerlaw":
        assert "rowchunks" in families  # the hubs' family, in half precision too
        if dtype == "f32" or op == "sddmm":
            assert "nnz_split" in families
        if op == "spmv":
            assert "binned" in families and "sell" not in families
            assert ("merge_path" in families) == (dtype == "f32")


def test_spmm_tiles_cover_n_without_too_many_registers():
    for n in (1, 5, 7, 32, 64, 130, 256, 1000):
        for lanes in F.LANES:
            for vec in (1, 2, 4, 8):
                tb, passes = F._tiles(n, lanes, vec)
                assert tb * passes * lanes * vec >= n
                assert tb * vec <= max(F.ACC_BUDGET, vec)
                assert (tb - 1) * passes * lanes * vec < n  # no empty tile column per pass


# --------------------------------------------------------------------------- nvcc


def _compile_subset() -> list[tuple[str, str, str, int, dict]]:
    """Per family x op x dtype: the default, plus the parameters that change the code path."""
    jobs = []
    extra = {
        ("vector_row", "spmv"): [{"lanes": 1, "unroll": 1, "rows": "sorted_desc"}, {"lanes": 32, "unroll": 4}],
        ("binned", "spmv"): [{"edges": (2, 8, 32, 256, 4096), "lanes": (1, 4, 16, 32, 32, 256)}],
        ("group_row", "spmm"): [{"lanes": 32, "vec": 2, "rows": "sorted_desc", "unroll": 1}],
        ("warp_row_staged", "spmm"): [{"lanes": 16, "vec": 2, "stage": "smem"}],
        ("nnz_split", "spmm"): [{"lanes": 4, "vec": 1, "chunk": 32}],
        ("rowchunks", "spmm"): [{"lanes": 32, "vec": 2, "seg": 128}],
    }
    for name, fam in F.FAMILIES.items():
        for op in sorted(fam.ops):
            for dtype in DTYPES:
                if float32_only(name, op) and dtype != "f32":
                    continue  # not in the space (float32 accumulation)
                if name == "tc_tiles":  # one and two 16-row tiles, 1 to 4 column tiles, TF32 once
                    shapes = [(16, {"j": 1}), (64, {"window": 32, "j": 2}), (64, {"window": 16, "j": 4, "block": 64})]
                    if dtype == "f32":
                        shapes += [(64, {"window": 32, "j": 2, "math": "tf32"}), (64, {"window": 32, "j": 2, "ksplit": 16})]
                elif op == "spmv":
                    shapes = [(1, {})]
                elif op == "sddmm":  # n=130 with vec=2: a ragged last tile of D; sorted rows; one lane per row
                    shapes = [(128, {}), (130, {"vec": 2, "lanes": 32}), (7, {"vec": 1, "lanes": 8, "unroll": 4})]
                else:  # n=130 with vec=2: a ragged last tile; half types try the 16-byte load
                    shapes = [(32, {}), (130, {"vec": 2, "lanes": 32})]
                    if dtype != "f32" and name == "group_row":
                        shapes.append((64, {"vec": 8, "lanes": 8}))
                for n, params in shapes:
                    jobs.append((name, op, dtype, n, params))
                if dtype == "f32":
                    jobs += [(name, op, dtype, 1 if op == "spmv" else 32, p) for p in extra.get((name, op), [])]
    return jobs


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_representative_sources_compile_for_sm90():
    from torch_sparserl.toolchain import nvcc

    jobs = _compile_subset()

    def build(job):
        name, op, dtype, n, params = job
        spec = F.render(name, params, op=op, dtype=dtype, n=n)
        try:
            result = nvcc.compile(spec.source, arch="sm_90")
        except Exception as exc:  # noqa: BLE001 - reported with the job below
            return job, f"{exc}\n{getattr(exc, 'log', '')[:2000]}"
        if result.spill_bytes or result.stack_bytes:
            return job, f"spills {result.spill_bytes} B, stack {result.stack_bytes} B, {result.registers} regs"
        return job, None

    with ThreadPoolExecutor(max_workers=2) as pool:
        failures = [(job, why) for job, why in pool.map(build, jobs) if why]
    assert not failures, "\n".join(f"{job}: {why}" for job, why in failures)
