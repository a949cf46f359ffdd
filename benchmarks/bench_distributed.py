"""Partitioned full-graph training on 1, 2, 4 ranks: epoch time, halo traffic, halo wait.

Runs ``examples/distributed_gcn.py`` under ``torchrun --standalone`` once per world size (the
graph's rows split over the ranks, each rank exchanging the halo rows its block reads) and
collects, per world size: the slowest rank's epoch time, the most rows and halo rows a rank
holds, the halo bytes a rank sends per product, the time a rank waited for the halo against the
time its products took, its peak memory, and the example's check against one process.

    python benchmarks/bench_distributed.py --device cuda --graph ../shared/matrices/pubmed.npz --order rcm
    python benchmarks/bench_distributed.py --device cpu --worlds 1,2 --epochs 5 --out /tmp/dist.json

Halo wait is host time spent in the exchange's wait; on a GPU the products are asynchronous, so
there it says how long the host blocked, not how long the device did.
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import REPO, command_line, environment, fmt, results_path, tables, usage_error, write_json_md  # noqa: E402
from common.torchrun import example_graph, run_example, world_sizes  # noqa: E402

EXAMPLE = REPO / "examples" / "distributed_gcn.py"


def run_world(world: int, args, folder: Path) -> dict:
    """The example's report for ``world`` ranks, or the tail of its output when it failed."""
    arguments = ["--graph", example_graph(args.graph), "--model", args.model, "--order", args.order, "--device", args.device,
                 "--epochs", str(args.epochs), "--hidden", str(args.hidden), "--features", str(args.features),
                 "--without-halo", str(args.without_halo), *(["--no-check"] if args.no_check else [])]
    return run_example(EXAMPLE, world, arguments, args.device, folder, args.timeout)


def summary_row(report: dict, one_rank_epoch_s: float | None) -> dict:
    if report["status"] == "failed":
        return {"world_size": report["world_size"], "status": "failed", "error": report.get("error")}
    ranks = report["ranks"]
    epoch_s, alone_s = report["epoch_s"], report.get("epoch_without_halo_s")
    return {"world_size": report["world_size"], "status": report["status"], "epoch_ms": epoch_s * 1e3,
            "epoch_without_halo_ms": alone_s * 1e3 if alone_s else None,
            "halo_cost": epoch_s / alone_s if alone_s and report["world_size"] > 1 else None,
            "speedup": one_rank_epoch_s / epoch_s if one_rank_epoch_s else None,
            "max_rows": max(r["rows"] for r in ranks), "max_halo_rows": max(r["halo_rows"] for r in ranks),
            "max_halo_mb_sent": max(r["halo_bytes_per_product"]["sent"] for r in ranks) / 2**20,
            "max_halo_wait_ms": max(r["halo_wait_s_per_epoch"] for r in ranks) * 1e3,
            "max_compute_ms": max(r["compute_s_per_epoch"] for r in ranks) * 1e3,
            "max_peak_memory_mb": max(r["peak_memory_mb"] for r in ranks),
            "max_rel_loss_diff": report.get("max_rel_loss_diff"),
            "max_rel_loss_error": report.get("max_rel_loss_error"),
            "single_process_max_rel_loss_error": report.get("single_process_max_rel_loss_error")}


def _alone(row: dict) -> str:
    if row.get("epoch_without_halo_ms") is None:
        return "–"
    cost = "" if row["halo_cost"] is None else f" ({row['halo_cost']:.2f})"
    return f"{row['epoch_without_halo_ms']:.1f}{cost}"


def _f64_error(row: dict) -> str:
    if row.get("max_rel_loss_error") is None:
        return "–"
    return f"{row['max_rel_loss_error']:.1e} ({row['single_process_max_rel_loss_error']:.1e})"


