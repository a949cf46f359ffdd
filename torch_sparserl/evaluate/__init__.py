"""The evaluator: the referee that scores every candidate kernel.

Pipeline stage 6 of 14: the referee: a candidate kernel's correctness and speed, measured first
in a sandboxed child process.
May import: config, dtypes, data, pattern, kernels, abi, toolchain.

* :mod:`.record` — :class:`EvalRecord` and the closed set of :class:`ErrorKind`;
* :mod:`.reward` — :func:`reward`, a pure function of a record;
* :mod:`.verdict` — whether a kernel serves, from its records: best pick, margin, per call, launch check;
* :mod:`.harness` — :func:`evaluate_candidate` on the GPU, in the calling process;
* :mod:`.sandbox` — :class:`Sandbox`: first runs of untrusted kernels in a child process;
* :mod:`.compile_tier` — :func:`compile_only` with nvcc, no GPU needed.

The harness (GPU) and the compile tier load on first use: the sandbox worker for plain
Python tasks imports none of this (see ``_worker``).
"""

from __future__ import annotations

from .config import EvalConfig
from .record import ErrorKind, EvalRecord
from .reward import reward
from .sandbox import Sandbox, SandboxError, TaskOutcome, evaluate_many


def __getattr__(name):
    # Lazy: harness imports torch and the build stage; compile_tier the build stage.
    if name in ("evaluate_candidate", "Matrix"):
        from . import harness
        return getattr(harness, name)
    if name == "compile_only":
        from .compile_tier import compile_only
        return compile_only
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["ErrorKind", "EvalConfig", "EvalRecord", "Matrix", "Sandbox", "SandboxError", "TaskOutcome",
           "compile_only", "evaluate_candidate", "evaluate_many", "reward"]
