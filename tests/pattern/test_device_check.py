"""The index check of CUDA indices, run on the device without the host waiting (CPU tests).

On the CPU the check runs at once; here it is made to run the device's way on CPU tensors
(``device_check.defers`` patched) with an event the test controls, so that every state a GPU
goes through can be stepped through: the verdict not there yet, passed, failed. What a real
GPU adds (no synchronization at all, the stream order) is ``test_device_check_gpu.py``'s.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

import torch_sparserl as ts
from torch_sparserl import pattern as patterns
from torch_sparserl.config import JitOptions
from torch_sparserl.dtypes import assert_close_to_reference
from torch_sparserl.jit.cache import KernelCache
from torch_sparserl.jit.runtime import Runtime
from torch_sparserl.pattern import device_check
from torch_sparserl.pattern import cache as pattern_table

from fakes import Fakes
from helpers import make_pattern, ref_spmm, ref_spmm_transposed, to_parts


class Event:
    """A CUDA event's two calls, with the device's progress in the test's hands."""

    def __init__(self):
        self.done = False
        self.waited = 0

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waited += 1
        self.done = True


@pytest.fixture
def device(monkeypatch):
    """CPU indices checked the device's way; ``device.events``: the events recorded, in order;
    ``device.host_checks``: the calls of the host's check (none is expected on this path)."""

    class Device:
        events: list[Event] = []
        host_checks: list[str] = []

        def finish(self):
            for event in self.events:
                event.done = True

    state = Device()
    state.events, state.host_checks = [], []
    monkeypatch.setattr(device_check, "defers", lambda crow, col: crow.shape[0] > 1)

    def record(device):
        state.events.append(Event())
        return state.events[-1]

    monkeypatch.setattr(device_check, "_record_event", record)
    real = pattern_table.check_csr_values
    monkeypatch.setattr(pattern_table, "check_csr_values", lambda op, *a: state.host_checks.append(op) or real(op, *a))
    return state


def _matrix(seed=0):
    M = make_pattern("random", seed=seed)
    crow, col, val = to_parts(M, torch.float64, torch.int64, "cpu")
    return M, crow, col, val


def _torch_csr(crow, col, val, shape):
    return torch.sparse_csr_tensor(crow, col, val, shape, check_invariants=False)


def test_good_indices_are_checked_without_the_host_reading_them_and_served(device):
    M, crow, col, val = _matrix()
    A = ts.csr(_torch_csr(crow, col, val, M.shape))
    entry = patterns.lookup(A._crow, A._col, M.shape[1])
    assert device.host_checks == [] and len(device.events) == 1
    assert entry.check is not None and not entry.settle()  # the device has not run it yet
    X = torch.randn(M.shape[1], 5, dtype=torch.float64)
    assert_close_to_reference(A @ X, ref_spmm(crow, col, val, M.shape[1], X))  # served meanwhile, right
    device.finish()
    assert_close_to_reference(A @ X, ref_spmm(crow, col, val, M.shape[1], X))
    assert entry.check is None and entry.settle()  # passed: nothing left to read
    assert torch.equal(A._crow, crow) and torch.equal(A._col, col)  # the library's copy, untouched


