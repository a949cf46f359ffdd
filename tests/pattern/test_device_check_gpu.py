"""CUDA indices checked on their device: intake and first products make no synchronizing call, bad
indices give NaN and then a named error, never a read out of bounds, under a CUDA graph too."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

import torch_sparserl as ts
from torch_sparserl import pattern as patterns
from torch_sparserl.dtypes import assert_close_to_reference

from helpers import NoSync, make_pattern, other_pattern_of, ref_spmm, ref_spmm_transposed, to_parts


@pytest.fixture(autouse=True)
def cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")


def _cuda_parts(seed, dtype=torch.float32):
    M = make_pattern("random", seed=seed)
    return M, to_parts(M, dtype, torch.int32, "cuda")


@pytest.mark.parametrize("source", ["torch csr", "parts"])
def test_intake_and_first_products_of_cuda_indices_wait_for_nothing(runtime, source):
    M, (crow, col, val) = _cuda_parts(seed=11)
    ts.csr((crow.clone(), col.clone(), val), M.shape) @ torch.randn(M.shape[1], 4, device="cuda")  # process warm-up
    runtime.wait()
    X = torch.randn(M.shape[1], 16, device="cuda")
    x = torch.randn(M.shape[1], device="cuda")
    G = torch.randn(M.shape[0], 16, device="cuda")
    with NoSync():
        data = (torch.sparse_csr_tensor(crow, col, val, M.shape, check_invariants=False) if source == "torch csr"
                else (crow, col, val))
        A = ts.csr(data, M.shape if source == "parts" else None)
        Y, y, Z = A @ X, A @ x, G.T @ A
    torch.cuda.synchronize()
    assert_close_to_reference(Y.cpu(), ref_spmm(crow, col, val, M.shape[1], X), torch.float32)
    assert_close_to_reference(y.cpu(), ref_spmm(crow, col, val, M.shape[1], x.unsqueeze(1)).squeeze(1), torch.float32)
    assert_close_to_reference(Z.T.cpu(), ref_spmm_transposed(crow, col, val, M.shape[1], G), torch.float32)
    assert patterns.lookup(A._crow, A._col, M.shape[1]).settle()
    runtime.wait()


def test_a_training_step_on_a_new_cuda_matrix_waits_for_nothing(runtime):
    M, (crow, col, val) = _cuda_parts(seed=12)
    W = torch.randn(M.shape[1], 8, device="cuda", requires_grad=True)
    ts.csr((crow.clone(), col.clone(), val), M.shape) @ W.detach()  # process warm-up
    weights = val.clone().requires_grad_()
    with NoSync():
        A = ts.csr((crow, col, weights), M.shape)
        loss = (A @ W).square().sum()
        loss.backward()
    torch.cuda.synchronize()
    assert torch.isfinite(W.grad).all() and torch.isfinite(weights.grad).all()
    runtime.wait()


@pytest.mark.parametrize("where", ["col", "crow"])
def test_bad_cuda_indices_give_nan_then_the_named_error(runtime, where):
    M, (crow, col, val) = _cuda_parts(seed=13)
    crow, col = crow.clone(), col.clone()
    if where == "col":
        col[5] = M.shape[1] + 10**6  # far out: an unchecked read would fault
        message = rf"^torch_sparserl\.csr: col must be < ncols = {M.shape[1]} \(got col\[5\]"
    else:
        crow[3] = 10**7
        message = r"^torch_sparserl\.csr: crow must be non-decreasing"
    with NoSync():
        A = ts.csr((crow, col, val), M.shape)
        _nan_or_named(lambda: A @ torch.randn(M.shape[1], 8, device="cuda"), message)
    with pytest.raises(ValueError, match=message):
        A @ torch.randn(M.shape[1], 8, device="cuda")
    with pytest.raises(ValueError, match=r"must be"):
        A.to_dense()
    runtime.wait()


def test_the_operator_on_bad_cuda_tensors_names_the_entry(runtime):
    M, (crow, col, val) = _cuda_parts(seed=14)
    col = col.clone()
    col[0] = -1
    X = torch.randn(M.shape[1], 8, device="cuda")
    message = r"^sparserl\.spmm: col must be >= 0 \(got col\[0\] = -1\)"
    _nan_or_named(lambda: torch.ops.sparserl.spmm(crow, col, val, M.shape[1], X), message)
    with pytest.raises(ValueError, match=message):
        torch.ops.sparserl.spmm(crow, col, val, M.shape[1], X)


def _nan_or_named(product, message):
    """The first product on bad indices: NaN throughout while the device check's verdict is not
    back, or the named error where it already is (a fast GPU); never a fault."""
    try:
        first = product()
    except ValueError as error:
        assert re.search(message, str(error)), str(error)
        return
    torch.cuda.synchronize()  # the device ran the check, and no kernel faulted
    assert first.isnan().all()


def test_an_operator_in_a_captured_graph_checks_each_replays_indices(runtime):
    """Indices first met inside a capture are the graph's placeholders: each replay copies,
    checks and repairs them in the graph, so refilled indices are served right and bad ones
    give NaN, never a fault or another replay's pattern."""
    M = make_pattern("random", seed=16)
    other = other_pattern_of(M, seed=17)  # same sizes, other pattern
    batches = [to_parts(A, torch.float32, torch.int32, "cuda") for A in (M, other, M)]
    static = [t.clone() for t in batches[0]]
    X = torch.randn(M.shape[1], 8, device="cuda")
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        out = torch.ops.sparserl.spmm(*static, M.shape[1], X)
    for parts in batches:
        for target, source in zip(static, parts):
            target.copy_(source)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_close_to_reference(out, ref_spmm(*parts, M.shape[1], X), torch.float32)
    static[1][2] = M.shape[1] + 10**6  # far out: an unchecked read would fault
    graph.replay()
    torch.cuda.synchronize()
    assert out.isnan().all()
    static[1].copy_(batches[0][1])  # and the next good batch is served again
    graph.replay()
    torch.cuda.synchronize()
    assert_close_to_reference(out, ref_spmm(*batches[0], M.shape[1], X), torch.float32)


