"""Every sparserl operator against a float64 reference, over the named edge cases."""


import pytest
import torch

from torch_sparserl.dtypes import INDEX_DTYPES, VALUE_DTYPES, assert_close_to_reference

from helpers import (PATTERNS, dense_operand, make_pattern, ref_sddmm, ref_spmm, ref_spmm_transposed,
                     to_parts)

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
