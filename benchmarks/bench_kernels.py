#!/usr/bin/env python3
"""Kernel benchmark: the exhaustive autotuner's best kernel (the oracle) against cuSPARSE.

For every cell (matrix, op, n, dtype) of a declared grid, calls
``torch_sparserl.specialize.autotune.tune`` and records the best correct kernel, cuSPARSE's time in the
same run, the speedup with and without the cuSPARSE fallback, and both times as a fraction of
the memory-bandwidth floor (:func:`floor_bytes`). Results are checkpointed after every cell, so
a run cut into chunks of under 10 minutes resumes where it stopped::

    python benchmarks/bench_kernels.py --quick                       # smoke run, ~1 minute
    python benchmarks/bench_kernels.py --max-time-s 540 --resume     # one chunk of the full grid
    python benchmarks/bench_kernels.py --list                        # the cells, nothing run
    python benchmarks/bench_kernels.py --report RESULTS.json         # re-render its .md and .svg

``--report`` needs neither a GPU nor the autotuner: the summary and the plot are functions of
the results file.

Exit status: 0 when every selected cell is done, 3 when cells remain (time limit reached or
cells that failed, to run again with ``--resume``), 4 when the CUDA context broke (the next
process resumes), 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as dt
import functools
import hashlib
import importlib
import json
import math
import os
import shutil
import statistics
import sys
import time
import traceback
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Callable, Iterable

import numpy as np

REPO = Path(__file__).resolve().parents[1]
# The common core, and this checkout's torch_sparserl (the code under test) ahead of any
# installed copy, also when run as a script from anywhere.
for _path in (str(REPO), str(Path(__file__).resolve().parent)):
    if _path not in sys.path:
        sys.path.insert(0, _path)
from common import (SMALL_SYNTHETIC, SYNTHETIC, MatrixEntry, dumps, environment, geomean, header,  # noqa: E402
                    matrix_list, plots, row, save_json, select_matrices, shared_matrices_dir, usage_error,
                    write_text_atomic)

DEFAULT_OUT = Path(__file__).resolve().parent / "results"

SCHEMA = "torch_sparserl.bench_kernels/1"
VALUE_BYTES = {"f32": 4, "f16": 2, "bf16": 2}
INDEX_BYTES = 4  # the kernel ABI takes int32 rowptr and col
GROUPS = ("real", "synthetic")
DONE_STATUSES = ("ok", "no_kernel")  # an "error" or "transient" cell is run again on --resume

# ------------------------------------------------------------------------------- the grid

QUICK = {"matrices": ["cora", "rajat01", "rmat-s12-ef8"], "ops": ["spmv", "spmm"], "n": [1, 32],
         "dtypes": ["f32"], "budget_s": 5.0}
DEFAULT_OPS = "spmv,spmm"
DEFAULT_N = "1,16,32,64,128,256"   # n=1 is spmv, n>1 spmm
DEFAULT_DTYPES = "f32"
DEFAULT_BUDGET_S = 20.0
# the cap of a cell's scaled screening budget (--max-budget-s)
DEFAULT_MAX_BUDGET_S = 600.0
DEFAULT_TUNE = "torch_sparserl.specialize.autotune:tune"
COPY_BYTES = 1 << 30               # the copy-bandwidth probe's buffer


@dataclasses.dataclass(frozen=True)
class Cell:
    matrix: str
    op: str
    n: int
    dtype: str

    @property
    def key(self) -> str:
        return f"{self.matrix}|{self.op}|n={self.n}|{self.dtype}"


def op_n_pairs(ops: Iterable[str], ns: Iterable[int]) -> list[tuple[str, int]]:
    """spmv runs at n=1 (when 1 is among ``ns``), spmm at every n > 1."""
    ops, ns = list(ops), sorted(set(ns))
    pairs = [("spmv", 1)] if "spmv" in ops and 1 in ns else []
    return pairs + [("spmm", n) for n in ns if n > 1 and "spmm" in ops]


def grid_cells(matrices: list[MatrixEntry], ops, ns, dtypes) -> list[Cell]:
    """Matrix-major, so each (possibly generated) matrix is built once per process."""
    return [Cell(m.name, op, n, dtype) for m in matrices for dtype in dtypes for op, n in op_n_pairs(ops, ns)]


# ------------------------------------------------------------------------------- the device

def measure_copy_bandwidth(nbytes: int = COPY_BYTES, repeats: int = 20) -> float | None:
    """Device-to-device ``dst.copy_(src)`` in GB/s, counting bytes read plus bytes written
    (median of ``repeats``, CUDA events); None without a GPU."""
    import torch

    if not torch.cuda.is_available():
        return None
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    src.fill_(1)
    for _ in range(3):
        dst.copy_(src)
    times_ms = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times_ms.append(start.elapsed_time(end))
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / (statistics.median(times_ms) * 1e-3) / 1e9


def _cuda_context_broken() -> bool:
    """After an exception: can this process still run CUDA work? A kernel that faulted
    poisons the context, and every later cell would fail for that reason alone."""
    import torch

    if not torch.cuda.is_available():
        return False
    try:
        torch.ones(1, device="cuda").add_(1)
        torch.cuda.synchronize()
        return False
    except Exception:  # noqa: BLE001 - any failure here means the context is unusable
        return True


# --------------------------------------------------------------------------------- records

def record_to_dict(record) -> dict | None:
    """An ``EvalRecord`` (or anything like it) as a JSON-ready dict."""
    if record is None:
        return None
    if hasattr(record, "to_json"):
        data = record.to_json()
        return json.loads(data) if isinstance(data, (str, bytes)) else dict(data)
    if dataclasses.is_dataclass(record):
        return dataclasses.asdict(record)
    if isinstance(record, dict):
        return dict(record)
    return {k: v for k, v in vars(record).items() if not k.startswith("_")}


def _usable(record) -> bool:
    runtime = getattr(record, "runtime_us", None)
    return (record is not None and bool(getattr(record, "correct", False))
            and runtime is not None and runtime > 0)


def matrix_meta(entry: MatrixEntry, matrix, load_s: float) -> dict:
    lengths = np.diff(matrix.indptr)
    digest = hashlib.sha1()
    for array in (np.asarray(matrix.shape, dtype=np.int64), matrix.indptr.astype(np.int64),
                  matrix.indices.astype(np.int32)):
        digest.update(np.ascontiguousarray(array).tobytes())
    mean = float(lengths.mean()) if lengths.size else 0.0
    return {"group": entry.group, "origin": entry.origin, "source": entry.source,
            "rows": int(matrix.shape[0]), "cols": int(matrix.shape[1]), "nnz": int(matrix.nnz),
            "distinct_cols": distinct_columns(matrix),
            "row_len_mean": mean, "row_len_max": int(lengths.max()) if lengths.size else 0,
            "row_len_cv": float(lengths.std() / mean) if mean else 0.0,
            "pattern_sha1": digest.hexdigest(), "load_s": round(load_s, 3)}


def transient_failures(table) -> int:
    """How many of a cell's evaluations failed for want of the device (``TRANSIENT_KINDS``:
    another process held its memory), not for the candidate. Such a cell's oracle may have
    missed its best candidate, so it is no label: it is recorded ``transient`` and run again on
    ``--resume``, and its rows stay out of the tables."""
    from torch_sparserl.evaluate.record import TRANSIENT_KINDS

    names = {kind.value for kind in TRANSIENT_KINDS}

    def kind(record) -> str | None:
        value = getattr(record, "error_kind", None)
        return getattr(value, "value", value)  # an ErrorKind, or its value as a string

    return sum(1 for r in table if kind(r) in names)


def cell_record(cell: Cell, meta: dict, result, copy_bw: float | None, budget_s: float, wall_s: float,
                run_index: int, cell_id: str) -> dict:
    table = list(getattr(result, "table", None) or [])
    transient = transient_failures(table)
    best = getattr(result, "best", None)
    cusparse_us = getattr(result, "cusparse_us", None)
    if cusparse_us is None and best is not None:
        cusparse_us = getattr(best, "cusparse_us", None)
    oracle_us = float(best.runtime_us) if _usable(best) else None
    nbytes = floor_bytes(meta["rows"], meta["nnz"], meta["distinct_cols"], cell.n,
                                VALUE_BYTES[cell.dtype])
    floor_time = floor_us(nbytes, copy_bw)
    record = {"key": cell.key, "matrix": cell.matrix, "group": meta["group"], "op": cell.op, "n": cell.n,
              "dtype": cell.dtype, "status": "transient" if transient else "ok" if oracle_us else "no_kernel",
              "cusparse_us": cusparse_us, "oracle_us": oracle_us,
              "best_family": getattr(best, "family", None) if oracle_us else None}
    record.update(cell_metrics(cusparse_us, oracle_us, floor_time))
    record.update({"floor_bytes": nbytes, "floor_us": floor_time, "copy_bandwidth_GBps": copy_bw,
                   "budget_s": budget_s, "screen_budget_s": getattr(result, "budget_s", None),
                   "tune_elapsed_s": getattr(result, "elapsed_s", None),
                   "wall_s": round(wall_s, 3), "evaluated": len(table),
                   "screened": getattr(result, "screened", None), "space_size": getattr(result, "candidates", None),
                   "budget_exhausted": getattr(result, "budget_exhausted", None),
                   "compiled": sum(1 for r in table if getattr(r, "compiled", False)),
                   "correct": sum(1 for r in table if getattr(r, "correct", False)),
                   "transient_failures": transient,
                   "best": record_to_dict(best), "error": None, "run": run_index, "cell_id": cell_id,
                   "finished": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")})
    return record


# ----------------------------------------------------------------------------------- metrics

# The memory-bandwidth floor of one product (int32 indices; ``s`` bytes per value):
#
#     bytes = 4·(rows+1)              rowptr
#           + 4·nnz + s·nnz           column indices and values
#           + s·distinct_cols·n       X: each column index that occurs selects one row of X,
#                                     which every algorithm must read at least once
#           + s·rows·n                Y: every output element written once
#     floor_us = bytes / copy_bandwidth
#
# ``copy_bandwidth`` is the device-to-device ``copy_`` rate measured in the same run (bytes read
# plus bytes written, per second). ``*_floor_frac = floor_us / measured_us``: 1.0 would be a
# kernel that moves only the compulsory bytes at copy speed.

def distinct_columns(matrix) -> int:
    """Number of columns holding at least one nonzero (rows of X a product must read)."""
    import numpy as np

    if matrix.nnz == 0:
        return 0
    return int(np.count_nonzero(np.bincount(matrix.indices, minlength=matrix.shape[1])))


def floor_bytes(rows: int, nnz: int, distinct_cols: int, n: int, value_bytes: int) -> int:
    """Bytes every algorithm must move for ``Y = A @ X`` (the floor, above)."""
    return (INDEX_BYTES * (rows + 1) + (INDEX_BYTES + value_bytes) * nnz
            + value_bytes * distinct_cols * n + value_bytes * rows * n)


def floor_us(nbytes: int, copy_bandwidth_GBps: float | None) -> float | None:
    if not copy_bandwidth_GBps or copy_bandwidth_GBps <= 0:
        return None
    return nbytes / (copy_bandwidth_GBps * 1e3)  # GB/s = 1e3 bytes/µs


def _positive(value) -> float | None:
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) and value > 0 else None


def cell_metrics(cusparse_us, oracle_us, floor_time_us) -> dict:
    """Speedups and floor fractions of one cell.

    ``speedup`` is cuSPARSE time over the oracle's (None without a correct kernel);
    ``speedup_with_fallback`` is ``max(1, speedup)`` (1 without a kernel): the runtime serves
    cuSPARSE whenever the best kernel is slower.
    """
    cusparse_us, oracle_us, floor_time_us = map(_positive, (cusparse_us, oracle_us, floor_time_us))
    speedup = cusparse_us / oracle_us if cusparse_us and oracle_us else None
    best_us = min(t for t in (cusparse_us, oracle_us) if t) if (cusparse_us or oracle_us) else None
    return {
        "speedup": speedup,
        "speedup_with_fallback": max(1.0, speedup) if speedup is not None else 1.0,
        "best_with_fallback_us": best_us,
        "oracle_floor_frac": floor_time_us / oracle_us if floor_time_us and oracle_us else None,
        "cusparse_floor_frac": floor_time_us / cusparse_us if floor_time_us and cusparse_us else None,
    }


def summarize(cells: Iterable[dict]) -> list[dict]:
    """One row per (op, n, dtype, group) over the finished cells.

    ``slower_than_cusparse`` counts the matrices where the oracle alone (no fallback) would
    lose: a slower best kernel, or no correct kernel at all (also counted in ``no_kernel``).
    """
    buckets: dict[tuple, list[dict]] = defaultdict(list)
    for cell in cells:
        if cell.get("status") in DONE_STATUSES:
            buckets[(cell["op"], cell["n"], cell["dtype"], cell["group"])].append(cell)
    rows = []
    for (op, n, dtype, group), members in sorted(buckets.items(), key=lambda kv: _order_key(*kv[0])):
        speedups = [c.get("speedup") for c in members]
        rows.append({
            "op": op, "n": n, "dtype": dtype, "group": group, "cells": len(members),
            "speedup_geomean": geomean(speedups),
            "speedup_with_fallback_geomean": geomean(c.get("speedup_with_fallback") for c in members),
            "slower_than_cusparse": sum(1 for s in speedups if s is None or s < 1.0),
            "no_kernel": sum(1 for s in speedups if s is None),
            "oracle_floor_frac_geomean": geomean(c.get("oracle_floor_frac") for c in members),
            "cusparse_floor_frac_geomean": geomean(c.get("cusparse_floor_frac") for c in members),
        })
    return rows


def _order_key(op, n, dtype, group="real"):
    dtype_order = list(VALUE_BYTES).index(dtype) if dtype in VALUE_BYTES else 99
    group_order = GROUPS.index(group) if group in GROUPS else 99
    return (dtype_order, 0 if op == "spmv" else 1, n, group_order)


# ------------------------------------------------------------------------------- JSON document

def new_document(env: dict) -> dict:
    return {"schema": SCHEMA, "env": env, "runs": [], "matrices": {}, "cells": []}


def load(path: str | os.PathLike) -> dict:
    with open(path, encoding="utf-8") as f:
        document = json.load(f)
    if document.get("schema") != SCHEMA:
        raise ValueError(f"{path} is not a bench_kernels results file "
                         f"(schema {document.get('schema')!r}, expected {SCHEMA!r})")
    return document


def companion(json_path: str | os.PathLike, suffix: str) -> Path:
    """``kernels-x.json`` → ``kernels-x.md`` / ``kernels-x.svg`` / ``kernels-x-tables.jsonl``."""
    json_path = Path(json_path)
    stem = json_path.name[:-5] if json_path.name.endswith(".json") else json_path.name
    return json_path.with_name(stem + suffix)


# ----------------------------------------------------------------------------------- runner

class _Progress:
    """tqdm when it is installed, plain lines otherwise."""

    def __init__(self, total: int, enabled: bool = True):
        self.total, self.done, self.bar = total, 0, None
        self.enabled = enabled
        if enabled:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, unit="cell", dynamic_ncols=True, file=sys.stderr)
            except ImportError:
                self.bar = None

    def start(self, cell: Cell) -> None:
        if self.bar is not None:
            self.bar.set_description(cell.key)

    def finish(self, line: str) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.write(line)
            self.bar.update(1)
        elif self.enabled:
            print(f"[{self.done}/{self.total}] {line}", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


@dataclasses.dataclass
class RunOutcome:
    results_path: Path
    ran: int          # cells run in this call
    skipped: int      # cells already done (resume)
    remaining: int    # selected cells not done when the call returned
    errors: int       # cells that raised in this call
    stopped: str | None  # "time" | "cuda" | None

    @property
    def exit_code(self) -> int:
        if self.stopped == "cuda":
            return 4
        return 3 if self.remaining else 0


def results_path_for(out_dir: Path, env: dict, date: dt.date | None = None) -> Path:
    date = date or dt.date.today()
    return out_dir / f"kernels-{env.get('gpu_slug') or 'cpu'}-{date.isoformat()}.json"


def _line(record: dict) -> str:
    if record["status"] == "error":
        return f"{record['key']}: error: {str(record['error']).splitlines()[-1][:160]}"
    if record["status"] == "transient":
        return (f"{record['key']}: {record['transient_failures']} evaluation(s) found no free device memory: "
                "no label, run again with --resume")
    frac = record.get("oracle_floor_frac")
    return (f"{record['key']}: speedup {_fmt_x(record['speedup'])} "
            f"(oracle {record['oracle_us'] or float('nan'):.1f} us, cuSPARSE {record['cusparse_us'] or float('nan'):.1f} us"
            f"{'' if frac is None else f', {100 * frac:.0f}% of floor'}) in {record['wall_s']:.1f} s")


def run_grid(matrices: list[MatrixEntry], cells: list[Cell], tune_fn: Callable, results_path: Path, *,
             budget_s: float, sandbox=None, resume: bool = False,
             max_time_s: float | None = None, copy_bandwidth_GBps: float | None = None,
             env: dict | None = None, argv: list[str] | None = None, tables: bool = True,
             progress: bool = True, dtype_arg: Callable[[str], object] | None = None) -> RunOutcome:
    """Run ``tune_fn`` on every cell not yet done and checkpoint after each one.

    ``tune_fn(matrix, op=, n=, dtype=, budget_s=, sandbox=)`` is the autotuner (injected, so
    tests pass a fake); ``sandbox`` is handed to it as is (a shared
    ``torch_sparserl.evaluate.sandbox.Sandbox``, or None: tune starts its own per call);
    ``dtype_arg`` maps "f32"/"f16"/"bf16" to what it takes (the names themselves by default). The results file, and its ``.md``, ``.svg`` and ``-tables.jsonl``, are
    rewritten after every cell; with ``resume``, cells already "ok" or "no_kernel" in it are
    skipped and "error" and "transient" cells (:func:`transient_failures`) run again.
    """
    started = time.monotonic()
    results_path = Path(results_path)
    results_path.parent.mkdir(parents=True, exist_ok=True)
    if results_path.exists():
        if not resume:
            raise FileExistsError(f"bench_kernels: {results_path} exists; pass --resume to continue it "
                                  "(or --out another folder)")
        document = load(results_path)
    else:
        document = new_document(env or {})
    if env:
        if document.get("env", {}).get("gpu") and env.get("gpu") != document["env"]["gpu"]:
            raise ValueError(f"bench_kernels: {results_path} holds results of {document['env']['gpu']}, "
                             f"this is {env.get('gpu')}: use another results file")
        document["env"] = env  # the latest run's; each run also keeps its own below
    dtype_arg = dtype_arg or str  # the ABI's names "f32", "f16", "bf16" (tune also takes torch dtypes)
    run_index = len(document["runs"])
    document["runs"].append({"started": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                             "argv": list(argv or []), "copy_bandwidth_GBps": copy_bandwidth_GBps,
                             "budget_s": budget_s, "sandbox": "per-cell" if sandbox is None else "shared",
                             "env": env or {}})
    done = {c["key"] for c in document["cells"] if c.get("status") in DONE_STATUSES}
    todo = [c for c in cells if c.key not in done]
    skipped = len(cells) - len(todo)
    entries = {m.name: m for m in matrices}
    tables_path = companion(results_path, "-tables.jsonl")
    bar = _Progress(len(todo), enabled=progress)
    ran = errors = 0
    stopped = None
    longest_cell_s = 0.0
    loaded_name, loaded_matrix = None, None
    try:
        for cell in todo:
            elapsed = time.monotonic() - started
            # The budget bounds the screening only; the finalists' full evaluation comes on top.
            estimate = max(1.5 * budget_s + 15.0, longest_cell_s)
            if max_time_s is not None and elapsed + estimate > max_time_s:
                stopped = "time"
                break
            bar.start(cell)
            cell_started = time.monotonic()
            entry = entries[cell.matrix]
            if loaded_name != cell.matrix:
                loaded_name, loaded_matrix = None, None  # free the last one before building the next
                load_started = time.monotonic()
                loaded_matrix = entry.load()
                loaded_name = cell.matrix
                meta = matrix_meta(entry, loaded_matrix, time.monotonic() - load_started)
                previous = document["matrices"].get(cell.matrix)
                if previous and previous.get("pattern_sha1") != meta["pattern_sha1"]:
                    raise RuntimeError(f"bench_kernels: matrix {cell.matrix!r} differs from the one in "
                                       f"{results_path} (pattern hash changed): use another results file")
                document["matrices"][cell.matrix] = meta
            meta = document["matrices"][cell.matrix]
            cell_id = uuid.uuid4().hex[:12]
            try:
                result = tune_fn(loaded_matrix, op=cell.op, n=cell.n, dtype=dtype_arg(cell.dtype),
                                 budget_s=budget_s, sandbox=sandbox)
            except Exception as exc:  # noqa: BLE001 - recorded, the grid goes on
                errors += 1
                record = {"key": cell.key, "matrix": cell.matrix, "group": meta["group"], "op": cell.op,
                          "n": cell.n, "dtype": cell.dtype, "status": "error",
                          "error": "".join(traceback.format_exception_only(type(exc), exc)).strip()
                                   + "\n" + traceback.format_exc()[-2000:],
                          "budget_s": budget_s, "wall_s": round(time.monotonic() - cell_started, 3),
                          "run": run_index, "cell_id": cell_id,
                          "finished": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}
                if _cuda_context_broken():
                    stopped = "cuda"
            else:
                wall = time.monotonic() - cell_started
                record = cell_record(cell, meta, result, copy_bandwidth_GBps, budget_s, wall, run_index, cell_id)
                if tables and record["status"] != "transient":
                    with open(tables_path, "a", encoding="utf-8") as f:
                        for rec in getattr(result, "table", None) or []:
                            f.write(dumps({"cell": cell.key, "cell_id": cell_id, **(record_to_dict(rec) or {})})
                                    + "\n")
            longest_cell_s = max(longest_cell_s, time.monotonic() - cell_started)
            document["cells"] = [c for c in document["cells"] if c["key"] != cell.key] + [record]
            save_json(document, results_path)
            write_reports(document, results_path)
            ran += 1
            bar.finish(_line(record))
            if stopped == "cuda":
                break
    finally:
        bar.close()
        save_json(document, results_path)
        write_reports(document, results_path)
    done = {c["key"] for c in document["cells"] if c.get("status") in DONE_STATUSES}
    remaining = sum(1 for c in cells if c.key not in done)
    return RunOutcome(results_path, ran, skipped, remaining, errors, stopped)


# ------------------------------------------------------------------------------- summary

def _fmt_x(value: float | None) -> str:
    if value is None:
        return "—"
    return f"{value:.2f}×" if value < 10 else f"{value:.1f}×"


def _fmt_pct(value: float | None) -> str:
    return "—" if value is None else f"{100 * value:.0f}%"


def _columns(cells: list[dict]) -> list[tuple[str, int]]:
    return sorted({(c["op"], c["n"]) for c in cells}, key=lambda on: (0 if on[0] == "spmv" else 1, on[1]))


def _column_title(op: str, n: int) -> str:
    return "spmv" if op == "spmv" else f"spmm n={n}"


def _cell_text(cell: dict | None) -> str:
    if cell is None:
        return ""
    status = cell.get("status")
    if status == "error":
        return "error"
    if status == "transient":
        return "rerun: device memory"
    cus = _fmt_pct(cell.get("cusparse_floor_frac"))
    if status == "no_kernel" or cell.get("speedup") is None:
        return f"no kernel · cuS {cus}"
    return f"**{_fmt_x(cell['speedup'])}** · {_fmt_pct(cell.get('oracle_floor_frac'))} / {cus}"


def _matrix_order(document: dict, cells: list[dict]) -> list[str]:
    matrices = document.get("matrices", {})
    names = list(dict.fromkeys(c["matrix"] for c in cells))
    group_of = {name: matrices.get(name, {}).get("group", "real") for name in names}
    return sorted(names, key=lambda m: (GROUPS.index(group_of[m]) if group_of[m] in GROUPS else 9,
                                        -int(matrices.get(m, {}).get("nnz", 0)), m))


def markdown(document: dict) -> str:
    env = document.get("env", {})
    cells = document.get("cells", [])
    runs = document.get("runs", [])
    lines = [f"# Kernel benchmarks: oracle autotuner vs cuSPARSE — {env.get('gpu', '?')}", ""]
    bandwidths = [r.get("copy_bandwidth_GBps") for r in runs if r.get("copy_bandwidth_GBps")]
    lines += [
        f"- GPU: {env.get('gpu', '?')} (driver {env.get('driver', '?')}, clocks as found: "
        f"SM {env.get('clocks', {}).get('sm_mhz', '?')} MHz, memory {env.get('clocks', {}).get('mem_mhz', '?')} MHz; "
        "not changed by the benchmark)",
        f"- torch {env.get('torch', '?')}, CUDA {env.get('cuda', '?')}, Python {env.get('python', '?')}",
        f"- runs: {len(runs)} (first {runs[0].get('started', '?') if runs else '?'}, "
        f"last {runs[-1].get('started', '?') if runs else '?'}); device-to-device copy bandwidth "
        + (", ".join(f"{b:.0f}" for b in bandwidths) + " GB/s (read + write, per run)" if bandwidths else "not measured"),
        "- commands: " + "; ".join(f"`{' '.join(r.get('argv', []))}`" for r in runs[-3:]) if runs else "- commands: none",
        "",
        "Cells: **speedup** of the oracle (best correct kernel of the exhaustive autotuner) over cuSPARSE "
        "measured in the same run · oracle's fraction of the memory-bandwidth floor / cuSPARSE's. "
        "“no kernel”: no correct candidate (the runtime serves cuSPARSE). "
        "With fallback, each speedup is max(1, speedup). Floor: compulsory bytes "
        "(rowptr, col, val, the rows of X that some column index selects, Y) at the copy bandwidth.",
        "",
        "## Geometric means",
        "",
        *header(["op", "n", "dtype", "group", "matrices", "speedup (geomean)", "with fallback",
                 "slower than cuSPARSE (no kernel)", "oracle % of floor", "cuSPARSE % of floor"]),
    ]
    for r in summarize(cells):
        lines.append(row([r["op"], r["n"], r["dtype"], r["group"], r["cells"], _fmt_x(r["speedup_geomean"]),
                          _fmt_x(r["speedup_with_fallback_geomean"]), f"{r['slower_than_cusparse']} ({r['no_kernel']})",
                          _fmt_pct(r["oracle_floor_frac_geomean"]), _fmt_pct(r["cusparse_floor_frac_geomean"])]))
    matrices = document.get("matrices", {})
    for dtype in sorted({c["dtype"] for c in cells}, key=lambda d: _order_key("spmv", 1, d)):
        dcells = [c for c in cells if c["dtype"] == dtype]
        columns = _columns(dcells)
        by_key = {(c["matrix"], c["op"], c["n"]): c for c in dcells}
        lines += ["", f"## {dtype}: speedup · oracle / cuSPARSE % of floor", "",
                  *header(["matrix", "group", "rows", "nnz", *(_column_title(*on) for on in columns)])]
        for name in _matrix_order(document, dcells):
            meta = matrices.get(name, {})
            lines.append(row([name, meta.get("group", "?"), meta.get("rows", "?"), meta.get("nnz", "?"),
                              *(_cell_text(by_key.get((name, *on))) for on in columns)]))
    errors = [c for c in cells if c.get("status") == "error"]
    if errors:
        lines += ["", "## Errors", ""]
        lines += [f"- `{c['key']}`: {str(c.get('error', '')).splitlines()[0][:200] if c.get('error') else '?'}"
                  for c in errors]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------- plot

_LABEL_CHARS = 26  # matrix names on the plot are cut to this


def _short(name: str) -> str:
    return name if len(name) <= _LABEL_CHARS else name[:_LABEL_CHARS - 1] + "…"


def _ticks(lo_exp: int, hi_exp: int) -> list[float]:
    ticks = []
    for e in range(lo_exp, hi_exp + 1):
        ticks += [10.0 ** e] + ([2 * 10.0 ** e, 5 * 10.0 ** e] if hi_exp - lo_exp <= 2 and e < hi_exp else [])
    return ticks


def plot(document: dict) -> str:
    """Bars of the speedup per matrix on a log scale from 1×, one panel per (op, n, dtype), green
    faster and red slower than cuSPARSE; a grey × where no correct kernel was found (or the cell
    failed); a dashed line between the real and the synthetic matrices. Each bar's id is
    ``speedup-<i>``, each ×'s ``missing-<i>``."""
    cells = [c for c in document.get("cells", []) if c.get("status") in DONE_STATUSES + ("error",)]
    panels = sorted({(c["op"], c["n"], c["dtype"]) for c in cells}, key=lambda k: _order_key(*k))
    names = _matrix_order(document, cells)
    matrices = document.get("matrices", {})
    speedups = [c["speedup"] for c in cells if c.get("speedup")]
    lo_exp = min(-1, math.floor(math.log10(min(speedups)))) if speedups else -1
    hi_exp = max(1, math.ceil(math.log10(max(speedups)))) if speedups else 1
    fig, axes = plots.figure("Oracle speedup over cuSPARSE (log scale) — " + str(document.get("env", {}).get("gpu", "?")),
                             width=max(6.4, 1.5 + 0.3 * len(names)), height=1.0 + 3.2 * max(1, len(panels)),
                             rows=max(1, len(panels)))
    if not panels:
        plots.no_results(axes[0])
        return plots.to_svg(fig)
    summary = {(r["op"], r["n"], r["dtype"], r["group"]): r for r in summarize(cells)}
    groups = [matrices.get(name, {}).get("group", "real") for name in names]
    bars = missing = 0
    for ax, (op, n, dtype) in zip(axes, panels):
        means = ", ".join(f"{g} geomean {_fmt_x(summary[(op, n, dtype, g)]['speedup_geomean'])}"
                          for g in GROUPS if (op, n, dtype, g) in summary)
        ax.set_title(f"{_column_title(op, n)} {dtype}" + (f" — {means}" if means else ""), loc="left", fontsize=9)
        plots.times_axis(ax, _ticks(lo_exp, hi_exp), log=True)
        by_matrix = {c["matrix"]: c for c in cells if (c["op"], c["n"], c["dtype"]) == (op, n, dtype)}
        for i, name in enumerate(names):
            if i and groups[i] != groups[i - 1]:
                ax.axvline(i - 0.5, color="#757575", linestyle="--", linewidth=1)
            cell = by_matrix.get(name)
            if cell is None:
                continue
            speedup = cell.get("speedup")
            if not speedup:
                ax.text(i, 1.0, "×", ha="center", va="bottom", color=plots.MISSING, fontweight="bold",
                        gid=f"missing-{missing}")
                missing += 1
                continue
            clipped = min(max(speedup, 10.0 ** lo_exp), 10.0 ** hi_exp)
            (bar,) = ax.bar(i, clipped - 1.0, 0.75, bottom=1.0, color=plots.FASTER if speedup >= 1 else plots.SLOWER)
            bar.set_gid(f"speedup-{bars}")
            bars += 1
        plots.unity(ax)
        ax.set_ylim(10.0 ** lo_exp, 10.0 ** hi_exp)
        ax.set_xticks(range(len(names)), [_short(name) for name in names], rotation=60, ha="right", fontsize=7)
        ax.set_xlim(-0.6, len(names) - 0.4)
    return plots.to_svg(fig)


