"""The per-pattern state never goes stale, whatever the caller does to its arrays afterwards.

The contract (torch_sparserl/pattern/__init__.py): ``ts.csr`` copies the caller's index arrays (and
NumPy/SciPy values); a pattern's validation keeps a private copy of a caller's indices, and
every product, derived pattern and kernel reads that copy. Writes torch counts (in place,
also under ``inference_mode``) make a new pattern, validated again; writes it does not count
(``.data``, NumPy views) are not seen; inference-tensor indices are validated on every call.
So no product ever reads unchecked indices (never a crash), and every product of a matrix
sees the same one (never ``A @ X`` on new indices and ``X @ A`` on old ones).

Every result is compared with a float64 reference on fresh random data, every tensor the
library allocates NaN-filled (``poison_uninitialized``) so that an unwritten element shows.
"""

import numpy as np
import pytest
import scipy.sparse as sp
import torch

import torch_sparserl as ts
from torch_sparserl import pattern as patterns
from torch_sparserl.pattern import cache as pattern_table

from helpers import raises_index_error

ops = torch.ops.sparserl

pytestmark = pytest.mark.usefixtures("poison_uninitialized")


def _random_csr(rows, cols, density, seed, dtype=np.float64):
    return sp.random(rows, cols, density=density, format="csr", dtype=dtype, random_state=seed)


def _parts(S, device, index_dtype=torch.int64, dtype=torch.float64):
    return (torch.tensor(S.indptr, dtype=index_dtype, device=device),
            torch.tensor(S.indices, dtype=index_dtype, device=device),
            torch.tensor(S.data, dtype=dtype, device=device))


def _check_products(A_ref: np.ndarray, spmm, spmm_t, device, seed=0):
    """``spmm(X)`` is A_ref @ X and ``spmm_t(G)`` is A_refᵀ @ G, on fresh random operands."""
    g = torch.Generator().manual_seed(seed)
    dense = torch.from_numpy(A_ref)
    X = torch.randn(A_ref.shape[1], 3, dtype=torch.float64, generator=g)
    G = torch.randn(A_ref.shape[0], 3, dtype=torch.float64, generator=g)
    torch.testing.assert_close(spmm(X.to(device)).cpu(), dense @ X)
    torch.testing.assert_close(spmm_t(G.to(device)).cpu(), dense.T @ G)


def _check_matrix(A, A_ref, device, seed=0):
    _check_products(A_ref, lambda X: A @ X, lambda G: (G.t() @ A).t(), device, seed)
    torch.testing.assert_close(A.to_dense().cpu(), torch.from_numpy(A_ref))


# ----------------------------------------------------------------- ts.csr owns its indices


def test_scipy_writes_after_csr_do_not_reach_the_matrix(device):
    """The issue's reproducers: out-of-range indices written into the SciPy matrix (a crash
    before), its values scaled (A @ X saw them, X @ A did not), its indices sorted."""
    S = _random_csr(40, 30, 0.1, seed=1)
    S.has_sorted_indices = False
    rng = np.random.default_rng(0)
    for r in range(S.shape[0]):  # unsorted columns within each row, so sort_indices() moves them
        lo, hi = S.indptr[r], S.indptr[r + 1]
        order = rng.permutation(hi - lo)
        S.indices[lo:hi] = S.indices[lo:hi][order]
        S.data[lo:hi] = S.data[lo:hi][order]
    ref = S.toarray()
    A = ts.csr(S, device=device)
    _check_matrix(A, ref, device)
    S.data[:] *= 3
    _check_matrix(A, ref, device, seed=1)
    S.sort_indices()
    _check_matrix(A, ref, device, seed=2)
    S.indices[:] = 10**8
    _check_matrix(A, ref, device, seed=3)


@pytest.mark.parametrize("write", ["in_place", "data", "inference_mode"])
def test_csr_copies_the_callers_index_tensors(device, write):
    S = _random_csr(25, 35, 0.15, seed=2)
    crow, col, val = _parts(S, device)
    A = ts.csr((crow, col, val), (25, 35))
    assert A.crow.data_ptr() != crow.data_ptr() and A.col.data_ptr() != col.data_ptr()
    _check_matrix(A, S.toarray(), device)
    target = {"in_place": col, "data": col.data}.get(write, col)
    if write == "inference_mode":
        with torch.inference_mode():
            target.zero_()
    else:
        target.zero_()
    _check_matrix(A, S.toarray(), device, seed=1)


def test_csr_under_inference_mode_builds_ordinary_tensors(device):
    S = _random_csr(20, 20, 0.2, seed=3)
    with torch.inference_mode():
        crow, col, val = _parts(S, device)
        A = ts.csr((crow, col, val), (20, 20))
    assert not (A._crow.is_inference() or A._col.is_inference() or A.val.is_inference())
    _check_matrix(A, S.toarray(), device)


def test_values_written_through_data_are_seen_by_every_product(device):
    """Values are read as they are on every call: A @ X and X @ A agree after a write that
    bumps no version counter (the transposed order is gathered per call)."""
    S = _random_csr(30, 30, 0.1, seed=4)
    A = ts.csr(S, device=device)
    _check_matrix(A, S.toarray(), device)
    _check_matrix(A, S.toarray(), device, seed=1)  # a second sight of the same values
    A.val.data.mul_(3)
    _check_matrix(A, 3 * S.toarray(), device, seed=2)


# ------------------------------------------------------ the operators on a caller's tensors


