"""Errors of the build stage, each carrying the compiler's or the driver's log."""

from __future__ import annotations


class BuildError(RuntimeError):
    def __init__(self, message: str, log: str = ""):
        super().__init__(message if not log else f"{message}\n{log.strip()[-4000:]}")
        self.log = log


class CompileError(BuildError):
    """The source did not compile (nvcc or NVRTC), or its plan line is malformed."""


class LaunchError(BuildError):
    """The driver refused to load or launch a compiled kernel."""
