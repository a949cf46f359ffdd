"""torch.compile: the sparserl backend and the passes it runs.

Pipeline stage 11 of 14: ``torch.compile``: the ``sparserl`` backend (:mod:`.backend`, found
through the entry point :mod:`._dynamo_entry`), its graph passes, specialization at compile
time, CUDA graphs, and :func:`torch_sparserl.compile` (:mod:`.convert`).
May import: config, dtypes, data, pattern, kernels, abi, toolchain, evaluate, specialize, jit,
ops, tensor.
"""
