"""An example script run under ``torchrun --standalone`` for one world size, its ``--out`` report read back."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from .environment import REPO
from .errors import usage_error
from .matrices import select_matrices


def world_sizes(text: str) -> list[int]:
    """``--worlds``: positive integers, comma-separated; a usage error names what came."""
    try:
        worlds = [int(w) for w in text.split(",")]
        if any(w < 1 for w in worlds):
            raise ValueError
    except ValueError:
        raise usage_error(f"--worlds: expected positive integers, comma-separated (got {text!r})") from None
    return worlds


def example_graph(name: str) -> str:
    """``--graph`` as an example run in another folder reads it: a generator spec as it is, a file's
    path made absolute, a shared matrix's name (``dblp-2010``) as its file's path (the examples know
    the package's shipped matrices, files and generator specs only)."""
    if ":" in name:  # a generator spec: the example generates it (per rank with --rows-only)
        return name
    if Path(name).is_file():
        return str(Path(name).resolve())
    return select_matrices([name])[0].source


_ERROR = re.compile(r"^(?:\[rank\d+\]:\s*)?((?:[\w.]+\.)?\w*(?:Error|Exception)\b.*)$")


def first_error(output: str) -> str | None:
    """The first exception line a rank printed (``[rank0]: ValueError: ...``), which torchrun's
    summary at the end of the output does not repeat; None where there is none."""
    for line in output.splitlines():
        found = _ERROR.match(line.strip())
        if found and not found.group(1).startswith(("torch.distributed.elastic", "ChildFailedError")):
            return found.group(1)[:500]
    return None


def run_example(example: Path, world: int, arguments: list[str], device: str, folder: Path, timeout: float) -> dict:
    """``example``'s report (``--out``) for ``world`` ranks with ``arguments``, ``status`` "ok",
    or "mismatch" when it exited non-zero (its check failed); without a report, the tail of its
    output with ``status`` "failed". ``device`` "cpu" hides every GPU from it."""
    out = folder / f"world{world}.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world), "--standalone",
               str(example), *arguments, "--out", str(out)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout, cwd=folder)
    if not out.exists():
        output = result.stdout + result.stderr
        return {"world_size": world, "status": "failed", "returncode": result.returncode,
                "error": first_error(output), "output_tail": output[-3000:]}
    report = json.loads(out.read_text())
    report["status"] = "ok" if result.returncode == 0 else "mismatch"
    return report
