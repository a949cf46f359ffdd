#!/usr/bin/env python3
"""Generation beyond the grid: off-grid kernels from the policy, and what becomes of them.

For every cell (matrix, op, n, dtype) the policy proposes with ``strategy="explore"``: its first
choice of the grid, then K - 1 off-grid kernels (parameter values and combinations the
templates accept and the grid never lists: :mod:`torch_sparserl.specialize.offgrid`). With
``--sample-k`` it also samples its own completions (``strategy="sample"``), which it writes
token by token and may put anywhere; each goes through the same domain gate. Then, by tier:

* ``--tier compile`` (no GPU): how many parse, pass the domain gate, and compile with nvcc for
  sm_90, with the registers and spills ptxas reports (:func:`compile_only`).
* ``--tier gpu``: each distinct kernel that passed the gate screened three times in the sandbox
  with cuSPARSE timed beside it (the median run, as ``eval.py``), and the exhaustive autotuner
  (the grid oracle) run on the same cell in the same process: how many are correct, and how
  often the best off-grid kernel beats the oracle.

Writes ``--out`` (JSON) and the same name with ``.md`` (a table), the command in its header::

    python training/offgrid.py --out training/results/offgrid-cpu.json                     # no GPU
    python training/offgrid.py --tier gpu --out training/results/offgrid-h100.json         # a GPU
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import platform
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from training.common import Patterns, parse_args, pick_device  # noqa: E402
from training.data import geomean  # noqa: E402
from training.eval import _json_default, _median_screen, _oracle_cell  # noqa: E402

TIERS = ("compile", "gpu")


@dataclass
class OffGridArgs:
    """Propose off-grid kernels with the policy and measure them (compile tier, or a GPU)."""

    policy: str = "torch_sparserl/specialize/policy/checkpoint"
    matrices: list[str] = field(default_factory=lambda: ["rajat01", "citeseer", "dnn_n1024_l1"])
    # op:n:dtype
    requests: list[str] = field(default_factory=lambda: ["spmv:1:f32", "spmm:32:f32", "spmm:128:f32",
                                                         "spmm:128:f16"])
    k: int = 16
    temperature: float = 1.0
    sample_k: int = 4
    sample_temperature: float = 1.5
    tier: str = "compile"
    oracle_budget_s: float = 300.0
    out: str = "training/results/offgrid-cpu.json"
    seed: int = 0
    device: str = "auto"


def parse_request(text: str) -> tuple[str, int, str]:
    """``op:n:dtype`` (``spmm:32:f32``) as (op, n, dtype); SystemExit naming the option otherwise."""
    parts = text.split(":")
    if len(parts) != 3 or parts[0] not in ("spmv", "spmm") or not parts[1].isdigit() or \
            parts[2] not in ("f32", "f16", "bf16") or (parts[0] == "spmv") != (parts[1] == "1"):
        raise SystemExit(f"offgrid: --requests expects op:n:dtype items such as spmv:1:f32 or spmm:32:bf16 "
                         f"(spmv with n=1), got {text!r}")
    return parts[0], int(parts[1]), parts[2]


def _row(p, op: str, n: int, dtype: str, grid: set) -> dict:
    """What the gate says of one proposal: parsed, inside the domain, off-grid."""
    from torch_sparserl.abi import PlanError, check_source
    from torch_sparserl.specialize import offgrid
    from torch_sparserl.specialize.families import expand_headers

    row = {"family": p.spec.family, "params": dict(p.spec.params), "key": p.spec.key,
           "logprob": round(p.sample.logprob, 3), "finished": p.sample.finished, "parsed": False,
           "in_domain": False, "off_grid": None, "refusal": None}
    try:
        if not p.sample.finished:
            raise PlanError(p.error or "unfinished")
        check_source(expand_headers(p.compact))
        row["parsed"] = True
        family, params = offgrid.check_declared(p.compact, op=op, dtype=dtype, n=n)
        row["in_domain"] = True
        row["off_grid"] = offgrid.canonical(family, params, op=op, dtype=dtype, n=n) not in grid
    except PlanError as exc:
        row["refusal"] = str(exc)
    return row


def _compile(row: dict, spec) -> None:
    from torch_sparserl.evaluate.compile_tier import compile_only

    record = compile_only(spec)
    row.update(compiled=bool(record.compiled), registers=record.registers, spill_bytes=record.spill_bytes,
               error_kind=str(record.error_kind) if record.error_kind else None)


def _screen(row: dict, spec, box, key: str, n: int, dtype: str) -> None:
    record = _median_screen(box, spec, key, n, dtype)
    row.update(compiled=bool(record.compiled), correct=record.correct, speedup=record.speedup,
               runtime_us=record.runtime_us, cusparse_us=record.cusparse_us,
               error_kind=str(record.error_kind) if record.error_kind else None)


def measure_cell(policy, pattern, op: str, n: int, dtype: str, args, box=None) -> dict:
    """One cell: the explored and sampled proposals, the gate, and the tier's measurement."""
    from torch_sparserl.specialize import offgrid
    from torch_sparserl.specialize.policy.propose import propose

    rowptr, col, shape, feats = pattern
    grid = offgrid.grid_keys(op, dtype, n, feats)
    start = time.monotonic()
    methods = {"explore": propose(policy, rowptr, col, shape, op=op, n=n, dtype=dtype, k=args.k, seed=args.seed,
                                  temperature=args.temperature, features=feats, strategy="explore")}
    generate_s = {"explore": round(time.monotonic() - start, 2)}
    if args.sample_k:
        start = time.monotonic()
        methods["sample"] = propose(policy, rowptr, col, shape, op=op, n=n, dtype=dtype, k=args.sample_k,
                                    seed=args.seed, temperature=args.sample_temperature, features=feats,
                                    strategy="sample")
        generate_s["sample"] = round(time.monotonic() - start, 2)
    tuning = None
    if args.tier == "gpu":
        from torch_sparserl.specialize import search

        tuning = search.problem((rowptr.astype("int32"), col.astype("int32"), shape), box, n=n, dtype=dtype,
                                timeout_s=60.0, features=feats)
    measured: dict[str, dict] = {}
    cell = {"op": op, "n": n, "dtype": dtype, "generate_s": generate_s}
    for name, props in methods.items():
        rows = []
        for p in props:
            row = _row(p, op, n, dtype, grid)
            if row["in_domain"]:  # only what passed the gate reaches a compiler
                if p.spec.key not in measured:
                    measured[p.spec.key] = {}
                    if tuning is None:
                        _compile(measured[p.spec.key], p.spec)
                    else:
                        _screen(measured[p.spec.key], p.spec, box, tuning.matrix_key, n, dtype)
                row.update(measured[p.spec.key])
            rows.append(row)
        cell[name] = rows
    if tuning is not None:
        cell["oracle"] = _oracle_cell(pattern, op, n, SimpleNamespace(dtype=dtype,
                                                                      oracle_budget_s=args.oracle_budget_s), box)
    return cell


