"""The tensor a user holds: CSRMatrix, and raw sparse CSR products routed to the operators.

Pipeline stage 10 of 14: the user's tensor: :class:`~.csr_matrix.CSRMatrix` and
:func:`~.construct.csr`, a CSR matrix that ``torch.compile`` traces whole, and the routing of
raw ``torch.sparse_csr`` products to the operators (:mod:`.intercept`).
May import: config, dtypes, data, pattern, kernels, abi, toolchain, evaluate, specialize, ops.
Never jit: the runtime is reached through the operators' one eager door (:mod:`torch_sparserl.ops.doors`).
"""
