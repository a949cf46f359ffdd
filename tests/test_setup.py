"""The install's build of the C++ fast path (setup.py): where it cannot build, it says why and
never fails the install (CPU)."""

from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def setup_module():
    spec = importlib.util.spec_from_file_location("sparserl_setup", ROOT / "setup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # not as __main__: setup() does not run
    return module


def test_the_build_hook_is_setuptools_build_py(setup_module):
    from setuptools.command.build_py import build_py

    assert issubclass(setup_module.BuildPyWithFastPath, build_py)


def test_a_cpu_torch_skips_the_build_and_says_why(setup_module, monkeypatch):
    import torch

    if torch.version.cuda is not None:
        pytest.skip("this torch has CUDA: the hook would build")
    monkeypatch.delenv("SPARSERL_FAST_PATH", raising=False)
    assert setup_module.build_fast_path() == "skipped: this torch has no CUDA"


def test_turned_off_by_the_environment(setup_module, monkeypatch):
    monkeypatch.setenv("SPARSERL_FAST_PATH", "0")
    assert setup_module.build_fast_path() == "skipped: turned off by SPARSERL_FAST_PATH"


@pytest.mark.parametrize("failure", ["timeout", "missing", "exit"])
def test_a_failed_build_never_fails_the_install(setup_module, failure):
    def run(*args, **kwargs):
        if failure == "timeout":
            raise subprocess.TimeoutExpired(args[0], 900)
        if failure == "missing":
            raise FileNotFoundError("python")
        return subprocess.CompletedProcess(args[0], 1, "", "Traceback ...\nRuntimeError: nvcc not found\n")

    said = setup_module.build_fast_path(run=run)
    assert said.startswith("not built (") and said.endswith("the first CUDA product builds it")
    if failure == "exit":
        assert "RuntimeError: nvcc not found" in said
