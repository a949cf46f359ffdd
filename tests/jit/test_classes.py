"""Kernels by pattern class (issue 36, CPU with fakes): young patterns are counted by class, a
class is decided once in the background and checked on more of its patterns, its kernel then
serves every young pattern of the class; classes are persisted in the cache, refused when a
check fails, guarded per call. Also the pattern-free kernels a class takes: the sized launch's
arguments and geometry, and the autotuner's narrowed candidates."""

from __future__ import annotations

import ctypes
import logging
import threading

import numpy as np
import pytest
import scipy.sparse as sp
import torch

from torch_sparserl import pattern as patterns
from torch_sparserl.jit import classes
from torch_sparserl.jit.cache import CacheEntry, KernelCache
from torch_sparserl.jit.decisions import Fallback
from torch_sparserl.jit.runtime import Runtime
from torch_sparserl.config import JitOptions
from torch_sparserl.specialize import autotune
from torch_sparserl.specialize.families import render
from torch_sparserl.toolchain.errors import LaunchError
from torch_sparserl.toolchain.kernel import Kernel, SizedKernel, pattern_free

SOURCE = ('// sparserl: op=spmm dtype=f32 block=32 grid=1\n'
          'extern "C" __global__ void sparserl_kernel(const int* rowptr) {}\n')
N = 8


class Specializer:
    def __init__(self, fail: Exception | None = None):
        self.keys, self.fail = [], fail

    def __call__(self, key, crow, col, ncols):
        self.keys.append(key)
        if self.fail is not None:
            raise self.fail
        return CacheEntry(key, SOURCE, family="fake", params={"lanes": 4}, reason="2.0x cuSPARSE")


def dense_launch(offset: float = 0.0):
    """A class installer whose kernel is the dense product (plus ``offset``: a wrong kernel)."""
    launched = []

    def installer(entry):
        def launch(crow, col, val, X, y=None):
            launched.append(crow.numel() - 1)
            rows = crow.numel() - 1
            A = torch.sparse_csr_tensor(crow.long(), col.long(), val, (rows, X.shape[0])).to_dense()
            out = A @ X + offset
            if y is not None:
                y.copy_(out)
                return y
            return out
        return launch
    installer.launched = launched
    return installer


def runtime_with(tmp_path, specializer, installer, **settings) -> Runtime:
    settings = {"mode": "background", "admit_age_s": 60.0, "class_after": 3, **settings}
    return Runtime(JitOptions(**settings), cache=KernelCache(tmp_path), specializer=specializer,
                   installer=lambda *a: pytest.fail("no pattern of its own is decided"), class_installer=installer,
                   devices=("cpu",))


def batch(seed: int, index_dtype=torch.int32, rows: int = 300, cols: int = 500, per_row: int = 6):
    """A sampled-looking pattern: every seed the same sizes, so the same class."""
    rng = np.random.default_rng(seed)
    A = sp.random(rows, cols, density=per_row / cols, format="csr", random_state=rng, dtype=np.float64)
    crow = torch.from_numpy(A.indptr.astype(np.int64)).to(index_dtype)
    col = torch.from_numpy(A.indices.astype(np.int64)).to(index_dtype)
    val = torch.randn(A.nnz, dtype=torch.float32)
    X = torch.randn(cols, N)
    return crow, col, val, X


def call(runtime, crow, col, val, X):
    entry = patterns.lookup(crow, col, X.shape[0])
    entry.validate("test", crow, col)
    return runtime.call("spmm", entry, crow, col, val, X)


def want(crow, col, val, X):
    return torch.sparse_csr_tensor(crow.long(), col.long(), val, (crow.numel() - 1, X.shape[0])).to_dense() @ X


# ------------------------------------------------------------------ the runtime


def test_a_class_is_decided_after_class_after_patterns_and_then_serves_new_ones(tmp_path):
    specializer, installer = Specializer(), dense_launch()
    runtime = runtime_with(tmp_path, specializer, installer)
    try:
        kept = [batch(seed) for seed in range(3)]  # held: ids of dead patterns could be reused
        for crow, col, val, X in kept:
            assert call(runtime, crow, col, val, X) is None  # cuSPARSE while counting
        runtime.wait(10)
        assert len(specializer.keys) == 1
        key = specializer.keys[0]
        assert classes.is_class(key) and (key.op, key.n, key.dtype) == ("spmm", N, "f32")
        # checked on the two patterns met before the one searched on
        assert installer.launched == [300, 300] and runtime.stats["class_decisions"] == 1
        for seed in (10, 11):
            crow, col, val, X = batch(seed)
            torch.testing.assert_close(call(runtime, crow, col, val, X), want(crow, col, val, X))
        stats = runtime.stats
        assert stats["class_calls"] == 2 and stats["installed_calls"] == 2 and stats["young_calls"] == 3
        assert stats["installs"] == 0 and len(specializer.keys) == 1
        assert runtime.state("spmm", patterns.lookup(crow, col, X.shape[0]), N, torch.float32) is None  # no record
        (listed, what), = runtime.classes()
        assert listed == key and what.startswith("installed: fake")
    finally:
        runtime.close()
    # a later process: the class's decision comes from the cache, no search
    again = Specializer()
    runtime = runtime_with(tmp_path, again, dense_launch())
    try:
        for seed in range(3):
            call(runtime, *batch(20 + seed))
        runtime.wait(10)
        assert again.keys == []
        crow, col, val, X = batch(30)
        torch.testing.assert_close(call(runtime, crow, col, val, X), want(crow, col, val, X))
    finally:
        runtime.close()


