"""The repository itself: CI proves what a new user gets, and no test patches torch's config in a
way that outlives it (issue 33, class 1).

pytest 9.2's ``monkeypatch.setattr`` takes the old value from the target's ``__dict__``; torch's
config modules keep their values elsewhere (served by ``__getattr__``), so the undo deletes the
attribute and every later compile in the session fails. ``config.patch(...)`` restores through
the config's own API.
"""

from __future__ import annotations

import ast
import re
import tomllib

import pytest

from helpers import REPO

ROOT = REPO
CI = ROOT / ".ci" / "run"
CONSTRAINTS = ROOT / ".ci" / "constraints.txt"

_PATCHERS = {"setattr", "delattr", "setitem", "delitem"}  # monkeypatch's, and the builtins
_CONFIG = re.compile(r"(^|[._])config($|[.\[])")


def _config_patches(source: str) -> list[tuple[int, str]]:
    """``(line, target)`` of each ``monkeypatch.setattr``-like call (or builtin ``setattr``) whose
    target is a config module or an object inside one, import aliases followed."""
    tree = ast.parse(source)
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases.update({a.asname: a.name for a in node.names if a.asname})
        elif isinstance(node, ast.ImportFrom) and node.module:
            aliases.update({a.asname or a.name: f"{node.module}.{a.name}" for a in node.names})
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not node.args:
            continue
        name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
        if name not in _PATCHERS:
            continue
        target = node.args[0]
        if isinstance(target, ast.Constant) and isinstance(target.value, str):
            text = target.value  # monkeypatch.setattr("torch._inductor.config.x", value)
        else:
            text = ast.unparse(target)
            root = text.split(".", 1)
            text = ".".join([aliases.get(root[0], root[0])] + root[1:])
        if _CONFIG.search(text):
            found.append((node.lineno, text))
    return found


@pytest.mark.parametrize("snippet, caught", [
    ('monkeypatch.setattr(torch._inductor.config, "force_disable_caches", True)', True),
    ('import torch._inductor.config as config\nmonkeypatch.setattr(config.triton, "cudagraph_trees", False)', True),
    ('import torch._dynamo.config as dc\nmp.setattr(dc, "cache_size_limit", 1)', True),
    ('from torch._inductor import config as c\nmonkeypatch.delattr(c, "x")', True),
    ('monkeypatch.setattr("torch._dynamo.config.suppress_errors", True)', True),
    ('monkeypatch.setitem(torch._inductor.config.__dict__, "x", 1)', True),
    ('setattr(torch._functorch.config, "x", 1)', True),
    ('monkeypatch.setattr(torch.cuda, "is_available", lambda: False)', False),
    ('monkeypatch.setattr(passes, "served_fused", f)', False),
    ('with torch._inductor.config.patch(force_disable_caches=True):\n    pass', False),
])
def test_the_scan_finds_config_patches(snippet, caught):
    assert bool(_config_patches(snippet)) == caught


def test_no_test_monkeypatches_a_torch_config():
    found = [f"{path.relative_to(ROOT)}:{line}: {target}"
             for path in sorted((ROOT / "tests").rglob("*.py")) for line, target in _config_patches(path.read_text())]
    assert not found, ("patch torch's config with config.patch(...) (a context manager or decorator), "
                       "not monkeypatch:\n" + "\n".join(found))


def _ci_commands() -> list[str]:
    """The script's command lines, comments and blank lines left out, continuations joined."""
    text = re.sub(r"\\\n\s*", " ", CI.read_text())
    return [line.split(" #")[0].strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def test_ci_builds_a_fresh_venv_and_installs_through_the_constraints():
    commands = _ci_commands()
    venvs = [c for c in commands if re.search(r"\bpython3? -m venv\b", c)]
    assert venvs and not any("system-site-packages" in c for c in venvs), venvs
    installs = [c for c in commands if re.search(r"\bpip(3)? install\b", c)]
    assert installs and all(re.search(r'(-c|--constraint)[ =]"?(\$\w+|\.ci/constraints\.txt)', c) for c in installs), \
        installs
    assert any("constraints.txt" in c for c in commands)
    # every pip and pytest runs with the venv's python, never the machine's
    assert not any(re.search(r"\bpython3? -m (pip|pytest)\b", c) for c in commands), commands
    assert any(re.search(r"-m pytest -q\b", c) for c in commands)
    assert any("torch==2.13.0" in c for c in commands) and any("--no-build-isolation" in c and ".[test]" in c
                                                              for c in commands)


def test_the_constraints_pin_every_dependency():
    lines = [line.split("#")[0].strip() for line in CONSTRAINTS.read_text().splitlines()]
    pins = {}
    for line in filter(None, lines):
        match = re.fullmatch(r"([A-Za-z0-9_.\-]+)==([\w.+!]+)", line)
        assert match, f"not a pin: {line!r}"
        pins[re.sub(r"[-_.]+", "-", match[1]).lower()] = match[2]
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = project["dependencies"] + project["optional-dependencies"]["test"] + ["setuptools"]
    names = {re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9_.\-]+", spec)[0]).lower() for spec in wanted}
    assert not names - pins.keys(), f"unpinned: {sorted(names - pins.keys())}"
    assert pins["torch"].startswith("2.13.0")
    assert CONSTRAINTS.read_text().lstrip().startswith("#"), "its header says how and when to update it"


def _requirements() -> list[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return project["dependencies"] + [spec for extra in project["optional-dependencies"].values() for spec in extra]


def test_every_runtime_dependency_has_a_lower_bound_the_pins_satisfy():
    """A user's older numpy, scipy, tokenizers or safetensors either works or is upgraded by pip;
    CI's pins (.ci/constraints.txt) lie inside every bound."""
    from packaging.requirements import Requirement

    def canonical(name):
        return re.sub(r"[-_.]+", "-", name).lower()

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    unbounded = [spec for spec in project["dependencies"] if not any(
        s.operator == ">=" for s in Requirement(spec).specifier)]
    assert not unbounded, unbounded
    pins = {}
    for line in CONSTRAINTS.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, version = line.split("==")
            pins[canonical(name)] = version
    for spec in map(Requirement, _requirements()):
        pinned = pins.get(canonical(spec.name))
        if pinned is not None:
            assert spec.specifier.contains(pinned, prereleases=True), f"{spec} excludes CI's pin {pinned}"
