"""The tensor-core family's plan (CPU): split=tiles(W) and math=tf32 in the ABI, the plan data
that prepare() builds (replayed here as the kernel reads it, in float64, against A @ X), the
window-reuse feature that gates the family, the TF32 tolerance and its opt-in."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
import torch

from torch_sparserl.abi import PlanError, parse_plan
from torch_sparserl.abi.prepare import TILE_K, prepare
from torch_sparserl.dtypes import TF32_TOLERANCE, TOLERANCES, close_to_reference, tolerance
from torch_sparserl.pattern.features import structural_features, window_reuse
from torch_sparserl.specialize import families as F


def _replay(aux: np.ndarray, parts: int, window: int, rows: int, nnz: int, val: np.ndarray,
            x: np.ndarray) -> np.ndarray:
    """What spmm_tc_tiles.cu computes, step by step, from the plan data alone."""
    win_blk = aux[:parts + 1]
    blocks = int(win_blk[-1])
    blk_col = aux[parts + 1: parts + 1 + TILE_K * blocks]
    blk_nz = aux[parts + 1 + TILE_K * blocks: parts + 2 + (TILE_K + 1) * blocks]
    nz_idx = aux[parts + 2 + (TILE_K + 1) * blocks:][:nnz]
    nz_slot = aux[parts + 2 + (TILE_K + 1) * blocks + nnz:][:nnz]
    assert aux.size == parts + 2 + (TILE_K + 1) * blocks + 2 * nnz
    y = np.full((parts * window, x.shape[1]), np.nan)
    for w in range(parts):
        acc = np.zeros((window, x.shape[1]))
        for b in range(win_blk[w], win_blk[w + 1]):
            tile = np.zeros((window, TILE_K))
            for i in range(blk_nz[b], blk_nz[b + 1]):  # slot: the column's rank in the window * 32 + row
                tile[nz_slot[i] % 32, nz_slot[i] // 32 - (b - win_blk[w]) * TILE_K] += val[nz_idx[i]]
            cols = blk_col[b * TILE_K:(b + 1) * TILE_K]
            staged = np.where((cols >= 0)[:, None], x[np.maximum(cols, 0)], 0.0)
            acc += tile @ staged
        y[w * window:(w + 1) * window] = acc
    return y[:rows]


def _patterns():
    rng = np.random.default_rng(7)
    banded = sp.diags([np.ones(300 - abs(k)) for k in range(-4, 5)], list(range(-4, 5)), format="csr")
    # duplicates (an uncoalesced CSR), empty rows in the middle, a hub row, rows not a multiple of W
    dup = sp.csr_matrix((np.ones(6), np.array([3, 3, 0, 5, 5, 5]), np.array([0, 2, 2, 2, 6])), shape=(4, 9))
    hub = sp.random(77, 500, density=0.01, random_state=3, format="csr")
    hub = sp.vstack([hub[:40], sp.csr_matrix(np.ones((1, 500))), sp.csr_matrix((0, 500)), hub[40:]]).tocsr()
    return {"banded": banded, "duplicates": dup, "hub and empty rows": hub,
            "random": sp.random(129, 60, density=0.2, random_state=rng.integers(1 << 30), format="csr"),
            "empty": sp.csr_matrix((0, 5)), "no nonzeros": sp.csr_matrix((33, 7))}


@pytest.mark.parametrize("window", [16, 32])
@pytest.mark.parametrize("name", list(_patterns()))
def test_tiles_plan_data_reproduces_the_product(name, window):
    A = _patterns()[name]
    A.has_sorted_indices = False  # keep duplicates and order as given
    rows, cols = A.shape
    spec = F.render("tc_tiles", {"window": window, "j": 1}, op="spmm", dtype="f32", n=16)
    rowptr = torch.from_numpy(A.indptr.astype(np.int32))
    col = torch.from_numpy(A.indices.astype(np.int32))
    prep = prepare(spec.plan, rowptr, col, (rows, cols), 16)
    assert prep.parts == -(-rows // window) and not prep.init_zero and prep.work_numel == 0
    assert prep.grid == -(-prep.parts // 4)  # one warp per window (n = one slice), 4 warps a block
    split = F.render("tc_tiles", {"window": window, "j": 1, "ksplit": 8}, op="spmm", dtype="f32", n=16)
    prep8 = prepare(split.plan, rowptr, col, (rows, cols), 16)
    assert prep8.init_zero and prep8.grid == -(-prep.parts * 8 // 4) and torch.equal(prep8.aux, prep.aux)
    rng = np.random.default_rng(rows + window)
    val = rng.standard_normal(A.nnz)
    x = rng.standard_normal((cols, 16))
    aux = prep.aux.numpy() if prep.aux is not None else np.zeros(0, dtype=np.int32)
    got = _replay(aux.astype(np.int64), prep.parts, window, rows, A.nnz, val, x)
    want = sp.csr_matrix((val, A.indices, A.indptr), shape=A.shape) @ x
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    if A.nnz:  # every block's columns are distinct and in the window's own rows
        blocks = int(aux[prep.parts])
        assert int((aux[prep.parts + 1: prep.parts + 1 + TILE_K * blocks] >= 0).sum()) == \
            len({(r // window, c) for r, c in zip(np.repeat(np.arange(rows), np.diff(A.indptr)), A.indices)})


def test_tiles_and_math_in_the_plan():
    line = "// sparserl: op=spmm dtype=f32 n=64 split=tiles(32) block=128 grid=ceil(parts*1/4) math=tf32"
    plan = parse_plan(line)
    assert (plan.split, plan.split_arg, plan.math, plan.atomic) == ("tiles", 32, "tf32", False)
    assert parse_plan(plan.format()) == plan
    assert parse_plan("// sparserl: op=spmm dtype=bf16 n=64 split=tiles(16) block=128 grid=1").math == "ieee"
    shared = parse_plan("// sparserl: op=spmm dtype=f32 n=64 split=tiles(16) block=128 grid=1 init=zero")
    assert shared.atomic  # warps sharing a window's steps add their tiles into zero-filled y
    for bad, words in [
        ("op=sddmm dtype=f32 n=64 split=tiles(16) block=128 grid=1", "not tiles for op=sddmm"),
        ("op=spmm dtype=f32 n=64 split=tiles(8) block=128 grid=1", "split=tiles(W): W must be 16 or 32"),
        ("op=spmm dtype=f32 n=64 split=tiles(16) block=128 grid=1 work=64", "split=tiles(W) must be no workspace"),
        ("op=spmm dtype=bf16 n=64 split=tiles(16) block=128 grid=1 init=zero",
         "split for op=spmm dtype=bf16 must be none, or rowchunks"),
        ("op=spmm dtype=f32 n=64 rows=sorted_desc split=tiles(16) block=128 grid=1", "natural with split=tiles"),
        ("op=spmm dtype=f16 n=64 split=tiles(16) block=128 grid=1 math=tf32", "math must be ieee for dtype=f16"),
        ("op=spmm dtype=f32 n=64 block=128 grid=1 math=fast", "math must be ieee or tf32"),
    ]:
        with pytest.raises(PlanError, match=words.replace("(", r"\(").replace(")", r"\)")):
            parse_plan("// sparserl: " + bad)


@pytest.mark.parametrize("params,dtype,n,words", [
    ({"j": 4}, "f32", 32, "parameter 'j' expected a divisor of n/16 (n=32 must be a multiple of 16*j = 64"),
    ({"math": "tf32"}, "bf16", 32, "parameter 'math' expected 'ieee' for dtype=bf16"),
    ({"window": 64}, "f32", 32, "parameter 'window' expected one of (16, 32)"),
    ({"ksplit": 4}, "bf16", 32, "parameter 'ksplit' expected 1 for dtype=bf16"),
    ({"ksplit": 3}, "f32", 32, "parameter 'ksplit' expected one of (1, 2, 4, 8, 16)"),
    ({"window": 32, "j": 4, "block": 256}, "f16", 64, "parameter 'block' expected at most 128 threads"),
])
def test_tc_tiles_parameters_are_checked(params, dtype, n, words):
    with pytest.raises(ValueError, match="family tc_tiles: " + words.replace("(", r"\(").replace(")", r"\)")
                       .replace("*", r"\*")):
        F.render("tc_tiles", params, op="spmm", dtype=dtype, n=n)


def test_window_reuse_is_exact_where_every_window_is_read():
    A = sp.random(500, 300, density=0.05, random_state=1, format="csr")
    A = (A + sp.diags(np.ones(300), 0, shape=(500, 300))).tocsr()
    row_of = np.repeat(np.arange(500), np.diff(A.indptr))
    exact = A.nnz / len(set(zip(row_of // 16, A.indices)))
    assert window_reuse(A.indptr, A.indices) == pytest.approx(exact)
    assert "window_reuse" not in structural_features(A.indptr, A.indices, A.shape)  # the runtime's path skips it
    dense_rows = sp.csr_matrix(np.ones((64, 8)))  # every row of a window reads the same 8 columns
    assert window_reuse(dense_rows.indptr, dense_rows.indices) == pytest.approx(16.0)
    assert window_reuse(np.zeros(4, dtype=np.int64), np.zeros(0, dtype=np.int64)) == 1.0


def test_the_space_offers_tiles_on_request_only_where_windows_share_columns():
    shared = {"rows": 5000, "cols": 5000, "nnz": 300_000, "row_mean": 60.0, "row_max": 80, "row_cv": 0.2,
              "window_reuse": 6.6}
    alone = {**shared, "window_reuse": 1.05}
    hub = {**shared, "row_max": 30000}  # 938 steps of 32 columns: more than 16 warps x 8 steps
    tc = ("tc_tiles",)
    assert not any(name == "tc_tiles" for name, _ in F.space("spmm", "f32", 128, shared))  # opt-in only
    assert any(name == "tc_tiles" for name, _ in F.space("spmm", "f32", 128, shared, opt_in=tc))
    assert not any(name == "tc_tiles" for name, _ in F.space("spmm", "f32", 128, alone, opt_in=tc))
    assert not any(name == "tc_tiles" for name, _ in F.space("spmm", "f32", 128, hub, opt_in=tc))
    assert not any(name == "tc_tiles" for name, _ in F.space("spmm", "f32", 24, shared, opt_in=tc))  # not whole tiles
    assert all(p["math"] == "ieee" for name, p in F.space("spmm", "f32", 64, shared, opt_in=tc) if name == "tc_tiles")
    long_rows = {**shared, "row_max": 3000}  # 94 steps: only the 16-way split keeps a warp's share short
    assert {p["ksplit"] for name, p in F.space("spmm", "f32", 64, long_rows, opt_in=tc) if name == "tc_tiles"} == {16}
    assert {p["ksplit"] for name, p in F.space("spmm", "bf16", 64, shared, opt_in=tc) if name == "tc_tiles"} == {1}
    with pytest.raises(ValueError, match="opt_in expected names from .'tc_tiles',., got .'group_row'."):
        F.space("spmm", "f32", 64, shared, opt_in=("group_row",))


def test_tf32_results_are_judged_by_the_tf32_tolerance():
    assert tolerance(torch.float32, "tf32") is TF32_TOLERANCE
    assert tolerance(torch.float32) is TOLERANCES[torch.float32]
    assert tolerance(torch.bfloat16, "tf32") is TOLERANCES[torch.bfloat16]
    ref = torch.randn(64, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    tf32_like = (ref * (1 + 4e-4)).float()  # TF32's rounding of one operand: 2^-11
    assert not close_to_reference(tf32_like, ref)[0]
    assert close_to_reference(tf32_like, ref, math_mode="tf32")[0]


def test_a_tf32_kernel_is_refused_without_torchs_opt_in():
    from torch_sparserl.jit.decisions import SpecializationError
    from torch_sparserl.jit.install import _bind_spec, tf32_allowed

    spec = F.render("tc_tiles", {"math": "tf32", "j": 1}, op="spmm", dtype="f32", n=16)
    crow, col = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([0], dtype=torch.int32)
    previous = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert not tf32_allowed()
        with pytest.raises(SpecializationError, match="math=tf32.*allow_tf32 = True to opt in"):
            _bind_spec(spec, crow, col, 1, 16, kernel=object())
        torch.set_float32_matmul_precision("high")
        assert tf32_allowed()
    finally:
        torch.set_float32_matmul_precision(previous)


def test_tune_adds_window_reuse_only_when_tc_tiles_is_opted_in():
    import torch_sparserl as ts
    from fakes import FakeSandbox

    from torch_sparserl.specialize.autotune import tune

    cora = ts.load_matrix("cora")
    plain = tune(cora, op="spmm", n=32, sandbox=FakeSandbox(), budget_s=0.0, top_k=1)
    opted = tune(cora, op="spmm", n=32, sandbox=FakeSandbox(), budget_s=0.0, top_k=1, opt_in=("tc_tiles",))
    assert "window_reuse" not in plain.features
    assert opted.features["window_reuse"] == pytest.approx(window_reuse(cora.indptr, cora.indices))
