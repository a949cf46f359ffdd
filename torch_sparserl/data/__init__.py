"""Matrices: shipped, loaded from files, or generated.

Pipeline stage 1 of 14: matrices for the demo, the tests, the benchmarks and training: the few
shipped with the package (``matrices/``, :mod:`.datasets`) and synthetic patterns of any size
(:mod:`.synthetic`); mini-batches sampled from a large graph (:mod:`.sampling`), padded to a few
sizes (:mod:`.buckets`: :class:`Buckets`, :class:`PaddedBatch`) and made ahead of the step that
trains on them (:mod:`.prefetch`); array helpers the stages share (:mod:`.arrays`).
May import: none.
"""


def __getattr__(name):
    # Lazy: buckets imports NumPy and SciPy, which loading a shipped matrix does not need.
    if name in ("Buckets", "PaddedBatch"):
        from . import buckets
        return getattr(buckets, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["Buckets", "PaddedBatch"]
