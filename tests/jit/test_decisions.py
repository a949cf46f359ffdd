"""One decision record per (pattern, op, n, dtype), owned by the runtime, read by every door (CPU)."""

from __future__ import annotations

import gc
from concurrent.futures import Future

import pytest
import torch

from torch_sparserl import pattern as patterns
from torch_sparserl.jit import runtime as rt
from torch_sparserl.jit.cache import KernelCache
from torch_sparserl.jit.decisions import Decision, DecisionTable, Fallback, Installed, Pending
from torch_sparserl.config import JitOptions

from helpers import make_pattern, to_parts
from fakes import Fakes


class _Pattern:
    """A stand-in for a Pattern: the table only needs identity and weak references."""


def _installed(tag: str) -> Installed:
    return Installed(key=None, launch=lambda *a: tag, description=tag)


def test_a_record_is_created_once_and_read_back():
    table, pattern = DecisionTable(), _Pattern()
    assert table.get(pattern, "spmm", 8, torch.float32) is None
    record = table.record(pattern, "spmm", 8, torch.float32)
    assert isinstance(record, Decision) and record.state is None
    assert table.record(pattern, "spmm", 8, torch.float32) is record
    assert table.get(pattern, "spmm", 8, torch.float32) is record
    assert table.get(pattern, "spmm", 16, torch.float32) is None  # another width: another record
    assert table.get(pattern, "spmm", 8, torch.float64) is None
    assert table.get(_Pattern(), "spmm", 8, torch.float32) is None
    assert table.of(pattern) == [record] and len(table) == 1


def test_replacing_a_state_a_copy_may_repeat_calls_the_one_hook():
    calls = []
    table, pattern = DecisionTable(lambda: calls.append(1)), _Pattern()
    record = table.record(pattern, "spmm", 8, torch.float32)
    table.set(record, Pending(None, Future()))
    assert calls == []  # nothing was decided before: nothing to drop
    table.set(record, _installed("nvrtc"))
    assert calls == [1]  # the C++ registry served cuSPARSE while it was pending
    table.set(record, _installed("library"))
    assert calls == [1, 1]  # the kernel it holds was replaced
    other = table.record(pattern, "spmv", 1, torch.float32)
    table.set(other, Fallback(None, "no kernel", decided=True))
    assert calls == [1, 1] and record.state.description == "library"


def test_records_go_with_their_pattern():
    table = DecisionTable()
    pattern = _Pattern()
    table.record(pattern, "spmm", 8, torch.float32)
    kept = _Pattern()
    table.record(kept, "spmm", 8, torch.float32)
    del pattern
    gc.collect()
    assert len(table) == 1 and [p for p, _ in table.items()] == [kept]


def test_two_runtimes_never_read_each_others_decisions(tmp_path):
    A = make_pattern("cora (real)")
    crow, col, val = to_parts(A, torch.float32, torch.int64, "cpu")
    entry = patterns.lookup(crow, col, A.shape[1])
    entry.validate("test", crow, col)
    X = torch.randn(A.shape[1], 8)
    fakes = Fakes()
    one = rt.Runtime(JitOptions(mode="sync"), cache=KernelCache(tmp_path / "one"),
                     specializer=fakes.specializer, installer=fakes.installer, devices=("cpu",))
    two = rt.Runtime(JitOptions(mode="off"), cache=KernelCache(tmp_path / "two"), devices=("cpu",))
    assert one.call("spmm", entry, crow, col, val, X) is not None
    assert isinstance(one.state("spmm", entry, 8, torch.float32), Installed)
    assert two.state("spmm", entry, 8, torch.float32) is None
    assert two.call("spmm", entry, crow, col, val, X) is None  # off: cuSPARSE (here: torch's CPU kernel)
    one.close()
    two.close()


@pytest.fixture
def routed(tmp_path):
    fakes = Fakes()
    runtime = rt.Runtime(JitOptions(mode="sync", strict=True), cache=KernelCache(tmp_path),
                         specializer=fakes.specializer, installer=fakes.installer, devices=("cpu",))
    previous = rt.set_active(runtime)
    yield runtime, fakes
    rt.set_active(previous)
    runtime.close()


def test_the_eager_path_reads_the_record_not_a_copy_of_its_kernel(routed):
    """A kernel the runtime replaces (its library's build after the interim NVRTC build) serves
    the next eager ``A @ X`` at once: the matrix keeps the record, whose state is read per call."""
    import torch_sparserl as ts

    runtime, fakes = routed
    M = make_pattern("random")
    A = ts.csr(M, dtype=torch.float32)
    X = torch.randn(M.shape[1], 8)
    want = torch.from_numpy(M.toarray()).float() @ X
    torch.testing.assert_close(A @ X, want)
    entry = patterns.lookup(A.crow, A.col, M.shape[1])
    record = runtime.decision("spmm", entry, 8, torch.float32)
    assert A.__dict__["_door"].hot[(2, 8)][1] is record  # the same record the runtime and the operators read

    replaced = []

    def library(crow, col, val, X):
        replaced.append(1)
        return torch.sparse_csr_tensor(crow, col, val, (M.shape[0], M.shape[1])).to_dense() @ X

    runtime._set(entry, record, Installed(record.state.key, library, "library"))
    lookups = patterns.stats()["lookups"]
    torch.testing.assert_close(A @ X, want)
    assert replaced == [1] and patterns.stats()["lookups"] == lookups  # the hot path, with the new kernel

    runtime._set(entry, record, Fallback(record.state.key, "withdrawn", decided=True))
    launched = len(fakes.launched) + len(replaced)
    torch.testing.assert_close(A @ X, want)  # the record no longer names a kernel: not launched
    assert len(fakes.launched) + len(replaced) == launched


def test_the_runtime_reports_every_record_of_a_pattern_and_its_transpose(routed):
    import torch_sparserl as ts

    runtime, _ = routed
    M = make_pattern("random")
    A = ts.csr(M, dtype=torch.float32)
    X = torch.randn(M.shape[1], 8, requires_grad=True)
    (A @ X).sum().backward()  # A spmm n=8, then Aᵀ spmm n=8 for X's gradient
    found = runtime.decisions(A.crow, A.col, M.shape[1])
    assert set(found) == {"A spmm n=8 float32", "At spmm n=8 float32"}
    assert all(line.startswith("installed: fake") for line in found.values())


def test_a_replaced_runtime_drops_its_copies_through_the_hook(monkeypatch, tmp_path):
    calls = []
    runtime = rt.Runtime(JitOptions(mode="off"), cache=KernelCache(tmp_path), devices=("cpu",))
    monkeypatch.setattr(runtime, "invalidate", lambda: calls.append("invalidate"))
    previous = rt.set_active(runtime)
    try:
        rt.set_active(previous)
        assert calls == ["invalidate"]  # no longer the active runtime: the C++ registry forgets its decisions
    finally:
        runtime.close()
