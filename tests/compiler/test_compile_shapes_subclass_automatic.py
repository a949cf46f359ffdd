"""Compiled products follow every size, as the subclass, automatic shapes: one
sixth of the cases of :func:`compile_shapes_cases.products_follow_every_size`, a file each so
that a GPU machine's call runs each in minutes."""

import pytest

from compile_shapes_cases import SEQUENCES, SPELLINGS, products_follow_every_size

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("fresh_dynamo")]


@pytest.mark.parametrize("changes", sorted(SEQUENCES))
@pytest.mark.parametrize("spelling", sorted(SPELLINGS))
def test_compiled_products_follow_every_size(spelling, changes):
    products_follow_every_size(spelling, changes, flatten=False, dynamic="automatic")