def write_reports(document: dict, json_path: str | os.PathLike) -> tuple[Path, Path]:
    """Write the ``.md`` and ``.svg`` beside ``json_path``; returns their paths."""
    md_path, svg_path = companion(json_path, ".md"), companion(json_path, ".svg")
    write_text_atomic(md_path, markdown(document))
    write_text_atomic(svg_path, plot(document))
    return md_path, svg_path


# -------------------------------------------------------------------------------------- CLI

def _warm_up(tune_fn: Callable, sandbox) -> None:
    """Start the sandbox's worker (CUDA context, imports, the build stage) before the grid.

    tune's budget clock includes that start, which would leave the first cell of a run time
    to screen few of its candidates where the later cells screen all of theirs. Not recorded."""
    import scipy.sparse

    started = time.monotonic()
    tiny = scipy.sparse.identity(64, dtype=np.float32, format="csr")
    try:
        tune_fn(tiny, op="spmv", n=1, dtype="f32", budget_s=0.0, sandbox=sandbox)
    except Exception as exc:  # noqa: BLE001 - the grid's cells will report the real failure
        print(f"bench_kernels: warm-up failed: {exc}", file=sys.stderr)
    print(f"sandbox warm-up: {time.monotonic() - started:.1f} s", file=sys.stderr)


