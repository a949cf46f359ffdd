"""The JIT runtime: which kernel serves each product, decided once and then reused.

Pipeline stage 8 of 14: the runtime: which kernel serves a (pattern, op, N, dtype), decided once
and reused (:mod:`.runtime`: the hot path and the process's runtime; :mod:`.decide`: admission
and the decision flow; :mod:`.classes`: kernels for classes of young patterns; :mod:`.fused`:
fused epilogues; :mod:`.workers`: the background thread, the specializer's worker and the exit),
one record per product that every door reads (:mod:`.decisions`), the searches that decide
(:mod:`.specializers`) and the installs that bind a decided kernel (:mod:`.install`), the
host costs the install verdict weighs (:mod:`.endtoend`), its decisions' cache in memory and on disk
(:mod:`.cache`), and the C++ fast path (:mod:`.fastpath`).
May import: config, dtypes, data, pattern, kernels, abi, toolchain, evaluate, specialize.
"""
