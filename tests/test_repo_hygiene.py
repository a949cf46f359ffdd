"""The repository itself: no test patches torch's config in a way that outlives it (issue 33,
class 1).

pytest 9.2's ``monkeypatch.setattr`` takes the old value from the target's ``__dict__``; torch's
config modules keep their values elsewhere (served by ``__getattr__``), so the undo deletes the
attribute and every later compile in the session fails. ``config.patch(...)`` restores through
the config's own API.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

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