def _csv(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def load_tune(dotted: str) -> Callable:
    module_name, _, attr = dotted.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise usage_error(f"bench_kernels: cannot import the autotuner {dotted!r} ({exc}); "
                         "pass --tune module:function") from exc
    try:
        return getattr(module, attr or "tune")
    except AttributeError:
        raise usage_error(f"bench_kernels: {module_name} has no {attr or 'tune'!r}") from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="bench_kernels.py", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Oracle (exhaustive autotuner) vs cuSPARSE over matrices x ops x n x dtypes; "
                    "JSON + Markdown + SVG results, checkpointed after every cell.",
        epilog="Matrices: the real ones in $SPARSERL_SHARED or ../shared/matrices (or shared/matrices in "
               "the repo), the package's shipped ones, and synthetic ones generated at run time: "
               + ", ".join(f"{k} ({v})" for k, v in {**SYNTHETIC, **SMALL_SYNTHETIC}.items())
               + ".\nExit status: 0 all selected cells done, 3 cells remain (run again with --resume), "
                 "4 CUDA context broke (run again with --resume).")
    parser.add_argument("--matrices", type=matrix_list, default=None,
                        help="comma-separated names or globs ('real' and 'synthetic' name the groups), "
                             "generator specs like rmat:scale=16,edge_factor=8, or .npz/.mtx "
                             "paths; default: every real matrix and the large synthetic ones")
    parser.add_argument("--ops", type=_csv, default=None, help=f"spmv and/or spmm (default {DEFAULT_OPS})")
    parser.add_argument("--n", type=_csv, default=None,
                        help=f"dense columns; 1 = spmv, >1 = spmm (default {DEFAULT_N})")
    parser.add_argument("--dtypes", type=_csv, default=None,
                        help=f"f32, f16, bf16 (default {DEFAULT_DTYPES})")
    parser.add_argument("--budget-s", type=float, default=None,
                        help=f"autotuning budget per (matrix, op, n, dtype) cell (default {DEFAULT_BUDGET_S:g})")
    parser.add_argument("--quick", action="store_true",
                        help=f"smoke run: {', '.join(QUICK['matrices'])}; spmv and spmm n=32; f32; "
                             f"{QUICK['budget_s']:g} s per cell (explicit options still win)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results folder (default benchmarks/results)")
    parser.add_argument("--resume", nargs="?", const="latest", default=None, metavar="RESULTS_JSON",
                        help="continue a results file: skip its done cells, rerun its errors. Without a "
                             "path: the newest kernels-<gpu>-*.json in --out; with a path elsewhere, it is "
                             "copied into --out (with its -tables.jsonl) and continued there")
    parser.add_argument("--max-budget-s", type=float, default=DEFAULT_MAX_BUDGET_S,
                        help="let a cell's screening budget grow to screen every candidate at the pace of "
                             f"its first, up to this many seconds (default {DEFAULT_MAX_BUDGET_S:g}; the "
                             "--budget-s value is the floor); 0 keeps --budget-s fixed")
    parser.add_argument("--max-time-s", type=float, default=None,
                        help="start no cell that might end past this many seconds (e.g. 540 for a "
                             "10-minute device call); exit 3 when cells remain")
    parser.add_argument("--sandbox", choices=("shared", "per-cell"), default="shared",
                        help="candidates always run in the evaluator's child process; 'shared': one worker "
                             "for the whole run (started once), 'per-cell': tune starts its own each cell")
    parser.add_argument("--no-tables", action="store_true", help="do not write the full tables (.jsonl)")
    parser.add_argument("--opt-in", default="", metavar="FAMILIES",
                        help="comma-separated families to screen besides the default space "
                             "(torch_sparserl.specialize.families.OPT_IN_FAMILIES, e.g. tc_tiles)")
    parser.add_argument("--tune", default=DEFAULT_TUNE, help=f"autotuner as module:function (default {DEFAULT_TUNE})")
    parser.add_argument("--list", action="store_true", help="print the selected matrices and cells and exit")
    parser.add_argument("--report", nargs="+", metavar="RESULTS_JSON",
                        help="only re-render the .md and .svg of these results files (no GPU needed)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar or per-cell lines")
    return parser


