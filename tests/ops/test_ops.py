"""Every sparserl operator against a float64 reference, over the named edge cases."""


import numpy as np
import pytest
import torch

from torch_sparserl.dtypes import INDEX_DTYPES, VALUE_DTYPES, assert_close_to_reference
from torch_sparserl.config import JitOptions

from helpers import (PATTERNS, UNSORTED_AND_DUPLICATE, dense_operand, make_pattern, make_unsorted_pattern, ref_sddmm,
                     ref_spmm, ref_spmm_transposed, summed_product, to_parts)

ops = torch.ops.sparserl
DTYPE_IDS = [str(d).replace("torch.", "") for d in VALUE_DTYPES]
INDEX_IDS = [str(d).replace("torch.", "") for d in INDEX_DTYPES]
# N = 0, a vector-like 1, and sizes that are not multiples of 4 or 32.
WIDTHS = [0, 1, 3, 33]

pytestmark = pytest.mark.usefixtures("poison_uninitialized")


@pytest.mark.parametrize("name", list(PATTERNS))
@pytest.mark.parametrize("n", WIDTHS)
@pytest.mark.parametrize("contiguous", [True, False], ids=["contiguous", "strided X"])
def test_spmm_patterns(device, name, n, contiguous):
    A = make_pattern(name, seed=n)
    crow, col, val = to_parts(A, torch.float32, torch.int32, device)
    X = dense_operand(A.shape[1], n, torch.float32, device, contiguous=contiguous, seed=n + 1)
    out = ops.spmm(crow, col, val, A.shape[1], X)
    assert out.shape == (A.shape[0], n) and out.device.type == device.type
    assert_close_to_reference(out, ref_spmm(crow, col, val, A.shape[1], X))


