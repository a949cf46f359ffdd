"""Mini-batch GraphSAGE under DDP on 1, 2, 4 ranks: throughput (seeds per second) and its scaling.

Runs ``examples/ddp_sage_minibatch.py`` under ``torchrun --standalone`` once per world size (each
rank sampling its own share of the seed nodes, DDP averaging the gradients) and collects, per
world size: the slowest rank's epoch time, the seeds trained per second over all ranks (the
first epoch, which warms up, not counted), the speedup over one rank and its efficiency
(speedup / ranks), the steps per epoch, the young calls the runtime served, and the example's
check of the first step against one process.

    python benchmarks/bench_ddp_minibatch.py --device cuda --graph ../shared/matrices/dblp-2010.npz --buckets 3
    python benchmarks/bench_ddp_minibatch.py --device cpu --worlds 1,2 --epochs 2 --out /tmp/ddp.json

On the CPU the ranks share the host's cores: the numbers say nothing of GPUs.
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import REPO, command_line, environment, fmt, results_path, tables, write_json_md  # noqa: E402
from common.torchrun import example_graph, run_example, world_sizes  # noqa: E402

EXAMPLE = REPO / "examples" / "ddp_sage_minibatch.py"


def summary_row(report: dict, one_rank_throughput: float | None) -> dict:
    if report["status"] == "failed":
        return {"world_size": report["world_size"], "status": "failed"}
    world, throughput = report["world_size"], report["throughput_seeds_per_s"]
    speedup = throughput / one_rank_throughput if one_rank_throughput else None
    check = report.get("check")
    return {"world_size": world, "status": report["status"], "throughput_seeds_per_s": throughput,
            "speedup": speedup, "efficiency": speedup / world if speedup is not None else None,
            "epoch_ms": min(report["epoch_s"][1:] or report["epoch_s"]) * 1e3,
            "steps_per_epoch": report["ranks"][0]["steps_per_epoch"][0],
            "young_calls": sum(r["runtime_stats"].get("young_calls", 0) for r in report["ranks"]),
            "max_rel_grad_diff": check["max_rel_grad_diff"] if check else None}


def markdown(doc: dict) -> str:
    env, cfg = doc["env"], doc["config"]
    lines = [f"# Mini-batch GraphSAGE under DDP — {env['gpu'] or env['cpu']} ({cfg['device']})", "",
             f"{cfg['graph']}, batches of {cfg['batch_size']} seeds, fanouts {cfg['fanouts']}, hidden {cfg['hidden']}, "
             f"buckets {cfg['buckets'] or 'none'}, {cfg['epochs']} epochs (the first not counted). *seeds/s*: seeds "
             "trained per second over all ranks; *epoch*: the slowest rank's, the fastest epoch; *grad diff*: the "
             "first step's averaged gradient against one process over the union of the ranks' batches.", "",
             *tables.header(["ranks", "status", "seeds/s", "speedup", "efficiency", "epoch ms", "steps/epoch",
                             "young calls", "grad diff"], "rlrrrrrrr")]
    for r in doc["rows"]:
        if r["status"] == "failed":
            lines.append(tables.row([r["world_size"], "failed", *["—"] * 7]))
            continue
        lines.append(tables.row([r["world_size"], r["status"], f"{r['throughput_seeds_per_s']:,.0f}",
                                 fmt(r["speedup"], ".2f", "×"), fmt(r["efficiency"], ".2f"), f"{r['epoch_ms']:.1f}",
                                 r["steps_per_epoch"], r["young_calls"], fmt(r["max_rel_grad_diff"], ".1e")]))
    lines += ["", command_line(doc["command"], doc["date"]), ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--graph", default="cora")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--worlds", default="1,2,4", help="world sizes, comma-separated")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--fanouts", default="10,5")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--features", type=int, default=64)
    parser.add_argument("--buckets", type=int, default=0)
    parser.add_argument("--no-check", action="store_true", help="skip the first step's check")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds one world size may take")
    parser.add_argument("--out", default="benchmarks/results", help="folder (a dated file in it) or a .json path")
    args = parser.parse_args(argv)
    worlds = world_sizes(args.worlds)

    arguments = ["--graph", example_graph(args.graph), "--epochs", str(args.epochs),
                 "--batch-size", str(args.batch_size), "--fanouts", args.fanouts, "--hidden", str(args.hidden), "--features", str(args.features),
                 "--buckets", str(args.buckets), *(["--no-check"] if args.no_check else [])]
    env = environment()
    started = dt.datetime.now().isoformat(timespec="seconds")
    reports = []
    with tempfile.TemporaryDirectory(prefix="bench-ddp-minibatch-") as folder:
        for world in worlds:
            report = run_example(EXAMPLE, world, arguments, args.device, Path(folder), args.timeout)
            reports.append(report)
            print(f"{world} rank(s): {report['status']}" + (f", {report['throughput_seeds_per_s']:,.0f} seeds/s"
                                                            if "throughput_seeds_per_s" in report else ""), flush=True)
    one = next((r["throughput_seeds_per_s"] for r in reports if r.get("world_size") == 1 and r["status"] != "failed"),
               None)
    doc = {"schema": "torch_sparserl.bench_ddp_minibatch/1", "env": env, "date": started,
           "config": {k: getattr(args, k) for k in ("graph", "device", "epochs", "batch_size", "fanouts", "hidden",
                                                    "features", "buckets")},
           "rows": [summary_row(r, one) for r in reports], "runs": reports,
           "command": " ".join(["python benchmarks/bench_ddp_minibatch.py"] + (argv if argv is not None else sys.argv[1:]))}
    path = results_path(args.out, "ddp-minibatch", env["gpu"] if args.device == "cuda" else None, started[:10])
    write_json_md(doc, path, markdown)
    print(f"wrote {path}")
    return 0 if all(r["status"] == "ok" for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
