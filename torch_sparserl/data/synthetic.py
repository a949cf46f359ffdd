"""Synthetic sparsity patterns: the large sizes and the variety the real matrices lack.

Every generator returns a ``scipy.sparse.csr_matrix`` in canonical form: ``int32`` ``indptr``
and ``indices`` (``int64`` only past 2^31 − 1 nonzeros, where SciPy needs it), column indices
sorted within each row, no duplicate entries, ``float32`` values. Randomness comes from a
``numpy.random.Generator`` seeded with ``seed``, so a (generator, arguments) pair always gives
the same matrix on the same NumPy; nothing is downloaded or stored.

All work is vectorized: a 2^21-row R-MAT with ~32 M edges takes a few seconds and a few GB.
Duplicates are removed by sorting one combined ``int64`` key ``row * cols + col``.

:func:`make` builds a matrix from a spec string such as ``"rmat:scale=20,edge_factor=16"``;
:data:`GENERATORS` lists the generators by name.
"""

from __future__ import annotations

import inspect
import re
from typing import Callable

import numpy as np
import scipy.sparse

from .arrays import sorted_unique

__all__ = ["GENERATORS", "arrow", "banded", "bipartite", "block_diagonal", "make", "parse_spec", "power_law",
           "power_law_rows", "rmat", "stencil_2d", "uniform"]

_INT32_MAX = np.iinfo(np.int32).max
# Rows handled per step where a generator materializes a (rows, width) candidate array.
_CHUNK_ELEMENTS = 1 << 24
_RMAT_CHUNK = 1 << 18  # edges whose levels are drawn together (2 MiB of state: stays in cache)


# --------------------------------------------------------------------------- assembly helpers

def _index_dtype(rows: int, cols: int, nnz: int) -> type:
    return np.int32 if max(rows, cols, nnz) <= _INT32_MAX else np.int64


def _random_values(rng: np.random.Generator, nnz: int) -> np.ndarray:
    """Values uniform in [-1, 1): never all equal, so a kernel that ignores them is caught."""
    values = rng.random(nnz, dtype=np.float32)
    values *= 2
    values -= 1
    return values


def _from_sorted_arrays(row: np.ndarray, col: np.ndarray, values: np.ndarray | None,
                        shape: tuple[int, int], rng: np.random.Generator | None) -> scipy.sparse.csr_matrix:
    """CSR from coordinates already sorted by (row, col) without duplicates."""
    rows, cols = shape
    nnz = int(col.size)
    index_dtype = _index_dtype(rows, cols, nnz)
    counts = np.bincount(row, minlength=rows) if nnz else np.zeros(rows, dtype=np.int64)
    indptr = np.zeros(rows + 1, dtype=index_dtype)
    np.cumsum(counts, out=indptr[1:])
    indices = col.astype(index_dtype, copy=False)
    if values is None:
        values = _random_values(rng, nnz) if rng is not None else np.ones(nnz, dtype=np.float32)
    matrix = scipy.sparse.csr_matrix((values.astype(np.float32, copy=False), indices, indptr),
                                     shape=shape, copy=False)
    matrix.has_sorted_indices = True
    matrix.has_canonical_format = True
    return matrix


def _col_bits(cols: int) -> int:
    return max(1, (cols - 1).bit_length())


def _from_keys(keys: np.ndarray, shape: tuple[int, int], rng: np.random.Generator) -> scipy.sparse.csr_matrix:
    """CSR from unsorted ``int64`` keys ``row << _col_bits(cols) | col`` that may repeat.

    Sorts ``keys`` in place. A shift rather than ``row * cols`` keeps the split into row and
    column a cheap mask instead of an ``int64`` division.
    """
    rows, cols = shape
    bits = _col_bits(cols)
    keys.sort()
    if keys.size > 1:
        keep = np.empty(keys.size, dtype=bool)
        keep[0] = True
        np.not_equal(keys[1:], keys[:-1], out=keep[1:])
        keys = keys[keep]
    row = keys >> bits
    keys &= (1 << bits) - 1
    return _from_sorted_arrays(row, keys, None, shape, rng)


