"""The geometric mean every summary of speedups uses."""

from __future__ import annotations

import math
from typing import Iterable


def geomean(values: Iterable[float | None]) -> float | None:
    """Geometric mean of the positive finite values; None when there are none."""
    logs = [math.log(v) for v in values if v is not None and math.isfinite(v) and v > 0]
    return math.exp(sum(logs) / len(logs)) if logs else None
