"""Pattern fingerprints and specialization keys."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from torch_sparserl import pattern as pattern_cache
from torch_sparserl.fingerprint import (_GOLDEN, _MIX1, _MIX2, _SEEDS, SpecializationKey, fingerprint,
                                        pattern_hash)

from helpers import make_pattern, to_parts

M = (1 << 64) - 1


def _numpy_lane(values: np.ndarray, seed: int, salt: int) -> int:
    """The same hash lane in numpy's wrapping uint64 arithmetic: the reference."""
    with np.errstate(over="ignore"):
        a = values.astype(np.int64).astype(np.uint64)
        pos = np.arange(len(values), dtype=np.uint64)
        x = a * np.uint64(_GOLDEN) + pos * np.uint64((seed ^ salt) & M) + np.uint64(seed)
        x ^= x >> np.uint64(30)
        x *= np.uint64(_MIX1)
        x ^= x >> np.uint64(27)
        x *= np.uint64(_MIX2)
        x ^= x >> np.uint64(31)
        return int(x.sum(dtype=np.uint64))


def _parts(name="cora (real)", index_dtype=torch.int32, device="cpu"):
    A = make_pattern(name)
    crow, col, _ = to_parts(A, torch.float32, index_dtype, device)
    return A, crow, col


def test_hash_lanes_match_a_numpy_reference(monkeypatch):
    A, crow, col = _parts()
    from torch_sparserl import fingerprint as fp
    seen = {}
    original = fp._lane_sums

    def spy(values, salt):
        sums = original(values, salt)
        seen[salt] = [int(s) & M for s in sums]
        return sums

    monkeypatch.setattr(fp, "_lane_sums", spy)
    monkeypatch.setattr(fp, "_CHUNK", 4096)  # several chunks: the sum must not depend on them
    pattern_hash(crow, col, A.shape[1])
    for salt, values in ((1, A.indptr), (2, A.indices)):
        assert seen[salt] == [_numpy_lane(values, seed, salt) for seed in _SEEDS]


def test_hash_is_stable_and_sensitive():
    A, crow, col = _parts()
    h = pattern_hash(crow, col, A.shape[1])
    assert h == pattern_hash(crow.clone(), col.clone(), A.shape[1]) and len(h) == 32
    swapped = col.clone()
    swapped[[0, 1]] = swapped[[1, 0]]
    moved = col.clone()
    moved[-1] = (moved[-1] + 1) % A.shape[1]
    assert len({h, pattern_hash(crow, swapped, A.shape[1]), pattern_hash(crow, moved, A.shape[1]),
                pattern_hash(crow, col, A.shape[1] + 1),
                pattern_hash(crow.long(), col.long(), A.shape[1])}) == 5


@pytest.mark.parametrize("name", ["all rows empty (nnz = 0)", "zero rows", "one row"])
def test_hash_of_degenerate_patterns(name):
    A, crow, col = _parts(name)
    assert pattern_hash(crow, col, A.shape[1]) == pattern_hash(crow.clone(), col.clone(), A.shape[1])


@pytest.mark.gpu
def test_hash_is_equal_on_cpu_and_gpu():
    A, crow, col = _parts()
    assert pattern_hash(crow, col, A.shape[1]) == pattern_hash(crow.cuda(), col.cuda(), A.shape[1])


def test_cpu_indices_are_their_own_host_copy_and_never_kept():
    A, crow, col = _parts()
    entry = pattern_cache.lookup(crow, col, A.shape[1])
    host = pattern_cache.host_indices(crow, col, A.shape[1])
    assert host[0] is crow and host[1] is col and entry._host is None  # no strong reference to the user's tensors
    fingerprint(entry, crow, col)
    assert entry._host is None


def test_the_transposed_pattern_is_what_a_lookup_of_its_tensors_finds():
    A, crow, col = _parts()
    entry = pattern_cache.lookup(crow, col, A.shape[1])
    pattern_t, crow_t, col_t, _ = entry.transpose(crow, col)
    assert pattern_cache.lookup(crow_t, col_t, A.shape[0]) is pattern_t
    assert pattern_t.is_transpose and not entry.is_transpose  # Runtime.fusable skips transposes


