"""Reference implementations in float64 and named sparsity patterns for the tests."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import numpy as np
import scipy.sparse as sp
import torch

import torch_sparserl as ts

TESTS = Path(__file__).resolve().parent
"""The test suite's folder: the stages' test folders, ``helpers``, ``adversarial``."""
REPO = TESTS.parent
"""The repository's root."""


def _random(rng, nrows, ncols, density):
    return sp.random(nrows, ncols, density=density, format="csr", random_state=rng, dtype=np.float64)


def _empty_rows_in_the_middle(rng):
    A = _random(rng, 40, 30, 0.2).tolil()
    A[10:25, :] = 0
    return A.tocsr()


def _short_and_huge_rows(rng):
    A = _random(rng, 64, 300, 0.005).tolil()
    A[5, :] = rng.standard_normal(300)
    A[40, ::2] = rng.standard_normal(150)
    return A.tocsr()


def _unsorted_columns(rng):
    A = _random(rng, 20, 25, 0.3)
    for r in range(A.shape[0]):  # reverse the columns of every row: still a valid CSR matrix
        lo, hi = A.indptr[r], A.indptr[r + 1]
        A.indices[lo:hi] = A.indices[lo:hi][::-1].copy()
        A.data[lo:hi] = A.data[lo:hi][::-1].copy()
    A.has_sorted_indices = False
    return A


def _duplicates_beyond_every_position(rng):
    # 9 entries in a 2 x 3 matrix: every position repeated, a row with one column five times.
    # torch's sampled_addmm once merged such duplicates and shrank the caller's indices.
    indptr = np.array([0, 6, 9])
    indices = np.array([1, 1, 0, 1, 1, 1, 2, 0, 2])
    return sp.csr_matrix((np.ones(9), indices, indptr), shape=(2, 3))


PATTERNS = {
    "random": lambda rng: _random(rng, 60, 45, 0.1),
    "empty rows in the middle": _empty_rows_in_the_middle,
    "all rows empty (nnz = 0)": lambda rng: sp.csr_matrix((30, 20), dtype=np.float64),
    "short and huge rows": _short_and_huge_rows,
    "one column": lambda rng: _random(rng, 40, 1, 0.5),
    "one row": lambda rng: _random(rng, 1, 50, 0.5),
    "zero rows": lambda rng: sp.csr_matrix((0, 7), dtype=np.float64),
    "zero columns": lambda rng: sp.csr_matrix((6, 0), dtype=np.float64),
    "wide": lambda rng: _random(rng, 7, 300, 0.05),
    "unsorted columns": _unsorted_columns,
    "duplicates, more than rows x cols": _duplicates_beyond_every_position,
    "cora (real)": lambda rng: ts.load_matrix("cora").astype(np.float64) * rng.standard_normal(),
}


def _drawn_rows(rng, lengths, ncols: int, *, duplicates: bool) -> sp.csr_matrix:
    """Rows of the given lengths whose columns are drawn at random and stored in the order drawn
    (unsorted); ``duplicates``: drawn with replacement, so (row, col) entries repeat, apart."""
    lengths = np.asarray(lengths, dtype=np.int64)
    indptr = np.concatenate([[0], np.cumsum(lengths)])
    rows = [rng.integers(0, ncols, size=n) if duplicates else rng.permutation(ncols)[:n] for n in lengths]
    indices = np.concatenate(rows) if len(rows) else np.zeros(0, dtype=np.int64)
    A = sp.csr_matrix((np.ones(indptr[-1]), indices, indptr), shape=(len(lengths), ncols))
    A.has_sorted_indices = False  # so that SciPy never takes the order for sorted
    return A


def _unsorted_with_hubs(rng):
    # 700 x 900: short rows, 60 empty ones in the middle, a full row and a half row (the hubs that
    # split families cut into pieces), every row's columns in random order
    lengths = rng.integers(0, 13, size=700)
    lengths[100:160] = 0
    lengths[5], lengths[600] = 900, 450
    return _drawn_rows(rng, lengths, 900, duplicates=False)


def _duplicate_entries(rng):
    # 500 x 300: columns drawn with replacement, so entries repeat within rows (unsorted, mostly
    # apart); row 3 holds 4000 entries of its 300 columns (each about 13 times), row 4 one
    # column 40 times; the matrix holds far fewer entries than positions (not overfull)
    lengths = rng.integers(0, 20, size=500)
    lengths[3], lengths[4] = 4000, 40
    A = _drawn_rows(rng, lengths, 300, duplicates=True)
    A.indices[A.indptr[4]:A.indptr[5]] = 7
    return A


UNSORTED_AND_DUPLICATE = {
    "unsorted columns, hub rows": _unsorted_with_hubs,
    "duplicate entries": _duplicate_entries,
}
"""Patterns the kernels must take as CSR allows them: columns in any order within a row, and
(row, col) entries repeated (their values summed, as torch and SciPy sum them)."""


def make_unsorted_pattern(name: str, seed: int = 0) -> sp.csr_matrix:
    """A pattern of :data:`UNSORTED_AND_DUPLICATE` with fresh values, its order and repeats kept."""
    A = UNSORTED_AND_DUPLICATE[name](np.random.default_rng(seed))
    A.data = np.random.default_rng(seed + 1).standard_normal(A.nnz)
    return A


