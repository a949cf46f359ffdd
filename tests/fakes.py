"""Test doubles shared by several stages' tests: a specializer and installer for the runtime
(:class:`Fakes`, CPU products through torch), and a sandbox that scores candidates without
running them (:class:`FakeSandbox`)."""

from __future__ import annotations

import hashlib
from contextlib import contextmanager

import torch

from torch_sparserl.evaluate.record import ErrorKind, EvalRecord, TransientFailure
from torch_sparserl.jit import runtime as rt
from torch_sparserl.jit.cache import CacheEntry, KernelCache
from torch_sparserl.specialize import families
from torch_sparserl.specialize.autotune import FINAL_CONFIG

# a source the cache accepts on a hit (the ABI's plan and kernel, device code only); the fake installer ignores it
SOURCE = ('// sparserl: op=spmm dtype=f32 block=32 grid=1\n'
          'extern "C" __global__ void sparserl_kernel(const int* rowptr) {}\n')


# What the fixed specializer installs for each op: families that render for every dtype and the
# widths the GPU tests use; group_row stores each row once, so the fused epilogues have a kernel too.
FIXED_FAMILIES = {"spmv": "rowchunks", "spmm": "group_row", "sddmm": "group_row"}


def fixed_specializer(key, crow, col, ncols):
    """Every key's kernel from :data:`FIXED_FAMILIES` with the family's defaults, no search: the
    GPU tests named for specialized kernels use it, so that what serves them is an installed
    kernel whatever a search would have decided (a search may rightly leave a product to cuSPARSE)."""
    family = FIXED_FAMILIES[key.op]
    spec = families.render(family, None, op=key.op, dtype=key.dtype, n=key.n)
    return CacheEntry(key, spec.source, family=family, reason="chosen by the test")


@contextmanager
def using_runtime(settings, cache_root, **parts):
    """A runtime active inside the block, closed after it; ``parts``: its specializer, installer."""
    runtime = rt.Runtime(settings, cache=KernelCache(cache_root), **parts)
    previous = rt.set_active(runtime)
    try:
        yield runtime
    finally:
        rt.set_active(previous)
        runtime.close()


class Fakes:
    def __init__(self, entry_source=SOURCE, fail_specialize=False, fail_install=False, gate=None, transient=0):
        self.specialized, self.installed, self.launched = [], [], []
        self.entry_source, self.fail_specialize, self.fail_install, self.gate = (
            entry_source, fail_specialize, fail_install, gate)
        self.transient = transient  # searches that fail for the device's state before one decides

    def specializer(self, key, crow, col, ncols):
        if self.gate is not None:
            self.gate.wait(10)
        self.specialized.append(key)
        if self.fail_specialize:
            raise RuntimeError("every candidate crashed")
        if len(self.specialized) <= self.transient:
            raise TransientFailure("no candidate decided: 2 of 2 evaluations failed for the device's state")
        return CacheEntry(key, self.entry_source, family="fake", params={"p": 1},
                          reason="2.0x cuSPARSE" if self.entry_source else "none beat cuSPARSE")

    def installer(self, entry, crow, col, ncols):
        self.installed.append(entry.key)
        if self.fail_install:
            raise OSError("the build failed")
        rows = crow.numel() - 1

        def launch(crow, col, val, X):
            self.launched.append((X.is_contiguous(), X.data_ptr() % 16, val.is_contiguous()))
            return torch.sparse_csr_tensor(crow, col, val, (rows, ncols)).to_dense() @ X

        return launch


class FakeSandbox:
    """Scores a candidate by a hash of its source; about every ``wrong_every``-th one is wrong."""

    def __init__(self, drift: float = 0.0, wrong_every: int = 5):
        self.calls: list[tuple[str, object]] = []
        self.matrices = {}
        self.drift = drift
        self.wrong_every = wrong_every

    def set_matrix(self, key, rowptr, col, shape):
        self.matrices[key] = (rowptr, col, shape)
        self.sent = getattr(self, "sent", 0) + 1

    def has_matrix(self, key):
        return key in self.matrices

    def release(self):
        self.released = getattr(self, "released", 0) + 1

    def evaluate(self, spec, matrix_key, n, dtype, config, timeout_s):
        assert matrix_key in self.matrices
        self.calls.append((spec.key, config))
        score = int(hashlib.sha256(spec.key.encode()).hexdigest()[:6], 16)
        record = EvalRecord(key=spec.key, family=spec.family, params=spec.params, op=spec.plan.op,
                            n=n, dtype=dtype, compiled=True)
        if self.wrong_every and score % self.wrong_every == 0:
            return record.fail(ErrorKind.WRONG, "fake")
        record.correct = True
        record.runtime_us = 10.0 + score % 1000 + (self.drift if config is FINAL_CONFIG else 0.0)
        record.cusparse_us = 500.0
        return record

    def close(self):
        pass