def summarize(cells: list[dict]) -> dict:
    """Counts per request (``op n dtype``) and in all, for each method."""
    groups: dict[str, list] = {}
    for c in cells:
        groups.setdefault(f"{c['op']} n={c['n']} {c['dtype']}", []).append(c)
    groups["all"] = list(cells)
    out = {}
    for g, cs in groups.items():
        per = {}
        for method in ("explore", "sample"):
            rows = [r for c in cs for r in c.get(method, [])]
            if not rows:
                continue
            beyond = [r for r in rows if r["off_grid"]]
            m = {"cells": len(cs), "proposals": len(rows), "distinct": len({(r["key"]) for r in rows}),
                 "parsed": sum(r["parsed"] for r in rows), "in_domain": sum(r["in_domain"] for r in rows),
                 "off_grid": len(beyond), "off_grid_compiled": sum(bool(r.get("compiled")) for r in beyond),
                 "off_grid_spilled": sum((r.get("spill_bytes") or 0) > 0 for r in beyond),
                 "off_grid_resources": sum(r.get("error_kind") == "resources" for r in beyond)}
            if any("correct" in r for r in rows):
                m["off_grid_correct"] = sum(bool(r.get("correct")) for r in beyond)
                wins, fracs = 0, []
                for c in cs:
                    oracle = (c.get("oracle") or {}).get("speedup")
                    best = max([r.get("speedup") or 0.0 for r in c.get(method, []) if r["off_grid"]
                                and r.get("correct")] or [0.0])
                    if oracle:
                        wins += best > oracle
                        fracs.append(best / oracle)
                m["cells_off_grid_beats_oracle"] = wins
                m["best_off_grid_frac_oracle_mean"] = sum(fracs) / len(fracs) if fracs else None
                m["oracle_speedup_geomean"] = geomean(c["oracle"]["speedup"] for c in cs
                                                      if (c.get("oracle") or {}).get("speedup"))
            per[method] = m
        out[g] = per
    return out


