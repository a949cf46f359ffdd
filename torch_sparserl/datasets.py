"""Matrices: the few shipped with the package, and loaders for ``.npz`` and ``.mtx`` files.

The shipped matrices (``data/matrices``) are small real graphs for the demo and the tests.
Their ``.npz`` layout is ``indptr``, ``indices``, ``data``, ``shape``; SciPy's own
``save_npz`` files load too.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import scipy.io
import scipy.sparse

DATA_DIR = Path(__file__).with_name("data") / "matrices"
DEFAULT_MATRIX = "cora"


def list_matrices() -> list[str]:
    """Names of the matrices shipped with the package."""
    return sorted(p.stem for p in DATA_DIR.glob("*.npz"))


def _load_npz(path: Path) -> scipy.sparse.csr_matrix:
    with np.load(path, allow_pickle=False) as z:
        keys = set(z.files)
        if {"indptr", "indices", "data", "shape"} <= keys and "format" not in keys:
            return scipy.sparse.csr_matrix((z["data"], z["indices"], z["indptr"]), shape=tuple(z["shape"]))
    return scipy.sparse.load_npz(path).tocsr()


def load_matrix(name_or_path: str | os.PathLike) -> scipy.sparse.csr_matrix:
    """A shipped matrix by name (see :func:`list_matrices`), or a ``.npz`` / ``.mtx`` file."""
    path = Path(name_or_path)
    if not path.suffix and (DATA_DIR / f"{path.name}.npz").exists():
        path = DATA_DIR / f"{path.name}.npz"
    if not path.exists():
        raise FileNotFoundError(f"load_matrix: no file {str(path)!r} and no shipped matrix of that "
                                f"name (shipped: {', '.join(list_matrices())})")
    if path.suffix == ".npz":
        return _load_npz(path)
    if path.suffix == ".mtx":
        return scipy.sparse.csr_matrix(scipy.io.mmread(path))
    raise ValueError(f"load_matrix: expected a .npz or .mtx file (got {str(path)!r})")