@pytest.mark.parametrize("dtype", VALUE_DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("index_dtype", INDEX_DTYPES, ids=INDEX_IDS)
@pytest.mark.parametrize("name", ["random", "short and huge rows", "cora (real)"])
def test_spmm_dtypes(device, dtype, index_dtype, name):
    A = make_pattern(name, seed=3)
    crow, col, val = to_parts(A, dtype, index_dtype, device)
    X = dense_operand(A.shape[1], 17, dtype, device, seed=4)
    out = ops.spmm(crow, col, val, A.shape[1], X)
    assert out.dtype == dtype
    assert_close_to_reference(out, ref_spmm(crow, col, val, A.shape[1], X), dtype)


@pytest.mark.parametrize("dtype", VALUE_DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("index_dtype", INDEX_DTYPES, ids=INDEX_IDS)
@pytest.mark.parametrize("name", list(PATTERNS))
def test_spmv(device, dtype, index_dtype, name):
    A = make_pattern(name, seed=5)
    crow, col, val = to_parts(A, dtype, index_dtype, device)
    x = dense_operand(A.shape[1], 1, dtype, device, seed=6)[:, 0]
    out = ops.spmv(crow, col, val, A.shape[1], x)
    assert out.shape == (A.shape[0],) and out.dtype == dtype
    assert_close_to_reference(out, ref_spmm(crow, col, val, A.shape[1], x[:, None])[:, 0], dtype)


@pytest.mark.parametrize("dtype", VALUE_DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("name", list(PATTERNS))
@pytest.mark.parametrize("n", [1, 33])
def test_transposed(device, dtype, name, n):
    A = make_pattern(name, seed=7)
    crow, col, val = to_parts(A, dtype, torch.int64, device)
    G = dense_operand(A.shape[0], n, dtype, device, contiguous=False, seed=8)
    out = ops.spmm_transposed(crow, col, val, A.shape[1], G)
    assert out.shape == (A.shape[1], n)
    assert_close_to_reference(out, ref_spmm_transposed(crow, col, val, A.shape[1], G), dtype)
    g = G[:, 0]
    out_v = ops.spmv_transposed(crow, col, val, A.shape[1], g)
    assert_close_to_reference(out_v, ref_spmm_transposed(crow, col, val, A.shape[1], g[:, None])[:, 0], dtype)


@pytest.mark.parametrize("dtype", VALUE_DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("index_dtype", INDEX_DTYPES, ids=INDEX_IDS)
@pytest.mark.parametrize("name", list(PATTERNS))
@pytest.mark.parametrize("n", [0, 5, 33])
def test_sddmm(device, dtype, index_dtype, name, n):
    A = make_pattern(name, seed=9)
    crow, col, _ = to_parts(A, dtype, index_dtype, device)
    Y = dense_operand(A.shape[0], n, dtype, device, seed=10)
    X = dense_operand(A.shape[1], n, dtype, device, contiguous=False, seed=11)
    out = ops.sddmm(crow, col, Y, X)
    assert out.shape == (A.nnz,) and out.dtype == dtype
    assert_close_to_reference(out, ref_sddmm(crow, col, Y, X), dtype)


def _heads_operand(rows, heads, c, dtype, device, seed, *, contiguous=True):
    g = torch.Generator().manual_seed(seed)
    if contiguous:
        return torch.randn(rows, heads, c, generator=g, dtype=torch.float64).to(device=device, dtype=dtype)
    wide = torch.randn(rows, heads, 2 * c, generator=g, dtype=torch.float64).to(device=device, dtype=dtype)
    return wide[:, :, ::2]


@pytest.mark.parametrize("dtype", VALUE_DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("index_dtype", INDEX_DTYPES, ids=INDEX_IDS)
@pytest.mark.parametrize("name", list(PATTERNS))
@pytest.mark.parametrize("heads", [1, 4])
def test_heads_products(device, dtype, index_dtype, name, heads):
    """spmm_heads, its transpose and sddmm_heads (one product for every head, on the pattern's
    block-diagonal form): each head against the float64 reference of its own product."""
    A = make_pattern(name, seed=13 + heads)
    crow, col, _ = to_parts(A, dtype, index_dtype, device)
    (m, n), c = A.shape, 6
    val = _heads_operand(A.nnz, heads, 1, dtype, device, 14)[:, :, 0]
    X = _heads_operand(n, heads, c, dtype, device, 15, contiguous=heads == 1)
    G = _heads_operand(m, heads, c, dtype, device, 16)
    out = ops.spmm_heads(crow, col, val, n, X)
    out_t = ops.spmm_heads_transposed(crow, col, val, n, G)
    out_s = ops.sddmm_heads(crow, col, G, X)
    assert out.shape == (m, heads, c) and out_t.shape == (n, heads, c) and out_s.shape == (A.nnz, heads)
    assert out.dtype == out_t.dtype == out_s.dtype == dtype
    for h in range(heads):
        assert_close_to_reference(out[:, h], ref_spmm(crow, col, val[:, h], n, X[:, h]), dtype)
        assert_close_to_reference(out_t[:, h], ref_spmm_transposed(crow, col, val[:, h], n, G[:, h]), dtype)
        assert_close_to_reference(out_s[:, h], ref_sddmm(crow, col, G[:, h], X[:, h]), dtype)


def test_heads_pattern_is_block_diagonal_and_computed_once(device):
    """Pattern.with_heads: row i*H + h holds head h of row i at columns col*H + h, in the
    order ``order`` gives the flattened (nnz, H) values, ``position`` undoes it; computed once."""
    from torch_sparserl import pattern as patterns

    A = make_pattern("short and huge rows", seed=17)
    crow, col, _ = to_parts(A, torch.float32, torch.int32, device)
    heads = 3
    entry = patterns.lookup(crow, col, A.shape[1])
    entry.validate("test", crow, col)  # a validated pattern's derived forms are validated too
    crow_h, col_h, order, position = entry.with_heads(crow, col, heads)
    assert entry.with_heads(crow, col, heads)[0] is crow_h  # cached
    assert crow_h.dtype == col_h.dtype == torch.int32
    rows = torch.repeat_interleave(torch.arange(A.shape[0]), torch.from_numpy(A.indptr).diff())
    dense = torch.zeros(A.shape[0] * heads, A.shape[1] * heads)
    flat = torch.arange(1, A.nnz * heads + 1, dtype=torch.float32).view(A.nnz, heads)  # distinct values
    for h in range(heads):
        dense[rows * heads + h, torch.from_numpy(A.indices).long() * heads + h] = flat[:, h]
    val_h = flat.reshape(-1).to(device).index_select(0, order)
    ours = torch.sparse_csr_tensor(crow_h.long().cpu(), col_h.long().cpu(), val_h.cpu(), dense.shape).to_dense()
    torch.testing.assert_close(ours, dense, rtol=0, atol=0)
    assert torch.equal(val_h.index_select(0, position).view(A.nnz, heads).cpu(), flat)
    assert bool((crow_h.diff() >= 0).all()) and patterns.validated(crow_h, col_h, A.shape[1] * heads) is not None
    # its transpose, with the values' order composed into one gather
    form_t, crow_t, col_t, order_t = entry.with_heads_transposed(crow, col, heads)
    assert entry.with_heads_transposed(crow, col, heads)[3] is order_t  # cached
    val_t = flat.reshape(-1).to(device).index_select(0, order_t)
    ours_t = torch.sparse_csr_tensor(crow_t.long().cpu(), col_t.long().cpu(), val_t.cpu(), dense.T.shape).to_dense()
    torch.testing.assert_close(ours_t, dense.T, rtol=0, atol=0)
    assert [(h, t is form_t) for h, _, t in entry.heads_forms()] == [(heads, True)]


def test_heads_errors_are_named():
    A = make_pattern("random", seed=18)
    crow, col, _ = to_parts(A, torch.float32, torch.int32, "cpu")
    n = A.shape[1]
    val, X = torch.randn(A.nnz, 2), torch.randn(n, 2, 4)
    # valid calls first: the pattern is validated and its form for 2 heads exists, so what
    # follows meets the operators' attribute-only fast checks before their full checks
    ops.spmm_heads(crow, col, val, n, X)
    ops.spmm_heads_transposed(crow, col, val, n, torch.randn(A.shape[0], 2, 4))
    ops.sddmm_heads(crow, col, torch.randn(A.shape[0], 2, 4), X)
    with pytest.raises(ValueError, match=r"sparserl.spmm_heads: val must be 2-D"):
        ops.spmm_heads(crow, col, val[:, 0], n, X)
    with pytest.raises(ValueError, match=r"sparserl.spmm_heads: val must have shape \(nnz, heads\)"):
        ops.spmm_heads(crow, col, val[1:], n, X)
    with pytest.raises(ValueError, match=r"sparserl.spmm_heads: X must have 2 heads"):
        ops.spmm_heads(crow, col, val, n, torch.randn(n, 3, 4))
    with pytest.raises(TypeError, match=r"sparserl.spmm_heads_transposed: G must have the dtype"):
        ops.spmm_heads_transposed(crow, col, val, n, torch.randn(A.shape[0], 2, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"sparserl.sddmm_heads: X must have 2 heads"):
        ops.sddmm_heads(crow, col, torch.randn(A.shape[0], 2, 4), torch.randn(n, 1, 4))
    with pytest.raises(TypeError, match=r"sparserl.spmm_heads: X must have the dtype"):
        ops.spmm_heads(crow, col, val, n, X.double())
    with pytest.raises(ValueError, match=r"sparserl.spmm_heads: X must have 2 heads"):
        ops.spmm_heads(crow, col, val, n, X[:, :1])
    with pytest.raises(ValueError, match=r"sparserl.spmm_heads_transposed: G must have"):
        ops.spmm_heads_transposed(crow, col, val, n, torch.randn(A.shape[0] + 1, 2, 4))
    with pytest.raises(ValueError, match=r"sparserl.sddmm_heads: Y and X must have the same number of columns C"):
        ops.sddmm_heads(crow, col, torch.randn(A.shape[0], 2, 4), torch.randn(n, 2, 5))
    with pytest.raises(ValueError, match=r"sparserl.spmm_heads: val must be on the device"):
        ops.spmm_heads(crow, col, val.to("meta"), n, X)
    many = torch.zeros(1).expand(A.nnz, 2**26)  # more heads than int32 indices can number
    with pytest.raises(ValueError, match=r"sparserl.spmm_heads: 67108864 heads .* need indices beyond torch.int32"):
        ops.spmm_heads(crow, col, many, n, torch.zeros(1).expand(n, 2**26, 1))


def test_fresh_data_every_trial(device):
    """Same pattern, new values and operands each time: nothing is reused between calls."""
    A = make_pattern("random", seed=12)
    crow, col, _ = to_parts(A, torch.float32, torch.int32, device)
    for trial in range(4):
        val = torch.randn(A.nnz, device=device)
        X = torch.randn(A.shape[1], 8, device=device)
        assert_close_to_reference(ops.spmm(crow, col, val, A.shape[1], X),
                                  ref_spmm(crow, col, val, A.shape[1], X))


def test_reference_kernel_works_in_chunks(device):
    """Enough nonzeros x N that the reference kernel (what the runtime checks fused kernels
    against, in float64) works in several chunks."""
    from torch_sparserl import pattern as patterns
    from torch_sparserl.kernels import reference
    A = make_pattern("cora (real)", seed=13)
    crow, col, val = to_parts(A, torch.float32, torch.int64, device)
    X = torch.randn(A.shape[1], 512, device=device)
    old = reference._CHUNK_ELEMENTS
    reference._CHUNK_ELEMENTS = 1 << 16
    try:
        out = reference.spmm(patterns.lookup(crow, col, A.shape[1]), crow, col, val, X)
    finally:
        reference._CHUNK_ELEMENTS = old
    assert_close_to_reference(out, ref_spmm(crow, col, val, A.shape[1], X))


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_cpu_products_are_torch_s_own(index_dtype):
    """On the CPU the operators serve products with torch's sparse kernels (MKL's or its own),
    several times faster than a gather and index_add_: the same bits as torch.sparse."""
    A = make_pattern("cora (real)", seed=14)
    crow, col, val = to_parts(A, torch.float32, index_dtype, "cpu")
    torch_csr = torch.sparse_csr_tensor(crow, col, val, A.shape)
    X = torch.randn(A.shape[1], 16)
    assert torch.equal(ops.spmm(crow, col, val, A.shape[1], X), torch.sparse.mm(torch_csr, X))
    assert torch.equal(ops.spmv(crow, col, val, A.shape[1], X[:, 0]), torch.mv(torch_csr, X[:, 0]))


def test_half_types_accumulate_in_float32(device):
    """A row of 4096 ones times ones: a float16 accumulator would stall at 2048."""
    n = 4096
    crow = torch.tensor([0, n], device=device)
    col = torch.arange(n, device=device)
    for dtype in (torch.float16, torch.bfloat16):
        val = torch.ones(n, dtype=dtype, device=device)
        X = torch.ones(n, 2, dtype=dtype, device=device)
        out = ops.spmm(crow, col, val, n, X)
        assert out.float().tolist() == [[4096.0, 4096.0]]


@pytest.mark.parametrize("name", list(UNSORTED_AND_DUPLICATE))
def test_products_on_unsorted_and_duplicate_columns(device, name):
    """The patterns the GPU kernels are also run on hold what their names say (rows with
    unsorted columns, hub rows; repeated entries, or none), and torch's products on them match
    a float64 reference that adds every entry."""
    A = make_unsorted_pattern(name)
    lengths = np.diff(A.indptr)
    unsorted = sum(bool(np.any(np.diff(A.indices[lo:hi]) < 0)) for lo, hi in zip(A.indptr[:-1], A.indptr[1:]))
    assert unsorted > A.shape[0] // 2 and lengths.max() >= 450 and (lengths == 0).any()
    distinct = len(np.unique(np.repeat(np.arange(A.shape[0]), lengths) * A.shape[1] + A.indices))
    assert distinct < 0.9 * A.nnz if "duplicate" in name else distinct == A.nnz
    crow, col, val = to_parts(A, torch.float32, torch.int32, device)
    X = dense_operand(A.shape[1], 5, torch.float32, device, seed=1)
    want = summed_product(A.indptr, A.indices, val.double().cpu().numpy(), X.double().cpu().numpy())
    assert_close_to_reference(ops.spmm(crow, col, val, A.shape[1], X), torch.from_numpy(want))
    assert_close_to_reference(ops.spmv(crow, col, val, A.shape[1], X[:, 0].contiguous()),
                              torch.from_numpy(want[:, 0]))
    G = dense_operand(A.shape[0], 5, torch.float32, device, seed=2)
    assert_close_to_reference(ops.spmm_transposed(crow, col, val, A.shape[1], G),
                              ref_spmm_transposed(crow, col, val, A.shape[1], G))
    assert_close_to_reference(ops.sddmm(crow, col, G, X), ref_sddmm(crow, col, G, X))


def test_decisions_name_the_heads_forms(tmp_path):
    """Runtime.decisions lists the products on the block-diagonal forms of attention heads: a
    runtime deciding on the CPU (every product left to torch) records the forward product on
    the two-head form, then the backward's on its transpose."""
    from torch_sparserl.jit import runtime as rt
    from torch_sparserl.jit.cache import CacheEntry, KernelCache

    decided = []

    def cusparse_for_all(key, crow, col, ncols):
        decided.append((key.op, key.n))
        return CacheEntry(key, None, reason="decided by the test")

    runtime = rt.Runtime(JitOptions(mode="sync", admit_calls=1), cache=KernelCache(tmp_path),
                         specializer=cusparse_for_all, devices=("cpu",))
    previous = rt.set_active(runtime)
    try:
        A = make_pattern("random", seed=19)
        crow, col, _ = to_parts(A, torch.float32, torch.int32, "cpu")
        val, X = torch.randn(A.nnz, 2), torch.randn(A.shape[1], 2, 4)
        ops.spmm_heads(crow, col, val, A.shape[1], X)
        cusparse = "cuSPARSE: no kernel: decided by the test"
        assert runtime.decisions(crow, col, A.shape[1]) == {"A heads=2 spmm n=4 float32": cusparse}
        from torch_sparserl import pattern as patterns
        forms = patterns.lookup(crow, col, A.shape[1]).heads_forms()
        assert [(heads, t) for heads, _, t in forms] == [(2, None)]
        ops.spmm_heads_transposed(crow, col, val, A.shape[1], torch.randn(A.shape[0], 2, 4))
        (heads, form, form_t), = patterns.lookup(crow, col, A.shape[1]).heads_forms()
        assert heads == 2 and form.nrows == 2 * A.shape[0] and form_t is not None and form_t.nrows == 2 * A.shape[1]
        assert runtime.decisions(crow, col, A.shape[1]) == {"A heads=2 spmm n=4 float32": cusparse,
                                                             "At heads=2 spmm n=4 float32": cusparse}
        assert decided == [("spmm", 4), ("spmm", 4)]
    finally:
        rt.set_active(previous)
        runtime.close()
