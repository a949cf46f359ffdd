"""The ``sparserl`` torch.compile backend: parse the options, hand off to Inductor.

Registered through the ``torch_dynamo_backends`` entry point, so
``torch.compile(model, backend="sparserl")`` needs no import. Graphs go to Inductor's
``compile_fx`` with :class:`~torch_sparserl.passes.SparseOpsPass` as the post-grad pass.
Before that, the products of the graph's CSRMatrix inputs (module buffers, constants,
arguments) are handed to the JIT runtime (:mod:`~torch_sparserl.prespecialize`), so their
kernels are being specialized while Inductor compiles; under CUDA graphs
(``mode="reduce-overhead"``), which capture the kernels they replay, compilation waits for
those decisions.
"""

from __future__ import annotations

from . import intercept
from .passes import SparseOpsPass
from .prespecialize import prespecialize_graph
from .settings import Settings


def sparserl_backend(gm, example_inputs, *, options=None, mode=None):
    import torch._inductor.config as inductor_config
    from torch._inductor import list_mode_options
    from torch._inductor.compile_fx import compile_fx

    settings = Settings.from_options(options)
    if settings.intercept_sparse:
        intercept.activate_for_backend()
    patches = dict(list_mode_options(mode)) if mode else {}
    if settings.prespecialize:
        # CUDA graphs capture whichever kernel serves each product when they are recorded,
        # and replay it: a product still being decided in the background would be captured
        # on cuSPARSE for good. So under them, the graph's decisions come first.
        captured = patches.get("triton.cudagraphs", inductor_config.triton.cudagraphs)
        prespecialize_graph(gm, example_inputs, wait=bool(captured))
    patches["post_grad_custom_post_pass"] = SparseOpsPass(
        settings, chained=inductor_config.post_grad_custom_post_pass)
    return compile_fx(gm, example_inputs, config_patches=patches)


# Recognized by torch_sparserl.intercept in Dynamo's callback chain.
sparserl_backend._sparserl_backend = True
