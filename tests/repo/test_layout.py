"""The package's layout: its folders are the stages of the pipeline, and imports follow them.

Read from the source, never by importing: every import statement of every module of the
package, function-level ones included, and every private name reached through an imported
module (``rt._ACTIVE``). The rules:

* every module belongs to one layer of :data:`LAYERS`, and the package's root holds only
  :data:`ROOT_MODULES`;
* a module imports from its own layer's package or from a layer below, never from a higher
  layer nor from another package of its own layer;
* no import cycle, between modules or between packages (a package's ``__init__`` importing a
  module that imports it back included);
* a name with a leading underscore is taken only inside the stage that defines it (a private
  module, like ``evaluate/_worker.py``, only inside its own package);
* a layer skips no layer that :data:`FORBIDDEN` puts between them (``tensor`` reaches the JIT
  through ``ops`` only).

Every package's ``__init__.py`` re-exports: at most :data:`INIT_MAX_CODE_LINES` lines of code
(its docstring, comments and blank lines not counted), the stage itself in modules of its own.

The self-tests at the end feed the same checks a package of a few files with one violation of
each kind, so a check that silently finds nothing fails.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from dataclasses import dataclass
from pathlib import Path

import pytest

from helpers import REPO

PACKAGE = "torch_sparserl"
FOLDER = REPO / PACKAGE

# The layers, lowest first: the pipeline, as the imports see it. A module may import from its own
# package (the entry it matches) and from any entry of a lower layer; the entries of one layer do
# not import each other. "torch_sparserl" is the package's own __init__ (its public names) alone.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("torch_sparserl.config", "torch_sparserl.dtypes", "torch_sparserl.data"),
    ("torch_sparserl.pattern",),
    ("torch_sparserl.kernels",),
    ("torch_sparserl.abi",),
    ("torch_sparserl.toolchain",),
    ("torch_sparserl.evaluate",),
    ("torch_sparserl.specialize",),
    ("torch_sparserl.jit",),
    ("torch_sparserl.ops",),
    ("torch_sparserl.tensor",),
    ("torch_sparserl.compiler", "torch_sparserl.distributed", "torch_sparserl.integrations",
     "torch_sparserl.train"),
    ("torch_sparserl",),
    ("torch_sparserl.cli",),
    ("torch_sparserl.__main__",),
)

# The modules that sit directly in the package's folder (its __init__ docstring says why each).
ROOT_MODULES = frozenset({
    "torch_sparserl.__main__",
    "torch_sparserl.config",
    "torch_sparserl.dtypes",
})

# Imports the order of LAYERS allows and the pipeline does not: (importer's entry of LAYERS, the
# entry it must not import): why. A stage's docstring leaves these out of its "May import".
FORBIDDEN: dict[tuple[str, str], str] = {
    ("torch_sparserl.tensor", "torch_sparserl.jit"):
        "the tensor layer reaches the runtime through the operators' one eager door (ops.doors), never the "
        "JIT's internals (issue 51)",
}

# Imports that break a rule today and are being removed (issue 34, item 2: the runtime's decision
# record). (importer, imported module or "module.name"): why. Empty it as they go: an entry that no
# longer occurs fails test_the_package_keeps_its_layout[stale exception], so the list never outlives them.
BEING_REMOVED: dict[tuple[str, str], str] = {}

# An __init__.py re-exports (issue 51, item 2); its stage lives in modules. 60 lines of code leave room
# for imports, __all__ and a lazy __getattr__ (the package's own __init__, the largest, holds 46).
INIT_MAX_CODE_LINES = 60

# Packages whose __init__.py still holds a stage, by why. Take each out when it is split: an entry
# whose __init__.py fits the cap fails test_every_init_only_re_exports[stale exception].
INIT_NOT_YET_THIN: dict[str, str] = {
}


# ----------------------------------------------------------------------------- reading the source


@dataclass(frozen=True)
class Import:
    importer: str      # the module whose source holds the import
    module: str        # the module it reaches
    name: str | None   # the name it takes from that module (None: the module itself)
    line: int

    @property
    def target(self) -> str:
        return self.module if self.name is None else f"{self.module}.{self.name}"


def modules(folder: Path, package: str) -> dict[str, Path]:
    """Every module of the package, by dotted name (a package by its ``__init__``'s). Folders
    reached through a symbolic link (``_csrc``) are not the package's."""
    found = {}
    for path in sorted(folder.rglob("*.py")):
        relative = path.relative_to(folder)
        if any((folder / Path(*relative.parts[:i])).is_symlink() for i in range(1, len(relative.parts))):
            continue
        parts = [package, *relative.with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _resolve(importer: str, is_package: bool, level: int, module: str | None) -> str:
    if not level:
        return module or ""
    base = importer.split(".") if is_package else importer.split(".")[:-1]
    base = base[:len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def imports_of(importer: str, path: Path, known: set[str], package: str) -> list[Import]:
    """The imports of one module into the package: ``from a import b`` reaches module ``a.b``
    where that is a module, else name ``b`` of ``a``; ``m._x`` reaches name ``_x`` of module
    ``m`` where ``m`` is bound to a module of the package by an import of this file."""
    tree = ast.parse(path.read_text(), str(path))
    is_package = path.name == "__init__.py"
    found: list[Import] = []
    bound: dict[str, str] = {}  # local name -> module of the package
    inside = lambda name: name == package or name.startswith(package + ".")  # noqa: E731
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if inside(alias.name):
                    found.append(Import(importer, alias.name, None, node.lineno))
                    if alias.asname:
                        bound[alias.asname] = alias.name
        elif isinstance(node, ast.ImportFrom):
            source = _resolve(importer, is_package, node.level, node.module)
            if not inside(source):
                continue
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                if submodule in known:
                    found.append(Import(importer, submodule, None, node.lineno))
                    bound[alias.asname or alias.name] = submodule
                else:
                    found.append(Import(importer, source, alias.name, node.lineno))
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound
                and _private(node.attr)):
            found.append(Import(importer, bound[node.value.id], node.attr, node.lineno))
    return found


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


# ----------------------------------------------------------------------------------- the checks


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (or a node importing itself),
    each sorted, in sorted order (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1 or node in graph.get(node, ()):
                        cycles.append(sorted(component))
    return sorted(cycles)


def unit_of(module: str, layers, package: str) -> str | None:
    """The entry of ``layers`` a module belongs to: the longest that is the module or a package
    holding it (the package's own entry holds only its ``__init__``)."""
    best = None
    for unit in (u for layer in layers for u in layer):
        if module == unit or (unit != package and module.startswith(unit + ".")):
            if best is None or len(unit) > len(best):
                best = unit
    return best


def check(folder: Path, package: str, layers, root_modules, exceptions,
          forbidden: dict[tuple[str, str], str] | None = None) -> dict[str, list[str]]:
    """Every violation of the rules, by kind: ``placement``, ``cycle``, ``layering``, ``private``,
    ``forbidden``, ``stale exception``. An import listed in ``exceptions`` is not a violation (nor an
    edge of the cycle search), but an exception that matches no import is. ``forbidden``: pairs of
    entries of ``layers``, (importer, imported), that the order allows and the pipeline does not."""
    forbidden = forbidden or {}
    found = modules(folder, package)
    known = set(found)
    level = {unit: i for i, layer in enumerate(layers) for unit in layer}
    problems: dict[str, list[str]] = {kind: [] for kind in
                                      ("placement", "cycle", "layering", "private", "forbidden", "stale exception")}
    for module in sorted(known):
        if unit_of(module, layers, package) is None:
            problems["placement"].append(f"{module} is in no layer of LAYERS")
        if module.count(".") == 1 and found[module].name != "__init__.py" and module not in root_modules:
            problems["placement"].append(f"{module} sits in the package's root, which holds only ROOT_MODULES")
    imports = [imp for module, path in sorted(found.items()) for imp in imports_of(module, path, known, package)]
    used = set()
    graph: dict[str, set[str]] = {module: set() for module in known}
    for imp in imports:
        key = (imp.importer, imp.target)
        if key in exceptions or (imp.importer, imp.module) in exceptions:
            used.add(key if key in exceptions else (imp.importer, imp.module))
            continue
        where = f"{imp.importer} (line {imp.line})"
        if imp.module != imp.importer:
            graph[imp.importer].add(imp.module)
        source, target = unit_of(imp.importer, layers, package), unit_of(imp.module, layers, package)
        if source is not None and target is not None and source != target and level[source] <= level[target]:
            how = "a higher layer" if level[source] < level[target] else "another package of its layer"
            problems["layering"].append(f"{where} imports {imp.target}: {target} is {how} than {source}")
        if (source, target) in forbidden:
            problems["forbidden"].append(f"{where} imports {imp.target}: {forbidden[source, target]}")
        private = _private_owner(imp, layers, package)
        if private is not None and not (imp.importer == private or imp.importer.startswith(private + ".")):
            problems["private"].append(f"{where} takes {imp.target}, private to {private}")
    for cycle in find_cycles(graph):
        problems["cycle"].append(" <-> ".join(cycle))
    for key in sorted(set(exceptions) - used):
        problems["stale exception"].append(f"{key[0]} no longer imports {key[1]}: take it out of the exceptions")
    return problems


def _private_owner(imp: Import, layers, package: str) -> str | None:
    """Who may use what ``imp`` takes, if it is private: a private module its package; a private
    name of a module that module's stage (the entry of LAYERS holding it)."""
    parts = imp.module.split(".")
    for i, part in enumerate(parts[1:], 1):
        if _private(part):
            return ".".join(parts[:i])
    if imp.name is not None and _private(imp.name):
        return unit_of(imp.module, layers, package) or imp.module
    return None


def code_lines(path: Path) -> int:
    """The lines of a module that hold code: not blank, not only a comment, not its docstring."""
    text = path.read_text()
    body = ast.parse(text).body
    docstring = set()
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        docstring = set(range(body[0].lineno, body[0].end_lineno + 1))
    lines = set()
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type not in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
                              tokenize.ENDMARKER):
            lines.update(range(token.start[0], token.end[0] + 1))
    return len(lines - docstring)


def check_inits(folder: Path, package: str, cap: int, not_yet_thin) -> dict[str, list[str]]:
    """Every package ``__init__.py`` over ``cap`` lines of code (``too large``), and every entry of
    ``not_yet_thin`` that is no package or whose ``__init__.py`` fits (``stale exception``)."""
    problems: dict[str, list[str]] = {"too large": [], "stale exception": []}
    inits = {module: path for module, path in modules(folder, package).items() if path.name == "__init__.py"}
    for module, path in sorted(inits.items()):
        lines = code_lines(path)
        if module in not_yet_thin:
            if lines <= cap:
                problems["stale exception"].append(f"{module}: its __init__.py fits ({lines} lines of code): "
                                                   "take it out of the exceptions")
        elif lines > cap:
            problems["too large"].append(f"{module}: its __init__.py holds {lines} lines of code, at most {cap}: "
                                         "move the stage into modules and re-export their names")
    for module in sorted(set(not_yet_thin) - set(inits)):
        problems["stale exception"].append(f"{module}: no such package, take it out of the exceptions")
    return problems


# ---------------------------------------------------------------------------------- the package


@pytest.fixture(scope="module")
def problems():
    return check(FOLDER, PACKAGE, LAYERS, ROOT_MODULES, BEING_REMOVED, FORBIDDEN)


@pytest.mark.parametrize("kind", ["placement", "cycle", "layering", "private", "forbidden", "stale exception"])
def test_the_package_keeps_its_layout(problems, kind):
    assert not problems[kind], f"{kind}:\n" + "\n".join(problems[kind])


@pytest.mark.parametrize("kind", ["too large", "stale exception"])
def test_every_init_only_re_exports(kind):
    problems = check_inits(FOLDER, PACKAGE, INIT_MAX_CODE_LINES, INIT_NOT_YET_THIN)
    assert not problems[kind], f"{kind}:\n" + "\n".join(problems[kind])


def test_every_stage_folder_is_a_layer():
    folders = {p.name for p in FOLDER.iterdir() if p.is_dir() and not p.is_symlink() and (p / "__init__.py").exists()}
    units = {unit.split(".")[1] for layer in LAYERS for unit in layer if unit.count(".") == 1}
    assert folders <= units, sorted(folders - units)


def _short(unit: str) -> str:
    return unit if unit == PACKAGE else unit[len(PACKAGE) + 1:]


@pytest.mark.parametrize("unit", [u for layer in LAYERS for u in layer if (FOLDER / _short(u)).is_dir()])
def test_every_stage_says_where_it_stands_and_what_it_may_import(unit):
    """A stage's ``__init__`` docstring says "Pipeline stage N of M" and "May import: a, b." as
    LAYERS and FORBIDDEN have it, so the docstrings cannot drift from the rules the checks enforce."""
    level = next(i for i, layer in enumerate(LAYERS) if unit in layer)
    doc = ast.get_docstring(ast.parse((FOLDER / _short(unit) / "__init__.py").read_text())) or ""
    assert f"Pipeline stage {level + 1} of {len(LAYERS)}" in doc, doc
    said = re.search(r"May import: ([^.]*)\.", doc)
    assert said, doc
    below = {_short(u) for layer in LAYERS[:level] for u in layer if not _private(u.rpartition(".")[2])
             and (unit, u) not in FORBIDDEN}
    listed = {name.strip().strip("`") for name in re.split(r",|\band\b", said[1]) if name.strip()} - {"none"}
    assert listed == below


# ------------------------------------------------------------------------------ the tests' layout

TESTS = REPO / "tests"
# Test folders that are no stage of the package: the root modules' (config, dtypes), the scripts
# beside the package, and the repository itself (this layout, packaging, hygiene).
TEST_FOLDERS_BEYOND_STAGES = {
    "config": "the root modules config and dtypes",
    "benchmarks": "the benchmarks' scripts and their common core (their CPU paths)",
    "training": "the training stages' scripts",
    "repo": "the package's layout, its packaging and the repository's hygiene",
}
SHARED_TEST_FOLDERS = frozenset({"adversarial", "__pycache__"})  # modules the tests share, no tests
# Stages with no test folder of their own, by why.
STAGES_TESTED_ELSEWHERE = {
    "kernels": "torch's own products and the float64 reference: every product test in ops/ runs them",
}


def test_the_tests_mirror_the_stages():
    """A newcomer finds a stage's tests in ``tests/<stage>/``: every test folder is a stage (or one
    of the few beyond them), every stage has one, and no test file sits outside them."""
    folders = {p.name for p in TESTS.iterdir() if p.is_dir() and p.name not in SHARED_TEST_FOLDERS}
    stages = {unit.split(".")[1] for layer in LAYERS for unit in layer
              if unit.count(".") == 1 and (FOLDER / unit.split(".")[1]).is_dir()}
    assert folders - stages - set(TEST_FOLDERS_BEYOND_STAGES) == set()
    assert stages - folders == set(STAGES_TESTED_ELSEWHERE)
    assert sorted(p.name for p in TESTS.glob("test_*.py")) == []


def test_gpu_tests_are_marked_by_their_file_s_name():
    """A stage's GPU-only tests are its ``*_gpu.py`` files, marked ``gpu`` by the suite's conftest
    (so that ``pytest -m gpu tests/<stage>`` runs them); no file marks itself."""
    marking = re.compile(r"^pytestmark = .*pytest\.mark\.gpu", re.M)
    for path in TESTS.glob("*/test_*.py"):
        assert not marking.search(path.read_text()), path


# ------------------------------------------------------------------------------ the checks' own


def test_the_cycle_search_finds_a_cycle_in_a_synthetic_graph():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a", "d"}, "e": set()}
    assert find_cycles(graph) == [["a", "b", "c"], ["d"]]
    graph["c"] = set()
    assert find_cycles(graph) == [["d"]]


def _write(folder: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_the_checks_catch_one_violation_of_each_kind(tmp_path):
    _write(tmp_path / "pkg", {
        "__init__.py": "from .high import b\n",
        "flat.py": "",                                          # a root module not in ROOT_MODULES
        "low/__init__.py": "",
        "low/a.py": "def f():\n    from ..high import b\n",  # up a layer, in a function
        "low/c.py": "from . import d\n",                       # c <-> d
        "low/d.py": "def g():\n    from .c import x\n",
        "low/_hidden.py": "",
        "high/__init__.py": "",
        "high/b.py": "from ..low import a\nfrom ..low.c import _secret\nfrom ..low import _hidden\n"
                     "from ..low import c as cc\ny = cc._other\n",
        "stray/__init__.py": "",                                 # in no layer
    })
    layers = (("pkg.low", "pkg.flat"), ("pkg.high",), ("pkg",))
    problems = check(tmp_path / "pkg", "pkg", layers, frozenset(), {("pkg.high.b", "pkg.gone"): "why"})
    assert problems["placement"] == ["pkg.flat sits in the package's root, which holds only ROOT_MODULES",
                                     "pkg.stray is in no layer of LAYERS"]
    assert problems["cycle"] == ["pkg.high.b <-> pkg.low.a", "pkg.low.c <-> pkg.low.d"]
    assert [p.split(":")[0] for p in problems["layering"]] == ["pkg.low.a (line 2) imports pkg.high.b"]
    assert sorted(p.split(",")[0] for p in problems["private"]) == [
        "pkg.high.b (line 2) takes pkg.low.c._secret", "pkg.high.b (line 3) takes pkg.low._hidden",
        "pkg.high.b (line 5) takes pkg.low.c._other"]
    assert problems["stale exception"] == ["pkg.high.b no longer imports pkg.gone: take it out of the exceptions"]
    # an exception takes its import out of every check, the cycle search included
    problems = check(tmp_path / "pkg", "pkg", layers, frozenset({"pkg.flat"}),
                     {("pkg.low.d", "pkg.low.c.x"): "why", ("pkg.low.a", "pkg.high.b"): "why"})
    assert not problems["cycle"] and not problems["layering"] and not problems["stale exception"]


def test_the_init_cap_counts_code_only_and_catches_a_stage_in_an_init(tmp_path):
    docstring = '"""A docstring\n\nof several lines."""\n'
    _write(tmp_path / "pkg", {
        "__init__.py": docstring + "# a comment\n\nfrom .thin import a\n",
        "thin/__init__.py": docstring + "from .x import (a,\n                b)\n" + "# why\n" * 50
                            + "__all__ = ['a', 'b']\n",
        "thin/x.py": "a = b = 1\n" * 100,                        # a module, not an __init__: any size
        "fat/__init__.py": docstring + "def f():\n    'its docstring is code'\n    return 1\n" + "x = 1\n" * 3,
        "split/__init__.py": "def g():\n    pass\n" * 3,        # over the cap, and excepted
        "done/__init__.py": "from .y import z\n",                # excepted, but fits
    })
    assert code_lines(tmp_path / "pkg" / "__init__.py") == 1
    assert code_lines(tmp_path / "pkg" / "thin" / "__init__.py") == 3
    assert code_lines(tmp_path / "pkg" / "fat" / "__init__.py") == 6
    problems = check_inits(tmp_path / "pkg", "pkg", 5, {"pkg.split": "why", "pkg.done": "why", "pkg.gone": "why"})
    assert problems["too large"] == ["pkg.fat: its __init__.py holds 6 lines of code, at most 5: move the stage into "
                                     "modules and re-export their names"]
    assert [p.split(":")[0] for p in problems["stale exception"]] == ["pkg.done", "pkg.gone"]
    assert check_inits(tmp_path / "pkg", "pkg", 6, {}) == {"too large": [], "stale exception": []}  # at the cap


def test_the_checks_catch_an_import_the_pipeline_forbids(tmp_path):
    """FORBIDDEN: an import the layers' order allows (a layer skipped) is refused where a pair
    names it, from any module of the importer's stage to any module of the other, at any depth
    (in a function too); other skips, and imports through the allowed layer, pass."""
    _write(tmp_path / "pkg", {
        "__init__.py": "",
        "low/__init__.py": "",
        "low/deep.py": "x = 1\n",
        "mid/__init__.py": "from ..low import deep\n",
        "high/__init__.py": "from ..mid import deep\n",        # through the layer between: fine
        "high/ok.py": "from .. import mid\n",
        "high/sub/__init__.py": "",
        "high/sub/bad.py": "def f():\n    from ...low.deep import x\n",  # skips mid: refused
        "top/__init__.py": "from ..low import deep\n",        # skips two layers, not forbidden: fine
    })
    layers = (("pkg.low",), ("pkg.mid",), ("pkg.high",), ("pkg.top",), ("pkg",))
    forbidden = {("pkg.high", "pkg.low"): "high reaches low through mid"}
    problems = check(tmp_path / "pkg", "pkg", layers, frozenset(), {}, forbidden)
    assert problems["forbidden"] == [
        "pkg.high.sub.bad (line 2) imports pkg.low.deep.x: high reaches low through mid"]
    assert not any(problems[kind] for kind in ("placement", "cycle", "layering", "private", "stale exception"))
    assert not check(tmp_path / "pkg", "pkg", layers, frozenset(), {})["forbidden"]  # no pairs: no finding
