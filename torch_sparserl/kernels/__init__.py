"""Implementations behind the ``sparserl`` operators.

``reference`` is written with device-generic torch operations (gather, multiply,
``index_add_``) and serves the CPU; ``cusparse`` reaches NVIDIA's cuSPARSE through
``torch.sparse`` and serves CUDA until pattern-specialized kernels take over.
Every function takes a :class:`~torch_sparserl.pattern.Pattern` plus its tensors, and the
caller (``ops.py``) has validated them.
"""
