"""The specialization cache: round trip, corruption, foreign entries, one build across processes."""

from __future__ import annotations

import json
import multiprocessing
import time

import pytest

from torch_sparserl.jit.cache import CacheEntry, CacheError, KernelCache
from torch_sparserl.pattern.fingerprint import SpecializationKey

KEY = SpecializationKey(pattern="abc", op="spmm", n=32, dtype="f32", arch="sm_90", policy="autotune")


SOURCE = ('// sparserl: op=spmm dtype=f32 block=32 grid=1\n'
          'extern "C" __global__ void sparserl_kernel(const int* rowptr) {}\n')


def entry(key=KEY, source=SOURCE, reason="fastest") -> CacheEntry:
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


# ------------------------------------------------------------------ broken folders (issue 33, class 6)

def test_clear_spares_a_write_in_flight_and_removes_stale_temporary_files(tmp_path):
    import os

    cache = KernelCache(tmp_path)
    cache.put(entry())
    fresh = tmp_path / ".tmp-abc123.json"  # another process's write under way
    fresh.write_text("{")
    stale = tmp_path / ".tmp-old456.json"  # left by a process killed long ago
    stale.write_text("{")
    os.utime(stale, (time.time() - 2 * 3600, time.time() - 2 * 3600))
    assert cache.clear() == 1 and fresh.exists() and not stale.exists()


def _bad_entry(path, how):
    """Put something broken where an entry goes."""
    import os

    if how == "directory":
        path.mkdir()
    elif how == "fifo":
        os.mkfifo(path)
    elif how == "dev-zero symlink":
        path.symlink_to("/dev/zero")
    elif how == "deep json":
        path.write_text("[" * 100_000 + "]" * 100_000)
    elif how == "huge":
        with open(path, "wb") as handle:
            handle.truncate(64 << 20)
    elif how == "unreadable":
        path.write_text("{}")
        path.chmod(0)
    return path


BROKEN = ["directory", "fifo", "dev-zero symlink", "deep json", "huge", "unreadable", "folder is a file",
          "read-only folder with a corrupt entry"]


def _product_with(cache_root, how):
    """A CPU product through the runtime (fake specializer and installer, as in test_runtime.py)
    whose cache folder is broken ``how``; returns (result, expected)."""
    import torch

    from torch_sparserl import pattern as patterns
    from torch_sparserl.jit.runtime import Runtime
    from torch_sparserl.config import JitOptions

    from helpers import make_pattern, to_parts

    def specializer(key, crow, col, ncols):
        return CacheEntry(key, SOURCE, family="fake", params={}, reason="2.0x cuSPARSE")

    def installer(entry, crow, col, ncols):
        rows = crow.numel() - 1
        return lambda crow, col, val, X: torch.sparse_csr_tensor(crow, col, val, (rows, ncols)).to_dense() @ X

    A = make_pattern("cora (real)")
    crow, col, val = to_parts(A, torch.float32, torch.int64, "cpu")
    X = torch.randn(A.shape[1], 8)
    runtime = Runtime(JitOptions(mode="sync"), cache=None if how == "folder is a file" else
                      KernelCache(cache_root), specializer=specializer, installer=installer, devices=("cpu",))
    pattern = patterns.lookup(crow, col, A.shape[1])
    path = runtime.cache.path(runtime._key("spmm", 8, pattern, crow, col, torch.float32))
    if how == "read-only folder with a corrupt entry":
        path.write_text("{ corrupt")
    elif how != "folder is a file":
        _bad_entry(path, how)
    out = runtime.call("spmm", pattern, crow, col, val, X)
    return out, torch.sparse_csr_tensor(crow, col, val, A.shape).to_dense() @ X


