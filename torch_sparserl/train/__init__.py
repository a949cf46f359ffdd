"""Training with the library: a whole training step captured as one CUDA graph.

Pipeline stage 11 of 14 (beside ``compiler`` and ``integrations``): :mod:`.capture`'s
:func:`capture_step` runs an eager training step on a ``CSRMatrix`` model as a CUDA graph once
the JIT runtime's decisions for its products are in, and captures it again when one lands later.
It reads the runtime's decision records and epoch, so it sits above ``jit`` and ``tensor``; it
does not compile (``compiler`` is ``torch.compile``'s), so it is a stage of its own.
May import: config, dtypes, data, pattern, kernels, abi, toolchain, evaluate, specialize, jit, ops, tensor.
"""

from .capture import CapturedStep, CapturedSteps, CudaGraphs, capture_step

__all__ = ["CapturedStep", "CapturedSteps", "CudaGraphs", "capture_step"]
