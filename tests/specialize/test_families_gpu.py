"""Kernel families on the GPU: every family x a few parameter sets x dtypes x n, on named
patterns, against a float64 reference. Outputs are pre-filled with NaN, so a row a kernel
leaves unwritten fails. Built with NVRTC (`load_kernel`), prepared with `prepare`. The same
kernels run again on patterns whose columns are unsorted within rows and whose (row, col)
entries repeat (``helpers.UNSORTED_AND_DUPLICATE``), against a reference summing every entry."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
import torch

from torch_sparserl.abi import operand_shapes
from torch_sparserl.dtypes import close_to_reference
from torch_sparserl.specialize import families as F

from helpers import UNSORTED_AND_DUPLICATE, make_unsorted_pattern, summed_product


TORCH_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


# --------------------------------------------------------------------------- patterns


def _random(rng, rows, cols, density):
    return sp.random(rows, cols, density=density, format="csr", random_state=rng, dtype=np.float64)


def _empty_rows_in_the_middle(rng):
    A = _random(rng, 300, 200, 0.05).tolil()
    A[100:220, :] = 0
    return A.tocsr()


def _arrow(rng):
    """One huge row (5000 nonzeros) and a dense column among rows of ~3 nonzeros."""
    rows, cols = 2000, 5000
    A = _random(rng, rows, cols, 3 / cols).tolil()
    A[17, :] = rng.standard_normal(cols)
    A[:, 3] = rng.standard_normal((rows, 1))
    return A.tocsr()


def _power_law(rng):
    """Row lengths ~ Zipf: many rows of 1-3 nonzeros, a few of hundreds to thousands."""
    rows, cols = 3000, 2500
    lengths = np.minimum(rng.zipf(1.6, rows), cols)
    indptr = np.concatenate([[0], np.cumsum(lengths)])
    indices = np.concatenate([np.sort(rng.choice(cols, size=l, replace=False)) for l in lengths])
    return sp.csr_matrix((np.ones(indptr[-1]), indices, indptr), shape=(rows, cols))


def _banded(rng):
    return sp.diags([1.0] * 9, list(range(-4, 5)), shape=(700, 700), format="csr")


PATTERNS = {
    "empty rows in the middle": _empty_rows_in_the_middle,
    "all rows empty": lambda rng: sp.csr_matrix((50, 40), dtype=np.float64),
    "arrow (one huge row)": _arrow,
    "power law": _power_law,
    "banded": _banded,
    "wide (cols != rows)": lambda rng: _random(rng, 37, 900, 0.08),
}


@pytest.fixture(scope="module")
def patterns():
    out = {}
    for i, (name, make) in enumerate(PATTERNS.items()):
        rng = np.random.default_rng(i)
        A = make(rng).tocsr()
        A.sort_indices()
        A.data = rng.standard_normal(A.nnz)
        out[name] = A
    return out


@pytest.fixture(scope="module")
def unsorted_patterns():
    """:data:`helpers.UNSORTED_AND_DUPLICATE`, as they are (never sorted or summed)."""
    return {name: make_unsorted_pattern(name, seed=i) for i, name in enumerate(UNSORTED_AND_DUPLICATE)}


@pytest.fixture(scope="module", params=["sorted", "unsorted+repeated"])
def pattern_set(request, patterns, unsorted_patterns):
    """Each family case runs on both: the named patterns (sorted columns), then patterns whose
    columns are unsorted within rows and whose entries repeat (the kernels are built once per
    process, so the second set costs its launches)."""
    return patterns if request.param == "sorted" else unsorted_patterns


# --------------------------------------------------------------------------- parameter sets


def _vec(dtype: str, n: int, widest: int = 8) -> int:
    return max(v for v in F._vecs(dtype) if n % v == 0 and v <= widest)


SPLIT_FAMILIES = ("nnz_split", "merge_path")
"""Their spmv kernels sum a row's pieces atomically into y: float32 only (the ABI refuses half
dtypes there: 16-bit atomics rounded every partial sum, and this test caught a bf16 arrow row
summed to -12.75 for -13.70 by rowchunks with 200-nonzero pieces, the atomics' order deciding).
The half kernels of rowchunks and of nnz_split's spmm sum a hub row's pieces in a float32
workspace instead, and are tested with the same small pieces as f32 (the arrow row in up to 5000
pieces, chunks of 7 nonzeros)."""


def _spmv_params(name: str, dtype: str) -> list[dict]:
    return {
        "vector_row": [{"lanes": 1, "unroll": 1}, {"lanes": 4, "rows": "sorted_desc", "unroll": 4},
                       {"lanes": 32, "unroll": 2}, {"lanes": 2, "rows": "sorted_desc", "unroll": 1, "block": 64}],
        "nnz_split": [{"chunk": 32}, {"chunk": 256}, {"chunk": 2048, "block": 128}],
        "merge_path": [{"items": 1}, {"items": 7}, {"items": 32}],
        "sell": [{"c": 32, "sigma": 128, "unroll": 1}, {"c": 4, "sigma": 4, "unroll": 4},
                 {"c": 128, "sigma": 1024, "unroll": 2}],
        "binned": [{}, {"edges": (2, 8, 32, 256, 4096), "lanes": (1, 4, 16, 32, 32, 256)},
                   {"edges": (1,), "lanes": (1, 256)}, {"edges": (3, 40), "lanes": (2, 32, 128), "block": 128}],
        "rowchunks": [{"lanes": 1, "seg": 64}, {"lanes": 32, "seg": 256}, {"lanes": 8, "seg": 7}],
    }[name]


def _spmv_cases():
    for name in ("vector_row", "nnz_split", "merge_path", "sell", "binned", "rowchunks"):
        for dtype in TORCH_DTYPES:
            if name in SPLIT_FAMILIES and dtype != "f32":
                continue
            for i, params in enumerate(_spmv_params(name, dtype)):
                yield pytest.param(name, params, dtype, 1, id=f"spmv-{name}-{i}-{dtype}")


def _spmm_params(name: str, dtype: str, n: int) -> list[dict]:
    v = _vec(dtype, n)
    return {
        "group_row": [{"lanes": 8, "vec": v}, {"lanes": 32, "vec": 1, "rows": "sorted_desc", "unroll": 4},
                      {"lanes": 1, "vec": v, "unroll": 1}, {"lanes": 4, "vec": _vec(dtype, n, 2), "block": 128}],
        "warp_row_staged": [{"lanes": 8, "vec": v, "stage": "shfl"},
                            {"lanes": 32, "vec": 1, "stage": "smem", "rows": "sorted_desc"},
                            {"lanes": 16, "vec": v, "stage": "smem"}],
        "nnz_split": [{"lanes": 8, "vec": v, "chunk": 64}, {"lanes": 1, "vec": 1, "chunk": 7, "unroll": 4},
                      {"lanes": 32, "vec": v, "chunk": 1000}],
        "rowchunks": [{"lanes": 8, "vec": v, "seg": 16}, {"lanes": 32, "vec": 1, "seg": 1},
                      {"lanes": 4, "vec": v, "seg": 500}],
    }[name]


def _sddmm_params(name: str, dtype: str, n: int) -> list[dict]:
    v = _vec(dtype, n)
    return {
        "group_row": [{"lanes": 8, "vec": v}, {"lanes": 32, "vec": 1, "rows": "sorted_desc", "unroll": 4},
                      {"lanes": 32 if n > 32 else 1, "vec": v, "unroll": 1}, {"lanes": 16, "vec": _vec(dtype, n, 2), "block": 128}],
        "nnz_split": [{"lanes": 8, "vec": v, "chunk": 7}, {"lanes": 32, "vec": v, "chunk": 1000, "unroll": 4},
                      {"lanes": 2, "vec": 1, "chunk": 64} if n <= 64 else {"lanes": 16, "vec": v, "chunk": 64}],
        "rowchunks": [{"lanes": 8, "vec": v, "seg": 16}, {"lanes": 32, "vec": 1, "seg": 1},
                      {"lanes": 4 if n <= 64 else 16, "vec": v, "seg": 500, "unroll": 4}],
    }[name]


def _sddmm_cases():
    for name in ("group_row", "nnz_split", "rowchunks"):
        for dtype in TORCH_DTYPES:
            for n in (1, 5, 32, 64, 130):
                for i, params in enumerate(_sddmm_params(name, dtype, n)):
                    yield pytest.param(name, params, dtype, n, id=f"sddmm-{name}-{i}-{dtype}-n{n}")


def _spmm_cases():
    for name in ("group_row", "warp_row_staged", "nnz_split", "rowchunks"):
        for dtype in TORCH_DTYPES:
            for n in (1, 5, 32, 64, 130):
                for i, params in enumerate(_spmm_params(name, dtype, n)):
                    yield pytest.param(name, params, dtype, n, id=f"spmm-{name}-{i}-{dtype}-n{n}")


def _tc_cases():
    """tc_tiles: one and two 16-row tiles, 1 to 4 column tiles a warp, every dtype; TF32 once."""
    for dtype in TORCH_DTYPES:
        for n in (16, 32, 64, 128):
            shapes = [{"window": 16, "j": 1}, {"window": 32, "j": 1 if n == 16 else 2}]
            if n == 64:
                shapes.append({"window": 16, "j": 4, "block": 64})
            if dtype == "f32" and n in (32, 128):
                shapes.append({"window": 32, "j": 2, "math": "tf32"})
            if dtype == "f32":  # warps sharing a window's steps, partial tiles added atomically
                shapes += [{"window": 16, "j": 1, "ksplit": 4}, {"window": 32, "j": 1, "ksplit": 16}]
            for i, params in enumerate(shapes):
                yield pytest.param("tc_tiles", params, dtype, n, id=f"spmm-tc_tiles-{i}-{dtype}-n{n}")


# --------------------------------------------------------------------------- the check


def _check(name, params, op, dtype, n, patterns):
    from torch_sparserl.abi.prepare import prepare
    from torch_sparserl.toolchain import load_kernel

    spec = F.render(name, params, op=op, dtype=dtype, n=n)
    kernel = load_kernel(spec)
    tdtype = TORCH_DTYPES[dtype]
    failures = []
    for pattern, A in patterns.items():
        rows, cols = A.shape
        rowptr = torch.from_numpy(A.indptr.astype(np.int32)).cuda()
        col = torch.from_numpy(A.indices.astype(np.int32)).cuda()
        g = torch.Generator().manual_seed(rows * 31 + n)
        shapes = operand_shapes(op, rows, cols, A.nnz, n)
        if op == "sddmm":  # the val slot holds the left dense operand D
            val = torch.randn(shapes["val"], generator=g, dtype=torch.float64).to("cuda", tdtype)
        else:
            val = torch.from_numpy(A.data).to(device="cuda", dtype=tdtype)
        x = torch.randn(shapes["x"], generator=g, dtype=torch.float64).to("cuda", tdtype)
        y = torch.full(shapes["y"], float("nan"), dtype=tdtype, device="cuda")
        prep = prepare(spec.plan, rowptr, col, (rows, cols), n)
        kernel(rowptr, col, val, x, y, prep)
        torch.cuda.synchronize()
        x64 = x.double().cpu().numpy()
        if op == "sddmm":
            row_of = np.repeat(np.arange(rows), np.diff(A.indptr))
            D = val.double().cpu().numpy()
            ref = torch.from_numpy(np.einsum("kn,kn->k", D[row_of], x64[A.indices]))
        else:
            ref = torch.from_numpy(summed_product(A.indptr, A.indices, val.double().cpu().numpy(), x64))
        ok, why = close_to_reference(y, ref, tdtype, spec.plan.math)
        if not ok:
            failures.append(f"{pattern}: {why}")
    assert not failures, f"{spec.describe()} op={op} dtype={dtype} n={n}:\n" + "\n".join(failures)


@pytest.mark.parametrize("name,params,dtype,n", list(_spmv_cases()))
def test_spmv_family_matches_reference(name, params, dtype, n, pattern_set):
    _check(name, params, "spmv", dtype, n, pattern_set)


@pytest.mark.parametrize("name,params,dtype,n", list(_spmm_cases()) + list(_tc_cases()))
def test_spmm_family_matches_reference(name, params, dtype, n, pattern_set):
    _check(name, params, "spmm", dtype, n, pattern_set)


@pytest.mark.parametrize("dtype", list(TORCH_DTYPES))
def test_tc_tiles_adds_duplicate_nonzeros(dtype):
    """An uncoalesced CSR: nonzeros repeated in a row meet in one slot of the tile and add up."""
    rng = np.random.default_rng(5)
    indptr = np.array([0, 3, 3, 7, 9])
    indices = np.array([4, 4, 1, 0, 0, 0, 30, 2, 2])
    A = sp.csr_matrix((rng.standard_normal(9), indices, indptr), shape=(4, 33))
    _check("tc_tiles", {"window": 16, "j": 2}, "spmm", dtype, 32, {"duplicates": A})
    if dtype == "f32":
        _check("tc_tiles", {"window": 16, "j": 2, "ksplit": 2}, "spmm", dtype, 32, {"duplicates": A})


@pytest.mark.parametrize("name,params,dtype,n", list(_sddmm_cases()))
def test_sddmm_family_matches_reference(name, params, dtype, n, pattern_set):
    _check(name, params, "sddmm", dtype, n, pattern_set)


@pytest.mark.parametrize("op,n,dtype", [("spmv", 1, "f32"), ("spmm", 32, "f32"), ("spmm", 32, "bf16"),
                                        ("sddmm", 64, "f32")])
def test_space_candidates_match_reference_on_power_law(op, n, dtype, patterns):
    """Every candidate of the default space for one shape (what the autotuner screens)."""
    A = {"power law": patterns["power law"]}
    for name, params in F.space(op, dtype, n):
        _check(name, params, op, dtype, n, A)


@pytest.mark.parametrize("family", F.EPILOGUE_FAMILIES)
@pytest.mark.parametrize("dtype", list(TORCH_DTYPES))
@pytest.mark.parametrize("epilogue", ["relu", "bias", "scale+bias+relu"])
def test_epilogue_kernels_match_reference(family, dtype, epilogue, patterns, unsorted_patterns):
    """relu(scale * (A @ X) + bias) from the fused row stores, on every pattern, n with a ragged tile."""
    from torch_sparserl.abi.prepare import prepare
    from torch_sparserl.toolchain import load_kernel

    tdtype = TORCH_DTYPES[dtype]
    for n, params in ((32, {}), (130, {"lanes": 32, "vec": 2})):
        spec = F.render(family, {**params, "epilogue": epilogue}, op="spmm", dtype=dtype, n=n)
        kernel = load_kernel(spec)
        failures = []
        for pattern, A in {**patterns, **unsorted_patterns}.items():
            rows, cols = A.shape
            g = torch.Generator().manual_seed(rows + n)
            rowptr = torch.from_numpy(A.indptr.astype(np.int32)).cuda()
            col = torch.from_numpy(A.indices.astype(np.int32)).cuda()
            val = torch.from_numpy(A.data).to(device="cuda", dtype=tdtype)
            x = torch.randn(cols, n, generator=g, dtype=torch.float64).to("cuda", tdtype)
            bias = torch.randn(n, generator=g, dtype=torch.float64).to("cuda", tdtype) if "bias" in epilogue else None
            scale = torch.rand(rows, generator=g, dtype=torch.float64).to("cuda", tdtype) if "scale" in epilogue else None
            y = torch.full((rows, n), float("nan"), dtype=tdtype, device="cuda")
            kernel(rowptr, col, val, x, y, prepare(spec.plan, rowptr, col, (rows, cols), n), bias=bias, scale=scale)
            torch.cuda.synchronize()
            ref = summed_product(A.indptr, A.indices, val.double().cpu().numpy(), x.double().cpu().numpy())
            if scale is not None:
                ref = ref * scale.double().cpu().numpy()[:, None]
            if bias is not None:
                ref = ref + bias.double().cpu().numpy()
            if "relu" in epilogue:
                ref = np.maximum(ref, 0.0)
            ok, why = close_to_reference(y, torch.from_numpy(ref), tdtype)
            if not ok:
                failures.append(f"{pattern}: {why}")
        assert not failures, f"{spec.describe()} n={n}:\n" + "\n".join(failures)
