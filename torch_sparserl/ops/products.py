"""The four products, ``sparserl::spmm``, ``spmv``, ``spmm_transposed`` and ``spmv_transposed``,
defined from one table (:data:`PRODUCTS`).

A row says what differs between them: the dense operand's name (in the schema and the errors),
whether it is a matrix or a vector, and whether A or Aᵀ multiplies it. Everything else (the
checks, the implementation, the fake, the backward, the registration) is written once, below,
for all four. The transposed products run on the transposed *pattern*, computed once per
pattern and cached (:meth:`Pattern.transpose`), except a pattern's first one where cuSPARSE
can run it on A's own arrays (:func:`_transposed_once`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .. import pattern as patterns
from ..jit import fastpath
from ..pattern.validation import check_csr_meta, check_dense
from .backward import _IMPLS, _OPERATORS, _product_backward_of, _spmm_setup
from .common import NAMESPACE, _pattern, _product


@dataclass(frozen=True)
class Product:
    """What one product's definition needs beyond the others'."""

    operand: str      # the dense operand's name in the schema and in errors
    dim: int          # 2: a matrix (N columns), 1: a vector
    transposed: bool  # Aᵀ times the operand: it has A's rows, the result A's columns
    doc: str

    @property
    def kernel(self) -> str:
        """The untransposed product that serves it: ``spmm`` or ``spmv``."""
        return "spmm" if self.dim == 2 else "spmv"


PRODUCTS: dict[str, Product] = {
    "spmm": Product("X", 2, False, "A @ X for the CSR matrix A = (crow, col, val) with ``ncols`` columns."),
    "spmv": Product("x", 1, False, "A @ x for the CSR matrix A = (crow, col, val) and a vector x of length ``ncols``."),
    "spmm_transposed": Product("G", 2, True, "Aᵀ @ G for the CSR matrix A = (crow, col, val); G is (nrows, N), the "
                                             "result (ncols, N)."),
    "spmv_transposed": Product("g", 1, True, "Aᵀ @ g for the CSR matrix A = (crow, col, val) and a vector g of "
                                             "length nrows."),
}


def _transposed_once(entry: patterns.Pattern, crow: Tensor, col: Tensor, val: Tensor, ncols: int,
                     G: Tensor) -> Tensor | None:
    """``Aᵀ @ G`` without the transpose, for a pattern's first transposed product: cuSPARSE on the
    pattern's own arrays (its transpose operation), through the C++ library. A one-off pattern
    (the backward of a sampled mini-batch) has no second one, and computing its transpose (a
    sort and a handful of launches on the host's critical path) costs more than the product.
    From the second on, the transpose is computed, and the product may be specialized and
    served from C++. None where this does not apply: not CUDA, the library not loaded, the
    transpose there already, an overfull pattern, deterministic algorithms asked for (cuSPARSE's
    transposed products may differ in the last bits from run to run), or a product cuSPARSE is
    not called with here (a type or int64 sizes it refuses)."""
    cusparse_once = fastpath.cusparse_once
    if (cusparse_once is None or not G.is_cuda or entry.has_transpose or entry.overfull
            or torch.compiler.is_compiling()):
        return None
    first = entry.transposed_products == 0
    entry.transposed_products += 1
    if not (first or entry.transient) or torch.are_deterministic_algorithms_enabled():
        return None
    crow, col = entry.indices(crow, col)
    out = cusparse_once(crow, col, val, ncols, G, True)
    if out is not None:
        patterns.count("transposes_avoided")
        if entry.check is not None:  # its device check has not come back
            entry.check.poison(out)
    return out


def _implementation(op: str, spec: Product):
    """``_<op>``: the checks, then the product (see :func:`~.common._product`)."""
    name, operand, dim, kernel = f"{NAMESPACE}.{op}", spec.operand, spec.dim, spec.kernel
    if not spec.transposed:
        def implementation(crow: Tensor, col: Tensor, val: Tensor, ncols: int, X: Tensor) -> Tensor:
            entry = _pattern(name, crow, col, val, ncols)
            check_dense(name, operand, X, dim=dim, rows=ncols, rows_name="ncols", like=val)
            return _product(kernel, entry, crow, col, val, X)
    else:
        def implementation(crow: Tensor, col: Tensor, val: Tensor, ncols: int, G: Tensor) -> Tensor:
            entry = _pattern(name, crow, col, val, ncols)
            check_dense(name, operand, G, dim=dim, rows=entry.nrows, rows_name="nrows", like=val)
            out = _transposed_once(entry, crow, col, val, ncols, G)
            if out is not None:
                return out
            entry_t, crow_t, col_t, perm = entry.transpose(crow, col)
            return _product(kernel, entry_t, crow_t, col_t, entry.transposed_values(val, perm), G)
    implementation.__name__ = implementation.__qualname__ = f"_{op}"
    return implementation


def _fake_of(op: str, spec: Product):
    """``_<op>_fake``: the metadata checks and the result's shape, for tracers."""
    name, operand, dim = f"{NAMESPACE}.{op}", spec.operand, spec.dim

    def fake(crow, col, val, ncols, X):
        check_csr_meta(name, crow, col, val, ncols)
        nrows = crow.shape[0] - 1
        if spec.transposed:
            check_dense(name, operand, X, dim=dim, rows=nrows, rows_name="nrows", like=val)
            rows = ncols
        else:
            check_dense(name, operand, X, dim=dim, rows=ncols, rows_name="ncols", like=val)
            rows = nrows
        return X.new_empty((rows, X.shape[1]) if dim == 2 else (rows,))

    fake.__name__ = fake.__qualname__ = f"_{op}_fake"
    return fake


def _define(op: str, spec: Product, implementation, fake):
    """``sparserl::<op>``: the custom op on ``implementation``, with its fake and its backward."""
    def operator(crow, col, val, ncols, X):
        return implementation(crow, col, val, ncols, X)

    operator.__name__ = operator.__qualname__ = op
    operator.__doc__ = spec.doc
    schema = f"(Tensor crow, Tensor col, Tensor val, SymInt ncols, Tensor {spec.operand}) -> Tensor"
    defined = torch.library.custom_op(f"{NAMESPACE}::{op}", operator, mutates_args=(), schema=schema)
    defined.register_fake(fake)
    defined.register_autograd(_BACKWARDS[op], setup_context=_spmm_setup)
    return defined


_BACKWARDS = {op: _product_backward_of(op) for op in PRODUCTS}
"""Each product's backward (what eager autograd's node calls too: :class:`.doors._EagerProduct`)."""
_DIRECT = {op: _implementation(op, spec) for op, spec in PRODUCTS.items()}
"""Each product's implementation: what :func:`.doors.direct` calls without the dispatcher."""
_FAKES = {op: _fake_of(op, spec) for op, spec in PRODUCTS.items()}
_DEFINED = {op: _define(op, spec, _DIRECT[op], _FAKES[op]) for op, spec in PRODUCTS.items()}
_IMPLS.update(_DIRECT)
_OPERATORS.update(_DEFINED)

spmm = _DEFINED["spmm"]
spmv = _DEFINED["spmv"]
spmm_transposed = _DEFINED["spmm_transposed"]
spmv_transposed = _DEFINED["spmv_transposed"]
