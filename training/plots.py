#!/usr/bin/env python3
"""Learning curves from the stages' metrics (JSONL) as one SVG: a panel per metric.

    python training/plots.py training/results/*-metrics.jsonl --out training/results/curves.svg
"""

from __future__ import annotations

import argparse
import html
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from training.common import read_metrics  # noqa: E402

DEFAULT_METRICS = ("pretrain/loss", "sft/loss", "sft/dev_loss", "sft/dev_exact", "rl/reward_mean",
                   "rl/correct_rate", "rl/speedup_mean", "rl/kl")
COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b")


def _series(files: list[Path]) -> dict[str, dict[str, list[tuple[float, float]]]]:
    """metric -> run name -> [(step, value)]"""
    out: dict[str, dict[str, list]] = {}
    for f in files:
        run = Path(f).parent.name if Path(f).name == "metrics.jsonl" else Path(f).stem.removesuffix("-metrics")
        for row in read_metrics(f):
            for k, v in row.items():
                if "/" in k and isinstance(v, (int, float)) and math.isfinite(v):
                    out.setdefault(k, {}).setdefault(run, []).append((row["step"], float(v)))
    return out


def learning_curves(files: list[Path], out: Path, metrics=None) -> Path:
    series = _series(files)
    names = [m for m in (metrics or DEFAULT_METRICS) if m in series] or sorted(series)
    w, h, cols = 360, 220, 2
    rows = max(1, -(-len(names) // cols))
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w * cols}" height="{h * rows}" '
             f'font-family="sans-serif" font-size="11">', '<rect width="100%" height="100%" fill="white"/>']
    for i, name in enumerate(names):
        x0, y0 = (i % cols) * w, (i // cols) * h
        runs = series[name]
        pts = [p for r in runs.values() for p in r]
        xs, ys = [p[0] for p in pts], [p[1] for p in pts]
        xlo, xhi = min(xs), max(xs) if max(xs) > min(xs) else min(xs) + 1
        ylo, yhi = min(ys), max(ys) if max(ys) > min(ys) else min(ys) + 1
        left, top, pw, ph = x0 + 50, y0 + 25, w - 70, h - 60
        parts.append(f'<text x="{x0 + w / 2}" y="{y0 + 15}" text-anchor="middle" font-weight="bold">'
                     f'{html.escape(name)}</text>')
        parts.append(f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="none" stroke="#888"/>')
        parts.append(f'<text x="{left - 4}" y="{top + 8}" text-anchor="end">{yhi:.3g}</text>')
        parts.append(f'<text x="{left - 4}" y="{top + ph}" text-anchor="end">{ylo:.3g}</text>')
        parts.append(f'<text x="{left}" y="{top + ph + 14}">{xlo:g}</text>')
        parts.append(f'<text x="{left + pw}" y="{top + ph + 14}" text-anchor="end">step {xhi:g}</text>')
        for j, (run, p) in enumerate(sorted(runs.items())):
            color = COLORS[j % len(COLORS)]
            coords = " ".join(f"{left + (s - xlo) / (xhi - xlo) * pw:.1f},{top + ph - (v - ylo) / (yhi - ylo) * ph:.1f}"
                              for s, v in p)
            parts.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.5" points="{coords}"/>')
            parts.append(f'<text x="{left + 4}" y="{top + ph + 28 + 0 * j}" dx="{j * 90}" fill="{color}">'
                         f'{html.escape(run)}</text>')
    parts.append("</svg>")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(parts) + "\n")
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    print(learning_curves(args.files, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