@pytest.mark.gpu
@pytest.mark.parametrize("kept_max", [None, 0], ids=["small: hashed on the host", "large: hashed on the GPU"])
def test_cuda_patterns_hash_as_on_the_cpu_and_small_ones_share_one_host_copy(monkeypatch, kept_max):
    from torch_sparserl.runtime import RuntimeSettings, autotune_specializer

    if kept_max is not None:
        monkeypatch.setattr(pattern_cache, "HOST_KEPT_MAX", kept_max)
    A, crow, col = _parts(device="cuda")
    expected = pattern_hash(crow.cpu(), col.cpu(), A.shape[1])
    entry = pattern_cache.lookup(crow, col, A.shape[1])
    assert fingerprint(entry, crow, col) == expected
    key = SpecializationKey(pattern=expected, op="spmm", n=32, dtype="f32", arch="sm_90", policy="autotune")
    (host_crow, host_col, shape), _ = autotune_specializer(RuntimeSettings())._problem(key, crow, col, A.shape[1])
    assert shape == A.shape and host_crow.device.type == host_col.device.type == "cpu"
    assert torch.equal(host_crow, crow.cpu()) and torch.equal(host_col, col.cpu())
    if kept_max is None:  # the search reads the copy the fingerprint was computed from
        assert entry._host is not None and host_crow is entry._host[0] and host_col is entry._host[1]
    else:
        assert entry._host is None
    pattern_t, crow_t, col_t, _ = entry.transpose(crow, col)
    assert fingerprint(pattern_t, crow_t, col_t) == pattern_hash(crow_t.cpu(), col_t.cpu(), A.shape[0])


def test_registering_a_cpu_pattern_makes_no_cuda_stream(monkeypatch):
    made = []
    monkeypatch.setattr(pattern_cache, "_side_stream", made.append)
    A, crow, col = _parts()
    pattern_cache.lookup(crow, col, A.shape[1])
    assert made == []


@pytest.mark.gpu
def test_registering_a_cuda_pattern_makes_its_side_stream_on_the_registering_thread(monkeypatch):
    # The first side stream of a process sets up torch's stream pool, holding the interpreter
    # lock for milliseconds: it must not fall to the runtime's background thread (to_host).
    monkeypatch.setattr(pattern_cache, "_SIDE_STREAMS", {})
    A, crow, col = _parts(device="cuda")
    entry = pattern_cache.lookup(crow, col, A.shape[1])
    assert set(pattern_cache._SIDE_STREAMS) == {crow.device.index or torch.cuda.current_device()}
    side = pattern_cache._SIDE_STREAMS[crow.device.index or torch.cuda.current_device()]
    assert pattern_cache.lookup(crow, col, A.shape[1]) is entry  # a hit makes nothing new
    assert list(pattern_cache._SIDE_STREAMS.values()) == [side]
    host_crow, host_col = entry.host_indices(crow, col)
    assert torch.equal(host_crow, crow.cpu()) and torch.equal(host_col, col.cpu())
    assert list(pattern_cache._SIDE_STREAMS.values()) == [side]


def test_fingerprint_is_computed_once_per_pattern_and_redone_after_an_in_place_change(monkeypatch):
    A, crow, col = _parts()
    from torch_sparserl import fingerprint as fp
    calls = []
    monkeypatch.setattr(fp, "pattern_hash", lambda *a: calls.append(1) or "h%d" % len(calls))
    entry = pattern_cache.lookup(crow, col, A.shape[1])
    assert fingerprint(entry, crow, col) == fingerprint(pattern_cache.lookup(crow, col, A.shape[1]), crow, col)
    assert len(calls) == 1
    col[0] = col[1]  # in place: the version counter moves, the cached entry no longer matches
    assert fingerprint(pattern_cache.lookup(crow, col, A.shape[1]), crow, col) == "h2"


def test_specialization_key_names_what_it_depends_on():
    key = SpecializationKey(pattern="p", op="spmm", n=32, dtype="f32", arch="sm_90", policy="autotune")
    assert key.digest() == SpecializationKey("p", "spmm", 32, "f32", "sm_90", "autotune").digest()
    for change in (dict(n=64), dict(dtype="bf16"), dict(arch="sm_80"), dict(policy="ckpt1"),
                   dict(torch_version="2.12.0"), dict(cuda_version="12.8"), dict(op="spmv")):
        other = SpecializationKey(**{**key.__dict__, **change})
        assert other.digest() != key.digest(), change
