"""Fixtures of the pattern stage's tests."""

from __future__ import annotations

import pytest

from torch_sparserl.config import JitOptions
from torch_sparserl.jit import runtime as rt
from torch_sparserl.jit.cache import CacheEntry, KernelCache


@pytest.fixture
def runtime(tmp_path):
    """A background runtime that decides cuSPARSE for everything (no kernel build in these tests)."""
    runtime = rt.Runtime(JitOptions(mode="background", admit_age_s=0), cache=KernelCache(tmp_path),
                         specializer=lambda key, crow, col, ncols: CacheEntry(key, None, reason="the test's: cuSPARSE"))
    previous = rt.set_active(runtime)
    yield runtime
    rt.set_active(previous)
    runtime.close()
