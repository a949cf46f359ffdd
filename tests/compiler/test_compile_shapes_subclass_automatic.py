"""Compiled products follow every size: the subclass, automatic shapes (one of six
files of :mod:`compile_shapes_cases`' product cases, so that each runs in minutes on a GPU machine)."""

from compile_shapes_cases import product_tests

test_compiled_products_follow_every_size = product_tests(flatten=False, dynamic="automatic")