def test_calls_on_one_pattern_count_once_and_other_classes_count_apart(tmp_path):
    specializer = Specializer()
    runtime = runtime_with(tmp_path, specializer, dense_launch())
    try:
        crow, col, val, X = batch(0)
        for _ in range(5):
            assert call(runtime, crow, col, val, X) is None
        other = [batch(seed, rows=5000) for seed in (1, 2)]  # another rows bucket
        for parts in other:
            call(runtime, *parts)
        runtime.wait(10)
        assert specializer.keys == []
        assert sorted(record.seen for record in runtime._classes.records()) == [1, 2]
    finally:
        runtime.close()


def test_a_class_kernel_that_differs_from_the_reference_is_refused(tmp_path, caplog):
    specializer, installer = Specializer(), dense_launch(offset=1e-2)
    runtime = runtime_with(tmp_path, specializer, installer)
    try:
        kept = [batch(seed) for seed in range(3)]
        with caplog.at_level(logging.WARNING, logger="torch_sparserl.jit.runtime"):
            for parts in kept:
                call(runtime, *parts)
            runtime.wait(10)
        assert "refused" in caplog.text and "float64 reference" in caplog.text
        (record,) = runtime._classes.records()
        assert isinstance(record.state, Fallback) and not record.kept  # nothing held after the decision
        assert call(runtime, *batch(5)) is None and installer.launched == [300]  # the first check failed
    finally:
        runtime.close()


def test_a_launch_that_declines_a_call_leaves_it_to_cusparse(tmp_path):
    declined = []

    def installer(entry):
        def launch(crow, col, val, X, y=None):
            if y is None:  # a product, not a check: declined (another device, a geometry out of range)
                declined.append(1)
                return None
            return y.copy_(want(crow, col, val, X))
        return launch

    runtime = runtime_with(tmp_path, Specializer(), installer)
    try:
        for seed in range(3):
            call(runtime, *batch(seed))
        runtime.wait(10)
        assert call(runtime, *batch(7)) is None and declined == [1]
        assert runtime.stats["class_calls"] == 0 and runtime.stats["fallback_calls"] == 4
    finally:
        runtime.close()


def test_no_class_for_int64_indices_other_ops_or_class_after_0(tmp_path):
    specializer = Specializer()
    runtime = runtime_with(tmp_path, specializer, dense_launch())
    try:
        for seed in range(4):
            call(runtime, *batch(seed, index_dtype=torch.int64))
        crow, col, val, X = batch(9)
        entry = patterns.lookup(crow, col, X.shape[0])
        assert runtime.call("sddmm", entry, crow, col, torch.randn(300, N), X) is None
        runtime.wait(10)
        assert specializer.keys == [] and len(runtime._classes) == 0
    finally:
        runtime.close()
    runtime = runtime_with(tmp_path, specializer, dense_launch(), class_after=0)
    try:
        for seed in range(4):
            call(runtime, *batch(seed))
        runtime.wait(10)
        assert specializer.keys == [] and len(runtime._classes) == 0
    finally:
        runtime.close()


def test_a_transient_failure_counts_the_class_again_and_a_search_failure_refuses_it(tmp_path):
    from torch_sparserl.evaluate.record import TransientFailure

    specializer = Specializer(fail=TransientFailure("out of memory"))
    runtime = runtime_with(tmp_path, specializer, dense_launch())
    try:
        for seed in range(3):
            call(runtime, *batch(seed))
        runtime.wait(10)
        (record,) = runtime._classes.records()
        assert record.state is None and record.seen == 0 and len(specializer.keys) == 1
        specializer.fail = RuntimeError("the sandbox broke")
        for seed in range(3, 6):
            call(runtime, *batch(seed))
        runtime.wait(10)
        assert isinstance(record.state, Fallback) and "the sandbox broke" in record.state.reason
        assert runtime.stats["class_decisions"] == 1
    finally:
        runtime.close()


def test_young_calls_of_many_threads_start_one_decision(tmp_path):
    specializer = Specializer()
    runtime = runtime_with(tmp_path, specializer, dense_launch(), class_after=8)
    kept = [batch(seed) for seed in range(32)]
    try:
        threads = [threading.Thread(target=lambda part=part: [call(runtime, *p) for p in part])
                   for part in (kept[0::2], kept[1::2])]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        runtime.wait(10)
        assert len(specializer.keys) == 1
    finally:
        runtime.close()


