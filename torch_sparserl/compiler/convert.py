"""``torch_sparserl.compile``: convert sparse inputs to CSRMatrix, then compile whole.

Dynamo cannot trace ``torch.sparse_csr`` tensors; :class:`~torch_sparserl.CSRMatrix` it can.
This helper converts a module's sparse buffers and attributes once, in place (as
``model.to()`` does), and the sparse arguments of every call, then compiles with the
``sparserl`` backend, so that a model written for ``torch.sparse`` compiles without graph
breaks.
"""

from __future__ import annotations

import functools

import torch
from torch.utils import _pytree as pytree
from torch.utils.weak import WeakIdKeyDictionary

from ..tensor import intercept
from ..tensor.construct import csr
from ..tensor.csr_matrix import CSRMatrix

_SPARSE_LAYOUTS = (torch.sparse_csr, torch.sparse_coo, torch.sparse_csc)
_converted = WeakIdKeyDictionary()  # sparse tensor -> CSRMatrix, so patterns stay cached


def _is_sparse_matrix(t) -> bool:
    return isinstance(t, torch.Tensor) and not isinstance(t, CSRMatrix) \
        and t.layout in _SPARSE_LAYOUTS and t.dim() == 2


def to_csr_matrix(t: torch.Tensor) -> CSRMatrix:
    """``csr(t)``, remembered per sparse tensor while it lives (values stay shared)."""
    if t.requires_grad:  # values carry a gradient: convert afresh so that it flows back
        return csr(t)
    matrix = _converted.get(t)
    if matrix is None:
        matrix = _converted[t] = csr(t)
    return matrix


def convert_module(model: torch.nn.Module) -> torch.nn.Module:
    """Replace sparse 2-D buffers and plain tensor attributes of every submodule, in place."""
    for module in model.modules():
        for name, buffer in list(module._buffers.items()):
            if _is_sparse_matrix(buffer):
                module._buffers[name] = to_csr_matrix(buffer)
        for name, value in list(vars(module).items()):
            if _is_sparse_matrix(value):
                setattr(module, name, to_csr_matrix(value))
    return model


def convert_arguments(args, kwargs):
    return pytree.tree_map_only(
        torch.Tensor, lambda t: to_csr_matrix(t) if _is_sparse_matrix(t) else t, (args, kwargs))


def _pre_hook(module, args, kwargs):
    return convert_arguments(args, kwargs)


def compile(model, *, options=None, **compile_kwargs):
    """``torch.compile(model, backend="sparserl")`` for models that use ``torch.sparse``.

    Sparse CSR/COO/CSC buffers and attributes of an ``nn.Module`` are converted in place;
    sparse arguments are converted at every call. Other keyword arguments (``fullgraph``,
    ``dynamic``, ``mode``) go to ``torch.compile``.
    """
    if "backend" in compile_kwargs:
        raise TypeError("torch_sparserl.compile: the backend is always 'sparserl' (got backend=)")
    intercept.activate_for_backend()
    if isinstance(model, torch.nn.Module):
        convert_module(model)
    compiled = torch.compile(model, backend="sparserl", options=options, **compile_kwargs)
    if isinstance(compiled, torch.nn.Module):
        # A pre-hook of the compiled wrapper runs before Dynamo sees the arguments.
        compiled.register_forward_pre_hook(_pre_hook, with_kwargs=True)
        return compiled

    @functools.wraps(model)
    def run(*args, **kwargs):
        args, kwargs = convert_arguments(args, kwargs)
        return compiled(*args, **kwargs)

    return run
