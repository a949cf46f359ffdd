"""Bad input gets an error that names the op, what was expected and what came."""

import pytest
import torch

import torch_sparserl as ts

ops = torch.ops.sparserl


def good(device="cpu"):
    crow = torch.tensor([0, 2, 3], device=device)
    col = torch.tensor([0, 2, 1], device=device)
    val = torch.tensor([1.0, 2.0, 3.0], device=device)
    return crow, col, val, 3, torch.randn(3, 4, device=device)


CASES = {
    "crow of wrong length": (lambda c, k, v, n, X: (c[:2], k, v, n, X), ValueError, r"crow\[-1\] must equal nnz = len\(col\) = 3 \(got 2\)"),
    "crow not non-decreasing": (lambda c, k, v, n, X: (torch.tensor([0, 3, 2, 3]), k, v, n, torch.randn(3, 4)), ValueError, r"crow must be non-decreasing \(got crow\[1\] = 3 > crow\[2\] = 2\)"),
    "crow not starting at 0": (lambda c, k, v, n, X: (c + 1, k, v, n, X), ValueError, r"crow\[0\] must be 0 \(got 1\)"),
    "col out of range": (lambda c, k, v, n, X: (c, torch.tensor([0, 3, 1]), v, n, X), ValueError, r"col must be < ncols = 3 \(got col\[1\] = 3\)"),
    "col negative": (lambda c, k, v, n, X: (c, torch.tensor([0, -1, 1]), v, n, X), ValueError, r"col must be >= 0 \(got col\[1\] = -1\)"),
    "col and val of different lengths": (lambda c, k, v, n, X: (c, k, v[:2], n, X), ValueError, r"col and val must have the same length nnz \(got col 3, val 2\)"),
    "X rows != ncols": (lambda c, k, v, n, X: (c, k, v, n, X[:2]), ValueError, r"X must have ncols = 3 rows \(got shape \(2, 4\)\)"),
    "X not 2-D": (lambda c, k, v, n, X: (c, k, v, n, X[:, 0]), ValueError, r"X must be 2-D \(got shape \(3,\)\)"),
    "mixed value dtypes": (lambda c, k, v, n, X: (c, k, v, n, X.double()), TypeError, r"X must have the dtype of the sparse values, torch.float32 \(got torch.float64\)"),
    "mixed index dtypes": (lambda c, k, v, n, X: (c.int(), k, v, n, X), TypeError, r"crow and col must have the same index dtype \(got crow torch.int32, col torch.int64\)"),
    "float indices": (lambda c, k, v, n, X: (c.float(), k, v, n, X), TypeError, r"crow must have dtype in \(int32, int64\) \(got torch.float32\)"),
    "integer values": (lambda c, k, v, n, X: (c, k, v.long(), n, X.long()), TypeError, r"val must have dtype in \(float32, float64, float16, bfloat16\) \(got torch.int64\)"),
    "crow not 1-D": (lambda c, k, v, n, X: (c[None], k, v, n, X), ValueError, r"crow must be 1-D \(got shape \(1, 3\)\)"),
    "empty crow": (lambda c, k, v, n, X: (c[:0], k[:0], v[:0], n, X), ValueError, r"crow must have nrows \+ 1 >= 1 elements \(got 0\)"),
    "negative ncols": (lambda c, k, v, n, X: (c, k, v, -1, X), ValueError, r"ncols must be >= 0 \(got -1\)"),
    "sparse X": (lambda c, k, v, n, X: (c, k, v, n, X.to_sparse()), TypeError, r"X must be a dense \(strided\) tensor \(got layout torch.sparse_coo\)"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_spmm_rejects(case):
    make, exc, message = CASES[case]
    with pytest.raises(exc, match=r"^sparserl\.spmm: " + message):
        ops.spmm(*make(*good()))


def test_mixed_devices_named():
    crow, col, val, n, X = good()
    with pytest.raises(ValueError, match=r"sparserl\.spmm: crow, col and val must be on the same device \(got col=meta, crow=cpu, val=cpu\)"):
        ops.spmm(crow, col.to("meta"), val, n, X)


@pytest.mark.gpu
def test_mixed_cpu_cuda():
    crow, col, val, n, X = good("cuda")
    with pytest.raises(ValueError, match=r"sparserl\.spmm: X must be on the device of the sparse matrix, cuda:0 \(got cpu\)"):
        ops.spmm(crow, col, val, n, X.cpu())


def test_other_ops_name_themselves():
    crow, col, val, n, X = good()
    with pytest.raises(ValueError, match=r"^sparserl\.spmv: x must have ncols = 3 rows \(got shape \(2,\)\)"):
        ops.spmv(crow, col, val, n, torch.randn(2))
    with pytest.raises(ValueError, match=r"^sparserl\.spmm_transposed: G must have nrows = 2 rows"):
        ops.spmm_transposed(crow, col, val, n, torch.randn(3, 4))
    with pytest.raises(ValueError, match=r"^sparserl\.sddmm: Y and X must have the same number of columns N"):
        ops.sddmm(crow, col, torch.randn(2, 4), torch.randn(3, 5))
    with pytest.raises(ValueError, match=r"^sparserl\.sddmm: col must be < ncols = 2"):
        ops.sddmm(crow, col, torch.randn(2, 4), torch.randn(2, 4))


def test_bad_pattern_checked_again_after_in_place_change():
    crow, col, val, n, X = good()
    ops.spmm(crow, col, val, n, X)  # valid: the verdict is cached
    col[1] = 7  # bumps col's version counter
    with pytest.raises(ValueError, match=r"col must be < ncols = 3 \(got col\[1\] = 7\)"):
        ops.spmm(crow, col, val, n, X)


def test_csr_constructor_errors():
    with pytest.raises(ValueError, match=r"torch_sparserl\.csr: shape=\(nrows, ncols\) is required"):
        ts.csr(([0, 1], [0], [1.0]))
    with pytest.raises(ValueError, match=r"torch_sparserl\.csr: crow must have nrows \+ 1 = 3 elements \(got 2\)"):
        ts.csr(([0, 1], [0], [1.0]), shape=(2, 2))
    with pytest.raises(ValueError, match=r"torch_sparserl\.csr: col must be < ncols = 2 \(got col\[0\] = 5\)"):
        ts.csr(([0, 1], [5], [1.0]), shape=(1, 2))
    with pytest.raises(TypeError, match=r"torch_sparserl\.csr: expected a torch sparse or dense tensor"):
        ts.csr("matrix")
    with pytest.raises(ValueError, match=r"torch_sparserl\.csr: expected a 2-D matrix \(got shape \(2, 2, 2\)\)"):
        ts.csr(torch.ones(2, 2, 2).to_sparse())


def test_csr_matrix_operand_errors():
    A = ts.csr(torch.eye(3))
    with pytest.raises(ValueError, match=r"CSRMatrix\.mm: the dense operand must be 2-D \(got shape \(3,\)\)"):
        torch.mm(A, torch.ones(3))
    with pytest.raises(ValueError, match=r"CSRMatrix\.matmul: the dense operand must be 1-D or 2-D \(got shape \(3, 3, 3\)\)"):
        A @ torch.ones(3, 3, 3)
    with pytest.raises(NotImplementedError, match=r"CSRMatrix: aten\.\w+.* is not supported"):
        torch.sin(A)
    with pytest.raises(NotImplementedError, match=r"sparse @ sparse"):
        A @ A
    with pytest.raises(RuntimeError, match=r"the gradient belongs to the values"):
        A.requires_grad_()
