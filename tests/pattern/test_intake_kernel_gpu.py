"""The fused intake kernel on a GPU: one launch copies and checks CUDA indices, with no
synchronization, the same copies as torch's clones, every failure named at the next use (NaN or the
error before), its pinned slots recycled, and inside a CUDA graph a check on every replay."""

from __future__ import annotations

import gc
import re
import time

import pytest
import torch

import torch_sparserl as ts
from torch_sparserl import pattern as patterns
from torch_sparserl.dtypes import assert_close_to_reference
from torch_sparserl.pattern import device_check
from torch_sparserl.pattern.validation import check_csr_values
from torch_sparserl.toolchain import intake

from helpers import NoSync, make_pattern, other_pattern_of, ref_spmm, to_parts


@pytest.fixture(scope="module")
def kernel():
    """The fused kernel, built and loaded for the current device (the first intake starts its
    build; the test waits for it, as a training loop's later intakes would find it)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    index = torch.cuda.current_device()
    deadline = time.monotonic() + 300
    while (launcher := intake.PROVIDER.launcher(index)) is None:
        if index in intake.PROVIDER._launchers:
            pytest.fail("the fused intake kernel could not be built or loaded (the log says why)")
        if time.monotonic() > deadline:
            pytest.fail("the fused intake kernel's build did not finish in 300 s")
        time.sleep(0.05)
    return launcher


def _launches() -> int:
    return device_check.FUSED_LAUNCHES[0]


def _random_csr(rows: int, nnz: int, ncols: int, index_dtype, seed: int):
    """Fresh random CSR parts on the GPU, rows of any length (empty ones too), columns unsorted."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    row = torch.randint(0, rows, (nnz,), device="cuda", generator=g).sort().values
    crow = torch.zeros(rows + 1, dtype=torch.int64, device="cuda")
    crow[1:] = torch.bincount(row, minlength=rows).cumsum(0)
    col = torch.randint(0, ncols, (nnz,), device="cuda", generator=g)
    val = torch.randn(nnz, device="cuda", generator=g)
    return crow.to(index_dtype), col.to(index_dtype), val


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("rows, nnz", [(1, 0), (1, 7), (2, 0), (300, 4000), (4097, 1), (100_000, 1_000_000),
                                       (100_000, 0)])
def test_one_launch_copies_like_torch_and_nothing_waits(kernel, runtime, index_dtype, rows, nnz):
    ncols = rows // 3 + 5
    crow, col, val = _random_csr(rows, nnz, ncols, index_dtype, seed=rows + nnz)
    X = torch.randn(ncols, 8, device="cuda")
    before = _launches()
    with NoSync():
        A = ts.csr((crow, col, val), (rows, ncols))
        out = A @ X
    assert _launches() == before + 1  # the fused kernel served the intake
    assert A._crow is not crow and A._col is not col
    assert A._crow.dtype == A._col.dtype == index_dtype and A._crow.is_contiguous() and A._col.is_contiguous()
    assert torch.equal(A._crow, crow) and torch.equal(A._col, col)
    entry = patterns.validated(A._crow, A._col, ncols)
    assert entry is not None and entry.settle(block=True) and entry.check is None
    assert_close_to_reference(out.cpu(), ref_spmm(crow.cpu(), col.cpu(), val.cpu(), ncols, X.cpu()), torch.float32)
    runtime.wait()


def test_a_torch_csr_tensor_and_an_operator_on_raw_tensors_take_the_kernel_too(kernel, runtime):
    M = make_pattern("random", seed=31)
    crow, col, val = to_parts(M, torch.float32, torch.int32, "cuda")
    X = torch.randn(M.shape[1], 4, device="cuda")
    before = _launches()
    with NoSync():
        A = ts.csr(torch.sparse_csr_tensor(crow, col, val, M.shape, check_invariants=False))
        Y = A @ X
    assert _launches() == before + 1
    Z = torch.ops.sparserl.spmm(crow.clone(), col.clone(), val, M.shape[1], X)  # _freeze's way (run_kept)
    assert _launches() == before + 2
    want = ref_spmm(crow, col, val, M.shape[1], X)
    assert_close_to_reference(Y.cpu(), want, torch.float32)
    assert_close_to_reference(Z.cpu(), want, torch.float32)
    runtime.wait()


_FAILURES = {  # the five checks of device_check._CHECKS, in order
    "crow[0]": lambda crow, col, n: crow.__setitem__(0, 1),
    "crow[-1]": lambda crow, col, n: crow.__setitem__(-1, crow[-1] - 1),
    "decreasing": lambda crow, col, n: crow.__setitem__(4, 10**7),
    "col negative": lambda crow, col, n: col.__setitem__(3, -(10**6)),  # far out: an unchecked read would fault
    "col too large": lambda crow, col, n: col.__setitem__(7, n + 10**6),
}


