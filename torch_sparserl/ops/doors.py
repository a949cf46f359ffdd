"""The operators' doors for eager code and for differentiated graphs' twins, and recording for C++.

Every door runs the same implementation (the same checks, errors and kernels) and asks the same
decision record of the runtime (:class:`~torch_sparserl.jit.decisions.Decision`); each exists for
one kind of caller, because what the caller has already done (differentiate, trace, dispatch)
is not paid for twice:

=============================  ===================================================================
door                           who calls it, and why it exists
=============================  ===================================================================
``sparserl::<op>``             users, tracers and ``torch.compile`` before AOTAutograd: the public,
                               differentiable operator with its fake and autograd formulas.
``sparserl_direct::<op>``      graphs AOTAutograd has differentiated (the backend's post-grad pass
                               retargets them, :data:`~.twins.DIRECT_OPS`): the implementation
                               only, no autograd kernel, whose layers would cost several times the
                               dispatch. Its CUDA products are recorded for C++ (:func:`record`).
``sparserl_fast::<op>``        the same graphs' CUDA ``spmm``/``spmv`` and their transposes when the
                               backend's ``fast_path`` is on (:data:`~.twins.FAST_OPS`): served in
                               C++ from the registry that repeats the runtime's records, else
                               ``sparserl_direct``.
:func:`direct`                 eager ``CSRMatrix`` products with nothing to differentiate, trace or
                               dispatch (:func:`~.common.direct_ok`): the implementation without the
                               dispatcher. ``A @ X`` then keeps the record on the matrix, and its
                               next call launches what the record names without a lookup.
:func:`eager_product`          eager ``CSRMatrix`` products that autograd records
                               (:func:`~.common.eager_ok`): one ``autograd.Function`` node around the
                               implementation instead of custom_op's autograd wrapper.
=============================  ===================================================================
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..jit import fastpath
from ..jit.runtime import active_or_none
from .backward import _IMPLS
from .products import _BACKWARDS, _DIRECT
from .sampled import _sddmm

_FAST_INDEX = {name: index for index, name in enumerate(fastpath.OPS)}  # what the C++ registry serves


# ------------------------------------------------------------------ recording for C++


def _recordable(X: Tensor) -> bool:
    """Whether C++ can take over a product on ``X``'s device: CUDA, the library loaded."""
    return X.is_cuda and fastpath.loaded


def record(op: str, crow: Tensor, col: Tensor, val: Tensor, ncols: int, X: Tensor, runtime=None) -> None:
    """After the Python implementation served this call, let C++ serve the next one like it
    (:func:`torch_sparserl.jit.fastpath.record`, which repeats the runtime's decision record: its
    kernel, or cuSPARSE), where the call is on CUDA, the library is loaded and a runtime is
    active (``runtime``: the one that served it, else the active one). The one place any door
    records: ``op`` is a product or ``sddmm`` (then ``val`` is Y and ``ncols`` X's rows)."""
    if not _recordable(X):
        return
    runtime = runtime or active_or_none()
    if runtime is not None:
        fastpath.record(runtime, op, crow, col, val, ncols, X)


def _recording(op: str, impl):
    """``impl``, after which a CUDA call is recorded for C++ (:func:`record`)."""
    def run(crow: Tensor, col: Tensor, val: Tensor, ncols: int, X: Tensor) -> Tensor:
        out = impl(crow, col, val, ncols, X)
        record(op, crow, col, val, ncols, X)
        return out

    run.__name__ = impl.__name__
    return run


def _recording_sddmm(crow: Tensor, col: Tensor, Y: Tensor, X: Tensor) -> Tensor:
    """:func:`~.sampled._sddmm`, after which a CUDA call an installed kernel served is recorded
    for C++ (cuSPARSE's SDDMM stays in Python)."""
    out = _sddmm(crow, col, Y, X)
    record("sddmm", crow, col, Y, X.shape[0], X)
    return out


_RECORDING = {**{op: _recording(op, impl) for op, impl in _DIRECT.items()}, "sddmm": _recording_sddmm}
"""The implementations that record their CUDA calls for C++: what the twins run
(:mod:`.twins`), and, behind C++'s door, eager autograd."""


# ------------------------------------------------------------------ the Python path's doors


def direct(op: str, crow: Tensor, col: Tensor, val: Tensor, ncols: int, X: Tensor) -> Tensor:
    """``torch.ops.sparserl.<op>(crow, col, val, ncols, X)`` without the dispatcher; only
    where :func:`~.common.direct_ok` holds. Same checks, same errors, same kernels."""
    return _DIRECT[op](crow, col, val, ncols, X)


def _door_first(op: str, recorded):
    """``recorded`` (the implementation that records a CUDA call for C++), after asking C++'s
    eager door (:data:`torch_sparserl.jit.fastpath.serve`). For the products that eager autograd
    runs: :class:`_EagerProduct`'s forward and the backward's products, where grad mode is
    off, so the door may serve once the call was recorded."""
    index = _FAST_INDEX[op]

    def run(crow: Tensor, col: Tensor, val: Tensor, ncols: int, X: Tensor) -> Tensor:
        serve = fastpath.serve
        if serve is not None:
            out = serve(index, crow, col, val, ncols, X)
            if out is not None:
                return out
        return recorded(crow, col, val, ncols, X)

    run.__name__ = recorded.__name__
    return run


def _sddmm_door_first(crow: Tensor, col: Tensor, Y: Tensor, X: Tensor) -> Tensor:
    """The values' gradient in an eager backward: C++'s installed kernel, once the Python
    implementation has served (and recorded) the same call."""
    serve = fastpath.serve
    if serve is not None and type(X) is Tensor and X.dim() == 2:
        out = serve(fastpath.SDDMM, crow, col, Y, X.shape[0], X)
        if out is not None:
            return out
    return _recording_sddmm(crow, col, Y, X)


_EAGER = {op: _door_first(op, _RECORDING[op]) for op in _DIRECT}
_IMPLS.update(_EAGER)  # the backward's products go through the door too
_IMPLS["sddmm"] = _sddmm_door_first


class _EagerProduct(torch.autograd.Function):
    """A differentiable product for eager code: the implementation forward, the operator's
    own backward formula (which calls the implementations again when it can).

    The operator's autograd (custom_op's wrapper around its dispatch) costs about three
    times the CPU of a whole product on a small graph; this node costs one
    ``autograd.Function`` call. Double backward goes through the differentiable operators.
    """

    @staticmethod
    def forward(ctx, crow, col, val, ncols, X, op):
        ctx.ncols, ctx.op = ncols, op
        ctx.save_for_backward(crow, col, val, X)
        return _EAGER[op](crow, col, val, ncols, X)

    @staticmethod
    def backward(ctx, grad):
        return (*_BACKWARDS[ctx.op](ctx, grad), None)


def eager_product(op: str, crow: Tensor, col: Tensor, val: Tensor, ncols: int, X: Tensor) -> Tensor:
    """``torch.ops.sparserl.<op>(crow, col, val, ncols, X)`` for eager code that needs a
    gradient; only where :func:`~.common.eager_ok` holds. Same checks, errors, kernels and gradients."""
    return _EagerProduct.apply(crow, col, val, ncols, X, op)
