"""What building a matrix per mini-batch costs the host: ``ts.csr`` of sampled subgraphs.

The batches of a graph are sampled as ``bench_minibatch`` samples them (1024 seeds, fanouts 10
and 5), and each is handed over the ways a training loop has them:

* ``cuda_csr`` — a ``torch.sparse_csr`` tensor already on the GPU (sampled there, or moved by a
  loader): ``ts.csr(A_i)`` copies its indices and checks them on the device
  (``torch_sparserl.pattern.device_check``);
* ``cuda_parts`` — the same as ``(crow, col, val)`` CUDA tensors;
* ``host_parts`` — host tensors, pinned, bound for the GPU: ``ts.csr(parts, shape,
  device="cuda")`` checks them on the host and sends them (the C++ library's staging);
* on the CPU, ``cpu_parts`` — host tensors, checked on the host.

Per way: host microseconds per ``ts.csr`` (each batch once per round, no synchronization in the
loop, the median over the rounds of the mean per batch), and on CUDA the same loop with
``torch.cuda.set_sync_debug_mode("error")``: ``syncs`` says whether any call synchronized (the
error it raised), ``none`` where none did. The first ``A @ X`` of each matrix is timed the same
way (``first_product_us``): intake and first product are what a step pays per new pattern.
``--breakdown`` runs the loop once more with the library's intake functions timed
(:data:`INTAKE_PARTS`: the C++ library's intake of a CUDA triple where it serves, else the metadata
checks, the copy and check of CUDA indices in all, the fused kernel's launch where it serves, else
the torch way's parts: index copies, the device check, its flags and event), in host µs per
matrix: where a ``ts.csr`` spends its time. The fused kernel is built in the background from the
first CUDA intake on, the C++ library from the first CUDA product; the warm-up waits for both, so
that the timed loops measure the intake a training loop has after its first steps.

    python benchmarks/bench_intake.py --graph pubmed --out benchmarks/results/
    python benchmarks/bench_intake.py --graph cora --device cpu --batches 4 --out /tmp/i.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import environment, load_graph, results_path, tables, timing, write_json_md  # noqa: E402

SCHEMA = "torch_sparserl.bench_intake/1"
CUDA_WAYS = ("cuda_csr", "cuda_parts", "host_parts")
INTAKE_PARTS = (  # (module, attribute, label): what --breakdown times inside ts.csr
    ("torch_sparserl.pattern", "intake", "C++ intake, in all"),
    ("torch_sparserl.pattern.device_check", "intake", "C++ intake: the slot and the library's call"),
    ("torch_sparserl.tensor.construct", "_check_parts", "metadata checks"),
    ("torch_sparserl.tensor.construct", "_staged", "C++ staging (host parts)"),
    ("torch_sparserl.pattern", "checked_copies", "copy and check, in all"),
    ("torch_sparserl.pattern.device_check", "_fused_copy_checked", "fused kernel: allocations and launch"),
    ("torch_sparserl.toolchain.intake", "_Launcher.__call__", "fused kernel: the launch"),
    ("torch_sparserl.pattern", "private_copy", "index copies"),
    ("torch_sparserl.pattern", "lookup", "pattern lookup"),
    ("torch_sparserl.pattern.device_check", "DeviceCheck.__init__", "device check (torch ops), in all"),
    ("torch_sparserl.pattern.device_check", "_flags", "device check: the flags"),
    ("torch_sparserl.pattern.device_check", "_record_event", "device check: its event"),
    ("torch_sparserl.tensor.construct", "_made", "the CSRMatrix"),
)


def handed_over(way: str, batch, device):
    """``(data, shape)``: what ``ts.csr`` is given for ``batch`` in ``way``."""
    import torch

    crow, col, val = batch.parts()
    shape = batch.shape
    if way == "cuda_csr":
        return torch.sparse_csr_tensor(crow.to(device), col.to(device), val.to(device), shape,
                                       check_invariants=False), None
    if way == "cuda_parts":
        return (crow.to(device), col.to(device), val.to(device)), shape
    if way == "host_parts":
        return (crow.pin_memory(), col.pin_memory(), val.pin_memory()), shape
    return (crow, col, val), shape


def fused_ready(device, timeout_s: float = 120.0) -> bool:
    """Wait until the fused intake kernel is built and loaded for ``device`` (its first request
    starts the build); False where it cannot be (the torch way then serves every intake)."""
    import torch

    from torch_sparserl.toolchain import intake

    index = device.index if device.index is not None else torch.cuda.current_device()
    deadline = time.monotonic() + timeout_s
    while intake.PROVIDER.launcher(index) is None:
        if index in intake.PROVIDER._launchers or time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def cpp_intake_ready() -> bool:
    """Load the C++ library (building it where it is not on disk), whose ``intake()`` takes CUDA
    triples in by one call; False where it cannot be loaded (the Python path then serves)."""
    from torch_sparserl.jit import fastpath

    return fastpath.ensure(wait=True)  # a loaded library registers its intake (pattern.device_check)


def time_way(way: str, batches, device, features: int, rounds: int, breakdown: bool = False) -> dict:
    import torch

    import torch_sparserl as ts

    cuda = torch.device(device).type == "cuda"
    target = device if way == "host_parts" else None
    given = [handed_over(way, b, device) for b in batches]
    xs = [torch.randn(b.shape[1], features, device=device) for b in batches]

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def build(data, shape):
        return ts.csr(data, shape, device=target) if shape is not None else ts.csr(data)

    for (data, shape), X in zip(given[:2], xs):  # the process's one-time costs
        build(data, shape) @ X
    fused = fused_ready(torch.device(device)) if cuda else False
    door = cuda and cpp_intake_ready()
    intake, product = [], []
    for _ in range(rounds):
        sync()
        start = time.perf_counter()
        built = [build(data, shape) for data, shape in given]
        intake.append((time.perf_counter() - start) / len(given) * 1e6)
        start = time.perf_counter()
        for A, X in zip(built, xs):
            A @ X
        product.append((time.perf_counter() - start) / len(given) * 1e6)
        sync()
    syncs = None
    if cuda:
        syncs = "none"
        sync()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for (data, shape), X in zip(given, xs):
                build(data, shape) @ X
        except RuntimeError as exc:
            syncs = str(exc).splitlines()[0][:200]
        finally:
            torch.cuda.set_sync_debug_mode("default")
        sync()
    parts = None
    if breakdown:  # once more, the intake's functions timed (their wrappers add to the total)
        sync()
        with timing.HostBreakdown(INTAKE_PARTS) as timed:
            start = time.perf_counter()
            for data, shape in given:
                build(data, shape)
            total = time.perf_counter() - start
        sync()
        parts = {label: {"us": seconds / len(given) * 1e6, "calls": timed.calls[label] / len(given)}
                 for label, seconds in timed.seconds.items()}
        parts["ts.csr, in all"] = {"us": total / len(given) * 1e6, "calls": 1.0}
    return {"intake_us": statistics.median(intake), "intake_rounds_us": intake,
            "first_product_us": statistics.median(product), "syncs": syncs, "breakdown_us": parts,
            "fused_kernel": fused, "cpp_intake": door}


def markdown(doc: dict) -> str:
    setup = doc["setup"]
    lines = [f"# Intake of sampled subgraphs: {setup['graph']} on {doc['env'].get('gpu') or 'CPU'}", "",
             f"{setup['batches']} batches ({setup['mean_rows']:.0f} rows, {setup['mean_nnz']:.0f} nonzeros on "
             f"average), {setup['rounds']} rounds; host µs per matrix, no synchronization in the loop "
             "(median over the rounds); syncs: what `torch.cuda.set_sync_debug_mode(\"error\")` raised.", "",
             *tables.header(["way", "ts.csr µs", "first A @ X µs", "syncs"], "lrrl")]
    for way, r in doc["ways"].items():
        lines.append(tables.row([way, f"{r['intake_us']:.1f}", f"{r['first_product_us']:.1f}", r["syncs"] or "–"]))
    broken = {way: r["breakdown_us"] for way, r in doc["ways"].items() if r.get("breakdown_us")}
    if broken:
        labels = [label for _, _, label in INTAKE_PARTS] + ["ts.csr, in all"]
        labels = [label for label in labels if any(label in parts for parts in broken.values())]
        lines += ["", "Where a `ts.csr` spends its host time (`--breakdown`: one more loop with these functions "
                  "timed, µs per matrix; calls per matrix in parentheses; the parts nest: the copy and check "
                  "holds the fused kernel's launch or the torch way's copies and device check, which holds its "
                  "flags and its event):", "", *tables.header(["part", *broken], "l" + "r" * len(broken))]
        for label in labels:
            cells = [f"{parts[label]['us']:.1f} ({parts[label]['calls']:g})" if label in parts else "–"
                     for parts in broken.values()]
            lines.append(tables.row([label, *cells]))
    return "\n".join(lines + ["", tables.runs_line(doc["runs"])]) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--graph", default="pubmed", help="a matrix name, a .npz path or a synthetic spec")
    parser.add_argument("--batches", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--fanouts", default="10,5")
    parser.add_argument("--features", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--device", default=None, help="cuda (default where there is one) or cpu")
    parser.add_argument("--breakdown", action="store_true", help="time the intake's parts too (one more loop)")
    parser.add_argument("--out", default="benchmarks/results/", help="a .json file, or a folder for the default name")
    args = parser.parse_args(argv)
    for name in ("batches", "batch_size", "features", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}: expected a whole number >= 1 (got {getattr(args, name)})")

    import numpy as np
    import torch

    from torch_sparserl.data.sampling import neighbor_batches

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    A = load_graph(args.graph)
    A = ((A + A.T) > 0).astype(np.float32).tocsr()
    fanouts = [int(f) for f in args.fanouts.split(",")]
    batches = list(neighbor_batches(A, args.batch_size, fanouts, seed=0, limit=args.batches))
    env = environment()
    path = results_path(args.out, "intake", env["gpu"] if device == "cuda" else None, dt.date.today().isoformat())
    doc = {"schema": SCHEMA, "env": env,
           "runs": [{"started": dt.datetime.now().isoformat(timespec="seconds"),
                     "command": " ".join(["python benchmarks/bench_intake.py"]
                                         + (argv if argv is not None else sys.argv[1:]))}],
           "setup": {"graph": args.graph, "batches": len(batches), "rounds": args.rounds, "device": device,
                     "mean_rows": float(np.mean([b.shape[0] for b in batches])),
                     "mean_nnz": float(np.mean([b.nnz for b in batches]))},
           "ways": {}}
    for way in (CUDA_WAYS if torch.device(device).type == "cuda" else ("cpu_parts",)):
        doc["ways"][way] = time_way(way, batches, device, args.features, args.rounds, args.breakdown)
        print(way, f"{doc['ways'][way]['intake_us']:.1f} us per ts.csr", doc["ways"][way]["syncs"] or "", flush=True)
    write_json_md(doc, path, markdown)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
