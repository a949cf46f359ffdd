"""Pattern fingerprints and specialization keys."""

from __future__ import annotations

import pytest
import torch

from torch_sparserl import pattern as pattern_cache
from torch_sparserl.pattern import cache as pattern_table
from torch_sparserl.pattern import streams
from torch_sparserl.pattern.fingerprint import SpecializationKey, fingerprint, pattern_hash

from helpers import make_pattern, to_parts

M = (1 << 64) - 1


def _parts(name="cora (real)", index_dtype=torch.int32, device="cpu"):
    A = make_pattern(name)
    crow, col, _ = to_parts(A, torch.float32, index_dtype, device)
    return A, crow, col


# cora's hashes as the torch-only implementation computed them (before 2026-11-24): kernel
# caches on disk are keyed by them
CORA_HASHES = {torch.int32: "a0ffee4b61cc7df8e49ae26090cfe988", torch.int64: "4105c8be2e77a1b17bc81de5f17d6a91"}


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_torch_and_numpy_lanes_agree_and_the_hash_keeps_its_value(monkeypatch, index_dtype):
    # pattern_hash runs torch's lanes on a GPU and numpy's on the host: a pattern's hash, its
    # cache key, must not depend on where its indices are
    A, crow, col = _parts(index_dtype=index_dtype)
    from torch_sparserl.pattern import fingerprint as fp

    assert pattern_hash(crow, col, A.shape[1]) == CORA_HASHES[index_dtype]
    monkeypatch.setattr(fp, "_CHUNK", 4096)  # several chunks: the sum must not depend on them
    for salt, tensor in ((1, crow), (2, col)):
        assert [int(s) & M for s in fp._lane_sums(tensor, salt)] == fp._host_lane_sums(tensor, salt)
    monkeypatch.setattr(fp, "_host_lane_sums", fp._lane_sums)  # torch's lanes, as on a GPU
    assert pattern_hash(crow, col, A.shape[1]) == CORA_HASHES[index_dtype]


def test_the_host_hash_reads_views_of_the_indices():
    A, crow, col = _parts()
    wide = torch.stack([col, torch.zeros_like(col)], dim=1)  # col as a strided view
    assert pattern_hash(crow, wide[:, 0], A.shape[1]) == pattern_hash(crow, col, A.shape[1])


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
    """On the CPU the host copy is the pattern's own validated indices (its private copy of
    the caller's tensors, pattern/__init__.py), not a second copy kept beside them."""
    A, crow, col = _parts()
    entry = pattern_cache.lookup(crow, col, A.shape[1])
    host = pattern_cache.host_indices(crow, col, A.shape[1])
    assert host[0] is entry.indices()[0] and host[1] is entry.indices()[1] and entry._host is None
    assert host[0] is not crow and torch.equal(host[0], crow) and torch.equal(host[1], col)
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
    from torch_sparserl.config import JitOptions
    from torch_sparserl.jit.specializers import autotune_specializer

    if kept_max is not None:
        monkeypatch.setattr(pattern_table, "HOST_KEPT_MAX", kept_max)
    A, crow, col = _parts(device="cuda")
    expected = pattern_hash(crow.cpu(), col.cpu(), A.shape[1])
    entry = pattern_cache.lookup(crow, col, A.shape[1])
    assert fingerprint(entry, crow, col) == expected
    key = SpecializationKey(pattern=expected, op="spmm", n=32, dtype="f32", arch="sm_90", policy="autotune")
    (host_crow, host_col, shape), _ = autotune_specializer(JitOptions())._problem(key, crow, col, A.shape[1])
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
    monkeypatch.setattr(streams, "_side_stream", made.append)
    A, crow, col = _parts()
    pattern_cache.lookup(crow, col, A.shape[1])
    assert made == []


@pytest.mark.gpu
def test_registering_a_cuda_pattern_makes_its_side_stream_on_the_registering_thread(monkeypatch):
    # The first side stream of a process sets up torch's stream pool, holding the interpreter
    # lock for milliseconds: it must not fall to the runtime's background thread (to_host).
    monkeypatch.setattr(streams, "_SIDE_STREAMS", {})
    A, crow, col = _parts(device="cuda")
    entry = pattern_cache.lookup(crow, col, A.shape[1])
    assert set(streams._SIDE_STREAMS) == {crow.device.index or torch.cuda.current_device()}
    side = streams._SIDE_STREAMS[crow.device.index or torch.cuda.current_device()]
    assert pattern_cache.lookup(crow, col, A.shape[1]) is entry  # a hit makes nothing new
    assert list(streams._SIDE_STREAMS.values()) == [side]
    host_crow, host_col = entry.host_indices(crow, col)
    assert torch.equal(host_crow, crow.cpu()) and torch.equal(host_col, col.cpu())
    assert list(streams._SIDE_STREAMS.values()) == [side]


def test_fingerprint_is_computed_once_per_pattern_and_redone_after_an_in_place_change(monkeypatch):
    A, crow, col = _parts()
    from torch_sparserl.pattern import fingerprint as fp
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
