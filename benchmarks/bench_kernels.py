#!/usr/bin/env python3
"""Kernel benchmark: the exhaustive autotuner's best kernel (the oracle) against cuSPARSE.

For every cell (matrix, op, n, dtype) of a declared grid, calls
``torch_sparserl.specialize.autotune.tune`` and records the best correct kernel, cuSPARSE's time in the
same run, the speedup with and without the cuSPARSE fallback, and both times as a fraction of
the memory-bandwidth floor (see ``report.py``). Results are checkpointed after every cell, so
a run cut into chunks of under 10 minutes resumes where it stopped::

    python benchmarks/bench_kernels.py --quick                       # smoke run, ~1 minute
    python benchmarks/bench_kernels.py --max-time-s 540 --resume     # one chunk of the full grid
    python benchmarks/bench_kernels.py --list                        # the cells, nothing run

Exit status: 0 when every selected cell is done, 3 when cells remain (time limit reached or
cells that failed, to run again with ``--resume``), 4 when the CUDA context broke (the next
process resumes), 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as dt
import fnmatch
import functools
import hashlib
import importlib
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import time
import traceback
import uuid
from pathlib import Path
from typing import Callable, Iterable

import numpy as np

REPO = Path(__file__).resolve().parents[1]
# The sibling module, and this checkout's torch_sparserl (the code under test) ahead of any
# installed copy, also when run as a script from anywhere.
for _path in (str(REPO), str(Path(__file__).resolve().parent)):
    if _path not in sys.path:
        sys.path.insert(0, _path)
import report  # noqa: E402

DEFAULT_OUT = Path(__file__).resolve().parent / "results"

# ------------------------------------------------------------------------------- the grid

# Large synthetic patterns: generated at run time (seeded, a few seconds each), never stored.
SYNTHETIC: dict[str, str] = {
    "rmat-s20-ef16": "rmat:scale=20,edge_factor=16",            # power law, 1M rows, ~16M nnz
    "rmat-s21-ef16": "rmat:scale=21,edge_factor=16",            # power law, 2M rows, ~32M nnz
    "uniform-1m-16": "uniform:rows=2^20,cols=2^20,nnz_per_row=16",  # 16 random columns per row
    "banded-1m-bw8": "banded:rows=2^20,bandwidth=8",            # 17 per row around the diagonal
}
# Small synthetic patterns for --quick; selectable by name too.
SMALL_SYNTHETIC: dict[str, str] = {
    "rmat-s12-ef8": "rmat:scale=12,edge_factor=8",
}
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
class MatrixEntry:
    """One matrix of the grid: a real one from a ``.npz``/``.mtx`` file, or a generator spec."""

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


@dataclasses.dataclass(frozen=True)
class Cell:
    matrix: str
    op: str
    n: int
    dtype: str

    @property
    def key(self) -> str:
        return f"{self.matrix}|{self.op}|n={self.n}|{self.dtype}"


def shared_matrices_dir() -> Path | None:
    """The real matrices: ``$SPARSERL_SHARED`` (the shared folder or its ``matrices``), else
    ``../shared/matrices`` beside the repository, else ``shared/matrices`` inside it (the copy
    that travels to a device machine). None when absent: the grid then skips them."""
    env = os.environ.get("SPARSERL_SHARED")
    if env:
        candidates = [Path(env) / "matrices", Path(env)]
    else:
        candidates = [Path(__file__).resolve().parents[2] / "shared" / "matrices",
                      REPO / "shared" / "matrices"]
    for path in candidates:
        if path.is_dir() and any(path.glob("*.npz")):
            return path
    return None


def known_matrices() -> dict[str, MatrixEntry]:
    """Every matrix the grid can name: shared real ones, shipped ones not among them, synthetic."""
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
    real = [e.name for e in entries.values() if e.group == "real"]
    return real + list(SYNTHETIC)


def select_matrices(patterns: Iterable[str] | None, entries: dict[str, MatrixEntry] | None = None
                    ) -> list[MatrixEntry]:
    """Names or globs of known matrices (``real`` and ``synthetic`` name the groups), generator
    specs (``rmat:scale=16,edge_factor=8``), or ``.npz``/``.mtx`` paths. Order is kept."""
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
            raise _usage_error(f"bench_kernels: --matrices {pattern!r} matches no matrix (known: "
                             f"{', '.join(entries)}; real matrices from "
                             f"{shared if shared else 'nowhere: no shared matrices found'})")
        for entry in hits:
            chosen.setdefault(entry.name, entry)
    return list(chosen.values())


def op_n_pairs(ops: Iterable[str], ns: Iterable[int]) -> list[tuple[str, int]]:
    """spmv runs at n=1 (when 1 is among ``ns``), spmm at every n > 1."""
    ops, ns = list(ops), sorted(set(ns))
    pairs = [("spmv", 1)] if "spmv" in ops and 1 in ns else []
    return pairs + [("spmm", n) for n in ns if n > 1 and "spmm" in ops]


def grid_cells(matrices: list[MatrixEntry], ops, ns, dtypes) -> list[Cell]:
    """Matrix-major, so each (possibly generated) matrix is built once per process."""
    return [Cell(m.name, op, n, dtype) for m in matrices for dtype in dtypes for op, n in op_n_pairs(ops, ns)]


# ------------------------------------------------------------------------- environment, timing

def gpu_slug(name: str | None) -> str:
    """"NVIDIA H100 80GB HBM3" → "h100-80gb-hbm3"; "cpu" without a GPU."""
    if not name:
        return "cpu"
    name = re.sub(r"^nvidia\s+", "", name.strip(), flags=re.I)
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "gpu"


def _nvidia_smi() -> dict:
    """Driver and the clocks as found (read only: the benchmark never changes clocks)."""
    fields = "driver_version,clocks.sm,clocks.mem,clocks.max.sm,clocks.max.mem,power.limit,temperature.gpu"
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=15, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    values = [v.strip() for v in out.splitlines()[0].split(",")] if out.strip() else []
    if len(values) != 7:
        return {}
    return {"driver": values[0], "clocks": {"sm_mhz": values[1], "mem_mhz": values[2], "max_sm_mhz": values[3],
                                             "max_mem_mhz": values[4]},
            "power_limit_w": values[5], "temperature_c": values[6]}


def _cpu_model() -> str | None:
    """The host CPU's model name (launch-bound timings depend on it), or None where unknown."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
    except OSError:
        return platform.processor() or None