def summed_product(indptr, indices, values, X) -> np.ndarray:
    """``A @ X`` in float64, every stored entry added on its own (repeats summed), for a CSR
    matrix given by its arrays: a reference that assumes neither sorted nor distinct columns."""
    indptr, indices = np.asarray(indptr, dtype=np.int64), np.asarray(indices, dtype=np.int64)
    X = np.asarray(X, dtype=np.float64)
    out = np.zeros((len(indptr) - 1,) + X.shape[1:])
    rows = np.repeat(np.arange(len(indptr) - 1), np.diff(indptr))
    weighted = np.asarray(values, dtype=np.float64).reshape((-1,) + (1,) * (X.ndim - 1)) * X[indices]
    np.add.at(out, rows, weighted)
    return out


def make_pattern(name: str, seed: int = 0) -> sp.csr_matrix:
    A = PATTERNS[name](np.random.default_rng(seed)).tocsr()
    A.data = np.random.default_rng(seed + 1).standard_normal(A.nnz)  # fresh values, not ones
    return A


def to_parts(A: sp.csr_matrix, dtype, index_dtype, device):
    """(crow, col, val) tensors of A."""
    crow = torch.from_numpy(A.indptr.astype(np.int64)).to(device=device, dtype=index_dtype)
    col = torch.from_numpy(A.indices.astype(np.int64)).to(device=device, dtype=index_dtype)
    val = torch.from_numpy(A.data.astype(np.float64)).to(device=device, dtype=dtype)
    return crow, col, val


def as_float64_scipy(crow, col, val, ncols) -> sp.csr_matrix:
    """The matrix as the op sees it (values already rounded to their dtype), in float64."""
    return sp.csr_matrix((val.detach().cpu().double().numpy(), col.cpu().numpy(), crow.cpu().numpy()),
                         shape=(crow.numel() - 1, ncols))


def ref_spmm(crow, col, val, ncols, X):
    A = as_float64_scipy(crow, col, val, ncols)
    return torch.from_numpy(np.asarray(A @ X.detach().cpu().double().numpy()))


def ref_spmm_transposed(crow, col, val, ncols, G):
    A = as_float64_scipy(crow, col, val, ncols)
    return torch.from_numpy(np.asarray(A.T @ G.detach().cpu().double().numpy()))


def ref_sddmm(crow, col, Y, X):
    rows = np.repeat(np.arange(crow.numel() - 1), np.diff(crow.cpu().numpy()))
    y = Y.detach().cpu().double().numpy()
    x = X.detach().cpu().double().numpy()
    c = col.cpu().numpy().astype(np.int64)
    return torch.from_numpy((y[rows] * x[c]).sum(axis=1) if len(rows) else np.zeros(0))


def dense_operand(rows, n, dtype, device, *, contiguous=True, seed=0):
    """Fresh random dense operand; non-contiguous variant is a transposed view."""
    g = torch.Generator().manual_seed(seed)
    if contiguous:
        return torch.randn(rows, n, generator=g, dtype=torch.float64).to(device=device, dtype=dtype)
    return torch.randn(n, rows, generator=g, dtype=torch.float64).to(device=device, dtype=dtype).t()


BENCHMARKS = REPO / "benchmarks"


def load_benchmark(name: str):
    """A module of ``benchmarks/``, loaded once: a script by its path there without ``.py``
    (``bench_gnn``, ``probes/profile_cell``), or the common core by its module name
    (``common``, ``common.gnn``). ``benchmarks/`` goes on ``sys.path``, where a script finds
    the common core beside it."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    if name.split(".")[0] == "common":
        return importlib.import_module(name)
    module = Path(name).name
    if module not in sys.modules:
        spec = importlib.util.spec_from_file_location(module, BENCHMARKS / f"{name}.py")
        sys.modules[module] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[module])
    return sys.modules[module]


def raises_index_error(call, match: str):
    """``call()`` refused for the indices it multiplies by, with a ``ValueError`` matching ``match``:
    at once on the CPU; on CUDA, where the device checks new indices without the host waiting
    (:class:`torch_sparserl.pattern.device_check.DeviceCheck`), the call itself returns NaN and
    the first call after the device ran the check raises."""
    import pytest

    try:
        out = call()
    except ValueError as exc:
        assert re.search(match, str(exc)), f"{exc!r} does not match {match!r}"
        return
    assert out.is_cuda, "indices on the host are checked at once"
    assert out.isnan().all(), "a product made before the device's verdict must be NaN"
    torch.cuda.synchronize()
    with pytest.raises(ValueError, match=match):
        call()


def padded_batch_step(weight, opt):
    """One training step on a mini-batch padded to a bucket, as a captured step takes it: the
    batch's features, labels, ``(crow, col, val)`` and a mask of its seed rows as arguments, the
    matrix built inside (``ts.csr``), the loss the mean over the seed rows; returns it detached."""
    def step(x, y, crow, col, val, seeds):
        opt.zero_grad(set_to_none=True)
        A = ts.csr((crow, col, val), (crow.shape[0] - 1, x.shape[0]))
        out = (A @ x) @ weight
        loss = (torch.nn.functional.cross_entropy(out, y, reduction="none") * seeds).sum() / seeds.sum()
        loss.backward()
        opt.step()
        return loss.detach()

    return step


class NoSync:
    """``torch.cuda.set_sync_debug_mode("error")`` for the block: a synchronizing call raises."""

    def __enter__(self):
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")

    def __exit__(self, *exc):
        torch.cuda.set_sync_debug_mode("default")


def other_pattern_of(M: sp.csr_matrix, seed: int) -> sp.csr_matrix:
    """A matrix of ``M``'s sizes and nonzero count with another pattern (its columns permuted)
    and fresh random values: what a CUDA graph's placeholders may be refilled with."""
    rng = np.random.default_rng(seed)
    other = M[:, rng.permutation(M.shape[1])].tocsr()
    other.sort_indices()
    other.data = rng.standard_normal(other.nnz)
    return other
