"""torch-sparserl: sparse CSR products with kernels specialized to the sparsity pattern.

Three ways in, one runtime:

* ``torch.ops.sparserl.spmm(crow, col, val, ncols, X)`` and friends (:mod:`.ops`);
* :func:`csr` builds a :class:`CSRMatrix`, a tensor subclass whose ``@``, ``torch.mm``,
  ``torch.sparse.mm``, ``torch.mv`` and ``torch.addmm`` run on those operators and that
  ``torch.compile`` traces whole;
* ``torch.compile(model, backend="sparserl")`` (found by name, no import needed) and
  :func:`compile`, which also converts sparse arguments and buffers to :class:`CSRMatrix`.
"""

from importlib import import_module
from typing import TYPE_CHECKING

from . import config, ops  # ops: registers the torch.ops.sparserl operators
from .intercept import intercept_sparse
from .settings import Settings

__version__ = "0.1.0"

config.warn_unknown_variables()  # a mistyped SPARSERL_* variable is named, not ignored

__all__ = ["CSRMatrix", "Settings", "compile", "config", "csr", "intercept_sparse", "list_matrices",
           "load_matrix", "ops"]

# Loaded on first use: the tensor subclass imports torch._dynamo (seconds on some hosts), which
# the sandbox's worker, a process of this package that never compiles, should not wait for.
_LAZY = {"CSRMatrix": "csr_matrix", "csr": "csr_matrix", "compile": "convert", "list_matrices": "datasets",
         "load_matrix": "datasets"}


if TYPE_CHECKING:  # the lazy names, for type checkers and editors
    from .convert import compile
    from .csr_matrix import CSRMatrix, csr
    from .datasets import list_matrices, load_matrix


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'torch_sparserl' has no attribute {name!r}")
    value = getattr(import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
