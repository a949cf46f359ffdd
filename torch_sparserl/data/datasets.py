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


# The arrays of a .npz that hold indices or sizes (this package's layout, and SciPy's save_npz of
# every format): SciPy casts them to integers, so 0.7 would silently become row or column 0.
_INDEX_ARRAYS = ("indptr", "indices", "shape", "row", "col", "offsets")


def _load_npz(path: Path) -> scipy.sparse.csr_matrix:
    import numpy as np
    import scipy.sparse

    if not zipfile.is_zipfile(path):  # np.load would try it as a pickle, and say so
        raise ValueError("not a .npz archive (NumPy's savez or SciPy's save_npz)")
    with np.load(path, allow_pickle=False) as z:
        keys = set(z.files)
        for name in _INDEX_ARRAYS:
            if name in keys:
                _check_integers(name, z[name])
        if {"indptr", "indices", "data", "shape"} <= keys and "format" not in keys:
            return scipy.sparse.csr_matrix((z["data"], z["indices"], z["indptr"]), shape=tuple(z["shape"]))
    return scipy.sparse.load_npz(path).tocsr()


def _check_integers(name: str, values) -> None:
    """Refuse an array of indices or sizes whose dtype is not an integer one (naming a fractional
    value where there is one)."""
    import numpy as np

    if values.dtype.kind in "iu":
        return
    example = ""
    if values.dtype.kind == "f":
        fractional = values[(values != np.round(values)) | ~np.isfinite(values)].ravel()
        example = f", e.g. {fractional[0].item()!r}" if fractional.size else ""
    raise ValueError(f"non-integer {name!r}: {values.dtype}{example}")


# The fewest bytes one entry of a Matrix Market file takes: ``1 1`` and a line end (coordinate),
# ``1`` and a line end (array).
_MIN_ENTRY_BYTES = {"coordinate": 4, "array": 2}


def _check_mtx_header(path: Path) -> None:
    """Refuse a Matrix Market file whose header promises more entries than its bytes can hold, or
    a matrix whose CSR form would not fit in this machine's memory: SciPy would try to allocate
    it first (a 60-byte file can promise 10**12 entries)."""
    import scipy.io

    rows, cols, entries, layout, field, symmetry = scipy.io.mminfo(path)
    size = path.stat().st_size
    most = (size + 1) // _MIN_ENTRY_BYTES[layout]  # the last entry may lack its line end
    if entries > most:
        raise ValueError(f"a header promising {entries} entries ({rows} x {cols}) in a file of {size} bytes, "
                         f"which hold at most {most}")
    stored = entries * (1 if symmetry == "general" else 2)  # the mirrored half is added
    needed = 8 * (rows + 1) + 24 * stored  # int64 row pointers; per entry, coordinates and a value
    memory = _physical_memory()
    if memory is not None and needed > memory:
        raise ValueError(f"a header declaring {rows} x {cols} with {stored} entries, about {needed / 2**30:.3g} "
                         f"GiB in memory; this machine has {memory / 2**30:.3g} GiB")


def _physical_memory() -> int | None:
    """This machine's memory in bytes, where the platform says (not on Windows)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


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
        if path.suffix == ".mtx":
            _check_mtx_header(path)
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
