"""The operators' twins for differentiated graphs: the ``sparserl_direct`` and ``sparserl_fast``
libraries, each operator's schema, implementation and fake without ``sparserl``'s autograd."""

from __future__ import annotations

import torch

from ..jit import fastpath
from .doors import _RECORDING
from .epilogue import _spmm_epilogue, _spmm_epilogue_fake
from .heads import _HEADS, _sddmm_heads_fake, _spmm_heads_fake, _spmm_heads_transposed_fake
from .products import _FAKES as _PRODUCT_FAKES
from .sampled import _sddmm_fake

DIRECT_NAMESPACE = "sparserl_direct"
_direct_library = torch.library.Library(DIRECT_NAMESPACE, "DEF")
_FAKES = {**_PRODUCT_FAKES, "sddmm": _sddmm_fake, "spmm_epilogue": _spmm_epilogue_fake,
          "spmm_heads": _spmm_heads_fake, "spmm_heads_transposed": _spmm_heads_transposed_fake,
          "sddmm_heads": _sddmm_heads_fake}


def _define_twin(library: torch.library.Library, name: str, impl, *, autograd_fallthrough: bool = False) -> tuple:
    """``<library's namespace>::<name>``: the schema, implementation and fake of ``sparserl::<name>``
    with no autograd kernel (or, with ``autograd_fallthrough``, autograd passed through),
    registered straight with the dispatcher."""
    public = getattr(torch.ops.sparserl, name).default
    library.define(str(public._schema).split("::", 1)[1])
    library.impl(name, impl, "CompositeExplicitAutograd")
    if autograd_fallthrough:
        library.impl(name, torch.library.fallthrough_kernel, "Autograd")
    torch.library.register_fake(f"{library.ns}::{name}", _FAKES[name], lib=library)
    return public, getattr(getattr(torch.ops, library.ns), name).default


# the products and SDDMM record their CUDA calls for C++ (ops.doors.record)
_DISPATCHED = {**_RECORDING, "spmm_epilogue": _spmm_epilogue, **_HEADS}

DIRECT_OPS: dict = dict(_define_twin(_direct_library, name, impl) for name, impl in _DISPATCHED.items())
"""``torch.ops.sparserl.<op>.default`` -> ``torch.ops.sparserl_direct.<op>.default``.

A graph Inductor compiles has been differentiated by AOTAutograd already: its products need
no autograd, yet custom_op's layers around each call (the autograd wrapper, the redispatch,
the aliasing check) cost several times the dispatcher's own work. The backend's post-grad
pass (:func:`torch_sparserl.compiler.passes.to_direct_ops`) retargets the graph's calls to these
implementation-only twins: same schema, same checks, errors and kernels, same fake."""

FAST_NAMESPACE = "sparserl_fast"
_fast_library = torch.library.Library(FAST_NAMESPACE, "DEF")


# the C++ fast path registers its CUDA kernels for these once loaded
FAST_OPS: dict = dict(_define_twin(_fast_library, name, _DISPATCHED[name], autograd_fallthrough=True)
                      for name in fastpath.OPS)
"""``torch.ops.sparserl.<op>.default`` -> ``torch.ops.sparserl_fast.<op>.default`` for the four
products: what compiled graphs call when the backend's ``fast_path`` is on. Their CUDA calls
are served in C++ (:mod:`torch_sparserl.jit.fastpath`) once its library is loaded and the Python
implementation has served the same call; until then, and on other devices, they are the
``sparserl_direct`` twins."""
