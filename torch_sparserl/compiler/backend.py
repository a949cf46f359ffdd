"""The ``sparserl`` torch.compile backend: parse the options, hand off to Inductor.

Options that are not the backend's own are Inductor's config patches, as with
``backend="inductor"`` (``options={"cpp_wrapper": True}``).

Registered through the ``torch_dynamo_backends`` entry point, so
``torch.compile(model, backend="sparserl")`` needs no import. Graphs go to Inductor's
``compile_fx`` with :class:`~torch_sparserl.compiler.passes.SparseOpsPass` as the post-grad pass, and with the
graph's CSRMatrix inputs handed over as their parts (:mod:`~torch_sparserl.compiler.flatten`).
Before that, the products of the graph's CSRMatrix inputs (module buffers, constants,
arguments) are handed to the JIT runtime (:mod:`~torch_sparserl.compiler.prespecialize`), so their
kernels are being specialized while Inductor compiles. Under CUDA graphs
(``mode="reduce-overhead"``), which replay the kernels they recorded, the graph is recorded
with cuSPARSE serving and recorded again once its kernels are decided
(:mod:`~torch_sparserl.compiler.cudagraphs`); where this torch does not allow that, compilation waits
for the decisions.
"""

from __future__ import annotations

import functools

import torch

from ..config import BackendOptions
from ..jit import fastpath
from ..jit import runtime as rt
from ..kernels import vendor
from ..tensor import intercept
from . import cudagraphs
from .flatten import call_flattened, flatten_matrix_inputs
from .passes import SparseOpsPass
from .prespecialize import prespecialize_graph


def sparserl_backend(gm, example_inputs, *, options=None, mode=None):
    import torch._inductor.config as inductor_config
    from torch._inductor import list_mode_options
    from torch._inductor.compile_fx import compile_fx

    settings = BackendOptions.from_options(options)
    if settings.fast_path and settings.direct_ops and torch.cuda.is_available():
        fastpath.ensure()  # loads it, or builds it in the background (graphs compiled meanwhile switch when it loads)
    if settings.intercept_sparse:
        intercept.activate_for_backend()
    patches = {**(list_mode_options(mode) if mode else {}), **dict(settings.inductor)}
    patches["post_grad_custom_post_pass"] = SparseOpsPass(
        settings, chained=patches.get("post_grad_custom_post_pass", inductor_config.post_grad_custom_post_pass))
    # CUDA graphs replay whichever kernel served each product when they were recorded: a
    # product still being decided in the background would replay cuSPARSE for good.
    captured = bool(patches.get("triton.cudagraphs", inductor_config.triton.cudagraphs))
    started = (prespecialize_graph(gm, example_inputs, wait=captured and not cudagraphs.supported())
               if settings.prespecialize else [])
    pending = [state.future for _, state in started if isinstance(state, rt.Pending)]
    if not (captured and pending):
        flat = None if captured or not settings.flatten_matrices else flatten_matrix_inputs(gm, example_inputs)
        if flat is None:
            return _handles_first(compile_fx(gm, example_inputs, config_patches=patches), captured)
        flat_gm, flat_inputs, to_flat = flat
        return call_flattened(compile_fx(flat_gm, flat_inputs, config_patches=patches), to_flat)
    decisions = cudagraphs.Decisions(pending, what=f"a graph of {len(gm.graph.nodes)} nodes")
    with decisions.collecting():
        return _handles_first(compile_fx(gm, example_inputs, inner_compile=decisions.inner_compile,
                                         config_patches=patches), captured)


def _handles_first(compiled, captured: bool):
    """``compiled``, which under CUDA graphs first makes the calling thread's cuSPARSE handle
    (:func:`~torch_sparserl.kernels.vendor.ensure_handle`): a graph recorded after warm-up calls
    that specialized kernels served would otherwise make it inside the recording, where a
    product falls back to cuSPARSE, and the recording fails."""
    if not captured or not torch.cuda.is_available():
        return compiled

    def run(*args, **kwargs):
        vendor.ensure_handle(torch.device("cuda", torch.cuda.current_device()))
        return compiled(*args, **kwargs)

    return functools.wraps(compiled)(run) if callable(compiled) else compiled


# Recognized by torch_sparserl.tensor.intercept in Dynamo's callback chain.
sparserl_backend._sparserl_backend = True
