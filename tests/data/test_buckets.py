"""Sampled batches padded to a few sizes (torch_sparserl.data.buckets): the shapes repeat, the
real rows' products do not change."""

from __future__ import annotations

import itertools
import warnings

import numpy as np
import pytest
import scipy.sparse as sp
import torch

import torch_sparserl as ts
from torch_sparserl.data import Buckets, PaddedBatch, synthetic
from torch_sparserl.data.buckets import _fitted
from torch_sparserl.data.sampling import Batch, neighbor_batches
from torch_sparserl.dtypes import assert_close_to_reference


@pytest.fixture(scope="module")
def batches():
    A = synthetic.make("rmat:scale=11,edge_factor=8")
    A = ((A + A.T) > 0).astype(np.float32).tocsr()
    return list(neighbor_batches(A, 150, (5, 3), seed=2))


def _batch(rows: int, nnz: int, seed: int = 0) -> Batch:
    """A batch of ``rows`` nodes and ``nnz`` random entries, int64 indices (as a caller may build)."""
    rng = np.random.default_rng(seed)
    row = np.sort(rng.integers(0, rows, nnz))
    crow = np.concatenate([[0], np.cumsum(np.bincount(row, minlength=rows))]).astype(np.int64)
    return Batch(nodes=rng.permutation(10 * rows)[:rows].astype(np.int64), seeds=max(1, rows // 3), crow=crow,
                 col=rng.integers(0, rows, nnz).astype(np.int64))


def _padded_nnz(sizes, batches) -> int:
    buckets = Buckets(sizes)
    return sum(buckets.select(b.nodes.size, b.nnz)[1] for b in batches)


def test_fit_holds_every_batch_in_at_most_count_buckets_with_the_least_padding():
    rng = np.random.default_rng(5)
    batches = [_batch(int(r), int(z), seed) for seed, (r, z) in
               enumerate(zip(rng.integers(20, 60, 9), rng.integers(40, 400, 9)))]
    for count in (1, 2, 3, 9, 20):
        buckets = Buckets.fit(batches, count=count)
        assert 1 <= len(buckets) <= min(count, 9)
        assert all(buckets.select(b.nodes.size, b.nnz) is not None for b in batches)
        rows, nnz = zip(*buckets.sizes)
        assert list(rows) == sorted(rows) and list(nnz) == sorted(nnz)  # a chain: larger holds smaller
        # the least padded nonzeros over every split of the batches sorted by nonzeros into `count` groups
        order = sorted(b.nnz for b in batches)
        groups = min(count, len(set(order)))
        least = min(sum(order[e - 1] * (e - s) for s, e in zip((0,) + cut, cut + (len(order),)))
                    for cut in itertools.combinations(range(1, len(order)), groups - 1))
        assert _padded_nnz(buckets.sizes, batches) == least
    assert Buckets.fit(batches, count=1).sizes == ((max(b.nodes.size for b in batches) + 1,
                                                    max(b.nnz for b in batches)),)


def test_fit_over_many_distinct_sizes_still_holds_every_batch():
    rng = np.random.default_rng(1)
    nnz = rng.integers(0, 100_000, 5000)
    rows = nnz // 5 + rng.integers(1, 50, 5000)
    sizes = _fitted(rows, nnz, 4)
    buckets = Buckets(sizes)
    assert len(sizes) == 4 and all(buckets.select(int(r), int(z)) is not None for r, z in zip(rows, nnz))
    padded = sum(buckets.select(int(r), int(z))[1] for r, z in zip(rows, nnz))
    assert padded < 1.3 * nnz.sum()  # uniform sizes in 4 buckets: about 1.25x at best


def test_select_takes_the_smallest_bucket_that_holds_the_batch():
    buckets = Buckets([(200, 900), (100, 500), [150, 500], (100, 500)])
    assert buckets.sizes == ((100, 500), (150, 500), (200, 900)) and len(buckets) == 3
    assert buckets.select(50, 500) == (100, 500)
    assert buckets.select(100, 400) == (150, 500)  # no padding row left in (100, 500) for 100 nonzeros
    assert buckets.select(100, 500) == (100, 500)  # its exact size: nothing to pad
    assert buckets.select(120, 501) == (200, 900)
    assert buckets.select(200, 10) is None and buckets.select(10, 901) is None


def test_padding_keeps_a_valid_csr_with_the_real_rows_first(batches):
    buckets = Buckets.fit(batches, count=3)
    shapes = set()
    for batch in batches:
        padded = buckets.pad(batch)
        rows, nnz = buckets.select(batch.nodes.size, batch.nnz)
        shapes.add((padded.shape, padded.nnz))
        assert isinstance(padded, PaddedBatch) and padded.shape == (rows, rows) and padded.nnz == nnz
        assert padded.crow.dtype == np.int32 and padded.col.dtype == np.int32
        assert padded.crow[0] == 0 and padded.crow[-1] == nnz and np.all(np.diff(padded.crow) >= 0)
        real, n = padded.real_rows, batch.nodes.size
        assert (real, padded.real_nnz, padded.seeds) == (n, batch.nnz, batch.seeds)
        assert np.array_equal(padded.crow[: n + 1], batch.crow) and np.array_equal(padded.col[: batch.nnz], batch.col)
        assert np.array_equal(padded.nodes[:n], batch.nodes) and np.all(padded.nodes[n:] == batch.nodes[0])
        # the padding entries: in padding rows and padding columns only, spread evenly, sorted per row
        pad_col = padded.col[batch.nnz:]
        assert np.all((pad_col >= n) & (pad_col < rows))
        lengths = np.diff(padded.crow[n:])
        assert lengths.size == rows - n and (lengths.size == 0 or lengths.max() - lengths.min() <= 1)
        per_column = np.bincount(pad_col - n, minlength=rows - n)
        assert per_column.size == 0 or per_column.max() - per_column.min() <= 1
        assert all(np.all(np.diff(padded.col[s:e]) >= 0) for s, e in zip(padded.crow[n:-1], padded.crow[n + 1:]))
        for values in ("mean", "ones"):
            data = padded.values(values)
            assert data.dtype == np.float32 and np.array_equal(data[: batch.nnz], batch.values(values))
            assert np.all(data[batch.nnz:] == 0)
        again = padded.unpadded()
        assert all(np.array_equal(getattr(again, f), getattr(batch, f)) for f in ("nodes", "crow", "col"))
        assert buckets.pad(padded).nnz == padded.nnz  # padded again from its real part
    assert len(shapes) <= 3 < len({(b.nodes.size, b.nnz) for b in batches})
    assert Buckets.fit(map(buckets.pad, batches), count=3).sizes == buckets.sizes  # fitted on the real sizes


def test_int64_batches_pad_to_int32_where_the_bucket_fits():
    batch = _batch(40, 160)
    assert batch.crow.dtype == np.int64
    padded = Buckets([(50, 200)]).pad(batch)
    assert padded.crow.dtype == np.int32 and padded.col.dtype == np.int32 and padded.nnz == 200
    assert sp.csr_matrix((padded.values("ones"), padded.col, padded.crow), shape=padded.shape).nnz == 200


def _float64(A: sp.csr_matrix, X: np.ndarray) -> np.ndarray:
    return np.asarray(A.astype(np.float64) @ X.astype(np.float64))


@pytest.mark.parametrize("values", ["mean", "ones"])
def test_the_real_rows_of_the_products_are_the_unpadded_ones(batches, values, poison_uninitialized):
    """NaN in every padding row of X and G: a padding entry in a real row or column would reach
    the real rows; none does, and they equal the unpadded products bitwise (outputs allocated
    NaN-filled: poison_uninitialized, as ``ts.csr`` products take no ``out=``)."""
    for batch in batches[:2]:
        padded = Buckets([(batch.nodes.size + 7, batch.nnz + 40)]).pad(batch)
        n, rows = batch.nodes.size, padded.shape[0]
        g = torch.Generator().manual_seed(n)
        X = torch.randn(n, 6, generator=g)
        X_pad = torch.cat([X, torch.full((rows - n, 6), float("nan"))])
        A, A_pad = ts.csr(batch.parts(values), batch.shape), ts.csr(padded.parts(values), padded.shape)
        out, out_pad = A @ X, A_pad @ X_pad
        assert torch.equal(out_pad[:n], out)
        reference = _float64(batch.adjacency(values), X.numpy())
        assert_close_to_reference(out_pad[:n], torch.from_numpy(reference), torch.float32)
        scipy_pad = padded.adjacency(values) @ X_pad.numpy()
        assert np.array_equal(scipy_pad[:n], batch.adjacency(values) @ X.numpy())
        # the backward's product, the transpose's: the real columns read no padding row of G
        G = torch.randn(n, 6, generator=g)
        G_pad = torch.cat([G, torch.full((rows - n, 6), float("nan"))])
        assert torch.equal((A_pad.t() @ G_pad)[:n], A.t() @ G)
        transposed = torch.from_numpy(_float64(batch.adjacency(values).T.tocsr(), G.numpy()))
        assert_close_to_reference((A_pad.t() @ G_pad)[:n], transposed, torch.float32)
        # finite padding rows: the padding block multiplies by zeros
        X_fin = torch.cat([X, torch.randn(rows - n, 6, generator=g)])
        assert torch.all((A_pad @ X_fin)[n:] == 0)


def test_a_batch_larger_than_every_bucket_gets_a_bucket_of_its_own_and_a_warning(batches):
    small = Buckets.fit(batches[1:3], count=1)
    large = max(batches, key=lambda b: b.nnz)
    assert small.select(large.nodes.size, large.nnz) is None
    with pytest.warns(RuntimeWarning, match=rf"a batch of {large.nodes.size} rows and {large.nnz} nonzeros fits "
                                            r"no bucket .*added the bucket \(\d+ rows, \d+ nonzeros\)"):
        padded = small.pad(large)
    assert len(small) == 2 and padded.shape[0] > large.nodes.size and padded.nnz >= large.nnz
    assert padded.shape[0] == max(large.nodes.size + 1, int(np.ceil(1.25 * large.nodes.size)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the next batch of that size shares the bucket: no warning
        assert small.pad(large).nnz == padded.nnz
    strict = Buckets(small.sizes[:1], oversize="error")
    with pytest.raises(ValueError, match=rf"Buckets.pad: a batch of {large.nodes.size} rows and {large.nnz} "
                                         r"nonzeros fits no bucket \(the largest: \d+ rows"):
        strict.pad(large)
    assert len(strict) == 1


@pytest.mark.parametrize("call, error, message", [
    (lambda: Buckets([]), ValueError, r"Buckets: sizes must be .*\(got none\)"),
    (lambda: Buckets("100,200"), ValueError, r"Buckets: sizes must be .*\(got '100,200'\)"),
    (lambda: Buckets([(100,)]), ValueError, r"Buckets: sizes must be .*\(got \(100,\)\)"),
    (lambda: Buckets([(0, 10)]), ValueError, r"rows >= 1, nnz >= 0 \(got \(0, 10\)\)"),
    (lambda: Buckets([(10, -1)]), ValueError, r"\(got \(10, -1\)\)"),
    (lambda: Buckets([(10.5, 3)]), ValueError, r"\(got \(10.5, 3\)\)"),
    (lambda: Buckets([(True, 3)]), ValueError, r"\(got \(True, 3\)\)"),
    (lambda: Buckets([(10, 3)], oversize="pad"), ValueError, r"Buckets: oversize must be one of 'grow', 'error' "
                                                             r"\(got 'pad'\)"),
    (lambda: Buckets([(10, 3)], growth=0.5), ValueError, r"Buckets: growth must be a finite real number >= 1 "
                                                         r"\(got 0.5\)"),
    (lambda: Buckets([(10, 3)], growth=float("inf")), ValueError, r"growth .*\(got inf\)"),
    (lambda: Buckets.fit([], count=2), ValueError, r"Buckets.fit: expected at least one batch \(got none\)"),
    (lambda: Buckets.fit([_batch(5, 5)], count=0), ValueError, r"Buckets.fit: count must be a whole number >= 1 "
                                                               r"\(got 0\)"),
    (lambda: Buckets.fit([_batch(5, 5)], count=2.0), ValueError, r"count .*\(got 2.0\)"),
    (lambda: Buckets.fit([_batch(5, 5), (5, 5)], count=2), TypeError,
     r"Buckets.fit: batches\[1\] must be a torch_sparserl.data.sampling.Batch \(got tuple\)"),
    (lambda: Buckets([(10, 3)]).pad(sp.eye(3, format="csr")), TypeError, r"Buckets.pad: batch must be a .*Batch"),
    (lambda: Buckets([(10, 30)]).pad(Batch(nodes=np.arange(3), seeds=1, crow=np.array([0, 1, 2]),
                                           col=np.array([0, 1]))), ValueError,
     r"Buckets.pad: batch is not a CSR batch: expected len\(crow\) = nodes \+ 1 = 4 .*\(got len\(crow\) = 3"),
])
def test_bad_arguments_are_named(call, error, message):
    with pytest.raises(error, match=message):
        call()