@pytest.mark.parametrize("case", ["col too large", "col negative", "crow decreasing", "crow[-1] short"])
def test_bad_indices_give_nan_until_the_verdict_and_then_the_named_error(device, case):
    M, crow, col, val = _matrix(seed=1)
    n = M.shape[1]
    crow, col = crow.clone(), col.clone()
    if case == "col too large":
        col[7] = n + 3
        message = rf"^torch_sparserl\.csr: col must be < ncols = {n} \(got col\[7\] = {n + 3}\)"
    elif case == "col negative":
        col[3] = -2
        message = r"^torch_sparserl\.csr: col must be >= 0 \(got col\[3\] = -2\)"
    elif case == "crow decreasing":
        crow[5] = crow[4] - 1
        message = r"^torch_sparserl\.csr: crow must be non-decreasing \(got crow\[4\]"
    else:
        crow[-1] -= 1
        message = rf"^torch_sparserl\.csr: crow\[-1\] must equal nnz = len\(col\) = {M.nnz}"
    A = ts.csr((crow, col, val), M.shape)  # no error yet: the verdict is on the device
    assert device.host_checks == []
    # what the library reads now is a valid structure whatever comes back: no read out of bounds
    assert A._crow[:-1].eq(0).all() and int(A._crow[-1]) == M.nnz and A._col.eq(0).all()
    entry = patterns.lookup(A._crow, A._col, n)
    assert entry is patterns.validated(A._crow, A._col, n)  # written without moving its versions
    X = torch.randn(n, 4, dtype=torch.float64)
    assert (A @ X).isnan().all()  # never a result that passes for a right one
    assert (A.t() @ torch.randn(M.shape[0], 4, dtype=torch.float64)).isnan().all()
    device.finish()
    with pytest.raises(ValueError, match=message):
        A @ X
    with pytest.raises(ValueError, match=message):  # and at every later use, naming the entry still
        torch.randn(4, M.shape[0], dtype=torch.float64) @ A


def test_a_failure_without_the_callers_tensors_names_the_check_and_the_matrix(device):
    M, crow, col, val = _matrix(seed=2)
    col = col.clone()
    col[0] = M.shape[1]
    A = ts.csr((crow, col, val), M.shape)
    col[0] = 0  # the caller's tensor changed meanwhile: its entry can no longer be named
    device.finish()
    with pytest.raises(ValueError, match=rf"^torch_sparserl\.csr: col must be < ncols = {M.shape[1]} \(the indices "
                                         rf"of a {M.shape[0]} x {M.shape[1]} matrix with {M.nnz} nonzeros on cpu"):
        A @ torch.randn(M.shape[1], 2, dtype=torch.float64)


def test_an_operator_on_a_callers_tensors_checks_its_private_copy(device):
    M, crow, col, val = _matrix(seed=3)
    col = col.clone()
    col[-1] = M.shape[1] + 9
    X = torch.randn(M.shape[1], 3, dtype=torch.float64)
    out = torch.ops.sparserl.spmm(crow, col, val, M.shape[1], X)
    assert out.isnan().all() and device.host_checks == []
    assert int(col[-1]) == M.shape[1] + 9  # the caller's tensor is never written
    device.finish()
    with pytest.raises(ValueError, match=rf"^sparserl\.spmm: col must be < ncols = {M.shape[1]} \(got col\[{M.nnz - 1}\]"):
        torch.ops.sparserl.spmm(crow, col, val, M.shape[1], X)


def test_the_transpose_and_the_backward_share_the_verdict(device):
    M, crow, col, val = _matrix(seed=4)
    A = ts.csr((crow, col, val.clone().requires_grad_()), M.shape)
    G = torch.randn(M.shape[0], 3, dtype=torch.float64)
    X = torch.randn(M.shape[1], 3, dtype=torch.float64, requires_grad=True)
    (A @ X).mul(G).sum().backward()
    assert_close_to_reference(X.grad, ref_spmm_transposed(crow, col, val, M.shape[1], G))
    device.finish()
    assert_close_to_reference(A.t() @ G, ref_spmm_transposed(crow, col, val, M.shape[1], G))
    entry = patterns.lookup(A._crow, A._col, M.shape[1])
    assert entry.check is None and entry.transpose(A._crow, A._col)[0].check in (None, entry.check)


def test_what_reads_the_indices_outside_a_product_waits_for_the_verdict(device):
    M, crow, col, val = _matrix(seed=5)
    col = col.clone()
    col[1] = -1
    A = ts.csr((crow, col, val), M.shape)
    with pytest.raises(ValueError, match=r"col must be >= 0"):
        A.to_dense()  # what it feeds cannot be poisoned: it waits, as the host would read the indices
    assert device.events[0].waited == 1


