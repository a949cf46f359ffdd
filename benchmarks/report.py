"""Results of ``bench_kernels.py``: per-cell metrics, the JSON file, the Markdown table, the SVG plot.

Pure functions of the results document, no GPU and no torch needed, so a results file can be
re-rendered anywhere::

    python benchmarks/report.py benchmarks/results/kernels-<gpu>-<date>.json

writes the ``.md`` and ``.svg`` beside it.

The memory-bandwidth floor of one product (int32 indices; ``s`` bytes per value)::

    bytes = 4·(rows+1)              rowptr
          + 4·nnz + s·nnz           column indices and values
          + s·distinct_cols·n       X: each column index that occurs selects one row of X,
                                    which every algorithm must read at least once
          + s·rows·n                Y: every output element written once
    floor_us = bytes / copy_bandwidth

``copy_bandwidth`` is the device-to-device ``copy_`` rate measured in the same run (bytes read
plus bytes written, per second). ``*_floor_frac = floor_us / measured_us``: 1.0 would be a
kernel that moves only the compulsory bytes at copy speed.
"""

from __future__ import annotations

import html
import json
import math
import os
import re
import sys
from collections import defaultdict
from pathlib import Path
from typing import Iterable

SCHEMA = "torch_sparserl.bench_kernels/1"
VALUE_BYTES = {"f32": 4, "f16": 2, "bf16": 2}
INDEX_BYTES = 4  # the kernel ABI takes int32 rowptr and col
GROUPS = ("real", "synthetic")
DONE_STATUSES = ("ok", "no_kernel")  # an "error" or "transient" cell is run again on --resume


# ----------------------------------------------------------------------------------- metrics

def distinct_columns(matrix) -> int:
    """Number of columns holding at least one nonzero (rows of X a product must read)."""
    import numpy as np

    if matrix.nnz == 0:
        return 0
    return int(np.count_nonzero(np.bincount(matrix.indices, minlength=matrix.shape[1])))


def floor_bytes(rows: int, nnz: int, distinct_cols: int, n: int, value_bytes: int) -> int:
    """Bytes every algorithm must move for ``Y = A @ X`` (see the module docstring)."""
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


def geomean(values: Iterable[float | None]) -> float | None:
    """Geometric mean of the positive finite values; None when there are none."""
    logs = [math.log(v) for v in values if v is not None and math.isfinite(v) and v > 0]
    return math.exp(sum(logs) / len(logs)) if logs else None


def results_path(out: str | Path, prefix: str, gpu_name: str | None, date: str) -> Path:
    """``out`` itself when it names a .json file, else ``out/<prefix>-<gpu slug>-<date>.json``."""
    from bench_kernels import gpu_slug

    out = Path(out)
    path = out if out.suffix == ".json" else out / f"{prefix}-{gpu_slug(gpu_name)}-{date}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


# a list of numbers as json.dumps(indent=1) writes it, one per line: written on one line instead
_NUMBER_LIST = re.compile(r"\[\s*((?:-?[0-9][0-9.eE+-]*,\s*)*-?[0-9][0-9.eE+-]*)\s*\]")


def write_json_md(doc: dict, path: Path, markdown, svg=None) -> None:
    """The results document as JSON at ``path`` (written atomically: a killed run leaves the
    previous file) and ``markdown(doc)`` beside it (.md), and ``svg(doc)`` (.svg) if given."""
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(_NUMBER_LIST.sub(lambda m: "[" + ", ".join(m.group(1).split()).replace(",,", ",") + "]",
                                    json.dumps(doc, indent=1)) + "\n")
    tmp.replace(path)
    path.with_suffix(".md").write_text(markdown(doc))
    if svg is not None:
        path.with_suffix(".svg").write_text(svg(doc))


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


def _json_safe(value):
    """NaN and infinities become None (strict JSON); unknown objects become strings."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if value is None or isinstance(value, (str, int, bool)):
        return value
    if hasattr(value, "item") and callable(value.item):  # numpy scalars
        return _json_safe(value.item())
    return str(value)


def dumps(value) -> str:
    return json.dumps(_json_safe(value), allow_nan=False, sort_keys=False)


def load(path: str | os.PathLike) -> dict:
    with open(path, encoding="utf-8") as f:
        document = json.load(f)
    if document.get("schema") != SCHEMA:
        raise ValueError(f"report: {path} is not a bench_kernels results file "
                         f"(schema {document.get('schema')!r}, expected {SCHEMA!r})")
    return document


def save(document: dict, path: str | os.PathLike) -> None:
    """Write atomically: a killed run leaves the previous checkpoint, never half a file."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(_json_safe(document), f, indent=1, allow_nan=False)
        f.write("\n")
    os.replace(tmp, path)


