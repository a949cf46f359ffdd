"""Integrations with other libraries.

Pipeline stage 11 of 14: other libraries on the operators: PyTorch Geometric (:mod:`.pyg`).
May import: config, dtypes, data, pattern, kernels, abi, toolchain, evaluate, specialize, jit,
ops, tensor.
"""
