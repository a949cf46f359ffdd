"""State that many patterns leave behind stays bounded (issue 36, CPU with fakes): the disk
cache's size cap with least-recently-used eviction and ``sparserl cache prune``, its lock
files and memory; the runtime's admission of a product on its ``admit_calls``-th call and its
bounded background queue."""

from __future__ import annotations

import fcntl
import os
import threading
import time

import pytest
import torch

from torch_sparserl import pattern as patterns
from torch_sparserl.cli import main
from torch_sparserl.jit import cache as cache_module
from torch_sparserl.jit.cache import CacheEntry, KernelCache
from torch_sparserl.jit.decisions import Installed, Pending
from torch_sparserl.jit.runtime import Runtime
from torch_sparserl.config import JitOptions
from torch_sparserl.pattern.fingerprint import SpecializationKey

from helpers import make_pattern, to_parts

SOURCE = ('// sparserl: op=spmm dtype=f32 block=32 grid=1\n'
          'extern "C" __global__ void sparserl_kernel(const int* rowptr) {}\n')


def key(i: int) -> SpecializationKey:
    return SpecializationKey(pattern=f"p{i}", op="spmm", n=32, dtype="f32", arch="sm_90", policy="autotune")


def entry(i: int) -> CacheEntry:
    return CacheEntry(key=key(i), spec_source=SOURCE, family="group_row", params={"lanes": 8},
                      record={"runtime_us": 10.0}, reason="fastest")


def entry_bytes(tmp_path) -> int:
    probe = KernelCache(tmp_path / "probe")
    return probe.put(entry(0)).stat().st_size


# ------------------------------------------------------------------ the disk cache