def markdown(doc: dict) -> str:
    env, cfg = doc["env"], doc["config"]
    lines = [f"# Partitioned full-graph training — {env['gpu'] or env['cpu']} ({cfg['device']})", "",
             f"{cfg['model'].upper()} on {cfg['graph']}, rows split in the `{cfg['order']}` order, hidden "
             f"{cfg['hidden']}, {cfg['epochs']} epochs (the first, which specializes, not timed). *epoch*: the "
             "slowest rank's mean; *halo wait* / *products*: a rank's host time per epoch waiting for the "
             "exchange / in the sparse products; *halo sent*: bytes a rank sends per product; *loss diff*: the "
             "largest relative difference from one process over the run; *f64 error*: the largest relative "
             "difference from one process in float64, of this run and (in parentheses) of one process in float32; "
             "*without halo*: the slowest rank's epoch with the halo exchange left out (its halo zeros), and the "
             "epoch over it (the exchange's cost; 1.00 where it is hidden).",
             "",
             *tables.header(["ranks", "status", "epoch ms", "speedup", "rows/rank", "halo rows", "halo sent MB",
                             "halo wait ms", "products ms", "without halo ms", "peak MB", "loss diff", "f64 error"],
                            "rlrrrrrrrrrrr")]
    failures = []
    for r in doc["rows"]:
        if r["status"] == "failed":
            lines.append(tables.row([r["world_size"], "failed", *["—"] * 11]))
            failures.append(f"- {r['world_size']} rank(s): {r.get('error') or 'no exception printed (see runs in the JSON)'}")
            continue
        lines.append(tables.row([r["world_size"], r["status"], f"{r['epoch_ms']:.1f}", fmt(r["speedup"], ".2f", "×"),
                                 f"{r['max_rows']:,}", f"{r['max_halo_rows']:,}", f"{r['max_halo_mb_sent']:.3f}",
                                 f"{r['max_halo_wait_ms']:.1f}", f"{r['max_compute_ms']:.1f}", _alone(r),
                                 f"{r['max_peak_memory_mb']:.0f}", fmt(r["max_rel_loss_diff"], ".1e"),
                                 _f64_error(r)]))
    if failures:
        lines += ["", "Why the failed world sizes failed (the first exception a rank printed):", "", *failures]
    lines += ["", command_line(doc["command"], doc["date"]), ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--graph", default="cora")
    parser.add_argument("--model", choices=("gcn", "sage"), default="gcn")
    parser.add_argument("--order", default="rows", help="rows, degree, rcm, metis or local")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--worlds", default="1,2,4", help="world sizes, comma-separated")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--features", type=int, default=128)
    parser.add_argument("--no-check", action="store_true", help="skip the one-process comparison")
    parser.add_argument("--without-halo", type=int, default=10, metavar="EPOCHS",
                        help="epochs timed again with the halo exchange left out (0: none)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds one world size may take")
    parser.add_argument("--out", default="benchmarks/results", help="folder (a dated file in it) or a .json path")
    args = parser.parse_args(argv)
    worlds = world_sizes(args.worlds)
    if args.order not in ("rows", "degree", "rcm", "metis", "local"):
        raise usage_error(f"--order: expected rows, degree, rcm, metis or local (got {args.order!r})")

    env = environment()
    started = dt.datetime.now().isoformat(timespec="seconds")
    reports = []
    with tempfile.TemporaryDirectory(prefix="bench-distributed-") as folder:
        for world in worlds:
            report = run_world(world, args, Path(folder))
            reports.append(report)
            print(f"{world} rank(s): {report['status']}" + (f", epoch {report['epoch_s'] * 1e3:.1f} ms"
                                                            if "epoch_s" in report else ""), flush=True)
    one = next((r["epoch_s"] for r in reports if r.get("world_size") == 1 and "epoch_s" in r), None)
    doc = {"schema": "torch_sparserl.bench_distributed/1", "env": env, "date": started,
           "config": {k: getattr(args, k) for k in ("graph", "model", "order", "device", "epochs", "hidden", "features",
                                                   "without_halo")},
           "rows": [summary_row(r, one) for r in reports], "runs": reports,
           "command": " ".join(["python benchmarks/bench_distributed.py"] + (argv if argv is not None else sys.argv[1:]))}
    path = results_path(args.out, "distributed", env["gpu"] if args.device == "cuda" else None, started[:10])
    write_json_md(doc, path, markdown)
    print(f"wrote {path}")
    return 0 if all(r["status"] == "ok" for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