def _resolve_results_path(args, env: dict) -> tuple[Path, bool]:
    out: Path = args.out
    if args.resume is None:
        return results_path_for(out, env), False
    if args.resume == "latest":
        found = sorted(out.glob(f"kernels-{env.get('gpu_slug') or 'cpu'}-*.json"))
        return (found[-1], True) if found else (results_path_for(out, env), True)
    source = Path(args.resume)
    if not source.exists():
        raise usage_error(f"bench_kernels: --resume {source}: no such file")
    target = out / source.name
    if source.resolve() != target.resolve():
        out.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, target)
        tables = companion(source, "-tables.jsonl")
        if tables.exists():
            shutil.copyfile(tables, companion(target, "-tables.jsonl"))
    return target, True


def main(argv: list[str] | None = None, tune_fn: Callable | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.report:
        for path in args.report:
            try:
                document = load(path)
            except (OSError, ValueError) as exc:  # no such file, not JSON, another benchmark's file
                raise usage_error(f"bench_kernels: --report {path}: {exc}") from None
            md_path, svg_path = write_reports(document, path)
            print(f"wrote {md_path} and {svg_path}")
        return 0
    quick = args.quick
    matrix_patterns = args.matrices if args.matrices is not None else (QUICK["matrices"] if quick else None)
    ops = args.ops or (QUICK["ops"] if quick else _csv(DEFAULT_OPS))
    dtypes = args.dtypes or (QUICK["dtypes"] if quick else _csv(DEFAULT_DTYPES))
    budget_s = args.budget_s if args.budget_s is not None else (QUICK["budget_s"] if quick else DEFAULT_BUDGET_S)
    try:
        ns = [int(v) for v in (args.n or ([str(v) for v in QUICK["n"]] if quick else _csv(DEFAULT_N)))]
    except ValueError:
        raise usage_error(f"bench_kernels: --n takes integers (got {args.n})") from None
    bad = [op for op in ops if op not in ("spmv", "spmm")] + [d for d in dtypes if d not in VALUE_BYTES]
    bad += [str(n) for n in ns if n < 1]
    if bad:
        raise usage_error(f"bench_kernels: unknown op/dtype/n: {', '.join(bad)} "
                         f"(ops spmv, spmm; dtypes {', '.join(VALUE_BYTES)}; n >= 1)")
    try:
        matrices = select_matrices(matrix_patterns)
    except ValueError as exc:  # a malformed generator spec
        raise usage_error(str(exc)) from None
    cells = grid_cells(matrices, ops, ns, dtypes)
    if not cells:
        raise usage_error("bench_kernels: the selection has no cells (spmv needs 1 in --n, spmm an n > 1)")
    if args.list:
        shared = shared_matrices_dir()
        print(f"real matrices from: {shared if shared else 'not found (only the shipped ones)'}")
        for m in matrices:
            print(f"matrix {m.name:28s} {m.group:9s} {m.origin:9s} {m.source}")
        print(f"{len(cells)} cells, budget {budget_s:g} s each (~{len(cells) * budget_s / 60:.0f} min of tuning):")
        for cell in cells:
            print(f"  {cell.key}")
        return 0
    injected = tune_fn is not None
    tune_fn = tune_fn or load_tune(args.tune)
    if args.max_budget_s and not injected:
        tune_fn = functools.partial(tune_fn, max_budget_s=max(args.max_budget_s, budget_s))
    opt_in = tuple(name for name in args.opt_in.split(",") if name)
    if opt_in:
        from torch_sparserl.specialize.families import OPT_IN_FAMILIES

        unknown = sorted(set(opt_in) - set(OPT_IN_FAMILIES))
        if unknown:
            raise usage_error(f"bench_kernels: --opt-in: expected names from {', '.join(OPT_IN_FAMILIES)}, "
                              f"got {', '.join(unknown)}")
        tune_fn = functools.partial(tune_fn, opt_in=opt_in)
    env = environment()
    if env["gpu"] is None:
        print("bench_kernels: no CUDA GPU: the floor fractions stay empty", file=sys.stderr)
    results_path, resume = _resolve_results_path(args, env)
    copy_bw = measure_copy_bandwidth()
    if copy_bw:
        print(f"device-to-device copy: {copy_bw:.0f} GB/s (read + write)", file=sys.stderr)
    sandbox = None
    if args.sandbox == "shared" and not injected:
        from torch_sparserl.evaluate.sandbox import Sandbox

        sandbox = Sandbox()  # its worker starts on the first candidate, restarts after a crash
        _warm_up(tune_fn, sandbox)
    try:
        outcome = run_grid(matrices, cells, tune_fn, results_path, budget_s=budget_s, sandbox=sandbox,
                           resume=resume, max_time_s=args.max_time_s, copy_bandwidth_GBps=copy_bw, env=env,
                           argv=["bench_kernels.py", *argv], tables=not args.no_tables,
                           progress=not args.no_progress)
    except (FileExistsError, ValueError) as exc:
        raise usage_error(str(exc)) from None
    finally:
        if sandbox is not None:
            sandbox.close()
    print(f"{outcome.results_path}: ran {outcome.ran}, skipped {outcome.skipped} done, "
          f"{outcome.errors} errors, {outcome.remaining} remaining"
          + {"time": " (stopped at --max-time-s)", "cuda": " (stopped: CUDA context broke)"}.get(outcome.stopped, ""),
          flush=True)
    return outcome.exit_code


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
