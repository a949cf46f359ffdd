"""Half precision: float16 / bfloat16 features, explicit or under torch.autocast, with float32
accumulation and the tolerances of the dtype table; and value gradients accumulated over
several products of one matrix."""

import pytest
import scipy.sparse as sp
import numpy as np
import torch

import torch_sparserl as ts
from torch_sparserl.dtypes import assert_close_to_reference

HALF = [torch.float16, torch.bfloat16]


def _matrix(seed=0, n=257):
    M = sp.random(n, n, density=0.04, random_state=seed, format="csr", dtype=np.float64)
    M.data[:] = np.random.default_rng(seed).uniform(0.5, 1.5, M.nnz)
    return M


@pytest.mark.parametrize("dtype", HALF)
def test_explicit_half_products(device, dtype):
    M = _matrix()
    A = ts.csr(M, dtype=dtype, device=device)
    X = torch.randn(M.shape[1], 48, dtype=torch.float64)
    out = A @ X.to(device=device, dtype=dtype)
    assert out.dtype == dtype
    ref = torch.from_numpy(M.toarray()).to(dtype).double() @ X.to(dtype).double()
    assert_close_to_reference(out, ref, dtype)


@pytest.mark.parametrize("dtype", HALF)
def test_autocast_runs_products_in_the_autocast_dtype(device, dtype):
    M = _matrix(1)
    A = ts.csr(M, dtype=torch.float32, device=device)
    X = torch.randn(M.shape[1], 32, device=device)
    with torch.autocast(device.type, dtype=dtype):
        out = A @ X
        vec = A @ X[:, 0]
    assert out.dtype == dtype and vec.dtype == dtype
    ref = torch.from_numpy(M.toarray()).float().to(dtype).double() @ X.cpu().to(dtype).double()
    assert_close_to_reference(out, ref, dtype)
    assert_close_to_reference(vec, ref[:, 0], dtype)
    double = ts.csr(M, device=device)  # float64 is not autocast, as for torch.mm
    with torch.autocast(device.type, dtype=dtype):
        assert (double @ X.double()).dtype == torch.float64


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.slow)])
@pytest.mark.parametrize("dtype", HALF)
def test_autocast_training_step_gradients(device, dtype, compiled):
    """A GCN-like step under autocast: the matrix's values feed two products (their
    gradients add up), parameters get float32 gradients within the dtype's tolerance of a
    float64 run that rounds to the dtype where autocast does."""
    M = _matrix(2)
    torch.manual_seed(0)
    lin = torch.nn.Linear(16, 8).to(device)
    X = torch.randn(M.shape[1], 16, device=device)
    w = torch.tensor(M.data, dtype=torch.float32, device=device, requires_grad=True)
    A = ts.csr(M, dtype=torch.float32, device=device).with_values(w)

    def step(A, X):
        with torch.autocast(device.type, dtype=dtype):
            h = A @ torch.relu(lin(A @ X))
        return h.float().square().mean()

    loss = (torch.compile(step, backend="sparserl", fullgraph=True) if compiled else step)(A, X)
    loss.backward()
    assert w.grad.dtype == torch.float32 and lin.weight.grad.dtype == torch.float32

    # The float64 run rounds where the autocast step rounds (each product's and the layer's
    # operands and outputs, and the gradients flowing back through them, to ``dtype``): what is
    # left between the two is the order of the float32 sums, well within the table's bound.
    w64 = w.detach().double().requires_grad_()
    lin64 = torch.nn.Linear(16, 8).double().to(device)
    lin64.load_state_dict({k: v.double() for k, v in lin.state_dict().items()})

    def rounded(t):
        return _Rounded.apply(t, dtype)

    def product(h):  # one autocast product: its values, operand and output in dtype
        return rounded(ts.csr(M, device=device).with_values(rounded(w64)) @ rounded(h))

    t = product(X.double())
    z = rounded(torch.nn.functional.linear(rounded(t), rounded(lin64.weight), rounded(lin64.bias)))
    ref = product(torch.relu(z)).square().mean()
    ref.backward()
    for got, want in ((loss, ref), (w.grad, w64.grad), (lin.weight.grad, lin64.weight.grad)):
        assert_close_to_reference(got, want.detach(), dtype)


class _Rounded(torch.autograd.Function):
    """Rounds a float64 tensor to ``dtype`` and back, and its gradient too: a tensor of
    ``dtype`` in a float64 computation (its gradient is one of ``dtype`` as well)."""

    @staticmethod
    def forward(ctx, t, dtype):
        ctx.dtype = dtype
        return t.to(dtype).to(t.dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad.to(ctx.dtype).to(grad.dtype), None


def test_value_gradients_of_a_matrix_used_twice():
    M = _matrix(3, n=40)
    w = torch.tensor(M.data, requires_grad=True)
    A = ts.csr(M).with_values(w)
    X = torch.randn(40, 3, dtype=torch.float64)
    (A.t() @ (A @ X)).sum().backward()
    dense = torch.from_numpy(M.toarray()).requires_grad_()
    (dense.t() @ (dense @ X)).sum().backward()
    coo = M.tocoo()
    assert_close_to_reference(w.grad, dense.grad[coo.row, coo.col])
    other = ts.csr(_matrix(4, n=40))
    with pytest.raises(NotImplementedError, match="same pattern"):
        torch.ops.aten.add.Tensor(A.detach(), other)
