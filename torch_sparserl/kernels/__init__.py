"""Implementations behind the ``sparserl`` operators.

Pipeline stage 3 of 14: the products that need no specialization: torch's own sparse kernels
(:mod:`.vendor`: the fallback and the baseline) and the device-generic float64 reference
(:mod:`.reference`).
May import: config, dtypes, data, pattern.

``vendor`` reaches torch's own sparse kernels through ``torch.sparse`` (NVIDIA's cuSPARSE on
CUDA, MKL or torch's native CSR kernels on the CPU): it serves the CPU, and CUDA until
pattern-specialized kernels take over. ``reference`` is written with device-generic torch
operations (gather, multiply, ``index_add_``) and computes the float64 references the
runtime checks kernels against.
Every function takes a :class:`~torch_sparserl.pattern.Pattern` plus its tensors, and the
caller (``ops``) has validated them.
"""