def _failure_is_named(case: str, index_dtype, seed: int) -> None:
    """``ts.csr`` of indices failing ``case``: one launch of the kernel, no synchronization, NaN from
    a product made before the verdict (or, on a fast GPU, the error already), never a fault, then
    the error the host's check gives at every later use."""
    M = make_pattern("random", seed=seed)
    crow, col, val = to_parts(M, torch.float32, index_dtype, "cuda")
    n = M.shape[1]
    _FAILURES[case](crow, col, n)
    with pytest.raises(ValueError) as expected:  # the entry named as the host's check names it
        check_csr_values("torch_sparserl.csr", crow, col, n)
    message = "^" + re.escape(str(expected.value)) + "$"
    X = torch.randn(n, 8, device="cuda")
    before = _launches()
    with NoSync():
        A = ts.csr((crow, col, val), M.shape)
        try:
            first = A @ X
        except ValueError as error:  # a fast GPU: the verdict was back already
            assert re.search(message, str(error)), str(error)
            first = None
    assert _launches() == before + 1
    if first is not None:
        torch.cuda.synchronize()  # no kernel faulted
        assert first.isnan().all()
    with pytest.raises(ValueError, match=message):
        A @ X
    with pytest.raises(ValueError, match=message):  # and at every later use
        A @ X


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("case", list(_FAILURES))
def test_each_failure_gives_nan_or_the_named_error_then_the_error(kernel, runtime, case, index_dtype):
    _failure_is_named(case, index_dtype, seed=32)
    runtime.wait()


def test_slots_of_checks_dropped_before_their_verdicts_are_recycled(kernel, runtime):
    crow, col, val = _random_csr(50, 400, 40, torch.int32, seed=33)
    pool = device_check._pool(torch.cuda.current_device(), device_check._FUSED)
    ts.csr((crow, col, val), (50, 40))  # the pool exists
    torch.cuda.synchronize()
    slots_before, before = pool.slots, _launches()
    for _ in range(10_000):
        ts.csr((crow, col, val), (50, 40))  # dropped at once, its verdict never read
    assert _launches() == before + 10_000
    torch.cuda.synchronize()
    gc.collect()
    # slots are reclaimed as their markers show: the pool grew by what the GPU had in flight at most
    assert pool.slots <= max(slots_before, 4096) and pool.slots < 10_000
    for _ in range(pool.slots + 1):
        ts.csr((crow, col, val), (50, 40))  # every slot comes back
    torch.cuda.synchronize()
    assert pool.slots <= max(slots_before, 4096)
    runtime.wait()


def test_a_graph_captured_with_the_kernel_checks_every_replay(kernel, runtime):
    """Indices met inside a capture (a graph's placeholders, refilled per step) are copied and
    checked by the fused kernel in the graph: good ones give the right product, bad ones NaN,
    never a fault, on every replay."""
    M = make_pattern("random", seed=34)
    other = other_pattern_of(M, seed=35)  # same sizes, other pattern
    batches = [to_parts(A, torch.float32, torch.int64, "cuda") for A in (M, other, M)]
    static = [t.clone() for t in batches[0]]
    X = torch.randn(M.shape[1], 8, device="cuda")
    torch.cuda.synchronize()
    before = _launches()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        out = ts.csr(tuple(static), M.shape) @ X
        via_op = torch.ops.sparserl.spmm(*static, M.shape[1], X)
    assert _launches() == before + 2  # captured: one launch each
    for parts in batches:
        for target, source in zip(static, parts):
            target.copy_(source)
        out.fill_(float("nan"))
        via_op.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        want = ref_spmm(*parts, M.shape[1], X)
        assert_close_to_reference(out.cpu(), want, torch.float32)
        assert_close_to_reference(via_op.cpu(), want, torch.float32)
    for case in _FAILURES.values():
        for target, source in zip(static, batches[1]):
            target.copy_(source)
        case(static[0], static[1], M.shape[1])
        graph.replay()
        torch.cuda.synchronize()
        assert out.isnan().all() and via_op.isnan().all()
    for target, source in zip(static, batches[0]):  # and the next good batch is served again
        target.copy_(source)
    graph.replay()
    torch.cuda.synchronize()
    assert_close_to_reference(out.cpu(), ref_spmm(*batches[0], M.shape[1], X), torch.float32)
    runtime.wait()