def _check_ops(crow, col, val, ncols, A_ref, device, seed=0):
    _check_products(A_ref, lambda X: ops.spmm(crow, col, val, ncols, X),
                    lambda G: ops.spmm_transposed(crow, col, val, ncols, G), device, seed)
    g = torch.Generator().manual_seed(seed + 100)
    Y = torch.randn(A_ref.shape[0], 4, dtype=torch.float64, generator=g)
    X = torch.randn(A_ref.shape[1], 4, dtype=torch.float64, generator=g)
    rows, cols = np.nonzero(A_ref != 0)  # the reference's pattern, row-major like CSR
    ref = (Y[rows] * X[cols]).sum(1)
    torch.testing.assert_close(ops.sddmm(crow, col, Y.to(device), X.to(device)).cpu(), ref)


def test_out_of_range_indices_written_through_data_are_never_read(device):
    """A write through ``.data`` bumps no version counter: the operators go on reading the
    indices they validated (never the caller's), so no product reads out of range, and
    A @ X, Aᵀ @ G and SDDMM all see the same matrix."""
    S = _random_csr(30, 20, 0.15, seed=5)
    S.data[:] = np.abs(S.data) + 0.5  # no explicit zeros, so the reference's pattern is S's
    crow, col, val = _parts(S, device)
    _check_ops(crow, col, val, 20, S.toarray(), device)
    col.data.fill_(10**8)
    _check_ops(crow, col, val, 20, S.toarray(), device, seed=1)
    crow.data.fill_(0)
    _check_ops(crow, col, val, 20, S.toarray(), device, seed=2)


@pytest.mark.parametrize("under_inference_mode", [False, True])
def test_in_place_index_writes_are_seen_and_checked(device, under_inference_mode):
    """An in-place write bumps the version counter (under inference_mode too): the next call
    validates the new indices and every product reads them; out-of-range ones are refused."""
    S = _random_csr(30, 20, 0.15, seed=6)
    S.data[:] = np.abs(S.data) + 0.5
    crow, col, val = _parts(S, device)
    _check_ops(crow, col, val, 20, S.toarray(), device)
    T = S.copy()
    T.indices[:] = (T.indices + 7) % 20
    T.sort_indices()
    # the same row pointers; the new columns in the same positions as T's
    new_col = torch.tensor(T.indices, dtype=col.dtype, device=device)
    new_val = torch.tensor(T.data, dtype=val.dtype, device=device)
    context = torch.inference_mode() if under_inference_mode else torch.enable_grad()
    with context:
        col.copy_(new_col)
        val.copy_(new_val)
    _check_ops(crow, col, val, 20, T.toarray(), device, seed=1)
    with context:
        col[0] = 10**6
    X = torch.randn(20, 2, dtype=torch.float64, device=device)
    raises_index_error(lambda: ops.spmm(crow, col, val, 20, X), r"sparserl\.spmm: col must be < ncols = 20")


def test_inference_tensor_indices_are_validated_on_every_call(device):
    """Inference tensors have no version counter, so their pattern is never cached: a write
    inside inference_mode is seen by the next call, and a bad one is refused."""
    S = _random_csr(25, 25, 0.15, seed=7)
    S.data[:] = np.abs(S.data) + 0.5
    with torch.inference_mode():
        crow, col, val = _parts(S, device)
        _check_ops(crow, col, val, 25, S.toarray(), device)
        T = S.copy()
        T.indices[:] = (T.indices + 3) % 25
        T.sort_indices()
        col.copy_(torch.tensor(T.indices, dtype=col.dtype, device=device))
        val.copy_(torch.tensor(T.data, dtype=val.dtype, device=device))
        _check_ops(crow, col, val, 25, T.toarray(), device, seed=1)
        col[0] = -1
        with pytest.raises(ValueError, match=r"col must be >= 0"):
            ops.spmm(crow, col, val, 25, torch.randn(25, 2, dtype=torch.float64, device=device))
    assert patterns.validated(crow, col, 25) is None  # never cached


def test_a_written_transpose_does_not_corrupt_the_cached_one(device):
    """``A.t()`` hands out the cached transposed pattern's tensors; an in-place write to them
    makes the next X @ A compute the transpose again instead of reading the written one."""
    S = _random_csr(20, 30, 0.15, seed=8)
    A = ts.csr(S, device=device)
    _check_matrix(A, S.toarray(), device)
    At = A.t()
    torch.testing.assert_close(At.to_dense().cpu(), torch.from_numpy(S.toarray().T))
    At.col.zero_()  # a write torch counts
    _check_matrix(A, S.toarray(), device, seed=1)


def test_a_matrix_on_callers_tensors_reads_its_validated_indices_everywhere(device):
    """A CSRMatrix made directly on the caller's tensors (no ts.csr copy): after a ``.data``
    write, its products and to_dense agree on the validated matrix."""
    S = _random_csr(15, 25, 0.2, seed=9)
    crow, col, val = _parts(S, device)
    A = ts.CSRMatrix(crow, col, val, (15, 25))
    _check_matrix(A, S.toarray(), device)
    col.data.fill_(10**8)
    _check_matrix(A, S.toarray(), device, seed=1)


def test_the_private_copy_dies_with_the_callers_tensors():
    """The pattern's private copy is cached under its own identity too; both keys go when
    the caller's tensors die, so nothing accumulates."""
    import gc

    before = len(pattern_table._CACHE)
    S = _random_csr(10, 10, 0.3, seed=10)
    crow, col, val = _parts(S, "cpu")
    ops.spmm(crow, col, val, 10, torch.randn(10, 2, dtype=torch.float64))
    entry = patterns.validated(crow, col, 10)
    frozen = entry.indices()
    assert frozen[0] is not crow and patterns.lookup(*frozen, 10) is entry
    del crow, col, val, entry, frozen
    gc.collect()
    assert len(pattern_table._CACHE) <= before
