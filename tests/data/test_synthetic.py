"""Synthetic pattern generators: canonical CSR, determinism, the structure each one promises."""

import numpy as np
import pytest
import scipy.sparse

from torch_sparserl.data import synthetic

# One small instance of every generator (CPU, milliseconds each).
SMALL_SPECS = {
    "rmat": "rmat:scale=10,edge_factor=8",
    "uniform": "uniform:rows=500,cols=300,nnz_per_row=7",
    "banded": "banded:rows=400,bandwidth=5,density=0.7",
    "block_diagonal": "block_diagonal:rows=250,block=16,density=0.3",
    "stencil_2d": "stencil_2d:side=13",
    "bipartite": "bipartite:rows=600,cols=200,nnz_per_row=5,skew=0.9",
    "arrow": "arrow:rows=50",
    "power_law": "power_law:nodes=3000,edge_factor=6,skew=0.9",
}
SEEDED = ["rmat", "uniform", "banded", "block_diagonal", "bipartite", "power_law"]


def assert_canonical(matrix: scipy.sparse.csr_matrix) -> None:
    assert isinstance(matrix, scipy.sparse.csr_matrix)
    assert matrix.indices.dtype == np.int32 and matrix.indptr.dtype == np.int32
    assert matrix.data.dtype == np.float32
    rows, cols = matrix.shape
    indptr, indices = matrix.indptr, matrix.indices
    assert indptr.size == rows + 1 and indptr[0] == 0 and indptr[-1] == indices.size == matrix.nnz
    assert np.all(np.diff(indptr) >= 0)
    if matrix.nnz:
        assert indices.min() >= 0 and indices.max() < cols
    # Strictly increasing inside each row: sorted and no duplicates at once.
    row_of = np.repeat(np.arange(rows), np.diff(indptr))
    same_row = row_of[1:] == row_of[:-1]
    assert np.all(np.diff(indices.astype(np.int64))[same_row] > 0)
    assert np.all(np.isfinite(matrix.data))


def test_registry_covers_the_specs():
    assert set(SMALL_SPECS) == set(synthetic.GENERATORS)


@pytest.mark.parametrize("name", sorted(SMALL_SPECS))
def test_canonical_csr(name):
    assert_canonical(synthetic.make(SMALL_SPECS[name]))


@pytest.mark.parametrize("name", SEEDED)
def test_same_seed_same_matrix_other_seed_other_matrix(name):
    spec = SMALL_SPECS[name]
    a, b = synthetic.make(spec + ",seed=3"), synthetic.make(spec + ",seed=3")
    c = synthetic.make(spec + ",seed=4")
    for field in ("indptr", "indices", "data"):
        np.testing.assert_array_equal(getattr(a, field), getattr(b, field))
    assert a.shape == c.shape
    assert not (np.array_equal(a.indices, c.indices) and np.array_equal(a.data, c.data))


def test_shapes():
    assert synthetic.rmat(7, 4).shape == (128, 128)
    assert synthetic.uniform(10, 20, 3).shape == (10, 20)
    assert synthetic.banded(33, 2).shape == (33, 33)
    assert synthetic.block_diagonal(30, 8).shape == (30, 30)
    assert synthetic.stencil_2d(6).shape == (36, 36)
    assert synthetic.bipartite(40, 25, 3).shape == (40, 25)
    assert synthetic.arrow(9).shape == (9, 9)


def test_rmat_is_skewed():
    matrix = synthetic.rmat(12, 8, seed=1)
    lengths = np.diff(matrix.indptr)
    assert matrix.nnz <= 8 * 4096 and matrix.nnz > 0.8 * 8 * 4096  # duplicates merged, not many
    assert lengths.max() > 20 * lengths.mean()
    # Without relabelling, R-MAT packs its hubs in the first rows.
    unpermuted = np.diff(synthetic.rmat(12, 8, seed=1, permute=False).indptr)
    assert unpermuted[:64].mean() > 5 * unpermuted.mean()


def test_rmat_every_level_draws_the_quadrant_probabilities():
    # P(row bit set) = c + d = 0.24 and P(col bit set) = b + d = 0.24 at every level (merging
    # duplicates, mostly among hubs whose bits are 0, lifts it a little). An odd scale has one
    # level drawn alone: it must not differ from the paired ones.
    coo = synthetic.rmat(11, 16, permute=False, seed=0).tocoo()
    for k in range(11):
        assert 0.22 < ((coo.row >> k) & 1).mean() < 0.30, k
        assert 0.22 < ((coo.col >> k) & 1).mean() < 0.30, k


def test_rmat_uniform_quadrants_is_not_skewed():
    lengths = np.diff(synthetic.rmat(12, 8, a=0.25, b=0.25, c=0.25, seed=0).indptr)
    assert lengths.max() < 4 * lengths.mean()


def test_uniform_has_exact_row_lengths_even_when_dense():
    np.testing.assert_array_equal(np.diff(synthetic.uniform(200, 1000, 9).indptr), 9)
    dense = synthetic.uniform(50, 12, 10, seed=2)  # most first draws repeat a column
    assert_canonical(dense)
    np.testing.assert_array_equal(np.diff(dense.indptr), 10)
    full = synthetic.uniform(5, 6, 6)
    assert full.nnz == 30


def test_uniform_many_rows_with_repeats_take_the_vectorized_path():
    matrix = synthetic.uniform(6000, 20, 12, seed=5)  # nearly every row repeats: > 4096 redrawn
    assert_canonical(matrix)
    np.testing.assert_array_equal(np.diff(matrix.indptr), 12)


