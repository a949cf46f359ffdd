"""Matrices: the few shipped with the package, and loaders for ``.npz`` and ``.mtx`` files.

The shipped matrices (``data/matrices``) are small real graphs for the demo and the tests.
Their ``.npz`` layout is ``indptr``, ``indices``, ``data``, ``shape``; SciPy's own
``save_npz`` files load too.
"""

from __future__ import annotations

import os
import stat
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING

# NumPy and SciPy are imported where a matrix is loaded: the command's --help reads DEFAULT_MATRIX.
if TYPE_CHECKING:
    import scipy.sparse

DATA_DIR = Path(__file__).with_name("matrices")
DEFAULT_MATRIX = "cora"


def list_matrices() -> list[str]:
    """Names of the matrices shipped with the package."""
    return sorted(p.stem for p in DATA_DIR.glob("*.npz"))


def _load_npz(path: Path) -> scipy.sparse.csr_matrix:
    import numpy as np
    import scipy.sparse

    if not zipfile.is_zipfile(path):  # np.load would try it as a pickle, and say so
        raise ValueError("not a .npz archive (NumPy's savez or SciPy's save_npz)")
    with np.load(path, allow_pickle=False) as z:
        keys = set(z.files)
        if {"indptr", "indices", "data", "shape"} <= keys and "format" not in keys:
            return scipy.sparse.csr_matrix((z["data"], z["indices"], z["indptr"]), shape=tuple(z["shape"]))
    return scipy.sparse.load_npz(path).tocsr()


def load_matrix(name_or_path: str | os.PathLike) -> scipy.sparse.csr_matrix:
    """A shipped matrix by name (see :func:`list_matrices`), or a ``.npz`` / ``.mtx`` file.

    A file that is not a sparse matrix, or whose indices are out of range or out of order,
    raises ValueError naming the file; a missing one FileNotFoundError."""
    import scipy.io
    import scipy.sparse

    path = Path(name_or_path)
    if not path.suffix and (DATA_DIR / f"{path.name}.npz").exists():
        path = DATA_DIR / f"{path.name}.npz"
    if not path.exists():
        raise FileNotFoundError(f"load_matrix: no file {str(path)!r} and no shipped matrix of that "
                                f"name (shipped: {', '.join(list_matrices())})")
    if path.suffix not in (".npz", ".mtx"):
        raise ValueError(f"load_matrix: expected a .npz or .mtx file (got {str(path)!r})")
    if not path.is_file():  # a folder, a FIFO (reading would wait forever), a device
        raise ValueError(f"load_matrix: expected a regular file (got {_kind(path)} {str(path)!r})")
    try:
        M = _load_npz(path) if path.suffix == ".npz" else scipy.sparse.csr_matrix(scipy.io.mmread(path))
        M.check_format(full_check=True)  # indices in range and in order: kernels index with them
    except (ValueError, TypeError, KeyError, EOFError, zipfile.BadZipFile) as exc:
        reason = " ".join(str(exc).split()) or type(exc).__name__
        raise ValueError(f"load_matrix: expected a sparse matrix in {str(path)!r} (got {reason})") from exc
    return M


def _kind(path: Path) -> str:
    mode = path.stat().st_mode
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "a special file"
