"""The operators' backward formulas, and the products a backward runs.

The products close under differentiation: a product's backward is an SDDMM (the values'
gradient) and the product in the other direction (the operand's), an SDDMM's two products
(:func:`_product_backward_of`, :func:`_sddmm_backward_of`). Each operator's module enters its
implementation and its operator into :data:`_IMPLS` and :data:`_OPERATORS` when it defines
them; :mod:`.doors` then puts its C++-door-first implementations in :data:`_IMPLS` for the
products eager autograd runs.
"""

from __future__ import annotations

from .common import direct_ok

_IMPLS: dict = {}
"""Each operator's implementation by name (``spmm``, ``sddmm``, ``spmm_heads`` ...): what an
eager backward calls."""

_OPERATORS: dict = {}
"""Each differentiable operator (``torch.ops.sparserl.<name>``'s custom op) by name: what a
backward that must be seen (a double backward, a tracer, a mode) calls."""


def _backward_impls(*tensors) -> dict:
    """The products a backward runs: the implementations themselves when nothing needs to
    see the operators (an eager backward: no double backward, no tracer, no mode), since the
    operators' dispatch costs more CPU than the products on a small graph; the
    differentiable operators otherwise."""
    if all(direct_ok(a, b) for a, b in zip(tensors, tensors[1:])):
        return _IMPLS
    return _OPERATORS


def _spmm_setup(ctx, inputs, output):
    crow, col, val, ncols, X = inputs
    ctx.ncols = ncols
    ctx.save_for_backward(crow, col, val, X)


def _sddmm_setup(ctx, inputs, output):
    crow, col, Y, X = inputs
    ctx.save_for_backward(crow, col, Y, X)


def _product_backward_of(op: str):
    """The backward of the product ``op`` (``spmm``, ``spmv``, ``spmm_heads`` or the transpose
    of one), saved as ``(crow, col, val, operand)`` by :func:`_spmm_setup`: the values' gradient
    by the SDDMM of the row side and the column side (the gradient and the operand; a vector
    as a one-column matrix), the operand's by the product in the other direction."""
    transposed = op.endswith("_transposed")
    forward = op.removesuffix("_transposed")
    other = forward if transposed else forward + "_transposed"
    sddmm = "sddmm_heads" if forward == "spmm_heads" else "sddmm"
    vector = forward == "spmv"

    def backward(ctx, grad):
        crow, col, val, operand = ctx.saved_tensors
        impl = _backward_impls(val, grad, operand)
        if ctx.needs_input_grad[2]:
            rows, cols = (operand, grad) if transposed else (grad, operand)
            if vector:
                rows, cols = rows.unsqueeze(1), cols.unsqueeze(1)
            grad_val = impl[sddmm](crow, col, rows, cols)
        else:
            grad_val = None
        grad_operand = impl[other](crow, col, val, ctx.ncols, grad) if ctx.needs_input_grad[4] else None
        return None, None, grad_val, None, grad_operand

    backward.__name__ = backward.__qualname__ = f"_{op}_backward"
    return backward


def _sddmm_backward_of(kind: str = ""):
    """The backward of ``sddmm<kind>``: ``spmm<kind>`` and ``spmm<kind>_transposed``."""
    def backward(ctx, grad):
        crow, col, Y, X = ctx.saved_tensors
        ncols = X.shape[0]
        impl = _backward_impls(grad, Y, X)
        grad_Y = impl[f"spmm{kind}"](crow, col, grad, ncols, X) if ctx.needs_input_grad[2] else None
        grad_X = impl[f"spmm{kind}_transposed"](crow, col, grad, ncols, Y) if ctx.needs_input_grad[3] else None
        return None, None, grad_Y, grad_X

    return backward
