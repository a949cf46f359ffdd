"""The install builds the C++ fast path where it can; the project's metadata is in pyproject.toml.

Where the installing Python has a CUDA build of torch and the CUDA toolkit (``nvcc``), building
the package (``pip install .``, and ``pip install -e .`` too) also builds the C++ fast path's
library into the installing user's cache (:func:`torch_sparserl.jit.fastpath.build`, about a
minute), so that the first CUDA product of a process loads it instead of starting its build. It
never fails the install: anywhere else (no torch in an isolated build environment, a CPU torch,
no compiler, ``SPARSERL_FAST_PATH=0``) it says why and the library is built by the first process
that needs it, in the background, as before.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
BUILD_TIMEOUT_S = 900

# Run from the source tree: it decides whether the library can be built here, and builds it.
_BUILD = """
import sys
try:
    import torch  # noqa: F401
except ImportError:
    print("skipped: torch is not installed in the build environment (pip's build isolation)")
    sys.exit(0)
from torch_sparserl.jit import fastpath
why = fastpath.unavailable()
if why is not None:
    print(f"skipped: {why}")
    sys.exit(0)
print(f"built: {fastpath.build()}")
"""


def build_fast_path(run=subprocess.run) -> str:
    """Build the fast path's library in a subprocess of the installing Python; one line saying
    what happened. Never raises."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    try:
        done = run([sys.executable, "-c", _BUILD], cwd=ROOT, env=env, capture_output=True, text=True,
                   timeout=BUILD_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"not built ({type(exc).__name__}: {exc}); the first CUDA product builds it"
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        return f"not built ({last}); the first CUDA product builds it"
    return done.stdout.strip().splitlines()[-1] if done.stdout.strip() else "nothing said"


class BuildPyWithFastPath(build_py):
    """``build_py``, then the C++ fast path's library (:func:`build_fast_path`)."""

    def run(self):
        super().run()
        print(f"torch-sparserl: C++ fast path: {build_fast_path()}", file=sys.stderr)


if __name__ == "__main__":  # as setuptools' build backend runs it; importable for tests
    setup(cmdclass={"build_py": BuildPyWithFastPath})