def companion(json_path: str | os.PathLike, suffix: str) -> Path:
    """``kernels-x.json`` → ``kernels-x.md`` / ``kernels-x.svg`` / ``kernels-x-tables.jsonl``."""
    json_path = Path(json_path)
    stem = json_path.name[:-5] if json_path.name.endswith(".json") else json_path.name
    return json_path.with_name(stem + suffix)


# -------------------------------------------------------------------------------- formatting

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
        "| op | n | dtype | group | matrices | speedup (geomean) | with fallback | slower than cuSPARSE (no kernel) "
        "| oracle % of floor | cuSPARSE % of floor |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in summarize(cells):
        lines.append(
            f"| {row['op']} | {row['n']} | {row['dtype']} | {row['group']} | {row['cells']} "
            f"| {_fmt_x(row['speedup_geomean'])} | {_fmt_x(row['speedup_with_fallback_geomean'])} "
            f"| {row['slower_than_cusparse']} ({row['no_kernel']}) "
            f"| {_fmt_pct(row['oracle_floor_frac_geomean'])} | {_fmt_pct(row['cusparse_floor_frac_geomean'])} |")
    matrices = document.get("matrices", {})
    for dtype in sorted({c["dtype"] for c in cells}, key=lambda d: _order_key("spmv", 1, d)):
        dcells = [c for c in cells if c["dtype"] == dtype]
        columns = _columns(dcells)
        by_key = {(c["matrix"], c["op"], c["n"]): c for c in dcells}
        lines += ["", f"## {dtype}: speedup · oracle / cuSPARSE % of floor", "",
                  "| matrix | group | rows | nnz | " + " | ".join(_column_title(*on) for on in columns) + " |",
                  "|---|---|---|---|" + "---|" * len(columns)]
        for name in _matrix_order(document, dcells):
            meta = matrices.get(name, {})
            lines.append(f"| {name} | {meta.get('group', '?')} | {meta.get('rows', '?')} | {meta.get('nnz', '?')} | "
                         + " | ".join(_cell_text(by_key.get((name, *on))) for on in columns) + " |")
    errors = [c for c in cells if c.get("status") == "error"]
    if errors:
        lines += ["", "## Errors", ""]
        lines += [f"- `{c['key']}`: {str(c.get('error', '')).splitlines()[0][:200] if c.get('error') else '?'}"
                  for c in errors]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------- SVG

_PANEL_H = 200      # plot area height per panel
_BAR_W = 18
_BAR_GAP = 6
_LEFT = 64
_TOP_TITLE = 30
_LABEL_H = 150      # room for rotated matrix names (cut to _LABEL_CHARS)
_LABEL_CHARS = 26
_COLOURS = {"faster": "#2e7d32", "slower": "#c62828", "missing": "#9e9e9e"}


def _short(name: str) -> str:
    return name if len(name) <= _LABEL_CHARS else name[:_LABEL_CHARS - 1] + "…"


def _ticks(lo_exp: int, hi_exp: int) -> list[float]:
    ticks = []
    for e in range(lo_exp, hi_exp + 1):
        ticks += [10.0 ** e] + ([2 * 10.0 ** e, 5 * 10.0 ** e] if hi_exp - lo_exp <= 2 and e < hi_exp else [])
    return ticks


