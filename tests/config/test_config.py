"""The settings tree (:mod:`torch_sparserl.config`): every environment variable read in one
place, its values and its errors; unknown names refused or warned about; the docs in step."""

from __future__ import annotations

import ast
import math
import os
import re
import subprocess
import sys
import warnings
from dataclasses import fields
from pathlib import Path

import pytest

import torch_sparserl as ts
from torch_sparserl import config
from torch_sparserl.cli import main
from torch_sparserl.config import ENVIRONMENT, BackendOptions, ConfigWarning, JitOptions
from torch_sparserl.jit import fastpath
from torch_sparserl.jit import runtime as rt
from torch_sparserl.tensor import intercept
from torch_sparserl.toolchain import paths

PACKAGE = Path(config.__file__).parent

# Every variable's good values (text -> value); a new variable must be added here.
GOOD = {
    "SPARSERL_JIT": [("sync", "sync"), (" Off ", "off"), ("background", "background")],
    "SPARSERL_JIT_STRICT": [("1", True), ("Yes", True), ("off", False), ("false", False)],
    "SPARSERL_JIT_MARGIN": [("1", 1.0), ("1.25", 1.25)],
    "SPARSERL_JIT_BUDGET_S": [("5", 5.0), ("0.5", 0.5)],
    "SPARSERL_JIT_POLICY": [("autotune", "autotune"), ("LEARNED", "learned")],
    "SPARSERL_JIT_K": [("1", 1), ("64", 64), (" 8 ", 8)],
    "SPARSERL_JIT_IDLE_S": [("0", 0.0), ("2.5", 2.5)],
    "SPARSERL_JIT_ADMIT_CALLS": [("1", 1), ("5", 5)],
    "SPARSERL_JIT_ADMIT_AGE_S": [("0", 0.0), ("0.1", 0.1)],
    "SPARSERL_JIT_QUEUE": [("1", 1), ("16", 16)],
    "SPARSERL_JIT_CLASS_AFTER": [("0", 0), ("16", 16)],
    "SPARSERL_CACHE_MAX_MB": [("0.5", 0.5), ("1024", 1024.0)],
    "SPARSERL_CACHE_CUBINS": [("0", False), ("on", True)],
    "SPARSERL_CACHE_DIR": [("/tmp/sparserl-cache", Path("/tmp/sparserl-cache")), ("relative", Path("relative"))],
    "SPARSERL_FAST_PATH": [("0", False), ("on", True)],
    "SPARSERL_POLICY_DEVICE": [(" CPU ", "cpu"), ("cuda", "cuda")],
    "SPARSERL_EVAL_BURST_REPS": [("0", 0), ("4", 4)],
    "SPARSERL_LOG": [("DEBUG", "debug"), ("info", "info")],
    "SPARSERL_DEBUG": [("1", True), ("no", False)],
}
# ... and the values each refuses (every folder path is a folder: SPARSERL_CACHE_DIR refuses none).
BAD = {
    "SPARSERL_JIT": ["eager"],
    "SPARSERL_JIT_STRICT": ["maybe", "2"],
    "SPARSERL_JIT_MARGIN": ["abc", "0.9", "nan"],
    "SPARSERL_JIT_BUDGET_S": ["soon", "0", "-1"],
    "SPARSERL_JIT_POLICY": ["oracle"],
    "SPARSERL_JIT_K": ["0", "65", "4.5", "x"],
    "SPARSERL_JIT_IDLE_S": ["-1", "later"],
    "SPARSERL_JIT_ADMIT_CALLS": ["0", "2.5", "often"],
    "SPARSERL_JIT_ADMIT_AGE_S": ["-1", "soon"],
    "SPARSERL_JIT_QUEUE": ["0", "-3", "many"],
    "SPARSERL_JIT_CLASS_AFTER": ["-1", "1.5", "some"],
    "SPARSERL_CACHE_MAX_MB": ["0", "-1", "big"],
    "SPARSERL_CACHE_CUBINS": ["sometimes"],
    "SPARSERL_FAST_PATH": ["maybe"],
    "SPARSERL_POLICY_DEVICE": ["tpu"],
    "SPARSERL_EVAL_BURST_REPS": ["four", "-1"],
    "SPARSERL_LOG": ["loud"],
    "SPARSERL_DEBUG": ["2"],
}