@pytest.mark.parametrize("how", BROKEN)
def test_a_broken_cache_folder_costs_one_warning_never_the_product(tmp_path, how, monkeypatch, caplog):
    import os
    import signal

    import torch

    from torch_sparserl.toolchain import paths, trust

    root = tmp_path / "kernels"
    if how == "unreadable" and os.getuid() == 0:
        # root reads a file of mode 000: refuse it here as the system refuses every other user
        real_open = os.open

        def open_as_a_user(path, flags, *args, **kwargs):
            if not flags & (os.O_WRONLY | os.O_RDWR) and str(path).startswith(str(root)) \
                    and os.path.isfile(path) and os.stat(path).st_mode & 0o777 == 0:
                raise PermissionError(13, "Permission denied", str(path))
            return real_open(path, flags, *args, **kwargs)

        monkeypatch.setattr(os, "open", open_as_a_user)
    if how == "folder is a file":  # SPARSERL_CACHE_DIR names a file
        (tmp_path / "afile").write_text("not a folder")
        monkeypatch.setenv("SPARSERL_CACHE_DIR", str(tmp_path / "afile"))
        paths.forget_checks()
        trust.forget_keys()
    elif how == "read-only folder with a corrupt entry":
        KernelCache(root)
        real_unlink = os.unlink
        # a read-only folder (chmod a-w does not stop root): removing and writing there fail
        monkeypatch.setattr(os, "unlink", lambda p, *a, **k: (_ for _ in ()).throw(PermissionError(13, "read-only"))
                            if str(p).startswith(str(root)) else real_unlink(p, *a, **k))
        import tempfile
        real_mkstemp = tempfile.mkstemp
        monkeypatch.setattr(tempfile, "mkstemp", lambda *a, dir=None, **k: (_ for _ in ()).throw(
            PermissionError(13, "read-only")) if str(dir).startswith(str(root)) else real_mkstemp(*a, dir=dir, **k))
    signal.alarm(30)  # a FIFO read would block forever
    try:
        out, want = _product_with(root, how)
    finally:
        signal.alarm(0)
        paths.forget_checks()
        trust.forget_keys()
    torch.testing.assert_close(out, want)
    warnings = [r for r in caplog.records if r.levelno >= 30]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    if how == "unreadable":
        assert "unreadable ([Errno 13] Permission denied" in warnings[0].getMessage()


@pytest.mark.parametrize("how", ["directory", "fifo", "dev-zero symlink", "deep json", "huge"])
def test_the_cache_reads_a_broken_entry_as_a_miss(tmp_path, how, caplog):
    import signal

    _bad_entry(KernelCache(tmp_path).path(KEY), how)
    signal.alarm(30)
    try:
        cache = KernelCache(tmp_path)
        assert cache.get(KEY) is None
        assert cache.listing() == [] or cache.listing()[0][1] is None
        assert cache.get_or_create(KEY, lambda key: entry(key)).family == "group_row"
    finally:
        signal.alarm(0)
    assert len([r for r in caplog.records if r.levelno >= 30]) == 1


# ------------------------------------------------------------------ processes sharing a folder (issue 50)

def _padded(i: int, process: int) -> CacheEntry:
    """An entry of a couple of kB (its reason padded), distinct per process and index."""
    key = SpecializationKey(pattern=f"w{process}-{i}", op="spmm", n=32, dtype="f32", arch="sm_90", policy="autotune")
    return entry(key=key, reason="fastest " + "x" * 2000)


def _write_many(folder: str, process: int, count: int, max_bytes: int, barrier) -> None:
    import os

    os.environ["SPARSERL_CACHE_DIR"] = folder  # the key too: made by whichever process comes first
    cache = KernelCache(os.path.join(folder, "kernels"), max_bytes=max_bytes)
    barrier.wait()
    for i in range(count):
        cache.put(_padded(i, process))