def test_under_a_cuda_graph_a_new_matrix_is_checked_in_it_and_a_pending_check_stays_poisoned(runtime):
    M, (crow, col, val) = _cuda_parts(seed=15)
    X = torch.randn(M.shape[1], 8, device="cuda", requires_grad=True)
    static = [t.clone() for t in (crow, col, val)]
    torch.cuda.synchronize()
    built = torch.cuda.CUDAGraph()
    with torch.cuda.graph(built, capture_error_mode="thread_local"):  # a matrix built in a captured step
        out = ts.csr(tuple(static), M.shape) @ X
        (grad,) = torch.autograd.grad(out.square().sum(), X)
    built.replay()
    torch.cuda.synchronize()
    want = ref_spmm(crow, col, val, M.shape[1], X)
    assert_close_to_reference(out, want, torch.float32)
    assert_close_to_reference(grad, ref_spmm_transposed(crow, col, val, M.shape[1], 2 * want), torch.float32)
    static[1][1] = M.shape[1] + 10**6  # the next replay's indices are bad: NaN, never a fault
    built.replay()
    torch.cuda.synchronize()
    assert out.isnan().all() and grad.isnan().all()
    X = X.detach()
    bad = col.clone()
    bad[1] = M.shape[1]
    A = ts.csr((crow, bad, val), M.shape)  # checked on the device: the capture below does not ask the event
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        static = A @ X
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        assert static.view(-1)[0].isnan()  # every replay of a product made before the verdict is poisoned
    with pytest.raises(ValueError, match=r"col must be < ncols"):
        A @ X


def test_good_cuda_indices_keep_their_results_exact_in_every_dtype(runtime):
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        M, (crow, col, val) = _cuda_parts(seed=16, dtype=dtype)
        A = ts.csr(torch.sparse_csr_tensor(crow, col, val, M.shape, check_invariants=False))
        X = torch.randn(M.shape[1], 32, device="cuda", dtype=dtype)
        for _ in range(3):
            out = A @ X
        want = ref_spmm(crow, col, val, M.shape[1], X)
        assert_close_to_reference(out.cpu(), torch.from_numpy(np.asarray(want)), dtype)
    runtime.wait()


def test_a_step_captured_right_after_a_cuda_matrix_is_built_is_not_poisoned(runtime):
    """capture_step reads every pending check's verdict before it captures: the graph's products
    of indices that passed carry no NaN fill, and replay exactly."""
    M, (crow, col, val) = _cuda_parts(seed=17)
    A = ts.csr((crow, col, val), M.shape)
    X = torch.randn(M.shape[1], 8, device="cuda")
    step = ts.capture_step(lambda X: A @ X, warmup=1)
    step(X)  # warm-up: possibly before the verdict
    out = step(X)  # captured, then replayed
    assert step.captured
    assert patterns.lookup(A._crow, A._col, M.shape[1]).check is None
    for seed in range(2):
        X2 = torch.randn(M.shape[1], 8, device="cuda", generator=torch.Generator("cuda").manual_seed(seed))
        out = step(X2)
        torch.cuda.synchronize()
        assert_close_to_reference(out.cpu(), ref_spmm(crow, col, val, M.shape[1], X2), torch.float32)
