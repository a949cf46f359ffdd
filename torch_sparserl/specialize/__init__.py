"""Specialization: from a pattern to the kernel that serves it.

Pipeline stage 7 of 14: which kernel for a pattern: the kernel families (:mod:`.families`), the
exhaustive autotuner (:mod:`.autotune`) and the learned policy (:mod:`.policy`), which run one
search (:mod:`.search`: screen, then validate the fastest).
May import: config, dtypes, data, pattern, kernels, abi, toolchain, evaluate.
"""
