"""The matrices and graphs the benchmarks run on.

Real matrices come from ``$SPARSERL_SHARED`` (the shared folder or its ``matrices``), else
``../shared/matrices`` beside the repository, else ``shared/matrices`` inside it (the copy that
travels to a device machine); the package's shipped matrices fill in the names those lack.
Synthetic ones are generated at run time from a spec (seeded, a few seconds each), never stored.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import os
import re
from pathlib import Path
from typing import Iterable

from .environment import REPO
from .errors import usage_error

# Large synthetic patterns: the kernel benchmark's default grid.
SYNTHETIC: dict[str, str] = {
    "rmat-s20-ef16": "rmat:scale=20,edge_factor=16",            # power law, 1M rows, ~16M nnz
    "rmat-s21-ef16": "rmat:scale=21,edge_factor=16",            # power law, 2M rows, ~32M nnz
    "uniform-1m-16": "uniform:rows=2^20,cols=2^20,nnz_per_row=16",  # 16 random columns per row
    "banded-1m-bw8": "banded:rows=2^20,bandwidth=8",            # 17 per row around the diagonal
}
# Small synthetic patterns for quick runs; selectable by name too.
SMALL_SYNTHETIC: dict[str, str] = {
    "rmat-s12-ef8": "rmat:scale=12,edge_factor=8",
}


@dataclasses.dataclass(frozen=True)
class MatrixEntry:
    """One matrix: a real one from a ``.npz``/``.mtx`` file, or a generator spec."""

    name: str
    group: str     # "real" | "synthetic"
    source: str    # file path, or a synthetic spec such as "rmat:scale=20,edge_factor=16"
    origin: str    # "shared" | "package" | "file" | "generated"

    def load(self):
        if self.origin == "generated":
            from torch_sparserl.data import synthetic

            return synthetic.make(self.source)
        from torch_sparserl.data.datasets import load_matrix

        return load_matrix(self.source)


def shared_matrices_dir() -> Path | None:
    """The folder of the real matrices (see the module's docstring); None when absent: the
    benchmarks then run on the shipped ones."""
    env = os.environ.get("SPARSERL_SHARED")
    if env:
        candidates = [Path(env) / "matrices", Path(env)]
    else:
        candidates = [REPO.parent / "shared" / "matrices", REPO / "shared" / "matrices"]
    for path in candidates:
        if path.is_dir() and any(path.glob("*.npz")):
            return path
    return None


def known_matrices() -> dict[str, MatrixEntry]:
    """Every matrix a benchmark can name: shared real ones, shipped ones not among them, synthetic."""
    from torch_sparserl.data.datasets import DATA_DIR, list_matrices

    entries: dict[str, MatrixEntry] = {}
    shared = shared_matrices_dir()
    if shared is not None:
        for path in sorted(shared.glob("*.npz")):
            entries[path.stem] = MatrixEntry(path.stem, "real", str(path), "shared")
    for name in list_matrices():
        entries.setdefault(name, MatrixEntry(name, "real", str(DATA_DIR / f"{name}.npz"), "package"))
    for table in (SYNTHETIC, SMALL_SYNTHETIC):
        for name, spec in table.items():
            entries[name] = MatrixEntry(name, "synthetic", spec, "generated")
    return entries


def default_matrix_names(entries: dict[str, MatrixEntry]) -> list[str]:
    """Every real matrix, then the large synthetic ones."""
    real = [e.name for e in entries.values() if e.group == "real"]
    return real + list(SYNTHETIC)


def select_matrices(patterns: Iterable[str] | None, entries: dict[str, MatrixEntry] | None = None
                    ) -> list[MatrixEntry]:
    """Names or globs of known matrices (``real`` and ``synthetic`` name the groups), generator
    specs (``rmat:scale=16,edge_factor=8``), or ``.npz``/``.mtx`` paths. Order is kept; a name
    that matches nothing exits with status 2 (:func:`~common.errors.usage_error`)."""
    entries = known_matrices() if entries is None else entries
    if not patterns:
        return [entries[name] for name in default_matrix_names(entries)]
    chosen: dict[str, MatrixEntry] = {}
    for pattern in patterns:
        pattern = pattern.strip()
        if not pattern:
            continue
        if pattern in ("real", "synthetic"):
            names = default_matrix_names(entries)
            hits = [entries[n] for n in names if entries[n].group == pattern]
        elif ":" in pattern:
            from torch_sparserl.data import synthetic

            synthetic.parse_spec(pattern)  # fail now, with the generator's own message
            name = re.sub(r"[^A-Za-z0-9_.-]+", "-", pattern.replace("=", "")).strip("-")
            hits = [MatrixEntry(name, "synthetic", pattern, "generated")]
        elif pattern.endswith((".npz", ".mtx")) and Path(pattern).exists():
            hits = [MatrixEntry(Path(pattern).stem, "real", str(Path(pattern)), "file")]
        else:
            hits = [entries[n] for n in entries if fnmatch.fnmatchcase(n, pattern)]
        if not hits:
            shared = shared_matrices_dir()
            raise usage_error(f"benchmarks: matrix {pattern!r} matches no matrix (known: "
                              f"{', '.join(entries)}; real matrices from "
                              f"{shared if shared else 'nowhere: no shared matrices found'})")
        for entry in hits:
            chosen.setdefault(entry.name, entry)
    return list(chosen.values())


def matrix_list(text: str) -> list[str]:
    """Comma-separated names, but a generator spec keeps its own commas: "cora,rmat:scale=12,
    edge_factor=4" is ["cora", "rmat:scale=12,edge_factor=4"]."""
    items: list[str] = []
    for part in (p.strip() for p in text.split(",")):
        if items and ":" in items[-1] and "=" in part and ":" not in part:
            items[-1] += "," + part
        elif part:
            items.append(part)
    return items


def load_graph(name: str):
    """A graph's binary adjacency (SciPy CSR, float32) without self loops; row i lists the
    sources of the edges into i. ``name`` as :func:`select_matrices` takes it."""
    import numpy as np
    import scipy.sparse as sp

    entry = select_matrices([name])[0]
    A = entry.load().tocsr()
    A = sp.csr_matrix((np.ones(A.nnz, dtype=np.float32), A.indices, A.indptr), shape=A.shape)
    A.setdiag(0)
    A.eliminate_zeros()
    A.sum_duplicates()
    A.sort_indices()
    A.data[:] = 1.0
    if A.shape[0] != A.shape[1]:
        raise ValueError(f"load_graph: graph {name} is not square ({A.shape})")
    return A