def test_a_decision_waits_for_the_verdict_and_refuses_indices_that_failed(device, tmp_path, caplog):
    fakes = Fakes()
    runtime = Runtime(JitOptions(mode="sync", admit_age_s=0), cache=KernelCache(tmp_path),
                      specializer=fakes.specializer, installer=fakes.installer, devices=("cpu",))
    M, crow, col, val = _matrix(seed=6)
    col = col.clone()
    col[2] = M.shape[1]
    A = ts.csr((crow, col, val.float()), M.shape)
    entry = patterns.lookup(A._crow, A._col, M.shape[1])
    X = torch.randn(M.shape[1], 8)
    with caplog.at_level(logging.INFO, logger="torch_sparserl"):
        assert runtime.call("spmm", entry, A._crow, A._col, A.val, X) is None  # cuSPARSE's (poisoned) then
    assert fakes.specialized == []  # nothing was searched on indices that failed
    assert "its indices failed their check" in runtime.explain("spmm", entry, 8, torch.float32)
    assert device.events[0].waited == 1
    with pytest.raises(ValueError, match=r"col must be < ncols"):
        A @ X
    runtime.close()


def test_indices_checked_on_the_host_need_no_device_check(device):
    M, crow, col, val = _matrix(seed=7)
    A = ts.csr((crow.numpy(), col.numpy(), val.numpy()), M.shape)  # host arrays, copied by torch: still CPU
    assert patterns.lookup(A._crow, A._col, M.shape[1]).check is not None  # CPU tensors: the device's way here
    with torch.inference_mode():  # inference tensors have no private copy to make harmless: checked at once
        crow_i, col_i = crow.clone(), col.clone()
        col_i[0] = -5
        with pytest.raises(ValueError, match=r"^sparserl\.spmm: col must be >= 0"):
            torch.ops.sparserl.spmm(crow_i, col_i, val, M.shape[1], torch.randn(M.shape[1], 2, dtype=torch.float64))
    assert device.host_checks == ["sparserl.spmm"]


