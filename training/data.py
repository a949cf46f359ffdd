"""Training data: the real-matrix split, the synthetic pattern families, the oracle labels.

* **Split.** The 21 matrices of ``../shared/matrices`` are split by hand so that every domain
  has a matrix on each side (citation, co-authorship, road, FEM, social, circuit). The
  validation matrices are never trained on: no stage reads their labels, and the label
  loader refuses them (:func:`load_labels` with ``split="train"``).
* **Synthetic patterns.** :func:`synthetic_specs` draws generator specs
  (``torch_sparserl.data.synthetic``) from a seeded grid: power law, uniform, banded, block
  diagonal, stencil, bipartite, arrow, at 4K-130K rows, so that labelling is quick on one GPU.
* **Labels.** The oracle is the exhaustive autotuner (``torch_sparserl.specialize.autotune.tune``),
  run by ``benchmarks/bench_kernels.py`` over a grid; its ``*-tables.jsonl`` holds one
  record per candidate and stage. :func:`load_labels` turns the final-stage records into one
  :class:`Label` per cell: the best correct kernel, its speedup over cuSPARSE, and every
  screened candidate's time (for the ranking metrics).
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

REPO = Path(__file__).resolve().parents[1]
LABEL_DIR = REPO / "training" / "labels"

# Real matrices of ../shared/matrices. Validation: one per domain, never trained on.
VAL_MATRICES = ("pubmed", "ca-CondMat", "luxembourg_osm", "bcsstk13", "twitch_DE", "rajat01")
TRAIN_MATRICES = ("cora", "citeseer", "ca-HepPh", "dblp-2010", "usroads-48", "bcsstk16",
                  "fb100_Cornell5", "musae_github", "p2p-Gnutella31", "arrow", "bayer10",
                  "pushpull", "Groebner_id2003_aug", "dnn_n1024_l1", "uk-2007-05_100000")

# Held out too: generated matrices that no stage has seen, their parameters off the grid that
# synthetic_specs draws training patterns from (other edge factors, skews, bandwidths, sizes
# that are not powers of two, seeds of their own). With VAL_MATRICES, the evaluation's matrices.
HELDOUT_SYNTHETIC = {
    "heldout-rmat-s16-ef12": "rmat:scale=16,edge_factor=12,a=0.5,b=0.2,c=0.2,seed=7001",
    "heldout-uniform-60000x45000-k12": "uniform:rows=60000,cols=45000,nnz_per_row=12,seed=7002",
    "heldout-banded-50000-bw12": "banded:rows=50000,bandwidth=12,density=0.45,seed=7003",
    "heldout-block-40000-b48": "block_diagonal:rows=40000,block=48,density=0.5,seed=7004",
    "heldout-stencil-300": "stencil_2d:side=300",
    "heldout-bipartite-30000x20000": "bipartite:rows=30000,cols=20000,nnz_per_row=12,skew=1.15,seed=7005",
}
EVAL_MATRICES = VAL_MATRICES + tuple(HELDOUT_SYNTHETIC)
EVAL_NS = (1, 32, 64, 128, 256)  # the evaluation's cells: SpMV and SpMM N = 32...256

# (op, n) cells a pattern is labelled at: SpMV, and SpMM at the widths GNN layers use.
LABEL_NS = (1, 16, 32, 64, 128)


def _pow2(lo: int, hi: int, rng: random.Random) -> int:
    return 1 << rng.randint(lo, hi)


def synthetic_specs(count: int = 96, seed: int = 0) -> list[str]:
    """``count`` generator specs, cycling over the generators with seeded random parameters.

    Sizes stay at 4K-130K rows and at most ~2M nonzeros so one cell labels in about a second.
    """
    rng = random.Random(seed)
    makers = [
        lambda s: f"rmat:scale={rng.randint(12, 17)},edge_factor={rng.choice([2, 4, 8, 16, 32])},"
                  f"{rng.choice(['a=0.45,b=0.22,c=0.22', 'a=0.57,b=0.19,c=0.19', 'a=0.65,b=0.15,c=0.15'])},seed={s}",
        lambda s: f"uniform:rows={_pow2(12, 17, rng)},cols={_pow2(12, 17, rng)},"
                  f"nnz_per_row={rng.choice([1, 2, 3, 5, 8, 16, 32, 64])},seed={s}",
        lambda s: f"banded:rows={_pow2(12, 17, rng)},bandwidth={rng.choice([1, 2, 4, 8, 16, 32])},"
                  f"density={rng.choice([0.3, 0.6, 1.0])},seed={s}",
        lambda s: f"block_diagonal:rows={_pow2(12, 16, rng)},block={rng.choice([4, 16, 32, 64, 128])},"
                  f"density={rng.choice([0.1, 0.3, 0.7])},seed={s}",
        lambda s: f"stencil_2d:side={rng.choice([64, 100, 181, 256, 362])}",
        lambda s: f"bipartite:rows={_pow2(12, 16, rng)},cols={_pow2(11, 16, rng)},"
                  f"nnz_per_row={rng.choice([2, 4, 8, 16, 32])},skew={rng.choice([0.5, 0.8, 1.0, 1.3])},seed={s}",
        lambda s: f"arrow:rows={rng.choice([4096, 8192, 16384, 32768, 65536])}",
    ]
    out: list[str] = []
    seen = set()
    i = 0
    while len(out) < count and i < 50 * count:
        spec = makers[i % len(makers)](seed * 100003 + i)
        i += 1
        if spec not in seen:
            seen.add(spec)
            out.append(spec)
    return out


# ------------------------------------------------------------------------------- labels


@dataclass
class Label:
    """The oracle's answer for one cell (matrix, op, n, dtype)."""

    matrix: str
    op: str
    n: int
    dtype: str
    family: str
    params: dict
    runtime_us: float
    cusparse_us: float
    screened: dict = field(default_factory=dict)  # "family(params)" -> screen runtime (us)

    @property
    def speedup(self) -> float:
        return self.cusparse_us / self.runtime_us

    @property
    def cell(self) -> str:
        return f"{self.matrix}|{self.op}|n={self.n}|{self.dtype}"