@pytest.mark.slow
def test_the_cap_holds_for_processes_writing_to_one_folder(tmp_path, monkeypatch):
    """Each write measures what the folder holds, under the prune lock: four processes writing
    six times the cap at once leave at most the cap (they left 3.64x when each counted its own)."""
    size = KernelCache(tmp_path / "probe").put(_padded(0, 0)).stat().st_size
    cap = 40 * size
    ctx = multiprocessing.get_context("spawn")
    with ctx.Manager() as manager:
        barrier = manager.Barrier(4)
        with ctx.Pool(4) as pool:
            pool.starmap(_write_many, [(str(tmp_path / "shared"), p, 60, cap, barrier) for p in range(4)])
    from torch_sparserl.toolchain import paths, trust

    monkeypatch.setenv("SPARSERL_CACHE_DIR", str(tmp_path / "shared"))  # the workers' key, to check their entries
    paths.forget_checks()
    trust.forget_keys()
    try:
        cache = KernelCache(tmp_path / "shared" / "kernels", max_bytes=cap)
        listing = cache.listing()
    finally:
        paths.forget_checks()
        trust.forget_keys()
    assert 0 < cache.disk_bytes() <= cap
    assert len(cache.entries()) >= int(cap * 0.8) // size - 1  # pruned to 80%, not emptied
    assert listing and all(entry is not None for _, entry, _ in listing)  # every entry left whole and signed


def test_a_write_prunes_what_other_processes_wrote(tmp_path):
    """The same without processes: a second cache object (another process's) writing to the
    folder after the first one filled it prunes the first one's entries too."""
    size = KernelCache(tmp_path / "probe").put(_padded(0, 0)).stat().st_size
    cap = 10 * size
    first, second = KernelCache(tmp_path / "c", max_bytes=cap), KernelCache(tmp_path / "c", max_bytes=cap)
    for i in range(20):  # taking turns: each wrote 10, the cap's worth; together twice the cap
        (first if i % 2 else second).put(_padded(i, i % 2))
        assert first.disk_bytes() <= cap
    assert first.stats["evicted"] > 0 and second.stats["evicted"] > 0


def test_a_symlinked_prune_lock_is_not_followed(tmp_path):
    import os

    target = tmp_path / "precious"
    target.write_text("keep me")
    size = KernelCache(tmp_path / "probe").put(_padded(0, 0)).stat().st_size
    cache = KernelCache(tmp_path / "c", max_bytes=3 * size)
    (tmp_path / "c" / "prune.lock").symlink_to(target)
    for i in range(6):
        cache.put(_padded(i, 0))
    assert target.read_text() == "keep me" and cache.disk_bytes() <= 3 * size  # pruned, unlocked
    assert os.path.islink(tmp_path / "c" / "prune.lock")
    made = KernelCache(tmp_path / "d")
    made.put(entry())
    assert (os.stat(tmp_path / "d" / "prune.lock").st_mode & 0o777) == 0o600  # the lock: private


def _churn(folder: str, seconds: float) -> None:
    """Write and prune in a loop: entries appear and vanish under a listing."""
    cache = KernelCache(folder)
    deadline = time.monotonic() + seconds
    i = 0
    while time.monotonic() < deadline:
        for j in range(5):
            cache.put(_padded(i + j, 9))
        cache.prune(0)
        i += 5


@pytest.mark.slow
def test_listing_while_another_process_writes_and_prunes(tmp_path, capsys, monkeypatch):
    from torch_sparserl.cli import main

    monkeypatch.delenv("SPARSERL_DEBUG", raising=False)
    folder = tmp_path / "c"
    KernelCache(folder).put(entry())
    ctx = multiprocessing.get_context("spawn")
    process = ctx.Process(target=_churn, args=(str(folder), 60.0))
    process.start()
    try:
        deadline = time.monotonic() + 60
        while len(KernelCache(folder).entries()) < 3 and time.monotonic() < deadline:  # the churn has begun
            time.sleep(0.05)
        codes = []
        for _ in range(40):
            codes.append(main(["cache", "list", "--dir", str(folder)]))
            codes.append(main(["explain", "cora", "--dir", str(folder)]))
        err = capsys.readouterr().err
        assert process.is_alive(), "the churn ended before the listings did"
        assert codes == [0] * len(codes), err
    finally:
        process.terminate()
        process.join(30)