def test_the_entries_stay_under_the_cap_and_the_least_recently_used_go_first(tmp_path):
    size = entry_bytes(tmp_path)
    cache = KernelCache(tmp_path / "c", max_bytes=10 * size + size // 2)
    for i in range(10):
        cache.put(entry(i))
    assert len(cache.entries()) == 10 and cache.stats["evicted"] == 0  # under the cap
    past = time.time() - 100
    for i in range(10):
        os.utime(cache.path(key(i)), (past + i, past + i))  # written in this order
    assert KernelCache(tmp_path / "c").get(key(0)) is not None  # a use from disk (another process)
    cache.put(entry(10))  # past the cap: down to 80% of it, the least recently used first
    on_disk = {p.name for p in cache.entries()}
    assert on_disk == {cache.path(key(i)).name for i in (0, 4, 5, 6, 7, 8, 9, 10)}
    assert cache.stats["evicted"] == 3
    for i in range(11, 40):
        cache.put(entry(i))
    assert sum(p.stat().st_size for p in cache.entries()) <= cache.max_bytes


def test_an_evicted_entry_is_decided_again(tmp_path):
    cache = KernelCache(tmp_path)
    cache.put(entry(1))
    assert cache.prune(0)[0] == 1
    built = []
    got = cache.get_or_create(key(1), lambda k: built.append(k) or entry(1))
    assert built == [key(1)] and got.family == "group_row"


def test_prune_removes_down_to_the_limit_and_says_what_it_did(tmp_path):
    cache = KernelCache(tmp_path)
    for i in range(4):
        cache.put(entry(i))
    total = sum(p.stat().st_size for p in cache.entries())
    removed, freed, kept = cache.prune(0)
    assert (removed, freed, kept) == (4, total, 0) and cache.entries() == []
    assert KernelCache(tmp_path).get(key(2)) is None  # gone from disk
    assert cache.get(key(2)) is None  # and from memory
    with pytest.raises(ValueError, match="max_bytes must be a whole number of bytes >= 0"):
        cache.prune(-1)


def test_lock_files_are_bounded_and_earlier_per_key_locks_are_swept(tmp_path):
    cache = KernelCache(tmp_path)
    for i in range(300):
        cache.get_or_create(key(i), lambda k, i=i: entry(i))
    locks = [p for p in tmp_path.glob("*.lock") if p.name != cache_module.PRUNE_LOCK]  # 256 stripes, one prune lock
    assert len(locks) <= 256 and all(len(p.stem) == 2 for p in locks)
    # an earlier version's lock per key: removed when no process holds it, kept while one does
    free, held = tmp_path / f"{'a' * 32}.lock", tmp_path / f"{'b' * 32}.lock"
    free.touch()
    fd = os.open(held, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        cache.prune()
        assert not free.exists() and held.exists()
    finally:
        os.close(fd)


def test_memory_keeps_the_most_recent_entries(tmp_path, monkeypatch):
    monkeypatch.setattr(cache_module, "MEMORY_ENTRIES", 3)
    cache = KernelCache(tmp_path)
    for i in range(5):
        cache.put(entry(i))
    cache.get(key(2))  # a hit: the most recent now
    cache.put(entry(5))
    assert set(cache._memory) == {key(i).digest() for i in (4, 2, 5)}


def test_the_cap_comes_from_the_settings(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARSERL_CACHE_MAX_MB", "0.5")
    assert KernelCache(tmp_path).max_bytes == 1 << 19
    with pytest.raises(ValueError, match="max_bytes must be a whole number of bytes >= 1"):
        KernelCache(tmp_path, max_bytes=0)


def test_cache_prune_command(tmp_path, capsys):
    cache = KernelCache(tmp_path)
    for i in range(3):
        cache.put(entry(i))
    assert main(["cache", "prune", "--max-mb", "0", "--dir", str(tmp_path)]) == 0
    assert "removed 3 least recently used entries" in capsys.readouterr().out and cache.entries() == []
    assert main(["cache", "prune", "--dir", str(tmp_path)]) == 0
    assert "removed 0 least recently used entries" in capsys.readouterr().out
    with pytest.raises(SystemExit) as refused:
        main(["cache", "prune", "--max-mb", "-1", "--dir", str(tmp_path)])
    assert refused.value.code == 2
    assert "expected a number of megabytes >= 0 and <= 1048576 (got '-1')" in capsys.readouterr().err


# ------------------------------------------------------------------ the runtime


class Specializer:
    def __init__(self, gate: threading.Event | None = None):
        self.keys, self.gate = [], gate

    def __call__(self, key, crow, col, ncols):
        if self.gate is not None:
            assert self.gate.wait(10)
        self.keys.append(key)
        return CacheEntry(key, SOURCE, family="fake", params={}, reason="2.0x cuSPARSE")


def installer(entry, crow, col, ncols):
    rows = crow.numel() - 1
    return lambda crow, col, val, X: torch.sparse_csr_tensor(crow, col, val, (rows, ncols)).to_dense() @ X


def runtime_with(tmp_path, specializer, **settings) -> Runtime:
    return Runtime(JitOptions(**settings), cache=KernelCache(tmp_path), specializer=specializer,
                   installer=installer, devices=("cpu",))


def operands(seed: int = 0):
    A = make_pattern("random", seed=seed)
    crow, col, val = to_parts(A, torch.float32, torch.int64, "cpu")
    return A, crow, col, val, torch.randn(A.shape[1], 8)


def call(runtime, A, crow, col, val, X):
    return runtime.call("spmm", patterns.lookup(crow, col, A.shape[1]), crow, col, val, X)


def test_a_product_is_decided_on_its_admit_calls_th_call(tmp_path, monkeypatch):
    specializer = Specializer()
    runtime = runtime_with(tmp_path, specializer, mode="sync", admit_calls=3)
    fingerprints = []
    from torch_sparserl.jit import decide

    real = decide.fingerprint
    monkeypatch.setattr(decide, "fingerprint", lambda *a: fingerprints.append(1) or real(*a))
    try:
        A, crow, col, val, X = operands()
        assert call(runtime, A, crow, col, val, X) is None  # cuSPARSE
        assert call(runtime, A, crow, col, val, X) is None
        # a pattern seen this often costs no fingerprint, no cache lookup, no search
        assert specializer.keys == [] and fingerprints == [] and runtime.stats["unadmitted_calls"] == 2
        assert runtime.state("spmm", patterns.lookup(crow, col, A.shape[1]), 8, torch.float32) is None
        want = torch.sparse_csr_tensor(crow, col, val, A.shape).to_dense() @ X
        torch.testing.assert_close(call(runtime, A, crow, col, val, X), want)  # the third: decided, installed
        torch.testing.assert_close(call(runtime, A, crow, col, val, X), want)
        assert len(specializer.keys) == 1 and runtime.stats["installs"] == 1
    finally:
        runtime.close()


def test_a_pattern_younger_than_admit_age_leaves_no_trace(tmp_path):
    """Background mode with admit_age_s: a fresh pattern's calls are cuSPARSE's and leave no
    decision record and nothing queued; once the pattern is old enough, its next call is
    decided. Sync mode and compile-time decisions do not wait."""
    specializer = Specializer()
    runtime = runtime_with(tmp_path, specializer, mode="background", admit_age_s=60.0)
    try:
        A, crow, col, val, X = operands()
        entry = patterns.lookup(crow, col, A.shape[1])
        assert call(runtime, A, crow, col, val, X) is None and call(runtime, A, crow, col, val, X) is None
        assert runtime.stats["young_calls"] == 2 and specializer.keys == []
        assert runtime._decisions.get(entry, "spmm", 8, torch.float32) is None  # no record made
        entry.created -= 61.0  # as if a minute had passed
        assert call(runtime, A, crow, col, val, X) is None  # decided in the background now
        runtime.wait(10)
        assert isinstance(runtime.state("spmm", entry, 8, torch.float32), Installed) and len(specializer.keys) == 1
        B, crow_b, col_b, val_b, X_b = operands(seed=1)
        state = runtime.prespecialize("spmm", patterns.lookup(crow_b, col_b, B.shape[1]), crow_b, col_b, 8,
                                      torch.float32)
        assert isinstance(state, Pending | Installed)  # compile time: admitted however young
    finally:
        runtime.close()
    runtime = runtime_with(tmp_path / "sync", Specializer(), mode="sync", admit_age_s=60.0)
    try:
        A, crow, col, val, X = operands(seed=2)
        assert call(runtime, A, crow, col, val, X) is not None  # sync: decided on the first call
        assert runtime.stats["young_calls"] == 0
    finally:
        runtime.close()


def test_compile_time_decisions_are_admitted_at_once(tmp_path):
    specializer = Specializer()
    runtime = runtime_with(tmp_path, specializer, mode="sync", admit_calls=5)
    try:
        A, crow, col, val, X = operands()
        state = runtime.prespecialize("spmm", patterns.lookup(crow, col, A.shape[1]), crow, col, 8, torch.float32)
        assert isinstance(state, Installed) and len(specializer.keys) == 1
    finally:
        runtime.close()


def test_the_background_queue_drops_what_it_cannot_take_and_asks_again_later(tmp_path):
    gate = threading.Event()
    specializer = Specializer(gate)
    runtime = runtime_with(tmp_path, specializer, mode="background", queue=1, admit_age_s=0)
    try:
        problems = [operands(seed) for seed in (0, 1, 2)]
        states = []
        for A, crow, col, val, X in problems:
            assert call(runtime, A, crow, col, val, X) is None
            states.append(runtime.state("spmm", patterns.lookup(crow, col, A.shape[1]), 8, torch.float32))
        # one decision runs (held at the gate), one waits, the third is not queued
        assert isinstance(states[0], Pending) and isinstance(states[1], Pending) and states[2] is None
        assert runtime.stats["dropped"] == 1
        gate.set()
        runtime.wait(10)
        A, crow, col, val, X = problems[2]
        assert call(runtime, A, crow, col, val, X) is None  # asked again: queued now
        runtime.wait(10)
        assert isinstance(runtime.state("spmm", patterns.lookup(crow, col, A.shape[1]), 8, torch.float32), Installed)
        assert len(specializer.keys) == 3
        # compile-time decisions are queued whatever waits (a graph recorded for CUDA graphs waits for them)
        gate.clear()
        held = [operands(seed) for seed in (3, 4, 5)]
        for A, crow, col, val, X in held:
            state = runtime.prespecialize("spmm", patterns.lookup(crow, col, A.shape[1]), crow, col, 8, torch.float32)
            assert isinstance(state, Pending) and not state.future.cancelled()
        gate.set()
        runtime.wait(10)
        assert len(specializer.keys) == 6
    finally:
        gate.set()
        runtime.close()
