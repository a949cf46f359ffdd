"""Implementations behind the ``sparserl`` operators.

``vendor`` reaches torch's own sparse kernels through ``torch.sparse`` (NVIDIA's cuSPARSE on
CUDA, MKL or torch's native CSR kernels on the CPU): it serves the CPU, and CUDA until
pattern-specialized kernels take over. ``reference`` is written with device-generic torch
operations (gather, multiply, ``index_add_``) and computes the float64 references the
runtime checks kernels against.
Every function takes a :class:`~torch_sparserl.pattern.Pattern` plus its tensors, and the
caller (``ops.py``) has validated them.
"""
