"""Bad input is refused with the library's own message (op name, what was expected, what
came), never accepted silently, and no operator writes to its inputs."""

import numpy as np
import pytest
import torch

import torch_sparserl as ts

from helpers import make_pattern, ref_sddmm, to_parts

ops = torch.ops.sparserl


# ------------------------------------------------------------------- construction


def test_int32_indices_that_do_not_fit_are_refused_not_wrapped():
    crow, col, val = torch.tensor([0, 1]), torch.tensor([2**32 + 1]), torch.tensor([1.0])
    with pytest.raises(ValueError, match=r"torch_sparserl\.csr: col holds 4294967297, which torch\.int32 "
                                         r"cannot represent"):
        ts.csr((crow, col, val), shape=(1, 10), index_dtype=torch.int32)
    with pytest.raises(ValueError, match=r"needs int64 indices \(got index_dtype=torch\.int32\)"):
        ts.csr((crow, col, val), shape=(1, 2**33), index_dtype=torch.int32)
    with pytest.raises(TypeError, match=r"crow must hold integers \(got dtype torch\.float32\)"):
        ts.csr((crow.float(), col, val), shape=(1, 10), index_dtype=torch.int32)


def test_int32_indices_that_fit_are_converted():
    A = ts.csr((torch.tensor([0, 1, 2]), torch.tensor([3, 0]), torch.tensor([1.0, 2.0])), shape=(2, 4),
               index_dtype=torch.int32)
    assert A.crow.dtype == A.col.dtype == torch.int32
    torch.testing.assert_close(A.to_dense(), torch.tensor([[0, 0, 0, 1.0], [2.0, 0, 0, 0]]))


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128])
def test_complex_values_are_refused(dtype):
    val = torch.tensor([1 + 2j], dtype=dtype)
    with pytest.raises(TypeError, match=r"torch_sparserl\.csr: complex values are not supported"):
        ts.csr((torch.tensor([0, 1]), torch.tensor([1]), val), shape=(1, 2))
    with pytest.raises(TypeError, match=r"torch_sparserl\.csr: complex values"):
        ts.csr(torch.eye(2, dtype=dtype).to_sparse_csr())


@pytest.mark.parametrize("size, message", [
    ((5, 2), r"CSRMatrix: crow must have nrows \+ 1 = 6 elements \(got 2\) for shape \(5, 2\)"),
    ((1, -1), r"CSRMatrix: ncols must be >= 0 \(got -1\)"),
    ((1,), r"CSRMatrix: shape must be a pair of ints \(nrows, ncols\) \(got \(1,\)\)"),
    ((1, 2.5), r"CSRMatrix: shape must be a pair of ints"),
    (3, r"CSRMatrix: shape must be a pair \(nrows, ncols\) \(got int\)"),
])
def test_csr_matrix_refuses_a_shape_that_disagrees_with_its_parts(size, message):
    with pytest.raises((ValueError, TypeError), match=message):
        ts.CSRMatrix(torch.tensor([0, 1]), torch.tensor([1]), torch.tensor([1.0]), size)


def test_csr_matrix_refuses_parts_of_different_lengths():
    with pytest.raises(ValueError, match=r"CSRMatrix: col and val must have the same length nnz \(got col 1, val 2\)"):
        ts.CSRMatrix(torch.tensor([0, 1]), torch.tensor([1]), torch.tensor([1.0, 2.0]), (1, 2))


# ------------------------------------------------------------- products' operands


def _bad_operands(rows, cols):
    return [
        (torch.randn(rows, cols, dtype=torch.float64), r"must have the dtype of the sparse values, torch\.float32 "
                                                       r"\(got torch\.float64\)"),
        (torch.ones(rows, cols, dtype=torch.int64), r"must have the dtype of the sparse values, torch\.float32 \(got torch\.int64\)"),
        (torch.randn(rows, cols, dtype=torch.complex64), r"must have the dtype of the sparse values, torch\.float32 \(got torch\.complex64\)"),
        (torch.randn(rows, cols).to_sparse(), r"must be a dense \(strided\) tensor \(got layout torch\.sparse_coo\)"),
        (torch.empty(rows, cols, device="meta"), r"must be on the device of the sparse matrix, cpu \(got meta\)"),
    ]


@pytest.mark.parametrize("case", range(5))
def test_a_matmul_x_says_what_is_wrong_with_x(case):
    """``A @ X`` with an unsupported X: the library's message reaches the user, not Python's
    bare "unsupported operand type(s) for @"."""
    A = ts.csr(torch.randn(3, 4).relu())
    X, message = _bad_operands(4, 2)[case]
    with pytest.raises((TypeError, ValueError), match=r"sparserl\.spmm: X " + message):
        A @ X
    with pytest.raises((TypeError, ValueError), match=r"sparserl\.spmm: X " + message):
        torch.matmul(A, X)
    with pytest.raises((TypeError, ValueError), match=r"sparserl\.spmm: X " + message):
        torch.sparse.mm(A, X)
    G, message = _bad_operands(2, 3)[case]
    with pytest.raises((TypeError, ValueError), match=r"sparserl\.spmm_transposed: G " + message):
        G @ A


def test_a_matmul_a_non_tensor_defers_to_python():
    A = ts.csr(torch.eye(2))
    with pytest.raises(TypeError, match="unsupported operand"):
        A @ "x"


# --------------------------------------------------------------- inputs stay as they were


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_sddmm_with_more_duplicates_than_positions_gives_one_value_per_entry(device, index_dtype,
                                                                           poison_uninitialized):
    """nnz > nrows * ncols: torch's sampled_addmm merged the duplicates, returned too few
    values and shrank the caller's col in place. Each entry gets its value, as in torch's
    products, and the inputs are untouched."""
    A = make_pattern("duplicates, more than rows x cols")
    crow, col, _ = to_parts(A, torch.float64, index_dtype, device)
    crow0, col0 = crow.clone(), col.clone()
    Y = torch.randn(A.shape[0], 5, dtype=torch.float64, device=device)
    X = torch.randn(A.shape[1], 5, dtype=torch.float64, device=device)
    torch.testing.assert_close(ops.sddmm(crow, col, Y, X).cpu(), ref_sddmm(crow, col, Y, X))
    assert torch.equal(crow, crow0) and torch.equal(col, col0)


def test_products_with_duplicates_sum_them_like_torch(device):
    A = make_pattern("duplicates, more than rows x cols")
    crow, col, val = to_parts(A, torch.float64, torch.int64, device)
    X = torch.randn(A.shape[1], 4, dtype=torch.float64, device=device)
    dense = torch.from_numpy(np.asarray(A.toarray()))  # SciPy sums duplicates
    torch.testing.assert_close(ops.spmm(crow, col, val, A.shape[1], X).cpu(), dense @ X.cpu())
    G = torch.randn(A.shape[0], 4, dtype=torch.float64, device=device)
    torch.testing.assert_close(ops.spmm_transposed(crow, col, val, A.shape[1], G).cpu(), dense.T @ G.cpu())