# ------------------------------------------------------------------ the class key


def test_the_class_key_buckets_rows_columns_and_mean_row_length():
    def key(rows, cols, per_row, index_dtype=torch.int32, op="spmm"):
        crow, col, _, _ = batch(0, index_dtype, rows, cols, per_row)
        entry = patterns.lookup(crow, col, cols)
        return classes.key_of(op, N, "f32", entry, "sm_90", "autotune")

    base = key(300, 500, 6)
    assert base.pattern.startswith(classes.PREFIX) and key(400, 400, 6) == base  # same powers of two
    assert key(600, 500, 6) != base and key(300, 1100, 6) != base and key(300, 500, 20) != base
    assert key(300, 500, 6, torch.int64) is None and key(300, 500, 6, op="sddmm") is None
    assert key(300, 500, 6, op="spmv").op == "spmv"


# ------------------------------------------------------------------ pattern-free kernels


def spec(family, params, n=32, op="spmm"):
    return render(family, params, op=op, dtype="f32", n=n)


def test_pattern_free_plans_take_nothing_but_sizes():
    assert pattern_free(spec("group_row", {"lanes": 4, "vec": 4}).plan)
    assert not pattern_free(spec("group_row", {"lanes": 4, "vec": 4, "rows": "sorted_desc"}).plan)
    assert not pattern_free(spec("rowchunks", {"seg": 64}).plan)
    assert not pattern_free(spec("nnz_split", {"chunk": 128}, op="spmv", n=1).plan)


def test_the_sized_kernel_packs_each_call_s_sizes_and_geometry():
    launches = []

    def fake_launch(grid, block, smem, stream, params):
        ptrs = [ctypes.cast(params[i], ctypes.POINTER(ctypes.c_void_p))[0] or 0 for i in range(7)]
        ints = [ctypes.cast(params[7 + i], ctypes.POINTER(ctypes.c_int))[0] for i in range(5)]
        launches.append((grid, block, smem, stream, ptrs, ints))

    s = spec("group_row", {"lanes": 4, "vec": 4})
    sized = SizedKernel(Kernel(s, fake_launch, backend="test"))
    for rows, cols, nnz in ((300, 500, 1800), (7, 9, 0)):
        crow = torch.zeros(rows + 1, dtype=torch.int32)
        col = torch.zeros(nnz, dtype=torch.int32)
        val, X = torch.zeros(nnz), torch.zeros(cols, 32)
        y = sized(crow, col, val, X, 5)
        assert y.shape == (rows, 32)
        grid, block, smem, stream, ptrs, ints = launches[-1]
        env = {"rows": rows, "cols": cols, "nnz": nnz, "n": 32, "parts": 0, "hubs": 0}
        assert (grid, block, smem, stream) == (s.plan.grid.evaluate(env), s.plan.block, s.plan.smem.evaluate(env), 5)
        assert ints == [rows, cols, 32, nnz, 0]
        assert ptrs[:5] == [crow.data_ptr(), col.data_ptr(), val.data_ptr() if nnz else 0, X.data_ptr(), y.data_ptr()]
        assert ptrs[5:] == [0, 0]  # no plan data, no workspace
    assert sized(torch.zeros(4, dtype=torch.int32), col, val, torch.zeros(cols, 16), 5) is None  # n is not the plan's
    with pytest.raises(LaunchError, match="needs data of its pattern"):
        SizedKernel(Kernel(spec("rowchunks", {"seg": 64}), fake_launch, backend="test"))


@pytest.mark.parametrize("op,n", [("spmm", 32), ("spmm", 128), ("spmv", 1)])
def test_the_autotuner_offers_classes_pattern_free_candidates(op, n):
    features = {"rows": 40000, "cols": 200000, "nnz": 400000, "row_mean": 10.0, "row_max": 60, "row_cv": 0.8}
    every = autotune.candidates(op, n, "f32", features)
    narrowed = autotune.candidates(op, n, "f32", features, only=classes.accepts)
    assert narrowed and len(narrowed) < len(every)
    assert all(pattern_free(s.plan) for s in narrowed)


def test_a_class_key_narrows_the_specializer_s_search(monkeypatch):
    from torch_sparserl.config import JitOptions
    from torch_sparserl.jit.specializers import autotune_specializer

    seen = {}

    def fake_tune(matrix, **kwargs):
        seen.update(kwargs)
        raise RuntimeError("stop here")

    monkeypatch.setattr(autotune, "tune", fake_tune)
    specializer = autotune_specializer(JitOptions())
    specializer._sandbox = object()  # never started
    crow, col, _, X = batch(0)
    entry = patterns.lookup(crow, col, X.shape[0])
    key = classes.key_of("spmm", N, "f32", entry, "sm_90", "autotune")
    with pytest.raises(RuntimeError, match="stop here"):
        specializer(key, crow, col, X.shape[0])
    assert seen["only"] is classes.accepts and seen["matrix_key"] != key.pattern  # the pattern's own hash
