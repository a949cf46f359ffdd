"""NumPy array helpers the stages share.

:func:`sorted_unique` stands for ``np.unique`` on index arrays: NumPy 2's ``unique`` of integers
goes through a hash table, which on arrays of thousands to millions of indices takes tens to a
hundred times as long as a sort (a sampled batch's frontier, a partition's halo columns, a
generated graph's edges).
"""

from __future__ import annotations

import numpy as np


def sorted_unique(values: np.ndarray) -> np.ndarray:
    """The distinct elements of the 1-D array ``values``, ascending: ``np.unique(values)``, by a sort."""
    values = np.sort(np.asarray(values).ravel())
    if values.size < 2:
        return values
    keep = np.empty(values.size, dtype=bool)
    keep[0] = True
    np.not_equal(values[1:], values[:-1], out=keep[1:])
    return values[keep]
