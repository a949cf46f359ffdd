"""``load_rows``: a few rows of a ``.npz`` CSR matrix, read without loading the matrix."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp

from torch_sparserl.data.datasets import load_matrix, load_rows


def _random(n: int = 300, seed: int = 0) -> sp.csr_matrix:
    rng = np.random.default_rng(seed)
    M = sp.random(n, n + 7, density=0.03, random_state=rng, format="csr", dtype=np.float64)
    M = M.tolil()
    M[::5] = 0  # empty rows: zero-length ranges
    M = M.tocsr()
    M.eliminate_zeros()
    M.data = rng.standard_normal(M.nnz)
    return M


@pytest.mark.parametrize("layout", ["scipy_compressed", "scipy_uncompressed", "package"])
def test_rows_in_any_order_equal_the_whole_matrix_rows(tmp_path, layout):
    M = _random()
    path = tmp_path / "m.npz"
    if layout == "package":
        np.savez(path, indptr=M.indptr, indices=M.indices, data=M.data, shape=np.array(M.shape))
    else:
        sp.save_npz(path, M, compressed=layout == "scipy_compressed")
    rng = np.random.default_rng(1)
    for rows in (rng.permutation(M.shape[0])[:120], np.arange(40, 90), np.array([3, 3, 0]), np.array([], dtype=int)):
        got = load_rows(path, rows)
        want = M[rows]
        assert got.shape == (rows.size, M.shape[1]) and got.dtype == M.dtype
        assert np.array_equal(got.indptr, want.indptr) and np.array_equal(got.indices, want.indices)
        assert np.array_equal(got.data, want.data)


def test_a_shipped_name_loads_its_rows():
    M = load_matrix("cora")
    rows = np.arange(M.shape[0])[::-3]
    assert (load_rows("cora", rows) != M[rows]).nnz == 0


def test_bad_files_and_rows_are_named(tmp_path):
    M = _random()
    path = tmp_path / "m.npz"
    sp.save_npz(path, M)
    with pytest.raises(ValueError, match=r"load_rows: rows must be in \[0, 300\) for .*m.npz' \(got -1\.\.2\)"):
        load_rows(path, [2, -1])
    with pytest.raises(ValueError, match=r"load_rows: rows must be in \[0, 300\)"):
        load_rows(path, [300])
    coo = tmp_path / "coo.npz"
    sp.save_npz(coo, M.tocoo())
    with pytest.raises(ValueError, match=r"load_rows: .*coo.npz' holds .*not a CSR matrix's indptr"):
        load_rows(coo, [0])
    csc = tmp_path / "csc.npz"
    sp.save_npz(csc, M.tocsc())
    with pytest.raises(ValueError, match=r"load_rows: .*csc.npz' holds a b?'csc' matrix, not a CSR one"):
        load_rows(csc, [0])
    text = tmp_path / "t.npz"
    text.write_text("not a zip")
    with pytest.raises(ValueError, match=r"load_rows: .*t.npz' is not a .npz archive"):
        load_rows(text, [0])
    with pytest.raises(ValueError, match=r"load_rows: expected a .npz file or a shipped matrix's name"):
        load_rows(tmp_path / "missing.mtx", [0])