def environment() -> dict:
    import scipy
    import torch

    env = {"gpu": None, "gpu_slug": "cpu", "torch": torch.__version__, "cuda": torch.version.cuda,
           "python": platform.python_version(), "numpy": np.__version__, "scipy": scipy.__version__,
           "platform": platform.platform(), "host": platform.node(), "cpu": _cpu_model(), "cpu_count": os.cpu_count(),
           "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
           "clocks_changed": False}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env.update({"gpu": props.name, "gpu_slug": gpu_slug(props.name),
                    "capability": f"{props.major}.{props.minor}",
                    "multiprocessors": props.multi_processor_count,
                    "memory_GiB": round(props.total_memory / 2**30, 1)})
        env.update(_nvidia_smi())
    return env


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
            "distinct_cols": report.distinct_columns(matrix),
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
    nbytes = report.floor_bytes(meta["rows"], meta["nnz"], meta["distinct_cols"], cell.n,
                                report.VALUE_BYTES[cell.dtype])
    floor_time = report.floor_us(nbytes, copy_bw)
    record = {"key": cell.key, "matrix": cell.matrix, "group": meta["group"], "op": cell.op, "n": cell.n,
              "dtype": cell.dtype, "status": "transient" if transient else "ok" if oracle_us else "no_kernel",
              "cusparse_us": cusparse_us, "oracle_us": oracle_us,
              "best_family": getattr(best, "family", None) if oracle_us else None}
    record.update(report.cell_metrics(cusparse_us, oracle_us, floor_time))
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
    return (f"{record['key']}: speedup {report._fmt_x(record['speedup'])} "
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
        document = report.load(results_path)
    else:
        document = report.new_document(env or {})
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
    done = {c["key"] for c in document["cells"] if c.get("status") in report.DONE_STATUSES}
    todo = [c for c in cells if c.key not in done]
    skipped = len(cells) - len(todo)
    entries = {m.name: m for m in matrices}
    tables_path = report.companion(results_path, "-tables.jsonl")
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
                            f.write(report.dumps({"cell": cell.key, "cell_id": cell_id, **(record_to_dict(rec) or {})})
                                    + "\n")
            longest_cell_s = max(longest_cell_s, time.monotonic() - cell_started)
            document["cells"] = [c for c in document["cells"] if c["key"] != cell.key] + [record]
            report.save(document, results_path)
            report.write_reports(document, results_path)
            ran += 1
            bar.finish(_line(record))
            if stopped == "cuda":
                break
    finally:
        bar.close()
        report.save(document, results_path)
        report.write_reports(document, results_path)
    done = {c["key"] for c in document["cells"] if c.get("status") in report.DONE_STATUSES}
    remaining = sum(1 for c in cells if c.key not in done)
    return RunOutcome(results_path, ran, skipped, remaining, errors, stopped)


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


def _usage_error(message: str) -> SystemExit:
    print(message, file=sys.stderr)
    return SystemExit(2)


def _csv(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _matrix_list(text: str) -> list[str]:
    """Comma-separated, but a generator spec keeps its own commas: "cora,rmat:scale=12,
    edge_factor=4" is ["cora", "rmat:scale=12,edge_factor=4"]."""
    items: list[str] = []
    for part in _csv(text):
        if items and ":" in items[-1] and "=" in part and ":" not in part:
            items[-1] += "," + part
        else:
            items.append(part)
    return items


def load_tune(dotted: str) -> Callable:
    module_name, _, attr = dotted.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise _usage_error(f"bench_kernels: cannot import the autotuner {dotted!r} ({exc}); "
                         "pass --tune module:function") from exc
    try:
        return getattr(module, attr or "tune")
    except AttributeError:
        raise _usage_error(f"bench_kernels: {module_name} has no {attr or 'tune'!r}") from None


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
    parser.add_argument("--matrices", type=_matrix_list, default=None,
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
        raise _usage_error(f"bench_kernels: --resume {source}: no such file")
    target = out / source.name
    if source.resolve() != target.resolve():
        out.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, target)
        tables = report.companion(source, "-tables.jsonl")
        if tables.exists():
            shutil.copyfile(tables, report.companion(target, "-tables.jsonl"))
    return target, True


def main(argv: list[str] | None = None, tune_fn: Callable | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    quick = args.quick
    matrix_patterns = args.matrices if args.matrices is not None else (QUICK["matrices"] if quick else None)
    ops = args.ops or (QUICK["ops"] if quick else _csv(DEFAULT_OPS))
    dtypes = args.dtypes or (QUICK["dtypes"] if quick else _csv(DEFAULT_DTYPES))
    budget_s = args.budget_s if args.budget_s is not None else (QUICK["budget_s"] if quick else DEFAULT_BUDGET_S)
    try:
        ns = [int(v) for v in (args.n or ([str(v) for v in QUICK["n"]] if quick else _csv(DEFAULT_N)))]
    except ValueError:
        raise _usage_error(f"bench_kernels: --n takes integers (got {args.n})") from None
    bad = [op for op in ops if op not in ("spmv", "spmm")] + [d for d in dtypes if d not in report.VALUE_BYTES]
    bad += [str(n) for n in ns if n < 1]
    if bad:
        raise _usage_error(f"bench_kernels: unknown op/dtype/n: {', '.join(bad)} "
                         f"(ops spmv, spmm; dtypes {', '.join(report.VALUE_BYTES)}; n >= 1)")
    try:
        matrices = select_matrices(matrix_patterns)
    except ValueError as exc:  # a malformed generator spec
        raise _usage_error(str(exc)) from None
    cells = grid_cells(matrices, ops, ns, dtypes)
    if not cells:
        raise _usage_error("bench_kernels: the selection has no cells (spmv needs 1 in --n, spmm an n > 1)")
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
            parser.error(f"--opt-in: expected names from {', '.join(OPT_IN_FAMILIES)}, got {', '.join(unknown)}")
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
        raise _usage_error(str(exc)) from None
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
