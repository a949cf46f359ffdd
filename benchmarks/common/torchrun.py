"""An example script run under ``torchrun --standalone`` for one world size, its ``--out`` report read back."""

from __future__ import annotations

import json
import os
import re
import signal
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


def _descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (Linux: read from ``/proc``), children first."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry))
    found, queue = [], [pid]
    while queue:
        for child in children.get(queue.pop(), []):
            found.append(child)
            queue.append(child)
    return found


def _kill_tree(pid: int) -> None:
    """Kill ``pid`` and every process under it: torchrun starts its ranks in sessions of their own,
    which a kill of its process group would miss."""
    for victim in [*_descendants(pid), pid]:
        try:
            os.kill(victim, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _text(output) -> str:
    return output.decode(errors="replace") if isinstance(output, bytes) else output or ""


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
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                               cwd=folder)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_tree(process.pid)
        stdout, stderr = process.communicate()
        output = _text(stdout) + _text(stderr)
        return {"world_size": world, "status": "failed", "returncode": None,
                "error": f"did not finish within {timeout:g} s", "output_tail": output[-3000:]}
    result = subprocess.CompletedProcess(command, process.returncode, stdout, stderr)
    if not out.exists():
        output = result.stdout + result.stderr
        return {"world_size": world, "status": "failed", "returncode": result.returncode,
                "error": first_error(output), "output_tail": output[-3000:]}
    report = json.loads(out.read_text())
    report["status"] = "ok" if result.returncode == 0 else "mismatch"
    return report