def _command(argv: list[str] | None) -> str:
    return " ".join(["python training/offgrid.py", *map(shlex.quote, sys.argv[1:] if argv is None else argv)])


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def markdown(doc: dict) -> str:
    """The summary as a table, the command and the environment in the header."""
    tier = doc["args"]["tier"]
    lines = [f"# Off-grid kernels: {tier} tier", "",
             "```bash", doc["command"], "```", "",
             f"{doc['created']}, commit {doc['commit']}, host {doc['env']['host']}"
             + (f", GPU {doc['env']['gpu']}" if doc["env"].get("gpu") else ", no GPU"), ""]
    if tier == "compile":
        lines += ["Correctness and speed need a GPU and were not measured in this run "
                  "(`--tier gpu` measures them against the grid oracle and cuSPARSE in the same run).", ""]
    head = ["request", "method", "proposals", "parsed", "in domain", "off-grid", "off-grid compiled",
            "off-grid spilling"]
    if tier == "gpu":
        head += ["off-grid correct", "cells beating the oracle", "best off-grid / oracle"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for group, per in doc["summary"].items():
        for method, m in per.items():
            row = [group, method, m["proposals"], m["parsed"], m["in_domain"], m["off_grid"], m["off_grid_compiled"],
                   m["off_grid_spilled"]]
            if tier == "gpu":
                frac = m.get("best_off_grid_frac_oracle_mean")
                row += [m.get("off_grid_correct"), f"{m.get('cells_off_grid_beats_oracle')} of {m['cells']}",
                        "-" if frac is None else f"{frac:.1%}"]
            lines.append("| " + " | ".join(str(v) for v in row) + " |")
    refusals: dict[str, int] = {}
    for c in doc["cells"]:
        for method in ("explore", "sample"):
            for r in c.get(method, []):
                if r["refusal"]:
                    why = r["refusal"].split(", got")[0][:140]
                    refusals[why] = refusals.get(why, 0) + 1
    if refusals:
        lines += ["", "Refused before any compiler (count, reason):", ""]
        lines += [f"- {v} × {k}" for k, v in sorted(refusals.items(), key=lambda kv: -kv[1])]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(OffGridArgs, argv)
    if args.tier not in TIERS:
        raise SystemExit(f"offgrid: --tier expects one of {', '.join(TIERS)}, got {args.tier!r}")
    if args.k < 2:
        raise SystemExit(f"offgrid: --k expects at least 2 (the grid's first choice and k - 1 off-grid), got {args.k}")
    requests = [parse_request(r) for r in args.requests]
    import torch

    from torch_sparserl.specialize.policy.model import KernelPolicy

    if args.tier == "gpu" and not torch.cuda.is_available():
        raise SystemExit("offgrid: --tier gpu needs a CUDA GPU (none is visible); --tier compile runs without one")
    patterns = Patterns()
    missing = [m for m in args.matrices if not patterns.available(m)]
    if missing:
        raise SystemExit(f"offgrid: --matrices names matrices that cannot be loaded: {', '.join(missing)}")
    policy = KernelPolicy.load(args.policy, pick_device(args.device))
    env = {"python": platform.python_version(), "torch": torch.__version__, "host": platform.node()}
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
    doc = {"schema": "torch_sparserl.offgrid/1", "command": _command(argv), "commit": _commit(),
           "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
           "args": dataclasses.asdict(args), "env": env, "cells": []}
    box = None
    if args.tier == "gpu":
        from torch_sparserl.evaluate.sandbox import Sandbox

        box = Sandbox()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        for matrix in args.matrices:
            pattern = patterns.get(matrix)
            for op, n, dtype in requests:
                start = time.monotonic()
                cell = {"matrix": matrix, **measure_cell(policy, pattern, op, n, dtype, args, box)}
                doc["cells"].append(cell)
                beyond = [r for r in cell["explore"] if r["off_grid"]]
                print(f"{matrix}|{op}|n={n}|{dtype}: {len(beyond)} off-grid, "
                      f"{sum(bool(r.get('compiled')) for r in beyond)} compiled"
                      + (f", {sum(bool(r.get('correct')) for r in beyond)} correct" if box else "")
                      + f" ({time.monotonic() - start:.1f} s)", flush=True)
                doc["summary"] = summarize(doc["cells"])
                out.write_text(json.dumps(doc, indent=1, default=_json_default) + "\n")
    finally:
        if box is not None:
            box.close()
    doc["summary"] = summarize(doc["cells"])
    out.write_text(json.dumps(doc, indent=1, default=_json_default) + "\n")
    out.with_suffix(".md").write_text(markdown(doc))
    print(markdown(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
