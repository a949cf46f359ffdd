"""The install's build of the C++ fast path (setup.py): where it cannot build, it says why and
never fails the install (CPU); and the metadata setuptools builds from pyproject.toml."""

from __future__ import annotations

import email.parser
import importlib.util
import shutil
import subprocess
import sys

import pytest

from helpers import REPO

ROOT = REPO


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


def test_setuptools_builds_the_metadata_with_one_version_and_an_spdx_license(tmp_path):
    """The version comes from torch_sparserl.__version__ alone; the license is an SPDX expression
    (the LICENSE file's own) with its file; the pyg extra exists. Built by this machine's
    setuptools, from a copy of the project's top files, so the checkout stays clean."""
    import torch_sparserl

    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, source / name)
    (source / "torch_sparserl").symlink_to(ROOT / "torch_sparserl")
    done = subprocess.run([sys.executable, "-c", "import sys; from setuptools import build_meta; "
                           "print(build_meta.prepare_metadata_for_build_wheel(sys.argv[1]))", str(tmp_path)],
                          cwd=source, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    info = tmp_path / done.stdout.split()[-1]
    metadata = email.parser.Parser().parsestr((info / "METADATA").read_text())
    assert metadata["Version"] == torch_sparserl.__version__
    assert (ROOT / "LICENSE").read_text().startswith("BSD 3-Clause License")
    assert metadata["License-Expression"] == "BSD-3-Clause" and (info / "licenses" / "LICENSE").is_file()
    assert not any(c.startswith("License ::") for c in metadata.get_all("Classifier"))  # PEP 639: not both
    assert 'torch_geometric>=2.6; extra == "pyg"' in metadata.get_all("Requires-Dist")


def test_the_package_data_ships_every_source_of_the_fast_path():
    """Each file the fast path's library is built from (the unit and the parts it includes)
    matches a package-data pattern of pyproject.toml: an installed package can build it."""
    import tomllib

    from torch_sparserl.jit import fastpath

    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    shipped = {path for pattern in data["torch_sparserl"] for path in (ROOT / "torch_sparserl").glob(pattern)}
    sources = fastpath.sources()
    assert len(sources) > 1 and [str(source) for source in sources if source not in shipped] == []
