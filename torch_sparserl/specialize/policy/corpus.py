"""The kernel text the policy learns to write.

* :func:`prompt_text` and :func:`completion_text` split one compact ABI source (``families.render
  (..., compact=True)``) into the request the runtime states (the start of the plan line:
  op, dtype, n) and what the policy writes (the rest of the plan, the parameters, the kernel).
* :func:`kernel_documents` enumerates the families' compact sources over their whole
  parameter grids: the pretraining corpus and the tokenizer's training text.
* :func:`cuda_documents` adds real CUDA C++ found offline (the toolkit's CUB/Thrust headers).
"""

from __future__ import annotations

import itertools
import os
import random
import shutil
from pathlib import Path
from typing import Iterator

from ...abi import PLAN_PREFIX
from .. import families as fam

SPMM_NS = (8, 16, 32, 64, 96, 128, 256)
DTYPES = ("f32", "f16", "bf16")

# Feature settings that open every branch of the families' grids (regular, skewed, hubby,
# short and long rows); None gives each family's default grid.
_FEATURES = (
    None,
    {"row_mean": 3.0, "row_max": 8, "row_cv": 0.3},
    {"row_mean": 12.0, "row_max": 40, "row_cv": 0.4},
    {"row_mean": 60.0, "row_max": 90, "row_cv": 0.2},
    {"row_mean": 5.0, "row_max": 300, "row_cv": 1.6},
    {"row_mean": 30.0, "row_max": 4000, "row_cv": 2.5},
    {"row_mean": 3.0, "row_max": 50000, "row_cv": 70.0},
)


def request(op: str, dtype: str, n: int) -> str:
    """What the caller asks for, as the start of the plan line."""
    return f"{PLAN_PREFIX} op={op} dtype={dtype} n={n}"


def prompt_text(op: str, dtype: str, n: int) -> str:
    return request(op, dtype, n)


def completion_text(source: str, op: str, dtype: str, n: int) -> str:
    """The part of a compact source after the request; raises if the source does not start with it."""
    head = request(op, dtype, n)
    if not source.startswith(head):
        raise ValueError(f"completion_text: the source does not start with {head!r} (got {source[:60]!r})")
    return source[len(head):]


def render_compact(family: str, params: dict, op: str, dtype: str, n: int) -> str:
    return fam.render(family, params, op=op, dtype=dtype, n=n, compact=True).source


def problems(ns_spmm=SPMM_NS, dtypes=DTYPES) -> list[tuple[str, str, int]]:
    return [(op, dt, n) for dt in dtypes for op, n in
            [("spmv", 1)] + [("spmm", n) for n in ns_spmm]]


def kernel_documents(ns_spmm=SPMM_NS, dtypes=DTYPES) -> list[tuple[str, str, int, str, dict, str]]:
    """Every distinct compact source of the families' grids: (op, dtype, n, family, params, text)."""
    out, seen = [], set()
    for op, dtype, n in problems(ns_spmm, dtypes):
        for features in _FEATURES:
            for family, params in fam.space(op, dtype, n, features):
                text = render_compact(family, params, op, dtype, n)
                if text not in seen:
                    seen.add(text)
                    out.append((op, dtype, n, family, params, text))
    return out


def cuda_include_dir() -> Path | None:
    """The CUDA toolkit's include folder with CUB (``$CUDA_HOME/include``, or beside the nvcc on PATH)."""
    homes = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    nvcc = shutil.which("nvcc")
    if nvcc:
        homes.append(str(Path(nvcc).resolve().parents[1]))
    homes.append("/usr/local/cuda")
    for home in filter(None, homes):
        inc = Path(home) / "include"
        if (inc / "cccl").is_dir() or (inc / "cub").is_dir():
            return inc
    return None


def cuda_documents(max_bytes: int = 4_000_000, seed: int = 0) -> list[str]:
    """CUB and Thrust headers from the installed toolkit (none if there is no toolkit)."""
    inc = cuda_include_dir()
    if inc is None:
        return []
    roots = [p for p in (inc / "cccl" / "cub", inc / "cub", inc / "cccl" / "thrust", inc / "thrust") if p.is_dir()]
    files = sorted({f.resolve() for r in roots for f in itertools.chain(r.rglob("*.cuh"), r.rglob("*.h"))})
    random.Random(seed).shuffle(files)
    docs, total = [], 0
    for path in files:
        try:
            text = path.read_text(errors="replace")
        except OSError:
            continue
        if total + len(text) > max_bytes:
            continue
        docs.append(text)
        total += len(text)
    return docs


def iter_texts(kernels: list, cuda: list[str], per_family: int = 256) -> Iterator[str]:
    """Tokenizer training text: the kernels, each (family, op) repeated up to ``per_family``
    documents so that rare families' bodies get merged as well as common ones, then the CUDA."""
    groups: dict[tuple[str, str], list[str]] = {}
    for doc in kernels:
        groups.setdefault((doc[3], doc[0]), []).append(doc[-1])
    for docs in groups.values():
        reps = max(1, -(-per_family // len(docs)))
        for _ in range(reps):
            yield from docs
    yield from cuda
