"""Where a first training run waits for the runtime: each call that the loop's thread makes
into the runtime's decisions, timed, beside what the background thread did meanwhile.

``bench_cold_start.py`` reports *waited*, the seconds the products spent in the runtime's
decisions (``Runtime.stats["jit_s"]``, charged to the break-even). This splits it: one child
process per row and variant, an empty kernel cache, the cold compiled run of
``bench_cold_start.run_cold`` (short: ``--after`` epochs once decided, ``--max-s`` at most),
with the runtime's ``_resolve`` (the caller's decision call), its hand-off to the background
thread, the fingerprint, the host copy of the indices and the side stream's creation timed on
whichever thread ran them.

Variants:
  default    the runtime as shipped
  gpu-hash   every CUDA pattern fingerprinted on the GPU (``pattern.HOST_KEPT_MAX = 0``)

    python benchmarks/profile_first_waits.py --rows pubmed:gcn,dblp-2010:gcn --variants default,gpu-hash

Prints each row's events (thread, start ms since the child began, duration ms) and writes
them as JSON lines with ``--out``.
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

VARIANTS = ("default", "gpu-hash")


def _child(graph: str, model: str, variant: str, after: int, max_s: float) -> dict:
    import torch

    import bench_cold_start as cold
    import bench_gnn as bench
    from torch_sparserl import fingerprint as fp
    from torch_sparserl import pattern as patterns
    from torch_sparserl import runtime as rt

    if variant == "gpu-hash":
        patterns.HOST_KEPT_MAX = 0
    start = time.perf_counter()
    events: list[dict] = []

    def timed(owner, name: str, what: str, detail=None):
        inner = getattr(owner, name)

        def wrapper(*args, **kwargs):
            began = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                events.append({"what": what, "thread": threading.current_thread().name,
                               "at_ms": round((began - start) * 1e3, 3),
                               "ms": round((time.perf_counter() - began) * 1e3, 3),
                               "detail": detail(args) if detail else None})
        setattr(owner, name, wrapper)

    timed(rt.Runtime, "_resolve", "decision call", lambda a: f"{a[1]} n={a[2]}")
    timed(rt.Runtime, "_in_background", "hand-off to the background thread")
    timed(patterns.Pattern, "host_indices", "host copy of the indices")
    timed(patterns, "_side_stream", "side stream")
    timed(fp, "fingerprint", "fingerprint")
    rt.fingerprint = fp.fingerprint  # the runtime's own name for it

    device = torch.device("cuda")
    graph_data = bench.prepare_graph(graph, device)
    result = cold.run_cold(model, 128, graph_data, device, jit="background", after=after, max_s=max_s)
    return {"graph": graph, "model": model, "variant": variant, "waited_ms": result["waited_s"] * 1e3,
            "compile_s": result["first_epoch_s"], "epochs_ms": result["epochs_ms"][:20], "events": events}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="pubmed:gcn", help="GRAPH:MODEL,... (hidden 128)")
    parser.add_argument("--variants", default="default")
    parser.add_argument("--after", type=int, default=2)
    parser.add_argument("--max-s", type=float, default=4.0)
    parser.add_argument("--out", help="JSON lines file")
    parser.add_argument("--child", nargs=3, metavar=("GRAPH", "MODEL", "VARIANT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print("RESULT " + json.dumps(_child(*args.child, args.after, args.max_s)))
        return 0
    for variant in args.variants.split(","):
        if variant not in VARIANTS:
            parser.error(f"--variants: expected some of {', '.join(VARIANTS)}, got {variant!r}")

    import torch

    import bench_cold_start as cold

    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (it times the runtime's first decisions beside a training loop on one)")
    fast = cold._fast_path_library("cuda")  # built once per machine, as after a user's first run
    lines = []
    for row in args.rows.split(","):
        graph, model = row.split(":")
        for variant in args.variants.split(","):
            with tempfile.TemporaryDirectory(prefix="sparserl-waits-") as tmp:
                if fast is not None:
                    shutil.copytree(fast, Path(tmp) / "cache" / "build" / fast.name)
                env = cold._child_env(str(Path(tmp) / "cache"))  # as bench_cold_start's rows
                done = subprocess.run([sys.executable, __file__, "--child", graph, model, variant, "--after",
                                       str(args.after), "--max-s", str(args.max_s)],
                                      env=env, capture_output=True, text=True, timeout=300)
            found = [line[7:] for line in done.stdout.splitlines() if line.startswith("RESULT ")]
            if done.returncode != 0 or not found:
                print(f"{graph} {model} {variant}: failed (exit {done.returncode})\n{done.stderr[-3000:]}")
                continue
            result = json.loads(found[-1])
            lines.append(result)
            print(f"== {graph} {model} {variant}: waited {result['waited_ms']:.2f} ms, compile "
                  f"{result['compile_s']:.1f} s, epochs 2-11 {[round(x, 2) for x in result['epochs_ms'][:10]]}")
            for event in sorted(result["events"], key=lambda e: e["at_ms"]):
                if event["ms"] >= 0.1:
                    print(f"   {event['at_ms']:10.2f} ms  {event['ms']:8.3f} ms  {event['thread'][:20]:20s} "
                          f"{event['what']}{' (' + event['detail'] + ')' if event['detail'] else ''}")
    if args.out:
        Path(args.out).write_text("".join(json.dumps(line) + "\n" for line in lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