# Text that no variable takes: not finite, past any range, not a number, not a word it knows.
NEVER = ["inf", "-inf", "Infinity", "nan", "NaN", "1e308", "-1e308", "1e999", "banana", "12abc", "1,5", "0x10",
         "1 2", "\u221e"]
# Every number's range, as the docs state it: (low, high, low excluded). Whole numbers: ints.
RANGES = {
    "SPARSERL_JIT_MARGIN": (1.0, 100.0, False),
    "SPARSERL_JIT_BUDGET_S": (0.0, 3600.0, True),
    "SPARSERL_JIT_K": (1, 64, False),
    "SPARSERL_JIT_IDLE_S": (0.0, 86400.0, False),
    "SPARSERL_JIT_ADMIT_CALLS": (1, 1_000_000, False),
    "SPARSERL_JIT_ADMIT_AGE_S": (0.0, 3600.0, False),
    "SPARSERL_JIT_QUEUE": (1, 4096, False),
    "SPARSERL_JIT_CLASS_AFTER": (0, 1_000_000, False),
    "SPARSERL_CACHE_MAX_MB": (0.1, 1048576.0, False),
    "SPARSERL_EVAL_BURST_REPS": (0, 100_000, False),
}
NUMERIC = sorted(RANGES)


def _outside(name: str) -> list[str]:
    """The values just outside the variable's range, as text: below its low bound (the bound
    itself where it is excluded), past its high one, and a tiny positive number where that is below."""
    low, high, excluded = RANGES[name]
    if isinstance(low, int):
        below, above = [str(low - 1)], [str(high + 1)]
    else:
        below = [repr(low) if excluded else repr(math.nextafter(low, -math.inf))]
        above = [repr(math.nextafter(high, math.inf))]
    tiny = ["1e-300"] if low >= 1e-300 or isinstance(low, int) else []
    return below + above + tiny + ["-1"]


def _inside(name: str) -> list[tuple[str, object]]:
    """The variable's bounds that it takes, as (text, value)."""
    low, high, excluded = RANGES[name]
    return ([] if excluded else [(str(low), low)]) + [(str(high), high)]


for _name in ENVIRONMENT:
    if _name != "SPARSERL_CACHE_DIR":
        BAD[_name] = list(dict.fromkeys(BAD[_name] + NEVER + (_outside(_name) if _name in RANGES else [])))
    if _name in RANGES:
        GOOD[_name] = GOOD[_name] + _inside(_name)


def _field(cfg: config.Config, path: str):
    group, name = path.split(".")
    return getattr(getattr(cfg, group), name)


def test_every_variable_is_tested():
    assert set(GOOD) == set(ENVIRONMENT)
    assert set(BAD) | {"SPARSERL_CACHE_DIR"} == set(ENVIRONMENT)


@pytest.mark.parametrize("name, text, value", [(n, t, v) for n, cases in GOOD.items() for t, v in cases])
def test_a_variable_sets_its_field(name, text, value):
    path = ENVIRONMENT[name].path
    assert config.read(path, {name: text}) == value
    assert _field(config.from_environment({name: text}, warn=False), path) == value


@pytest.mark.parametrize("name, text", [(n, t) for n, texts in BAD.items() for t in texts])
def test_a_bad_value_is_named_with_what_was_expected(name, text):
    expected = ENVIRONMENT[name].kind.expected
    message = re.escape(f"{name}: expected {expected} (got {text!r})")
    with pytest.raises(ValueError, match=message):
        config.read(ENVIRONMENT[name].path, {name: text})
    with pytest.raises(ValueError, match=message):
        config.from_environment({name: text}, warn=False)