def test_an_empty_matrix_and_one_without_rows(device):
    A = ts.csr((torch.tensor([0, 0, 0]), torch.tensor([], dtype=torch.int64), torch.tensor([], dtype=torch.float64)),
               (2, 3))
    device.finish()
    assert torch.equal(A @ torch.ones(3, 2, dtype=torch.float64), torch.zeros(2, 2, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"crow\[0\] must be 0"):  # no rows: checked at once
        ts.csr((torch.tensor([1]), torch.tensor([0]), torch.tensor([1.0])), (0, 3))
    assert np.array_equal(device.host_checks, ["torch_sparserl.csr"])


def test_settling_every_pending_check_before_a_capture_reads_each_verdict_once(device):
    M, crow, col, val = _matrix(seed=8)
    good = ts.csr((crow, col, val), M.shape)
    bad_col = col.clone()
    bad_col[0] = -1
    bad = ts.csr((crow, bad_col, val), M.shape)
    patterns.settle_pending()
    assert [event.waited for event in device.events] == [1, 1]
    assert patterns.lookup(good._crow, good._col, M.shape[1]).check is None  # passed: captured products unpoisoned
    with pytest.raises(ValueError, match=r"col must be >= 0"):  # failed: raised at the matrix's next use
        bad @ torch.randn(M.shape[1], 2, dtype=torch.float64)
    patterns.settle_pending()  # nothing left to wait for
    assert [event.waited for event in device.events] == [1, 1]


def test_compile_time_specialization_reads_the_verdict_first(device):
    """The backend's compile-time specialization waits for the check (compiling waits anyway), so
    a graph's first calls, a CUDA graph's recording among them, find the pattern checked."""
    from torch_sparserl.compiler.prespecialize import specialize

    M, crow, col, val = _matrix(seed=9)
    A = ts.csr((crow, col, val.float()), M.shape)
    specialize(A, "spmm", 8)
    assert device.events[0].waited == 1 and patterns.lookup(A._crow, A._col, M.shape[1]).check is None
    bad_col = col.clone()
    bad_col[4] = M.shape[1]
    with pytest.raises(ValueError, match=r"col must be < ncols"):
        specialize(ts.csr((crow, bad_col, val.float()), M.shape), "spmm", 8)


@pytest.mark.parametrize("bad", [False, True])
def test_a_check_made_inside_a_graph_repairs_a_copy_poisons_all_and_reports_nothing(bad):
    """:func:`device_check.in_graph`: the caller's tensors (a graph's placeholders) stay as they
    are; the copies products read are repaired should the check fail, and every product on them
    is NaN throughout, as no replay can raise."""
    crow, col = torch.tensor([0, 1, 3]), torch.tensor([0, 5 if bad else 2, 1])
    own_crow, own_col, check = device_check.in_graph("sparserl.spmm", crow, col, 3)
    assert col.tolist() == [0, 5 if bad else 2, 1] and own_crow is not crow and own_col is not col
    assert (own_crow.tolist(), own_col.tolist()) == (([0, 0, 3], [0, 0, 0]) if bad else ([0, 1, 3], [0, 2, 1]))
    assert check.verdict() is None
    with pytest.raises(RuntimeError, match="checked inside a CUDA graph"):
        check.verdict(block=True)
    out = check.poison(torch.ones(2, 4))
    assert out.isnan().all() if bad else out.eq(1).all()


def test_a_pattern_made_inside_a_graph_is_found_by_its_copies_and_never_specialized():
    """:func:`patterns.in_graph_copies`: what a matrix built in a captured step reads: copies
    the caller holds, their entry cached under them (a product on them finds it), transient,
    its derived forms computed in place (the backward's transpose), gone with the copies."""
    M, crow, col, val = _matrix(seed=5)
    own_crow, own_col = patterns.in_graph_copies("torch_sparserl.csr", crow, col, M.shape[1])
    assert own_crow is not crow and own_col is not col and torch.equal(own_col, col)
    entry = patterns.validated(own_crow, own_col, M.shape[1])
    assert entry is not None and entry.transient and entry.in_graph and entry.check is not None
    assert entry.indices()[0] is own_crow
    A = ts.CSRMatrix._wrap(own_crow, own_col, val, M.shape)
    G = torch.randn(M.shape[0], 3, dtype=torch.float64)
    X = torch.randn(M.shape[1], 3, dtype=torch.float64)
    assert_close_to_reference(A @ X, ref_spmm(crow, col, val, M.shape[1], X))
    assert_close_to_reference(A.t() @ G, ref_spmm_transposed(crow, col, val, M.shape[1], G))
    assert entry.transpose(own_crow, own_col)[0].in_graph
    key = id(own_crow)
    del A, own_crow, own_col, entry
    assert key not in pattern_table._CACHE


def test_an_operators_pattern_made_inside_a_graph_holds_its_copies_and_is_not_cached():
    M, crow, col, val = _matrix(seed=6)
    entry = patterns.in_graph("sparserl.spmm", crow, col, M.shape[1])
    own_crow, own_col = entry.indices(crow, col)
    assert own_crow is not crow and torch.equal(own_col, col) and id(own_crow) not in pattern_table._CACHE
    assert entry.transient and entry.in_graph
    G = torch.randn(M.shape[0], 3, dtype=torch.float64)
    entry_t, crow_t, col_t, perm = entry.transpose(crow, col)
    assert entry_t.in_graph and entry_t.transient
    got = ts.CSRMatrix._wrap(crow_t, col_t, val[perm], (M.shape[1], M.shape[0])) @ G
    assert_close_to_reference(got, ref_spmm_transposed(crow, col, val, M.shape[1], G))