def test_banded_bandwidth():
    matrix = synthetic.banded(300, 4)
    coo = matrix.tocoo()
    assert np.abs(coo.row - coo.col).max() == 4
    assert matrix.nnz == 300 * 9 - 2 * (1 + 2 + 3 + 4)  # full band, corners cut
    sparse = synthetic.banded(300, 4, density=0.5, seed=1)
    coo = sparse.tocoo()
    assert np.abs(coo.row - coo.col).max() <= 4
    assert np.all(sparse.diagonal() != 0)
    assert sparse.nnz < matrix.nnz


def test_block_diagonal_stays_in_blocks():
    coo = synthetic.block_diagonal(100, 16, density=0.4, seed=0).tocoo()
    np.testing.assert_array_equal(coo.row // 16, coo.col // 16)
    assert set(range(100)) <= set(coo.row[coo.row == coo.col])  # diagonal kept


def test_stencil_is_the_5_point_laplacian():
    side = 5
    matrix = synthetic.stencil_2d(side)
    assert matrix.nnz == 5 * side * side - 4 * side
    np.testing.assert_array_equal(matrix.sum(axis=1).A.ravel()[side + 1], 0)  # interior point
    np.testing.assert_array_equal(matrix.diagonal(), 4)
    assert (matrix != matrix.T).nnz == 0


def test_bipartite_skew():
    skewed = np.diff(synthetic.bipartite(2000, 1000, 8, skew=1.0, seed=0).indptr)
    flat = np.diff(synthetic.bipartite(2000, 1000, 8, skew=0.0, seed=0).indptr)
    assert skewed.max() > 10 * skewed.mean()
    assert flat.max() < 4 * flat.mean()


def test_power_law_is_skewed_and_any_row_range_comes_out_alone():
    """Each rank of a graph too large for one host makes its own rows: any split of the rows,
    blocks of the generator's streams cut anywhere, gives the whole graph's rows."""
    nodes = 3 * synthetic._POWER_LAW_BLOCK // 2 + 17  # two blocks, the second cut short
    whole = synthetic.power_law(nodes, edge_factor=5, skew=0.9, seed=1)
    cuts = [0, 1, 1000, synthetic._POWER_LAW_BLOCK, synthetic._POWER_LAW_BLOCK + 5, nodes]
    pieces = [synthetic.power_law_rows(nodes, a, b, edge_factor=5, skew=0.9, seed=1) for a, b in zip(cuts, cuts[1:])]
    for piece in pieces:
        assert_canonical(piece)
    stacked = scipy.sparse.vstack(pieces).tocsr()
    assert stacked.shape == whole.shape and (stacked != whole).nnz == 0
    rows, cols = np.diff(whole.indptr), np.bincount(whole.indices, minlength=nodes)
    assert 4 < rows.mean() < 5.5 and rows.max() > 40 * rows.mean() and cols.max() > 40 * cols.mean()
    flat = np.diff(synthetic.power_law(5000, edge_factor=8, skew=0.0, seed=1).indptr)
    assert flat.max() < 4 * flat.mean()
    assert synthetic.power_law_rows(nodes, 7, 7).shape == (0, nodes)
    with pytest.raises(ValueError, match=r"need 0 <= start <= stop <= nodes \(got 5, 3, 10\)"):
        synthetic.power_law_rows(10, 5, 3)


def test_the_power_law_rankings_are_permutations():
    for size in (1, 2, 1000, 1 << 12, (1 << 12) + 1):
        ranks = synthetic._permutation(np.arange(size), size, salt=1)
        assert np.array_equal(np.sort(ranks), np.arange(size))
    assert not np.array_equal(synthetic._permutation(np.arange(1000), 1000, 1),
                              synthetic._permutation(np.arange(1000), 1000, 2))


def test_arrow():
    matrix = synthetic.arrow(10)
    assert matrix.nnz == 3 * 10 - 2
    lengths = np.diff(matrix.indptr)
    assert lengths[0] == 10 and np.all(lengths[1:] == 2)


def test_empty_and_tiny_sizes():
    assert synthetic.uniform(0, 5, 2).nnz == 0
    assert synthetic.banded(0, 3).shape == (0, 0)
    assert synthetic.uniform(4, 5, 0).nnz == 0
    assert_canonical(synthetic.rmat(1, 1))
    assert synthetic.arrow(1).nnz == 1


def test_parse_spec_converts_types_and_powers():
    name, kwargs = synthetic.parse_spec("rmat:scale=2^4, edge_factor=8, a=0.6, permute=false")
    assert name == "rmat"
    assert kwargs == {"scale": 16, "edge_factor": 8, "a": 0.6, "permute": False}
    assert synthetic.parse_spec("uniform:rows=2**10,cols=8,nnz_per_row=2")[1]["rows"] == 1024
    assert synthetic.parse_spec("arrow:rows=4") == ("arrow", {"rows": 4})


@pytest.mark.parametrize("spec, message", [
    ("nosuch:rows=3", "unknown generator 'nosuch'"),
    ("rmat:scale=4,size=2", "unknown argument 'size'"),
    ("rmat:edge_factor=4", "missing required argument(s) scale"),
    ("rmat:scale=four", "scale='four' is not a valid int"),
    ("rmat:scale=4,scale=5", "given twice"),
    ("rmat:scale", "expected key=value"),
    ("", "expected a spec"),
    ("rmat:scale=40", "scale must be in 1..30"),
    ("uniform:rows=3,cols=2,nnz_per_row=3", "nnz_per_row must be in 0..cols=2"),
])
def test_make_errors_are_clear(spec, message):
    with pytest.raises(ValueError) as info:
        synthetic.make(spec)
    assert message in str(info.value)
