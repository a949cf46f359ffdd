"""torch_sparserl.data.arrays: the helpers that stand for NumPy calls on index arrays."""

from __future__ import annotations

import numpy as np
import pytest

from torch_sparserl.data.arrays import sorted_unique


@pytest.mark.parametrize("size, high", [(0, 5), (1, 5), (2, 1), (1000, 10), (50_000, 2**40), (7, 2**62)])
@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_sorted_unique_is_numpys_unique(size, high, dtype):
    rng = np.random.default_rng(size)
    values = rng.integers(-min(high, np.iinfo(dtype).max), min(high, np.iinfo(dtype).max), size, dtype=dtype)
    before = values.copy()
    got = sorted_unique(values)
    want = np.unique(values)
    assert got.dtype == want.dtype and np.array_equal(got, want)
    assert np.array_equal(values, before)  # the caller's array is left as it was


def test_sorted_unique_of_a_view_and_of_a_list():
    values = np.arange(20)[::-3] % 4
    assert np.array_equal(sorted_unique(values), np.unique(values))
    assert np.array_equal(sorted_unique([3, 1, 3, 2]), [1, 2, 3])
