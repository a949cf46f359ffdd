"""The machine a run measured, recorded in every results file: the GPU (its driver and clocks as
found), torch, CUDA, the host's CPU, the checkout's commit; and the process's resident memory."""

from __future__ import annotations

import os
import platform
import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def gpu_slug(name: str | None) -> str:
    """"NVIDIA H100 80GB HBM3" → "h100-80gb-hbm3"; "cpu" without a GPU."""
    if not name:
        return "cpu"
    name = re.sub(r"^nvidia\s+", "", name.strip(), flags=re.I)
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "gpu"


def cuda_available() -> bool:
    """Whether torch sees a CUDA GPU (False where torch is missing)."""
    try:
        import torch
        return torch.cuda.is_available()
    except ImportError:  # pragma: no cover
        return False


def nvidia_smi() -> dict:
    """Driver and the clocks as found (read only: no benchmark changes clocks); empty where
    ``nvidia-smi`` is missing or says something else."""
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


def cpu_model() -> str | None:
    """The host CPU's model name (launch-bound timings depend on it), or None where unknown."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
    except OSError:
        return platform.processor() or None


def commit() -> str | None:
    """The checkout's commit (short hash), with ``+`` where tracked files differ from it; None
    outside a git checkout. A copy of the working tree sent to another machine may carry a git
    folder of its own that names another commit: the commit in a results file is the one of
    the machine that ran it."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, timeout=15,
                              check=True).stdout.strip()

    try:
        head = git("rev-parse", "--short", "HEAD")
        changed = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+" if changed else "")


def rss_mb() -> float:
    """The process's resident memory now (Linux), in MB; nan where the kernel does not say."""
    try:
        with open("/proc/self/statm") as handle:
            return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return float("nan")


def environment() -> dict:
    """What a results file records of the machine: versions, host, CPU, commit, and where torch
    sees a GPU its name, slug, capability, size and ``nvidia-smi``'s driver and clocks."""
    import numpy as np
    import scipy
    import torch

    env = {"gpu": None, "gpu_slug": "cpu", "torch": torch.__version__, "cuda": torch.version.cuda,
           "python": platform.python_version(), "numpy": np.__version__, "scipy": scipy.__version__,
           "platform": platform.platform(), "host": platform.node(), "cpu": cpu_model(), "cpu_count": os.cpu_count(),
           "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"), "commit": commit(),
           "clocks_changed": False}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env.update({"gpu": props.name, "gpu_slug": gpu_slug(props.name),
                    "capability": f"{props.major}.{props.minor}",
                    "multiprocessors": props.multi_processor_count,
                    "memory_GiB": round(props.total_memory / 2**30, 1)})
        env.update(nvidia_smi())
    return env
