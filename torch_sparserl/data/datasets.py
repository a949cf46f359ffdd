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


def load_rows(name_or_path: str | os.PathLike, rows) -> scipy.sparse.csr_matrix:
    """The rows ``rows`` (original indices, in the order given) of the CSR matrix in a ``.npz``
    file (a shipped name, this package's layout or SciPy's ``save_npz``), with all its columns,
    reading only the row pointers and those rows' entries: a rank of
    :meth:`torch_sparserl.distributed.DistributedCSRMatrix.from_local` loads its share of a
    matrix larger than its memory. Rows are read in file order, one seek per run of consecutive
    rows: an uncompressed file (``save_npz(..., compressed=False)``) seeks directly, a compressed
    one is decompressed once as a stream (never held whole).

    A file that is not a CSR ``.npz``, or a row out of range, raises ValueError naming it."""
    import numpy as np
    import scipy.sparse

    path = Path(name_or_path)
    if not path.suffix and (DATA_DIR / f"{path.name}.npz").exists():
        path = DATA_DIR / f"{path.name}.npz"
    if path.suffix != ".npz" or not path.is_file():
        raise ValueError(f"load_rows: expected a .npz file or a shipped matrix's name (got {str(path)!r})")
    if not zipfile.is_zipfile(path):
        raise ValueError(f"load_rows: {str(path)!r} is not a .npz archive (NumPy's savez or SciPy's save_npz)")
    with zipfile.ZipFile(path) as archive:
        members = {Path(name).stem: name for name in archive.namelist()}
        if not {"indptr", "indices", "data", "shape"} <= members.keys():
            raise ValueError(f"load_rows: {str(path)!r} holds {sorted(members)}, not a CSR matrix's indptr, indices, "
                             "data and shape")
        if "format" in members:
            fmt = _read_member(archive, members["format"])
            if fmt.item() not in (b"csr", "csr"):
                raise ValueError(f"load_rows: {str(path)!r} holds a {fmt.item()!r} matrix, not a CSR one")
        shape = _read_member(archive, members["shape"])
        indptr = _read_member(archive, members["indptr"])
        for name, values in (("shape", shape), ("indptr", indptr)):
            try:
                _check_integers(name, values)
            except ValueError as exc:
                raise ValueError(f"load_rows: {str(path)!r}: {exc}") from exc
        nrows, ncols = (int(v) for v in shape)
        rows = np.asarray(rows, dtype=np.int64).reshape(-1)
        if rows.size and (rows.min() < 0 or rows.max() >= nrows):
            raise ValueError(f"load_rows: rows must be in [0, {nrows}) for {str(path)!r} (got {rows.min()}..{rows.max()})")
        indptr = indptr.astype(np.int64)
        starts, stops = indptr[rows], indptr[rows + 1]
        indices = _read_ranges(archive, members["indices"], starts, stops)
        data = _read_ranges(archive, members["data"], starts, stops)
    out_indptr = np.zeros(rows.size + 1, dtype=np.int64)
    np.cumsum(stops - starts, out=out_indptr[1:])
    M = scipy.sparse.csr_matrix((data, indices, out_indptr), shape=(rows.size, ncols))
    try:
        M.check_format(full_check=True)
    except ValueError as exc:
        raise ValueError(f"load_rows: expected a sparse matrix in {str(path)!r} (got {exc})") from exc
    return M


def _read_member(archive: zipfile.ZipFile, name: str):
    import numpy as np

    with archive.open(name) as f:
        return np.lib.format.read_array(f, allow_pickle=False)


def _read_ranges(archive: zipfile.ZipFile, name: str, starts, stops):
    """Entries ``starts[i]:stops[i]`` of the 1-D array ``name`` of ``archive``, concatenated in
    the order given, read in file order (forward seeks only: a compressed member is streamed once)."""
    import numpy as np

    with archive.open(name) as f:
        version = np.lib.format.read_magic(f)
        read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, _, dtype = read_header(f)
        if len(shape) != 1 or dtype.hasobject:
            raise ValueError(f"load_rows: {name} must be a 1-D array of numbers (got shape {shape}, {dtype})")
        offset = f.tell()
        out = np.empty(int((stops - starts).sum()), dtype=dtype)
        placed = np.zeros(starts.size + 1, dtype=np.int64)
        np.cumsum(stops - starts, out=placed[1:])
        for i in np.argsort(starts, kind="stable"):
            if stops[i] > starts[i]:
                f.seek(offset + int(starts[i]) * dtype.itemsize)
                out[placed[i]:placed[i + 1]] = np.frombuffer(f.read(int(stops[i] - starts[i]) * dtype.itemsize), dtype)
        return out