def candidate_name(family: str, params: dict) -> str:
    """Stable name of a (family, params) point: ``group_row(block=256,lanes=8,...)``."""
    items = ",".join(f"{k}={_norm(v)}" for k, v in sorted(params.items()))
    return f"{family}({items})"


def _norm(v):
    if isinstance(v, list):
        return "(" + ",".join(str(x) for x in v) + ")"
    if isinstance(v, tuple):
        return "(" + ",".join(str(x) for x in v) + ")"
    return v


def _params(raw: dict) -> dict:
    """JSON turns tuples into lists; the families check tuples."""
    return {k: tuple(v) if isinstance(v, list) else v for k, v in raw.items()}


def table_files(paths: Iterable[Path] | None = None) -> list[Path]:
    if paths:
        return [Path(p) for p in paths]
    found = sorted(LABEL_DIR.glob("*-tables.jsonl"))
    found += sorted((REPO / "benchmarks" / "results").glob("kernels-*-tables.jsonl"))
    return found


def load_labels(paths: Iterable[Path] | None = None, split: str = "train") -> list[Label]:
    """One :class:`Label` per cell of the tables, from its fastest correct final-stage record.

    ``split``: ``"train"`` (synthetic patterns and TRAIN_MATRICES), ``"val"`` (EVAL_MATRICES: the
    real validation matrices and the held-out generated ones) or ``"all"``. Real matrices in neither list are skipped. A cell labelled twice (a resumed or
    repeated run) keeps the later file's answer.
    """
    if split not in ("train", "val", "all"):
        raise ValueError(f"load_labels: split expected 'train', 'val' or 'all', got {split!r}")
    cells: dict[str, dict] = {}
    for path in table_files(paths):
        per_file: dict[str, dict] = {}
        with open(path) as fh:
            for line in fh:
                if not line.strip():
                    continue
                r = json.loads(line)
                cell = per_file.setdefault(r["cell"], {"screen": {}, "final": []})
                stage = (r.get("timing") or {}).get("stage")
                ok = r.get("correct") is True and r.get("runtime_us")
                if stage == "screen" and ok:
                    cell["screen"][candidate_name(r["family"], _params(r["params"]))] = r["runtime_us"]
                elif stage == "final" and ok and r.get("cusparse_us"):
                    cell["final"].append(r)
        cells.update(per_file)
    labels: list[Label] = []
    for key, cell in cells.items():
        matrix, op, n, dtype = key.split("|")
        if not in_split(matrix, split) or not cell["final"]:
            continue
        best = min(cell["final"], key=lambda r: r["runtime_us"])
        labels.append(Label(matrix=matrix, op=op, n=int(n.removeprefix("n=")), dtype=dtype,
                            family=best["family"], params=_params(best["params"]),
                            runtime_us=best["runtime_us"], cusparse_us=best["cusparse_us"],
                            screened=cell["screen"]))
    return labels


def is_synthetic(matrix: str) -> bool:
    """Generated patterns are named after their spec (``rmat-scale12...``) or listed in the bench."""
    return matrix not in EVAL_MATRICES and matrix not in TRAIN_MATRICES and not _is_real(matrix)


def _is_real(matrix: str) -> bool:
    from torch_sparserl.data.datasets import list_matrices

    shared = REPO.parent / "shared" / "matrices"
    return (shared / f"{matrix}.npz").exists() or (REPO / "shared" / "matrices" / f"{matrix}.npz").exists() \
        or matrix in list_matrices()


def in_split(matrix: str, split: str) -> bool:
    if split == "all":
        return True
    if split == "val":
        return matrix in EVAL_MATRICES
    return matrix in TRAIN_MATRICES or (matrix not in EVAL_MATRICES and is_synthetic(matrix))


def geomean(values: Iterable[float]) -> float:
    values = [v for v in values if v and v > 0]
    return math.exp(sum(map(math.log, values)) / len(values)) if values else float("nan")