def test_the_messages_read_as_documented():
    with pytest.raises(ValueError, match=re.escape("SPARSERL_JIT_MARGIN: expected a number >= 1 and <= 100 "
                                                   "(got 'abc')")):
        config.from_environment({"SPARSERL_JIT_MARGIN": "abc"}, warn=False)
    with pytest.raises(ValueError, match=re.escape("SPARSERL_JIT_K: expected a whole number >= 1 and <= 64 "
                                                   "(got '0')")):
        JitOptions.from_env({"SPARSERL_JIT_K": "0"})
    with pytest.raises(ValueError, match=re.escape("SPARSERL_CACHE_MAX_MB: expected a number of megabytes >= 0.1 "
                                                   "and <= 1048576 (got 'inf')")):
        config.read("cache.max_mb", {"SPARSERL_CACHE_MAX_MB": "inf"})


def test_every_number_has_a_finite_range():
    kinds = {f"{group}.{f.name}": f.metadata["kind"] for group, cls in config.GROUPS.items() for f in fields(cls)
             if "kind" in f.metadata}
    numeric = {path for path, kind in kinds.items() if kind.read is float or kind.low is not None}
    assert numeric == {ENVIRONMENT[name].path for name in NUMERIC}
    for name in NUMERIC:
        kind = ENVIRONMENT[name].kind
        assert (kind.low, kind.high, kind.above) == RANGES[name], name
        assert kind.check(kind.high) and not kind.check(math.inf) and not kind.check(math.nan), name


NOT_NUMBERS = [math.inf, -math.inf, math.nan, 1e308, -1e308, 10 ** 400, True, "5", None]


@pytest.mark.parametrize("variable", NUMERIC)
def test_a_number_set_in_code_is_checked_as_its_variable_is(variable):
    """The same range for a field given in code (configure, the groups' constructors) as for
    its variable; the ValueError names the group and the field."""
    group, name = ENVIRONMENT[variable].path.split(".")
    cls = config.GROUPS[group]
    whole = isinstance(RANGES[variable][0], int)
    outside = [(int if whole else float)(text) for text in _outside(variable) if not (whole and text == "1e-300")]
    for value in NOT_NUMBERS + outside + ([1.5] if whole else []):
        with pytest.raises(ValueError) as refused:
            cls(**{name: value})
        assert str(refused.value) == f"{cls.__name__}: {name} must be {ENVIRONMENT[variable].kind.expected} " \
                                     f"(got {value!r})"
    for _, value in _inside(variable):
        assert getattr(cls(**{name: value}), name) == value


@pytest.mark.parametrize("changes", [dict(idle_s=math.inf), dict(idle_s=1e10), dict(budget_s=math.nan),
                                     dict(margin=1e308), dict(queue=10 ** 6), dict(admit_age_s=-1.0)])
def test_configure_refuses_a_number_out_of_range_and_keeps_the_runtime(changes):
    before = rt.active()
    [(name, value)] = changes.items()
    message = re.escape(f"JitOptions: {name} must be ") + ".*" + re.escape(f"(got {value!r})")
    with pytest.raises(ValueError, match=message):
        rt.configure(**changes)
    assert rt.active() is before