def svg(document: dict) -> str:
    """Bar charts of log speedup per matrix, one panel per (op, n, dtype), a line at 1×."""
    cells = [c for c in document.get("cells", []) if c.get("status") in DONE_STATUSES + ("error",)]
    panels = sorted({(c["op"], c["n"], c["dtype"]) for c in cells}, key=lambda k: _order_key(*k))
    names = _matrix_order(document, cells)
    matrices = document.get("matrices", {})
    speedups = [c["speedup"] for c in cells if c.get("speedup")]
    lo_exp = min(-1, math.floor(math.log10(min(speedups)))) if speedups else -1
    hi_exp = max(1, math.ceil(math.log10(max(speedups)))) if speedups else 1
    width = max(640, _LEFT + max(1, len(names)) * (_BAR_W + _BAR_GAP) + 20)
    panel_total = _TOP_TITLE + _PANEL_H + _LABEL_H
    height = 40 + max(1, len(panels)) * panel_total
    env = document.get("env", {})
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="11">',
           '<rect width="100%" height="100%" fill="white"/>',
           f'<text x="{_LEFT}" y="22" font-size="14" font-weight="bold">'
           f'{html.escape("Oracle speedup over cuSPARSE (log scale) — " + str(env.get("gpu", "?")))}</text>']
    if not panels:
        out.append(f'<text x="{_LEFT}" y="60">no results yet</text>')

    def y_of(value: float, top: float) -> float:
        frac = (math.log10(value) - lo_exp) / (hi_exp - lo_exp)
        return top + _PANEL_H * (1 - frac)

    summary = {(r["op"], r["n"], r["dtype"], r["group"]): r for r in summarize(cells)}
    for index, (op, n, dtype) in enumerate(panels):
        top = 40 + index * panel_total + _TOP_TITLE
        means = ", ".join(f"{g} geomean {_fmt_x(summary[(op, n, dtype, g)]['speedup_geomean'])}"
                          for g in GROUPS if (op, n, dtype, g) in summary)
        title = f"{_column_title(op, n)} {dtype}" + (f" — {means}" if means else "")
        out.append(f'<text x="{_LEFT}" y="{top - 10:.1f}" font-size="12" font-weight="bold">{html.escape(title)}</text>')
        right = width - 10
        for tick in _ticks(lo_exp, hi_exp):
            y = y_of(tick, top)
            out.append(f'<line x1="{_LEFT}" y1="{y:.1f}" x2="{right}" y2="{y:.1f}" stroke="#e0e0e0"/>')
            out.append(f'<text x="{_LEFT - 6}" y="{y + 4:.1f}" text-anchor="end">{tick:g}×</text>')
        out.append(f'<line x1="{_LEFT}" y1="{top}" x2="{_LEFT}" y2="{top + _PANEL_H}" stroke="black"/>')
        by_matrix = {c["matrix"]: c for c in cells if (c["op"], c["n"], c["dtype"]) == (op, n, dtype)}
        one = y_of(1.0, top)
        previous_group = None
        for i, name in enumerate(names):
            x = _LEFT + 10 + i * (_BAR_W + _BAR_GAP)
            group = matrices.get(name, {}).get("group", "real")
            if previous_group is not None and group != previous_group:
                sep = x - _BAR_GAP / 2
                out.append(f'<line x1="{sep:.1f}" y1="{top}" x2="{sep:.1f}" y2="{top + _PANEL_H}" '
                           'stroke="#757575" stroke-dasharray="4,3"/>')
            previous_group = group
            cell = by_matrix.get(name)
            label_y = top + _PANEL_H + 8
            out.append(f'<text x="{x + _BAR_W / 2:.1f}" y="{label_y:.1f}" text-anchor="end" '
                       f'transform="rotate(-60 {x + _BAR_W / 2:.1f} {label_y:.1f})">{html.escape(_short(name))}</text>')
            if cell is None:
                continue
            speedup = cell.get("speedup")
            if not speedup:
                reason = "error" if cell.get("status") == "error" else "no correct kernel"
                out.append(f'<text x="{x + _BAR_W / 2:.1f}" y="{one - 4:.1f}" text-anchor="middle" '
                           f'fill="{_COLOURS["missing"]}" font-weight="bold">×<title>{html.escape(name)}: '
                           f'{reason}</title></text>')
                continue
            clipped = min(max(speedup, 10.0 ** lo_exp), 10.0 ** hi_exp)
            y = y_of(clipped, top)
            colour = _COLOURS["faster"] if speedup >= 1 else _COLOURS["slower"]
            out.append(f'<rect x="{x}" y="{min(y, one):.1f}" width="{_BAR_W}" height="{max(abs(one - y), 1):.1f}" '
                       f'fill="{colour}"><title>{html.escape(name)}: {speedup:.3g}× '
                       f'(oracle {cell.get("oracle_us") or 0:.1f} µs, cuSPARSE {cell.get("cusparse_us") or 0:.1f} µs)'
                       '</title></rect>')
        out.append(f'<line x1="{_LEFT}" y1="{one:.1f}" x2="{right}" y2="{one:.1f}" stroke="black" '
                   'stroke-width="1.5"/>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def write_reports(document: dict, json_path: str | os.PathLike) -> tuple[Path, Path]:
    """Write the ``.md`` and ``.svg`` beside ``json_path``; returns their paths."""
    md_path, svg_path = companion(json_path, ".md"), companion(json_path, ".svg")
    for path, text in ((md_path, markdown(document)), (svg_path, svg(document))):
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    return md_path, svg_path


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="Render the Markdown table and SVG plot of a "
                                                 "bench_kernels results file (written beside it).")
    parser.add_argument("results", nargs="+", help="kernels-<gpu>-<date>.json file(s)")
    args = parser.parse_args(argv)
    for path in args.results:
        md_path, svg_path = write_reports(load(path), path)
        print(f"wrote {md_path} and {svg_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())


def emit_markdown(text: str, out: str) -> None:
    """A comparison's Markdown: to ``out`` where it names a ``.md`` file, else to stdout."""
    if str(out).endswith(".md"):
        Path(out).write_text(text)
    else:
        print(text, end="")