def _from_candidates(col: np.ndarray, keep: np.ndarray, shape: tuple[int, int],
                     rng: np.random.Generator | None, first_row: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Coordinates of a (chunk_rows, width) candidate array whose columns increase along axis 1."""
    row = np.broadcast_to(np.arange(first_row, first_row + col.shape[0], dtype=np.int64)[:, None], col.shape)
    return row[keep], col[keep]


def _check(name: str, condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(f"synthetic.{name}: {message}")


# --------------------------------------------------------------------------------- generators

def rmat(scale: int, edge_factor: int = 16, a: float = 0.57, b: float = 0.19, c: float = 0.19,
         seed: int = 0, permute: bool = True) -> scipy.sparse.csr_matrix:
    """R-MAT power-law graph (Chakrabarti et al.; the Graph500 defaults a, b, c = .57, .19, .19).

    ``2**scale`` rows and columns; ``edge_factor * 2**scale`` edges are drawn, duplicates
    merged (so nnz is somewhat lower). Each edge picks one quadrant per level with
    probabilities a, b, c, d = 1 − a − b − c. ``permute`` relabels vertices with one random
    permutation, as Graph500 does, so hub rows are scattered instead of packed at the top.
    """
    _check("rmat", 1 <= scale <= 30, f"scale must be in 1..30 (got {scale})")
    _check("rmat", edge_factor >= 1, f"edge_factor must be >= 1 (got {edge_factor})")
    d = 1.0 - a - b - c
    _check("rmat", min(a, b, c) >= 0 and d >= -1e-12,
           f"a, b, c must be >= 0 with a + b + c <= 1 (got a={a}, b={b}, c={c})")
    d = max(d, 0.0)
    rng = np.random.default_rng(seed)
    n = 1 << scale
    edges = edge_factor * n
    # Two levels per 16-bit random number: a lookup table maps it to the 4-bit code
    # (row bit hi, row bit lo, col bit hi, col bit lo), with probabilities exact to 2^-16;
    # an odd scale's last level uses a one-level table (row bit, col bit).
    quadrant_p = np.array([a, b, c, d])  # quadrant q: row bit q >> 1, col bit q & 1
    pair_p = np.outer(quadrant_p, quadrant_p).ravel()  # first level major
    pair_codes = np.array([((q1 >> 1) << 3) | ((q2 >> 1) << 2) | ((q1 & 1) << 1) | (q2 & 1)
                           for q1 in range(4) for q2 in range(4)], dtype=np.uint8)
    single_codes = np.arange(4, dtype=np.uint8)  # (row bit, col bit): the quadrant itself

    def table(p: np.ndarray, codes: np.ndarray) -> np.ndarray:
        edges_cum = np.rint(np.cumsum(p) / p.sum() * 65536).astype(np.int64)
        return np.repeat(codes, np.diff(np.concatenate([[0], edges_cum])))

    # The state packs both ends in one int64, row << 32 | col, so that each level is one
    # shift and one OR; the tables give each code's (row bits << 32 | col bits) directly.
    def spread(codes: np.ndarray, bits: int) -> np.ndarray:
        codes = codes.astype(np.int64)
        return ((codes >> bits) << 32) | (codes & ((1 << bits) - 1))

    pair_table = spread(table(pair_p, pair_codes), 2)
    single_table = spread(table(quadrant_p, single_codes), 1)
    state = np.zeros(edges, dtype=np.int64)  # (edges,) row << 32 | col
    # All levels of one cache-sized chunk at a time: the chunk stays in cache from level to
    # level, where whole-array passes would stream the array through memory once per level.
    for first in range(0, edges, _RMAT_CHUNK):
        part = state[first:first + _RMAT_CHUNK]
        levels = scale
        while levels > 0:
            step = 2 if levels >= 2 else 1
            draws = rng.bit_generator.random_raw((part.size + 3) // 4).view(np.uint16)[:part.size]
            part <<= step
            part |= (pair_table if step == 2 else single_table)[draws]
            levels -= step
    low = np.int64((1 << 32) - 1)
    row = state >> 32
    if permute:
        perm = rng.permutation(n).astype(np.int64)
        col = perm[state & low]
        row = perm[row]
    else:
        col = state & low
    del state
    keys = row
    keys <<= _col_bits(n)
    keys |= col
    del col
    return _from_keys(keys, (n, n), rng)


def uniform(rows: int, cols: int, nnz_per_row: int, seed: int = 0) -> scipy.sparse.csr_matrix:
    """Exactly ``nnz_per_row`` distinct columns per row, each k-subset equally likely."""
    _check("uniform", rows >= 0 and cols >= 1, f"need rows >= 0 and cols >= 1 (got {rows}, {cols})")
    _check("uniform", 0 <= nnz_per_row <= cols,
           f"nnz_per_row must be in 0..cols={cols} (got {nnz_per_row})")
    rng = np.random.default_rng(seed)
    k = nnz_per_row
    index_dtype = _index_dtype(rows, cols, rows * k)
    col = rng.integers(0, cols, size=(rows, k), dtype=index_dtype)  # (rows, k)
    col.sort(axis=1)
    if k > 1:
        bad = np.flatnonzero((col[:, 1:] == col[:, :-1]).any(axis=1))
        # Rows drawn with a repeat are drawn again without replacement: conditioning on
        # "no repeat" keeps every k-subset equally likely.
        if bad.size <= 4096:
            for r in bad:
                col[r] = np.sort(rng.choice(cols, size=k, replace=False))
        else:
            chunk = max(1, _CHUNK_ELEMENTS // cols)
            for start in range(0, bad.size, chunk):
                part = bad[start:start + chunk]
                keys = rng.random((part.size, cols), dtype=np.float32)
                col[part] = np.sort(np.argpartition(keys, k - 1, axis=1)[:, :k], axis=1)
    row = np.repeat(np.arange(rows, dtype=np.int64), k)
    return _from_sorted_arrays(row, col.ravel(), None, (rows, cols), rng)


def banded(rows: int, bandwidth: int, seed: int = 0, density: float = 1.0) -> scipy.sparse.csr_matrix:
    """Square band: entries with |i − j| <= ``bandwidth``; off-diagonal ones kept with
    probability ``density`` (the diagonal always)."""
    _check("banded", rows >= 0 and bandwidth >= 0, f"need rows, bandwidth >= 0 (got {rows}, {bandwidth})")
    _check("banded", 0.0 <= density <= 1.0, f"density must be in [0, 1] (got {density})")
    rng = np.random.default_rng(seed)
    offsets = np.arange(-bandwidth, bandwidth + 1, dtype=np.int64)
    chunk = max(1, _CHUNK_ELEMENTS // offsets.size)
    parts_row, parts_col = [], []
    for first in range(0, rows, chunk):
        r = np.arange(first, min(rows, first + chunk), dtype=np.int64)
        col = r[:, None] + offsets  # (chunk, 2·bandwidth + 1)
        keep = (col >= 0) & (col < rows)
        if density < 1.0:
            keep &= (rng.random(col.shape, dtype=np.float32) < density) | (offsets == 0)
        row_part, col_part = _from_candidates(col, keep, (rows, rows), rng, first)
        parts_row.append(row_part)
        parts_col.append(col_part)
    row = np.concatenate(parts_row) if parts_row else np.zeros(0, np.int64)
    col = np.concatenate(parts_col) if parts_col else np.zeros(0, np.int64)
    return _from_sorted_arrays(row, col, None, (rows, rows), rng)


def block_diagonal(rows: int, block: int, density: float = 0.5, seed: int = 0) -> scipy.sparse.csr_matrix:
    """Square blocks of ``block`` rows along the diagonal (the last one may be smaller); each
    entry of a block kept with probability ``density``, the diagonal always."""
    _check("block_diagonal", rows >= 0 and block >= 1, f"need rows >= 0, block >= 1 (got {rows}, {block})")
    _check("block_diagonal", 0.0 <= density <= 1.0, f"density must be in [0, 1] (got {density})")
    rng = np.random.default_rng(seed)
    within = np.arange(block, dtype=np.int64)
    chunk = max(1, _CHUNK_ELEMENTS // block)
    parts_row, parts_col = [], []
    for first in range(0, rows, chunk):
        r = np.arange(first, min(rows, first + chunk), dtype=np.int64)
        col = (r // block * block)[:, None] + within  # (chunk, block)
        keep = col < rows
        if density < 1.0:
            keep &= (rng.random(col.shape, dtype=np.float32) < density) | (col == r[:, None])
        row_part, col_part = _from_candidates(col, keep, (rows, rows), rng, first)
        parts_row.append(row_part)
        parts_col.append(col_part)
    row = np.concatenate(parts_row) if parts_row else np.zeros(0, np.int64)
    col = np.concatenate(parts_col) if parts_col else np.zeros(0, np.int64)
    return _from_sorted_arrays(row, col, None, (rows, rows), rng)


def stencil_2d(side: int) -> scipy.sparse.csr_matrix:
    """5-point Laplacian on a ``side`` × ``side`` grid (rows = side²): 4 on the diagonal, −1
    to each grid neighbour. Deterministic; no seed."""
    _check("stencil_2d", side >= 1, f"side must be >= 1 (got {side})")
    rows = side * side
    r = np.arange(rows, dtype=np.int64)
    x = r % side
    offsets = np.array([-side, -1, 0, 1, side], dtype=np.int64)
    col = r[:, None] + offsets  # (rows, 5)
    keep = (col >= 0) & (col < rows)
    keep[:, 1] &= x > 0
    keep[:, 3] &= x < side - 1
    values = np.broadcast_to(np.array([-1, -1, 4, -1, -1], dtype=np.float32), col.shape)[keep]
    row, col = _from_candidates(col, keep, (rows, rows), None)
    return _from_sorted_arrays(row, col, values, (rows, rows), None)


def _zipf_probabilities(size: int, skew: float, rng: np.random.Generator) -> np.ndarray:
    weights = np.arange(1, size + 1, dtype=np.float64) ** -skew
    weights = weights[rng.permutation(size)]  # hubs at random positions, not packed at 0
    return weights / weights.sum()


def bipartite(rows: int, cols: int, nnz_per_row: float = 16, skew: float = 1.0,
              seed: int = 0) -> scipy.sparse.csr_matrix:
    """Rectangular user–item style graph (a Chung–Lu bipartite model).

    ``rows * nnz_per_row`` edges are drawn; each end picks a row (a column) with probability
    proportional to ``rank**-skew`` over a random ranking, so both row lengths and column
    popularity follow a power law with exponent ``skew`` (0: uniform). Duplicates merged.
    """
    _check("bipartite", rows >= 1 and cols >= 1, f"need rows, cols >= 1 (got {rows}, {cols})")
    _check("bipartite", nnz_per_row >= 0, f"nnz_per_row must be >= 0 (got {nnz_per_row})")
    _check("bipartite", skew >= 0, f"skew must be >= 0 (got {skew})")
    rng = np.random.default_rng(seed)
    edges = int(round(rows * nnz_per_row))
    row_counts = rng.multinomial(edges, _zipf_probabilities(rows, skew, rng))
    col_cdf = np.cumsum(_zipf_probabilities(cols, skew, rng))
    col_cdf[-1] = 1.0
    col = np.searchsorted(col_cdf, rng.random(edges), side="right").astype(np.int64)
    np.minimum(col, cols - 1, out=col)
    keys = np.repeat(np.arange(rows, dtype=np.int64) << _col_bits(cols), row_counts)
    keys |= col
    del col
    return _from_keys(keys, (rows, cols), rng)


def arrow(rows: int) -> scipy.sparse.csr_matrix:
    """One dense first row, one dense first column and the diagonal (nnz = 3·rows − 2); all
    ones. The extreme of row-length skew: one row holds a third of the nonzeros."""
    _check("arrow", rows >= 1, f"rows must be >= 1 (got {rows})")
    r = np.arange(1, rows, dtype=np.int64)
    row = np.concatenate([np.zeros(rows, np.int64), np.repeat(r, 2)])
    col = np.concatenate([np.arange(rows, dtype=np.int64), np.stack([np.zeros_like(r), r], axis=1).ravel()])
    return _from_sorted_arrays(row, col, np.ones(col.size, np.float32), (rows, rows), None)


_POWER_LAW_BLOCK = 1 << 16  # rows drawn from one seeded stream: any row range comes out the same


def _permutation(x: np.ndarray, size: int, salt: int) -> np.ndarray:
    """A fixed pseudo-random permutation of ``[0, size)``, applied to ``x`` elementwise with no
    table (a rank of a 2^27-node graph needs no 1 GB array): two rounds of multiply-by-odd and
    xor-shift, each a bijection of ``[0, 2^bits)``, walked until the value falls below ``size``."""
    bits = max(1, int(size - 1).bit_length())
    mask = np.uint64((1 << bits) - 1)
    shift = np.uint64(max(1, bits // 2))
    multipliers = [np.uint64((m ^ (salt * 0x632BE59BD9B4E019)) & 0xFFFFFFFFFFFFFFFF | 1)
                   for m in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9)]

    def rounds(y):
        for m in multipliers:
            y = (y * m) & mask  # wraps modulo 2^64, so modulo 2^bits too: odd m is a bijection
            y ^= y >> shift
        return y

    with np.errstate(over="ignore"):
        y = rounds(np.asarray(x, dtype=np.uint64))
        outside = y >= size
        while outside.any():  # cycle-walking: a bijection of [0, size) (each cycle returns below size)
            y[outside] = rounds(y[outside])
            outside = y >= size
    return y.astype(np.int64)


def _power_law_total(nodes: int, skew: float) -> float:
    total, step = 0.0, 1 << 22
    for lo in range(1, nodes + 1, step):
        total += float((np.arange(lo, min(lo + step, nodes + 1), dtype=np.float64) ** -skew).sum())
    return total


def power_law_rows(nodes: int, start: int, stop: int, edge_factor: float = 16, skew: float = 0.8,
                   seed: int = 0) -> scipy.sparse.csr_matrix:
    """Rows ``start:stop`` of :func:`power_law`'s graph, made without the others: a ``(stop -
    start) x nodes`` matrix, the same rows whatever range they are asked in. For a graph no host
    holds whole, each rank makes its own rows (``DistributedCSRMatrix.from_local``)."""
    _check("power_law", nodes >= 1, f"nodes must be >= 1 (got {nodes})")
    _check("power_law", 0 <= start <= stop <= nodes, f"need 0 <= start <= stop <= nodes (got {start}, {stop}, {nodes})")
    _check("power_law", edge_factor >= 0, f"edge_factor must be >= 0 (got {edge_factor})")
    _check("power_law", 0 <= skew < 5, f"skew must be in [0, 5) (got {skew})")
    total = _power_law_total(nodes, skew)
    rows, cols = [], []
    first_block, last_block = start // _POWER_LAW_BLOCK, (max(stop, start + 1) - 1) // _POWER_LAW_BLOCK
    for block in range(first_block, last_block + 1):
        lo, hi = block * _POWER_LAW_BLOCK, min((block + 1) * _POWER_LAW_BLOCK, nodes)
        rng = np.random.default_rng([seed, block])
        ids = np.arange(lo, hi, dtype=np.int64)
        # a row's expected length follows its (hidden) rank's weight: a few hubs, a long tail
        weight = (_permutation(ids, nodes, salt=1) + 1).astype(np.float64) ** -skew
        degree = rng.poisson(edge_factor * nodes * weight / total)
        u = rng.random(int(degree.sum()))
        # each edge's column: a rank drawn from the continuous power law on [1, nodes + 1), then
        # the node of that rank (another fixed permutation: popular columns are not the long rows)
        if abs(skew - 1.0) < 1e-12:
            rank = np.exp(u * np.log(nodes + 1.0))
        else:
            rank = (1.0 + u * ((nodes + 1.0) ** (1.0 - skew) - 1.0)) ** (1.0 / (1.0 - skew))
        rank = np.clip(np.floor(rank).astype(np.int64), 1, nodes)
        col = _permutation(rank - 1, nodes, salt=2)
        row = np.repeat(ids, degree)
        keep = (row >= start) & (row < stop)
        keys = sorted_unique((row[keep] - start) * np.int64(nodes) + col[keep])  # by (row, col), merged
        rows.append(keys // nodes)
        cols.append(keys % nodes)
    row, col = np.concatenate(rows), np.concatenate(cols)  # the blocks come in row order
    return _from_sorted_arrays(row, col, np.ones(col.size, np.float32), (stop - start, nodes), None)


def power_law(nodes: int, edge_factor: float = 16, skew: float = 0.8, seed: int = 0) -> scipy.sparse.csr_matrix:
    """A directed power-law graph of ``nodes`` nodes and about ``nodes * edge_factor`` edges (a
    Chung–Lu model): row ``i`` draws a Poisson number of edges with mean proportional to
    ``rank_i**-skew`` over a fixed pseudo-random ranking of the rows, each edge's column a node
    drawn with the same law over another ranking; duplicates merged, values 1. Made block by
    block of rows (:func:`power_law_rows`), so a rank can make its own rows alone."""
    return power_law_rows(nodes, 0, nodes, edge_factor=edge_factor, skew=skew, seed=seed)


# ------------------------------------------------------------------------------ registry, specs

GENERATORS: dict[str, Callable[..., scipy.sparse.csr_matrix]] = {
    "rmat": rmat,
    "uniform": uniform,
    "banded": banded,
    "block_diagonal": block_diagonal,
    "stencil_2d": stencil_2d,
    "bipartite": bipartite,
    "arrow": arrow,
    "power_law": power_law,
}

_POWER = re.compile(r"^\s*(\d+)\s*(?:\^|\*\*)\s*(\d+)\s*$")


def _convert(generator: str, key: str, text: str, kind: type) -> object:
    text = text.strip()
    try:
        if kind is bool:
            if text.lower() in ("1", "true", "yes", "on"):
                return True
            if text.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError
        power = _POWER.match(text)
        if power:
            value = int(power.group(1)) ** int(power.group(2))
            return value if kind is int else kind(value)
        if kind is int:
            return int(text)
        return kind(text)
    except ValueError:
        raise ValueError(f"synthetic.make: {generator}: argument {key}={text!r} is not a valid "
                         f"{kind.__name__}") from None


def parse_spec(name_spec: str) -> tuple[str, dict[str, object]]:
    """``"rmat:scale=20,edge_factor=16"`` → ``("rmat", {"scale": 20, "edge_factor": 16})``.

    Values are converted to the type of the parameter's default or annotation; integers may be
    written ``2^20`` or ``2**20``. Unknown generators, unknown or repeated arguments, missing
    required arguments and malformed values raise ``ValueError`` naming what was expected.
    """
    if not isinstance(name_spec, str) or not name_spec.strip():
        raise ValueError(f"synthetic.make: expected a spec like 'rmat:scale=20,edge_factor=16' "
                         f"(got {name_spec!r})")
    name, _, arg_text = name_spec.strip().partition(":")
    name = name.strip()
    if name not in GENERATORS:
        raise ValueError(f"synthetic.make: unknown generator {name!r} (known: {', '.join(GENERATORS)})")
    parameters = inspect.signature(GENERATORS[name]).parameters
    kwargs: dict[str, object] = {}
    for item in filter(None, (part.strip() for part in arg_text.split(","))):
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or not key:
            raise ValueError(f"synthetic.make: {name}: expected key=value, got {item!r} in {name_spec!r}")
        if key not in parameters:
            raise ValueError(f"synthetic.make: {name}: unknown argument {key!r} "
                             f"(accepted: {', '.join(parameters)})")
        if key in kwargs:
            raise ValueError(f"synthetic.make: {name}: argument {key!r} given twice in {name_spec!r}")
        param = parameters[key]
        annotation = param.annotation if isinstance(param.annotation, type) else None
        kind = {"int": int, "float": float, "bool": bool}.get(str(param.annotation), annotation)
        if kind is None:
            kind = type(param.default) if param.default is not inspect.Parameter.empty else float
        kwargs[key] = _convert(name, key, value, kind)
    missing = [p for p, param in parameters.items()
               if param.default is inspect.Parameter.empty and p not in kwargs]
    if missing:
        raise ValueError(f"synthetic.make: {name}: missing required argument(s) {', '.join(missing)} "
                         f"(signature: {name}{inspect.signature(GENERATORS[name])})")
    return name, kwargs


def make(name_spec: str) -> scipy.sparse.csr_matrix:
    """Build the matrix a spec names, e.g. ``make("rmat:scale=20,edge_factor=16")``."""
    name, kwargs = parse_spec(name_spec)
    return GENERATORS[name](**kwargs)
