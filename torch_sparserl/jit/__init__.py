"""The JIT runtime: which kernel serves each product, decided once and then reused.

Pipeline stage 8 of 14: the runtime: which kernel serves a (pattern, op, N, dtype), decided once
and reused (:mod:`.runtime`), one record per product that every door reads
(:mod:`.decisions`), the searches that decide (:mod:`.specializers`) and the installs that
bind a decided kernel (:mod:`.install`), its decisions' cache in memory and on disk
(:mod:`.cache`), and the C++ fast path (:mod:`.fastpath`).
May import: config, dtypes, data, pattern, kernels, abi, toolchain, evaluate, specialize.
"""
