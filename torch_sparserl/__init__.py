"""torch-sparserl: sparse CSR products with kernels specialized to the sparsity pattern.

Three ways in, one runtime:

* ``torch.ops.sparserl.spmm(crow, col, val, ncols, X)`` and friends (:mod:`.ops`);
* :func:`csr` builds a :class:`CSRMatrix`, a tensor subclass whose ``@``, ``torch.mm``,
  ``torch.sparse.mm``, ``torch.mv`` and ``torch.addmm`` run on those operators and that
  ``torch.compile`` traces whole;
* ``torch.compile(model, backend="sparserl")`` (found by name, no import needed) and
  :func:`compile`, which also converts sparse arguments and buffers to :class:`CSRMatrix`.
"""

from . import ops  # registers the torch.ops.sparserl operators
from .convert import compile
from .csr_matrix import CSRMatrix, csr
from .datasets import list_matrices, load_matrix
from .intercept import intercept_sparse
from .settings import Settings

__version__ = "0.1.0"

__all__ = ["CSRMatrix", "Settings", "compile", "csr", "intercept_sparse", "list_matrices",
           "load_matrix", "ops"]