@pytest.mark.parametrize("name", NUMERIC)
def test_a_command_refuses_a_bad_variable_before_it_starts(name, tmp_path, monkeypatch, capsys):
    """Every variable is read when a command starts: one line naming it, status 2, whether or
    not the command would have used it (``SPARSERL_CACHE_MAX_MB=inf sparserl cache list`` was an
    OverflowError)."""
    monkeypatch.delenv("SPARSERL_DEBUG", raising=False)
    monkeypatch.setenv(name, "inf")
    assert main(["cache", "list", "--dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [f"sparserl cache: {name}: expected {ENVIRONMENT[name].kind.expected} (got 'inf')"]


@pytest.mark.slow
def test_a_bad_log_variable_is_one_line_of_the_command_and_refused_by_the_runtime(tmp_path):
    """SPARSERL_LOG is read when the package is imported: a bad value there is no traceback
    before the command can say it in one line, and the runtime still refuses it."""
    env = {k: v for k, v in os.environ.items() if k != "SPARSERL_DEBUG"}
    env.update(SPARSERL_LOG="banana", PYTHONPATH=str(PACKAGE.parent))
    done = subprocess.run([sys.executable, "-m", "torch_sparserl", "cache", "list", "--dir", str(tmp_path)],
                          capture_output=True, text=True, env=env, timeout=300)
    expected = ENVIRONMENT["SPARSERL_LOG"].kind.expected
    assert done.returncode == 2 and done.stderr.splitlines() == [
        f"sparserl cache: SPARSERL_LOG: expected {expected} (got 'banana')"], done.stderr
    code = ("import torch_sparserl\nfrom torch_sparserl.jit import runtime as rt\ntry:\n    rt.active()\n"
            "except ValueError as exc:\n    print(exc)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0 and done.stdout == f"SPARSERL_LOG: expected {expected} (got 'banana')\n", done.stderr


@pytest.mark.parametrize("name", sorted(ENVIRONMENT))
def test_an_empty_variable_is_the_default(name):
    path = ENVIRONMENT[name].path
    assert _field(config.from_environment({name: "  "}, warn=False), path) == _field(config.Config(), path)


def test_defaults_without_environment():
    assert config.from_environment({}, warn=False) == config.Config()
    assert JitOptions.from_env({}) == JitOptions()


def test_the_configuration_is_the_tree_and_configure_at_the_top():
    """``ts.config`` is the settings tree and ``ts.configure(**fields)`` replaces the process's
    runtime with fields of ``JitOptions`` changed; the former aliases are gone."""
    assert ts.config is config
    assert not hasattr(config, "Settings") and not hasattr(rt, "RuntimeSettings") and "Settings" not in ts.__all__
    with pytest.raises(AttributeError):
        ts.Settings  # noqa: B018
    previous = rt.active().settings
    try:
        runtime = ts.configure(mode="off", margin=1.3)
        assert rt.active() is runtime and runtime.settings == previous.replace("test", mode="off", margin=1.3)
        with pytest.raises(TypeError, match="margin"):
            ts.configure(margn=1.3)
        with pytest.raises(ValueError, match=r"JitOptions: margin must be a number >= 1 and <= 100 \(got 0.5\)"):
            ts.configure(margin=0.5)
        assert rt.active() is runtime  # a refused change keeps the runtime
    finally:
        rt.configure(previous)


# ------------------------------------------------------------------- call-time readers


def test_readers_read_the_environment_when_called(monkeypatch, tmp_path):
    monkeypatch.setenv("SPARSERL_CACHE_DIR", str(tmp_path))
    assert paths.configured_cache_dir() == tmp_path
    monkeypatch.setenv("SPARSERL_CACHE_DIR", "")
    assert paths.configured_cache_dir().name == "torch_sparserl"
    monkeypatch.setenv("SPARSERL_FAST_PATH", "no")
    assert fastpath.unavailable() == "turned off by SPARSERL_FAST_PATH"
    monkeypatch.setenv("SPARSERL_FAST_PATH", "maybe")
    with pytest.raises(ValueError, match=r"SPARSERL_FAST_PATH: expected a boolean .*\(got 'maybe'\)"):
        fastpath.unavailable()


def test_a_bad_debug_variable_is_one_cli_line(monkeypatch, capsys):
    monkeypatch.setenv("SPARSERL_DEBUG", "sure")
    assert main(["info"]) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == ["sparserl info: SPARSERL_DEBUG: expected a boolean (1/0, true/false, yes/no, on/off) "
                                "(got 'sure')"]


def test_the_runtime_is_created_from_the_environment(monkeypatch):
    monkeypatch.setenv("SPARSERL_JIT", "sync")
    monkeypatch.setenv("SPARSERL_JIT_K", "7")
    previous = rt.set_active(None)
    try:
        assert rt.active().settings == JitOptions(mode="sync", k=7)
        monkeypatch.setenv("SPARSERL_JIT_BUDGET_S", "never")
        rt.active().close()
        rt.set_active(None)
        with pytest.raises(ValueError, match=r"SPARSERL_JIT_BUDGET_S: expected .* \(got 'never'\)"):
            rt.active()
    finally:
        rt.set_active(previous)


# ------------------------------------------------------------------------- unknown names


def test_an_unknown_variable_is_warned_about_once():
    config._warned.discard("SPARSERL_JTI")  # as in a fresh process
    environ = {"SPARSERL_JTI": "off", "SPARSERL_JIT": "sync", "SPARSERL_SHARED": "/data", "SPARSERL_TEST_X": "1"}
    with pytest.warns(ConfigWarning) as caught:
        config.from_environment(environ)
    assert len(caught) == 1
    text = str(caught[0].message)
    assert "SPARSERL_JTI" in text and "did you mean SPARSERL_JIT?" in text
    assert all(name in text for name in ENVIRONMENT)  # the known ones
    assert "SPARSERL_SHARED" not in text and "SPARSERL_TEST_X" not in text
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        config.from_environment(environ)  # once: no second warning
        assert config.warn_unknown_variables(environ) == []


@pytest.mark.slow
def test_an_unknown_variable_is_warned_about_at_import_once():
    env = dict(os.environ, SPARSERL_JTI="off", PYTHONPATH=str(PACKAGE.parent))
    code = "import torch_sparserl as ts; from torch_sparserl.jit import runtime as rt; rt.configure(mode='off')"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stderr.count("unknown environment variable(s) SPARSERL_JTI") == 1, result.stderr


def test_an_unknown_backend_option_is_refused_with_the_valid_names():
    valid = [name for name in BackendOptions.names() if name != "inductor"]
    with pytest.raises(ValueError, match=re.escape(f"unknown option(s) ['stirct']; expected some of {valid}")) as info:
        BackendOptions.from_options({"stirct": True})
    assert "did you mean 'strict'?" in str(info.value) and "torch._inductor.config" in str(info.value)


def test_an_unknown_configure_keyword_is_refused_with_the_valid_names():
    before = rt.active()
    valid = JitOptions.names()
    with pytest.raises(TypeError, match=re.escape(f"configure: unknown setting(s) ['mdoe']; expected some of {valid}")):
        rt.configure(mdoe="sync")
    assert rt.active() is before
    assert valid == ["admit_age_s", "admit_calls", "budget_s", "class_after", "idle_s", "k", "margin", "mode",
                     "policy", "queue", "strict"]


# ------------------------------------------------------------------------------ strict


def test_strict_is_the_runtime_s_unless_the_model_says(monkeypatch):
    runtime = rt.Runtime(JitOptions(mode="off", strict=True), specializer=lambda *a: None)
    previous = rt.set_active(runtime)
    try:
        assert intercept._strict(BackendOptions()) is True
        assert intercept._strict(BackendOptions.from_options({"strict": False})) is False
        rt.set_active(rt.Runtime(JitOptions(mode="off"), specializer=lambda *a: None)).close()
        assert intercept._strict(BackendOptions()) is False
        assert intercept._strict(BackendOptions.from_options({"strict": True})) is True
        rt.set_active(None).close()
        monkeypatch.setenv("SPARSERL_JIT_STRICT", "1")  # no runtime yet: the environment's
        assert intercept._strict(BackendOptions()) is True
    finally:
        rt.set_active(previous)


# ---------------------------------------------------------------------- one place, one doc


_READERS = {"get", "getenv", "setdefault", "pop", "__getitem__", "__contains__"}


def _environ_reads(tree: ast.AST):
    """(line, name) of every read of a SPARSERL_ variable through os.environ / os.getenv."""

    def sparserl(node):
        return isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("SPARSERL_")

    def environ(node):
        return "environ" in ast.unparse(node) or "getenv" in ast.unparse(node)

    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and environ(node.func) \
                and (node.func.attr in _READERS or node.func.attr == "getenv"):
            hits = [a for a in node.args if sparserl(a)]
        elif isinstance(node, ast.Subscript) and environ(node.value):
            hits = [node.slice] if sparserl(node.slice) else []
        elif isinstance(node, ast.Compare) and any(environ(c) for c in node.comparators):
            hits = [node.left] if sparserl(node.left) else []
        else:
            continue
        for hit in hits:
            yield node.lineno, hit.value


def test_the_scan_finds_reads():
    source = ('import os\nos.environ.get("SPARSERL_X")\nos.environ["SPARSERL_Y"]\nos.getenv("SPARSERL_Z", "1")\n'
              '"SPARSERL_W" in os.environ\nos.environ.get("CUDA_HOME")\n')
    assert [name for _, name in _environ_reads(ast.parse(source))] == ["SPARSERL_X", "SPARSERL_Y", "SPARSERL_Z",
                                                                      "SPARSERL_W"]


def test_only_config_reads_sparserl_variables():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == Path(config.__file__):
            continue
        source = path.read_text()
        found += [f"{path.relative_to(PACKAGE)}:{line}: {name}" for line, name in _environ_reads(ast.parse(source))]
        # a name kept apart from its read (a table of names, then os.environ.get(name)): no
        # string outside config.py is a variable's name alone (messages and docs may name one)
        found += [f"{path.relative_to(PACKAGE)}:{node.lineno}: the string {node.value!r}"
                  for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Constant)
                  and isinstance(node.value, str) and re.fullmatch(r"SPARSERL_[A-Z0-9_]*", node.value)]
    assert not found, found


def test_the_docstring_table_lists_every_variable():
    rows = dict(re.findall(r"^``(SPARSERL_\w+)``\s+``([\w.]+)``", config.__doc__, flags=re.M))
    assert rows == {name: variable.path for name, variable in ENVIRONMENT.items()}


def _bounds(name: str) -> list[str]:
    """The variable's bounds as the docs write them: 0.1, 100, 1048576."""
    return [str(int(bound)) if float(bound).is_integer() else repr(bound) for bound in RANGES[name][:2]]


def test_the_docs_state_every_range():
    """The docstring's table and the reference (docs/reference.md) say each number's bounds."""
    values = dict(re.findall(r"^``(SPARSERL_\w+)``\s+``[\w.]+``\s+(.*)$", config.__doc__, flags=re.M))
    readme = (PACKAGE.parent / "docs" / "reference.md").read_text()
    for name in NUMERIC:
        for bound in _bounds(name):
            assert re.search(rf"(?<![\d.]){re.escape(bound)}(?![\d.])", values[name]), (name, bound, values[name])
        readme_lines = [line for line in readme.splitlines() if f"`{name}`" in line and "|" in line] or \
            [line for line in readme.splitlines() if f"`{name}" in line]
        assert any(all(re.search(rf"(?<![\d.]){re.escape(b)}(?![\d.])", line) for b in _bounds(name))
                   for line in readme_lines), (name, readme_lines)


def test_every_variable_names_a_field():
    for name, variable in ENVIRONMENT.items():
        group, field = variable.path.split(".")
        assert field in {f.name for f in fields(config.GROUPS[group])}, name
        assert variable.kind.expected


def test_every_field_has_a_docstring_and_a_named_default():
    tree = ast.parse(Path(config.__file__).read_text())
    classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}
    for cls in [*config.GROUPS.values(), config.Config]:
        body = classes[cls.__name__].body
        documented = {}
        for stmt, after in zip(body, body[1:] + [None]):
            if isinstance(stmt, ast.AnnAssign):
                doc = isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) \
                      and isinstance(after.value.value, str)
                documented[stmt.target.id] = (doc, ast.unparse(stmt.value))
        assert set(documented) == {f.name for f in fields(cls)}, cls
        for name, (doc, default) in documented.items():
            assert doc, f"{cls.__name__}.{name} has no docstring"
            if cls is not config.Config and name != "inductor":
                assert default.startswith("setting(DEFAULT_"), f"{cls.__name__}.{name}: {default}"
