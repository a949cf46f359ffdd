"""The old module names (``torch_sparserl.runtime``, ...) still work, through one alias
mechanism (:mod:`torch_sparserl._compat`), and nothing of the repository uses them any more."""

from __future__ import annotations

import ast
import importlib
import json
import re
import subprocess
import sys
import textwrap
import tomllib
import warnings
from pathlib import Path

import pytest

import torch_sparserl as ts
from torch_sparserl import _compat

ROOT = Path(__file__).resolve().parents[1]
NOT_SCANNED = {Path(__file__).resolve(), Path(_compat.__file__).resolve()}
SKIPPED_FOLDERS = {".git", "__pycache__", "results", "labels", "build", "dist", "runs", ".venv", "venv"}


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)


def test_the_table_maps_old_names_to_modules_that_exist():
    assert _compat.MOVED
    for old, new in _compat.MOVED.items():
        assert old != new and old.startswith("torch_sparserl.") and new.startswith("torch_sparserl."), old
        assert importlib.util.find_spec(new) is not None, new
        assert _compat.new_name(new) is None, f"{new} is itself an old name"


@pytest.mark.slow
def test_every_old_name_is_its_new_module_with_a_warning_that_names_it():
    result = _run("""
        import importlib, json, warnings
        import torch_sparserl
        from torch_sparserl import _compat
        wrong = []
        for old, new in sorted(_compat.MOVED.items()):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                module = importlib.import_module(old)
            mine = [w for w in caught if issubclass(w.category, DeprecationWarning) and old in str(w.message)]
            if module is not importlib.import_module(new):
                wrong.append(f"{old}: not the module {new}")
            elif len(mine) != 1 or new not in str(mine[0].message):
                wrong.append(f"{old}: warned {[str(w.message) for w in caught]}")
            elif mine[0].filename != "<string>":
                wrong.append(f"{old}: the warning points at {mine[0].filename}, not at the import")
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                importlib.import_module(old)  # once per process and name
        print(json.dumps(wrong))
    """)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.splitlines()[-1]) == []


@pytest.mark.slow
def test_importing_the_package_and_every_module_uses_no_old_name():
    result = _run("""
        import importlib, pkgutil, sys, warnings
        warnings.filterwarnings("error", message=r"torch_sparserl\\.", category=DeprecationWarning)
        import torch_sparserl
        from torch_sparserl import _compat
        for found in pkgutil.walk_packages(torch_sparserl.__path__, "torch_sparserl."):
            if not found.name.endswith("__main__"):
                importlib.import_module(found.name)
        print(sorted(name for name in sys.modules if name in _compat.MOVED))
    """)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "[]"


def test_a_patch_through_the_old_name_reaches_the_new_module(monkeypatch):
    from torch_sparserl.jit import runtime

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        old = importlib.import_module("torch_sparserl.runtime")
        assert old is runtime and sys.modules["torch_sparserl.runtime"] is runtime
        marker = object()
        monkeypatch.setattr("torch_sparserl.runtime.active", marker)
    assert runtime.active is marker
    assert runtime.__spec__.name == "torch_sparserl.jit.runtime"  # the module keeps its own spec


def test_the_old_names_are_attributes_of_the_package_and_from_imports_work():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from torch_sparserl import fastpath, intercept  # loaded by the package's import
        assert ts.fastpath is fastpath is importlib.import_module("torch_sparserl.jit.fastpath")
        assert intercept is importlib.import_module("torch_sparserl.tensor.intercept")
        import torch_sparserl.build.inline as inline
        assert inline is importlib.import_module("torch_sparserl.toolchain.inline")
    with pytest.raises(AttributeError, match="no attribute 'nothing_here'"):
        ts.nothing_here  # noqa: B018
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("torch_sparserl.nothing_here")


def test_an_old_module_that_is_not_loaded_is_no_attribute_as_before():
    result = _run("""
        import torch_sparserl as ts
        print(hasattr(ts, "pyg"), hasattr(ts, "runtime"))  # pyg is loaded by its import only
    """)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "True"]


def _scanned(suffixes):
    for path in sorted(ROOT.rglob("*")):
        parts = set(path.relative_to(ROOT).parts[:-1])
        if (path.suffix in suffixes and path.is_file() and path.resolve() not in NOT_SCANNED
                and not parts & SKIPPED_FOLDERS and not any(p.startswith(".") or p.endswith(".egg-info") for p in parts)):
            yield path


def test_nothing_in_the_repository_uses_an_old_name():
    moved = sorted(_compat.MOVED, key=len, reverse=True)
    # (a name followed by "/" is an identifier, not a module: the checkpoint's format "torch_sparserl.policy/1")
    dotted = re.compile(r"(?<![\w.])(" + "|".join(re.escape(name) for name in moved) + r")(?![\w/])")
    found = []
    for path in _scanned({".py", ".md", ".toml", ".txt", ".cpp", ".cu", ".cuh"}):
        text = path.read_text(errors="replace")
        where = path.relative_to(ROOT)
        found += [f"{where}: {m[1]}" for m in dotted.finditer(text)]
        if path.suffix != ".py":
            continue
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "torch_sparserl":
                found += [f"{where}:{node.lineno}: from {node.module} import {alias.name}" for alias in node.names
                          if _compat.new_name(f"{node.module}.{alias.name}")]
    assert not found, "\n".join(found)


def test_the_entry_points_name_modules_by_their_new_names():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    targets = list(project["scripts"].values()) + [t for group in project["entry-points"].values()
                                                   for t in group.values()]
    for target in targets:
        module, _, attr = target.partition(":")
        assert _compat.new_name(module) is None, target
        spec = importlib.util.find_spec(module)
        assert spec is not None and Path(spec.origin).is_relative_to(ROOT), target
        assert re.search(rf"\b{attr}\b", Path(spec.origin).read_text()), target  # read, not run: no side effect
