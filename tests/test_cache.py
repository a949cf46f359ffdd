"""The specialization cache: round trip, corruption, foreign entries, one build across processes."""

from __future__ import annotations

import json
import multiprocessing
import time

import pytest

from torch_sparserl.cache import CacheEntry, CacheError, KernelCache
from torch_sparserl.fingerprint import SpecializationKey

KEY = SpecializationKey(pattern="abc", op="spmm", n=32, dtype="f32", arch="sm_90", policy="autotune")


def entry(key=KEY, source="// sparserl: op=spmm ...", reason="fastest") -> CacheEntry:
    return CacheEntry(key=key, spec_source=source, family="group_row", params={"lanes": 8},
                      record={"runtime_us": 10.0}, reason=reason)


def test_round_trip_through_memory_and_disk(tmp_path):
    cache = KernelCache(tmp_path)
    assert cache.get(KEY) is None
    cache.put(entry())
    assert cache.get(KEY).params == {"lanes": 8} and cache.stats["memory_hits"] == 1
    fresh = KernelCache(tmp_path)  # a new process: nothing in memory
    got = fresh.get(KEY)
    want = entry().payload()
    assert {k: v for k, v in got.payload().items() if k != "created"} == {k: v for k, v in want.items() if k != "created"}
    assert got.key == KEY and fresh.stats["disk_hits"] == 1
    assert not list(tmp_path.glob(".tmp-*"))


def test_negative_entries_are_cached(tmp_path):
    cache = KernelCache(tmp_path)
    cache.put(entry(source=None, reason="no candidate beat cuSPARSE by the margin"))
    assert KernelCache(tmp_path).get(KEY).spec_source is None


@pytest.mark.parametrize("damage", ["flip", "truncate", "not json", "format"])
def test_corrupted_entries_are_discarded_and_rebuilt(tmp_path, damage, caplog):
    cache = KernelCache(tmp_path)
    path = cache.put(entry())
    raw = path.read_bytes()
    if damage == "flip":
        path.write_bytes(raw.replace(b'"lanes": 8', b'"lanes": 9'))
    elif damage == "truncate":
        path.write_bytes(raw[: len(raw) // 2])
    elif damage == "not json":
        path.write_bytes(b"\x00\xff garbage")
    else:
        document = json.loads(raw)
        document["format"] = 99
        path.write_text(json.dumps(document))
    fresh = KernelCache(tmp_path)
    assert fresh.get(KEY) is None and fresh.stats["rejected"] == 1 and not path.exists()
    assert "discarding" in caplog.text
    built = fresh.get_or_create(KEY, lambda key: entry(key))
    assert built.params == {"lanes": 8} and fresh.stats["builds"] == 1


def test_foreign_entry_under_the_same_file_name_is_not_used(tmp_path):
    cache = KernelCache(tmp_path)
    other = SpecializationKey(pattern="zzz", op="spmm", n=32, dtype="f32", arch="sm_90", policy="autotune")
    path = cache.put(entry(key=other))
    path.rename(cache.path(KEY))  # e.g. copied from another machine under a wrong name
    assert KernelCache(tmp_path).get(KEY) is None


def test_create_must_answer_for_the_key_it_was_given(tmp_path):
    other = SpecializationKey(pattern="zzz", op="spmm", n=32, dtype="f32", arch="sm_90", policy="autotune")
    with pytest.raises(CacheError, match="another key"):
        KernelCache(tmp_path).get_or_create(KEY, lambda key: entry(key=other))


def _worker(root: str, log_file: str, barrier) -> str:
    barrier.wait()
    cache = KernelCache(root)

    def create(key):
        with open(log_file, "a") as f:
            f.write("built\n")
        time.sleep(0.5)  # long enough for every other process to be waiting on the lock
        return entry(key)

    return cache.get_or_create(KEY, create).family


def test_several_processes_build_a_key_once(tmp_path):
    log_file = tmp_path / "builds.log"
    ctx = multiprocessing.get_context("spawn")
    with ctx.Manager() as manager:
        barrier = manager.Barrier(4)
        with ctx.Pool(4) as pool:
            results = pool.starmap(_worker, [(str(tmp_path / "c"), str(log_file), barrier)] * 4)
    assert results == ["group_row"] * 4
    assert log_file.read_text().count("built") == 1


def _hold_and_die(root: str) -> None:
    cache = KernelCache(root)
    with cache._locked(KEY):
        import os
        os._exit(9)  # killed while specializing: the OS drops its lock


def test_a_builder_that_dies_does_not_block_the_others(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    process = ctx.Process(target=_hold_and_die, args=(str(tmp_path),))
    process.start()
    process.join(60)
    cache = KernelCache(tmp_path, lock_timeout_s=5)
    assert cache.get_or_create(KEY, lambda key: entry(key)).family == "group_row"


def test_waiting_too_long_is_an_error_that_names_the_key(tmp_path):
    holder = KernelCache(tmp_path)
    waiter = KernelCache(tmp_path, lock_timeout_s=0.2)
    with holder._locked(KEY):
        import threading
        errors = []
        thread = threading.Thread(target=lambda: errors.append(
            pytest.raises(CacheError, waiter.get_or_create, KEY, lambda key: entry(key))))
        thread.start()
        thread.join(10)
    assert errors and KEY.digest() in str(errors[0].value)


def test_clear_removes_entries(tmp_path):
    cache = KernelCache(tmp_path)
    cache.put(entry())
    assert cache.clear() == 1 and cache.get(KEY) is None and not cache.entries()
