"""float64 gradcheck of every product, for the dense operands and for the values."""

import pytest
import torch
from torch.autograd import gradcheck, gradgradcheck

from helpers import make_pattern, to_parts

ops = torch.ops.sparserl


def _leaf(t):
    return t.detach().clone().requires_grad_()


@pytest.mark.parametrize("name", ["random", "empty rows in the middle", "short and huge rows", "wide"])
def test_spmm_gradcheck(device, name):
    A = make_pattern(name, seed=31)
    crow, col, val = to_parts(A, torch.float64, torch.int32, device)
    X = torch.randn(A.shape[1], 3, dtype=torch.float64, device=device)
    f = lambda v, x: ops.spmm(crow, col, v, A.shape[1], x)  # noqa: E731
    assert gradcheck(f, (_leaf(val), _leaf(X)))
    assert gradgradcheck(f, (_leaf(val), _leaf(X)))


@pytest.mark.parametrize("name", ["random", "short and huge rows"])
def test_spmv_gradcheck(device, name):
    A = make_pattern(name, seed=32)
    crow, col, val = to_parts(A, torch.float64, torch.int64, device)
    x = torch.randn(A.shape[1], dtype=torch.float64, device=device)
    assert gradcheck(lambda v, x: ops.spmv(crow, col, v, A.shape[1], x), (_leaf(val), _leaf(x)))


@pytest.mark.parametrize("name", ["random", "short and huge rows"])
def test_transposed_gradcheck(device, name):
    A = make_pattern(name, seed=33)
    crow, col, val = to_parts(A, torch.float64, torch.int64, device)
    G = torch.randn(A.shape[0], 2, dtype=torch.float64, device=device)
    assert gradcheck(lambda v, g: ops.spmm_transposed(crow, col, v, A.shape[1], g), (_leaf(val), _leaf(G)))
    assert gradcheck(lambda v, g: ops.spmv_transposed(crow, col, v, A.shape[1], g), (_leaf(val), _leaf(G[:, 0])))


def test_sddmm_gradcheck(device):
    A = make_pattern("random", seed=34)
    crow, col, _ = to_parts(A, torch.float64, torch.int64, device)
    Y = torch.randn(A.shape[0], 4, dtype=torch.float64, device=device)
    X = torch.randn(A.shape[1], 4, dtype=torch.float64, device=device)
    assert gradcheck(lambda y, x: ops.sddmm(crow, col, y, x), (_leaf(Y), _leaf(X)))


def test_transpose_computed_once_per_pattern(device):
    """Backward runs on the transposed pattern, derived once and then reused."""
    from torch_sparserl import pattern

    A = make_pattern("random", seed=35)
    crow, col, val = to_parts(A, torch.float32, torch.int32, device)
    before = pattern.stats()["transposes"]
    for _ in range(3):
        X = torch.randn(A.shape[1], 4, device=device, requires_grad=True)
        ops.spmm(crow, col, val, A.shape[1], X).sum().backward()
    assert pattern.stats()["transposes"] == before + 1


def test_transposed_values_are_read_as_they_are_on_every_call(device, poison_uninitialized):
    """Aᵀ @ G gathers the values into the transposed order on every call, so every change is
    seen at once: in place, through ``.data`` (which bumps no version counter), new values,
    values that need a gradient, inference tensors. Each result against float64 dense, with
    the tensors the library allocates NaN-filled."""
    A = make_pattern("random", seed=36)
    crow, col, val = to_parts(A, torch.float64, torch.int32, device)
    dense = lambda v: torch.sparse_csr_tensor(crow.long(), col.long(), v, A.shape).to_dense()  # noqa: E731

    def check(v):
        G = torch.randn(A.shape[0], 3, dtype=torch.float64, device=device)
        torch.testing.assert_close(ops.spmm_transposed(crow, col, v, A.shape[1], G), dense(v.detach()).T @ G)

    for _ in range(3):
        check(val)
    val.mul_(-2.0)  # in place: the version moves
    check(val)
    val.data.mul_(3.0)  # through .data: no version bump
    check(val)
    check(val.clone())  # other values, same numbers
    check(val + 1.0)
    check(_leaf(val))
    with torch.inference_mode():
        inference = val * 3.0
    check(inference)
    with torch.inference_mode():
        inference.mul_(0.5)  # an inference tensor written in place
    check(inference)


def test_an_eager_backward_skips_the_dispatch_and_a_double_backward_keeps_it(device, monkeypatch):
    from torch_sparserl.ops import backward as module

    dispatched = []
    for name in ("sddmm", "spmm_transposed"):
        op = module._OPERATORS[name]
        monkeypatch.setitem(module._OPERATORS, name, lambda *a, _op=op, _name=name: dispatched.append(_name) or _op(*a))
    A = make_pattern("random", seed=34)
    crow, col, val = to_parts(A, torch.float64, torch.int32, device)
    v, X = _leaf(val), _leaf(torch.randn(A.shape[1], 3, dtype=torch.float64, device=device))
    out = ops.spmm(crow, col, v, A.shape[1], X)
    grad_v, grad_X = torch.autograd.grad(out.square().sum(), (v, X))
    assert dispatched == []  # the implementations ran directly
    dense = torch.sparse_csr_tensor(crow.long(), col.long(), v.detach(), A.shape).to_dense()
    rows = torch.repeat_interleave(torch.arange(A.shape[0], device=device), crow.diff().long())
    want_out = dense @ X.detach()
    torch.testing.assert_close(grad_X, 2 * dense.t() @ want_out)
    torch.testing.assert_close(grad_v, (2 * want_out[rows] * X.detach()[col.long()]).sum(1))
    out = ops.spmm(crow, col, v, A.shape[1], X)
    torch.autograd.grad(out.square().sum(), (v, X), create_graph=True)
    assert sorted(dispatched) == ["sddmm", "spmm_transposed"]  # the graph of the gradient needs the operators


@pytest.mark.parametrize("name", ["random", "empty rows in the middle", "short and huge rows"])
def test_heads_gradcheck(device, name):
    """The heads products, first and second order, for the attention and the features."""
    A = make_pattern(name, seed=35)
    crow, col, _ = to_parts(A, torch.float64, torch.int32, device)
    val = torch.randn(A.nnz, 3, dtype=torch.float64, device=device)
    X = torch.randn(A.shape[1], 3, 2, dtype=torch.float64, device=device)
    G = torch.randn(A.shape[0], 3, 2, dtype=torch.float64, device=device)
    spmm = lambda v, x: ops.spmm_heads(crow, col, v, A.shape[1], x)  # noqa: E731
    assert gradcheck(spmm, (_leaf(val), _leaf(X)))
    assert gradgradcheck(spmm, (_leaf(val), _leaf(X)))
    assert gradcheck(lambda v, g: ops.spmm_heads_transposed(crow, col, v, A.shape[1], g), (_leaf(val), _leaf(G)))
    assert gradcheck(lambda y, x: ops.sddmm_heads(crow, col, y, x), (_leaf(G), _leaf(X)))