def test_a_failed_verdict_read_during_a_capture_is_left_for_after_it(kernel, runtime):
    M = make_pattern("random", seed=37)
    crow, col, val = to_parts(M, torch.float32, torch.int32, "cuda")
    col[2] = M.shape[1]
    A = ts.csr((crow, col, val), M.shape)
    torch.cuda.synchronize()  # the verdict is in the pinned slot already
    X = torch.randn(M.shape[1], 4, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        static = A @ X  # no error inside the capture: naming the entry would read the device
    graph.replay()
    torch.cuda.synchronize()
    assert static.view(-1)[0].isnan()
    with pytest.raises(ValueError, match=rf"col must be < ncols = {M.shape[1]} \(got col\[2\]"):
        A @ X
    runtime.wait()


# ---- the C++ library's intake door (csrc/fastpath/intake.h) ----------------------------------------------


@pytest.fixture(scope="module")
def door(kernel):
    """The C++ library loaded (built first where it is not on disk), its intake registered."""
    from torch_sparserl.jit import fastpath

    assert fastpath.ensure(wait=True), fastpath.unavailable()
    assert device_check._DOOR is not None
    return device_check._DOOR


@pytest.fixture
def python_launch_refused(monkeypatch):
    """Fail the test where the fused kernel's Python launch serves an intake the library should."""
    def refuse(*args):
        raise AssertionError("the Python launch served an intake that the C++ library should have")

    monkeypatch.setattr(device_check, "_fused_copy_checked", refuse)


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("rows, nnz", [(1, 0), (1, 7), (300, 4000), (4097, 1), (100_000, 1_000_000)])
def test_the_library_takes_a_cuda_triple_in_by_one_call(door, runtime, python_launch_refused, index_dtype, rows,
                                                        nnz):
    ncols = rows // 3 + 5
    crow, col, val = _random_csr(rows, nnz, ncols, index_dtype, seed=rows + nnz + 1)
    X = torch.randn(ncols, 8, device="cuda")
    before = _launches()
    with NoSync():
        A = ts.csr((crow, col, val), (rows, ncols), device="cuda")
        out = A @ X
    assert _launches() == before + 1
    assert A._crow is not crow and A._col is not col and A.val is val
    assert A._crow.dtype == A._col.dtype == index_dtype and A._crow.is_contiguous() and A._col.is_contiguous()
    assert torch.equal(A._crow, crow) and torch.equal(A._col, col)
    entry = patterns.validated(A._crow, A._col, ncols)
    assert entry is not None and entry.settle(block=True) and entry.check is None
    assert_close_to_reference(out.cpu(), ref_spmm(crow.cpu(), col.cpu(), val.cpu(), ncols, X.cpu()), torch.float32)
    runtime.wait()


@pytest.mark.parametrize("case", list(_FAILURES))
def test_bad_indices_the_library_took_in_give_nan_or_the_named_error(door, runtime, python_launch_refused, case):
    _failure_is_named(case, torch.int32, seed=38)
    runtime.wait()


def _declined(M, crow, col, val):
    """(name, (data, shape)) of CUDA triples whose metadata the library declines."""
    shape = M.shape
    yield "crow one short", ((crow[:-1], col, val), shape)
    yield "val one short", ((crow, col, val[:-1]), shape)
    yield "val on the host", ((crow, col, val.cpu()), shape)
    yield "2-D val", ((crow, col, val.view(-1, 1)), shape)
    yield "int64 col with int32 crow", ((crow, col.long(), val), shape)
    yield "strided col", ((crow, torch.stack([col, col], 1)[:, 0], val), shape)
    yield "integer val", ((crow, col, torch.ones_like(col)), shape)
    yield "int32 indices past 2^31 columns", ((crow, col, val), (shape[0], 2**31))
    yield "no row", ((crow[:1], col[:0], val[:0]), (0, shape[1]))


def test_what_the_library_declines_ends_as_the_python_path_ends(door, runtime, monkeypatch):
    M = make_pattern("random", seed=39)
    crow, col, val = to_parts(M, torch.float32, torch.int32, "cuda")
    X = torch.randn(M.shape[1], 4, device="cuda")

    def outcome(data, shape):
        try:
            A = ts.csr(data, shape)
        except (ValueError, TypeError, RuntimeError) as error:
            return type(error), str(error)
        return A.to_dense().cpu() if shape[1] < 2**20 else (A._crow.cpu(), A._col.cpu())

    for name, (data, shape) in _declined(M, crow, col, val):
        with_door = outcome(data, shape)
        with monkeypatch.context() as m:
            m.setattr(device_check, "_DOOR", None)
            alone = outcome(data, shape)
        if isinstance(alone, tuple) and isinstance(alone[0], type):
            assert with_door == alone, name
        elif isinstance(alone, tuple):
            assert all(torch.equal(a, b) for a, b in zip(with_door, alone)), name
        else:
            assert torch.equal(with_door, alone), name
    runtime.wait()


def test_under_inference_mode_and_in_a_capture_the_python_path_serves(door, runtime):
    M = make_pattern("random", seed=40)
    parts = to_parts(M, torch.float32, torch.int64, "cuda")
    X = torch.randn(M.shape[1], 4, device="cuda")
    want = ref_spmm(*parts, M.shape[1], X)
    with torch.inference_mode():
        A = ts.csr(parts, M.shape)
    assert not A._crow.is_inference() and not A._col.is_inference()
    assert_close_to_reference((A @ X).cpu(), want, torch.float32)
    static = [t.clone() for t in parts]
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        out = ts.csr(tuple(static), M.shape) @ X  # the library declines: copied and checked in the graph
    other = to_parts(other_pattern_of(M, seed=41), torch.float32, torch.int64, "cuda")
    for target, source in zip(static, other):
        target.copy_(source)
    graph.replay()
    torch.cuda.synchronize()
    assert_close_to_reference(out.cpu(), ref_spmm(*other, M.shape[1], X), torch.float32)
    runtime.wait()
