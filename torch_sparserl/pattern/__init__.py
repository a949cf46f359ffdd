"""Per-pattern state, computed once and cached by tensor identity and version.

Pipeline stage 2 of 14: a CSR pattern's structure, validated once and cached (:mod:`.cache`): its
derived forms (transpose, row indices, the heads' block diagonal: :mod:`.derived`), made on a side
stream (:mod:`.streams`), its fingerprint (:mod:`.fingerprint`), its structural features
(:mod:`.features`) and the one CSR validator (:mod:`.validation`).
May import: config, dtypes, data.

A *pattern* is the structure of a CSR matrix: ``crow``, ``col`` and ``ncols``. Everything
derived from it alone — the validation verdict, the row index of every nonzero, the
transposed pattern and the permutation that carries values into it — is computed on first
use and reused while the same ``crow``/``col`` tensors live unmodified. The cache holds
weak references to the caller's tensors only, so it never keeps a user's adjacency alive.

**The indices are read once.** A pattern's validation reads its indices and, unless the
library made them itself (:func:`own`: the copies :func:`torch_sparserl.csr` takes, the
derived patterns below), keeps a private copy of what it validated; every product, kernel,
plan and derived pattern then reads that copy (:meth:`Pattern.indices`), never the caller's
tensors again. So whatever later happens to the caller's memory, a product runs on indices
that were checked: never an out-of-range read, and every product of a pattern (``A @ X``,
``X @ A``, the backward) sees the same matrix. A new tensor, or an in-place write torch
counts (its version counter, which in-place operations bump, under ``inference_mode`` too),
makes a new pattern, validated again. Writes torch does not count — through ``.data``, or
through a NumPy array sharing a CPU tensor's memory — are not seen: the pattern stays the
one that was validated. Inference tensors have no version counter at all, so indices that
are inference tensors are never cached: each call validates them again (:func:`lookup`).
Nor are indices an operator first meets while a CUDA graph is captured, which the graph's
replays may refill: each replay copies and checks them inside the graph (:func:`in_graph`,
:func:`in_graph_copies`).

Values are not part of the pattern: they may change every step (attention-weighted
graphs), and every product reads them as they are.

The cached tensors are computed by :func:`run_kept`, outside any CUDA graph's private
memory pool: the first product on a pattern may run inside the warm-up of a CUDA graph
(``mode="reduce-overhead"``), where a tensor kept beyond the step is an error.
"""

from __future__ import annotations

from .cache import _CACHE  # noqa: F401  the table itself, whose size benchmarks/bench_churn.py reads
from .cache import (HOST_KEPT_MAX, Pattern, checked_copies, count, host_indices, in_graph, in_graph_copies, intake,
                    lookup, own, owned, private_copy, settle_pending, staged, stats, validated, versions)
from .derived import row_indices
from .streams import run_kept, to_host

__all__ = ["HOST_KEPT_MAX", "Pattern", "checked_copies", "count", "host_indices", "in_graph", "in_graph_copies",
           "intake", "lookup", "own", "owned", "private_copy", "row_indices", "run_kept", "settle_pending", "staged",
           "stats", "to_host", "validated", "versions"]
