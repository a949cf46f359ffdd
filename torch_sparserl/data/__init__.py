"""Matrices: shipped, loaded from files, or generated.

Pipeline stage 1 of 14: matrices for the demo, the tests, the benchmarks and training: the few
shipped with the package (``matrices/``, :mod:`.datasets`) and synthetic patterns of any size
(:mod:`.synthetic`).
May import: none.
"""
