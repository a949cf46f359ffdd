"""The old module names, from before the package was arranged by pipeline stage.

``import torch_sparserl.runtime`` (or ``from torch_sparserl import runtime``, or
``torch_sparserl.runtime`` as an attribute) still works: :data:`MOVED` maps each old name to
its new one, and a finder first on ``sys.meta_path`` hands out the module under its new name
— the same module object, so a patch through either name reaches the same globals — with a
:class:`DeprecationWarning` that names the new module, once per process and name. A module
inside a moved package moves with it (``torch_sparserl.build.nvrtc``). Installed by the
package's ``__init__``; it imports nothing of the package until an old name is asked for.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

PACKAGE = __name__.rpartition(".")[0]

# old module name -> new module name
MOVED: dict[str, str] = {
    "torch_sparserl._dynamo_entry": "torch_sparserl.compiler._dynamo_entry",
    "torch_sparserl.autotune": "torch_sparserl.specialize.autotune",
    "torch_sparserl.backend": "torch_sparserl.compiler.backend",
    "torch_sparserl.build": "torch_sparserl.toolchain",
    "torch_sparserl.build.driver": "torch_sparserl.toolchain.driver",
    "torch_sparserl.build.errors": "torch_sparserl.toolchain.errors",
    "torch_sparserl.build.inline": "torch_sparserl.toolchain.inline",
    "torch_sparserl.build.kernel": "torch_sparserl.toolchain.kernel",
    "torch_sparserl.build.nvcc": "torch_sparserl.toolchain.nvcc",
    "torch_sparserl.build.nvrtc": "torch_sparserl.toolchain.nvrtc",
    "torch_sparserl.cache": "torch_sparserl.jit.cache",
    "torch_sparserl.convert": "torch_sparserl.compiler.convert",
    "torch_sparserl.csr_matrix": "torch_sparserl.tensor.csr_matrix",
    "torch_sparserl.cudagraphs": "torch_sparserl.compiler.cudagraphs",
    "torch_sparserl.datasets": "torch_sparserl.data.datasets",
    "torch_sparserl.decisions": "torch_sparserl.jit.decisions",
    "torch_sparserl.families": "torch_sparserl.specialize.families",
    "torch_sparserl.fastpath": "torch_sparserl.jit.fastpath",
    "torch_sparserl.features": "torch_sparserl.pattern.features",
    "torch_sparserl.fingerprint": "torch_sparserl.pattern.fingerprint",
    "torch_sparserl.flatten": "torch_sparserl.compiler.flatten",
    "torch_sparserl.installers": "torch_sparserl.jit.install",
    "torch_sparserl.intercept": "torch_sparserl.tensor.intercept",
    "torch_sparserl.measure": "torch_sparserl.cli.measure",
    "torch_sparserl.passes": "torch_sparserl.compiler.passes",
    "torch_sparserl.paths": "torch_sparserl.toolchain.paths",
    "torch_sparserl.policy": "torch_sparserl.specialize.policy",
    "torch_sparserl.policy.corpus": "torch_sparserl.specialize.policy.corpus",
    "torch_sparserl.policy.decoder": "torch_sparserl.specialize.policy.decoder",
    "torch_sparserl.policy.encoder": "torch_sparserl.specialize.policy.encoder",
    "torch_sparserl.policy.model": "torch_sparserl.specialize.policy.model",
    "torch_sparserl.policy.propose": "torch_sparserl.specialize.policy.propose",
    "torch_sparserl.policy.tokenizer": "torch_sparserl.specialize.policy.tokenizer",
    "torch_sparserl.prepare": "torch_sparserl.abi.prepare",
    "torch_sparserl.prespecialize": "torch_sparserl.compiler.prespecialize",
    "torch_sparserl.pyg": "torch_sparserl.integrations.pyg",
    "torch_sparserl.runtime": "torch_sparserl.jit.runtime",
    "torch_sparserl.settings": "torch_sparserl.config",
    "torch_sparserl.specializers": "torch_sparserl.jit.specializers",
    "torch_sparserl.synthetic": "torch_sparserl.data.synthetic",
    "torch_sparserl.trust": "torch_sparserl.toolchain.trust",
    "torch_sparserl.validation": "torch_sparserl.pattern.validation",
}


def new_name(name: str) -> str | None:
    """The new name of module ``name``, or None where it did not move."""
    prefix = name
    while prefix:
        if prefix in MOVED:
            return MOVED[prefix] + name[len(prefix):]
        prefix = prefix.rpartition(".")[0]
    return None


def _importer():
    """The frame of the code that asked for the old name: the first outside the import system."""
    frame = sys._getframe(1)
    while frame is not None and (frame.f_code.co_filename == __file__
                                 or frame.f_code.co_filename.startswith("<frozen importlib")
                                 or frame.f_globals.get("__name__") in ("importlib", "importlib._bootstrap")):
        frame = frame.f_back
    return frame


def _warn(old: str, new: str) -> None:
    message = (f"{old} is now {new}; the old name is an alias that will go away "
               f"(torch_sparserl is laid out by pipeline stage: see its docstring)")
    frame = _importer()
    if frame is None:
        warnings.warn(message, DeprecationWarning, stacklevel=2)
        return
    warnings.warn_explicit(message, DeprecationWarning, frame.f_code.co_filename, frame.f_lineno,
                           module=frame.f_globals.get("__name__", "<unknown>"),
                           registry=frame.f_globals.setdefault("__warningregistry__", {}))


class _Alias(importlib.abc.Loader):
    """Loads an old name as the module of its new name."""

    def __init__(self, new: str):
        self.new = new
        self.spec = None

    def create_module(self, spec):
        module = importlib.import_module(self.new)
        self.spec = module.__spec__
        _warn(spec.name, self.new)
        return module

    def exec_module(self, module) -> None:
        # The import system has just set the module's __spec__ to the old name's: the module
        # keeps its own (relative imports inside it, reload and pickling read it).
        module.__spec__ = self.spec


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if not fullname.startswith(PACKAGE + "."):
            return None
        new = new_name(fullname)
        return None if new is None else importlib.util.spec_from_loader(fullname, _Alias(new))


_FINDER = _Finder()


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (idempotent)."""
    if not any(isinstance(finder, _Finder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _FINDER)


def old_module(name: str):
    """``torch_sparserl.<name>`` as an attribute, for an old module name whose module is loaded
    (an attribute the package had then too: importing a module sets it on its package)."""
    new = MOVED.get(f"{PACKAGE}.{name}")
    if new is None or new not in sys.modules:
        raise AttributeError(f"module {PACKAGE!r} has no attribute {name!r}")
    return importlib.import_module(f"{PACKAGE}.{name}")
