"""CSRMatrix: construction from every source, the mapped functions, moves, gradients."""

import pickle

import numpy as np
import pytest
import scipy.sparse as sp
import torch

import torch_sparserl as ts
from torch_sparserl.dtypes import assert_close_to_reference

from helpers import make_pattern


def _dense64(A):
    return torch.from_numpy(A.toarray())


@pytest.fixture
def pattern():
    return make_pattern("empty rows in the middle", seed=41)


def _sources(A, device):
    dense = torch.from_numpy(A.toarray()).float().to(device)
    crow, col, val = (torch.from_numpy(A.indptr), torch.from_numpy(A.indices), torch.from_numpy(A.data).float())
    return {
        "torch csr": dense.to_sparse_csr(),
        "torch coo": dense.to_sparse(),
        "torch csc": dense.to_sparse_csc(),
        "dense": dense,
        "scipy csr": A.astype(np.float32),
        "scipy coo": A.tocoo().astype(np.float32),
        "arrays": (A.indptr, A.indices, A.data.astype(np.float32)),
        "tensors": (crow, col, val),
    }


@pytest.mark.parametrize("source", ["torch csr", "torch coo", "torch csc", "dense", "scipy csr",
                                    "scipy coo", "arrays", "tensors"])
def test_construction(device, pattern, source):
    data = _sources(pattern, device)[source]
    shape = pattern.shape if isinstance(data, tuple) else None
    A = ts.csr(data, shape, device=device)
    assert isinstance(A, ts.CSRMatrix) and A.shape == pattern.shape and A.device.type == device.type
    assert A.nnz == pattern.nnz
    assert_close_to_reference(A.to_dense(), _dense64(pattern))
    assert ts.csr(A) is not None


def test_conversions(pattern):
    A = ts.csr(pattern, dtype=torch.float64, index_dtype=torch.int32)
    assert A.dtype == torch.float64 and A.crow.dtype == torch.int32
    assert ts.csr(sp.csr_matrix(np.eye(3, dtype=bool))).dtype == torch.get_default_dtype()
    assert "CSRMatrix(shape=(40, 30)" in repr(A)


def test_mapped_functions(device, pattern):
    A = ts.csr(pattern, dtype=torch.float64, device=device)
    D = _dense64(pattern).to(device)
    X = torch.randn(pattern.shape[1], 6, dtype=torch.float64, device=device)
    x = torch.randn(pattern.shape[1], dtype=torch.float64, device=device)
    L = torch.randn(5, pattern.shape[0], dtype=torch.float64, device=device)
    bias = torch.randn(6, dtype=torch.float64, device=device)
    y0 = torch.randn(pattern.shape[0], dtype=torch.float64, device=device)
    nan_bias = torch.full((pattern.shape[0], 6), float("nan"), dtype=torch.float64, device=device)
    cases = {
        "A @ X": (A @ X, D @ X),
        "A @ x": (A @ x, D @ x),
        "L @ A": (L @ A, L @ D),
        "L[0] @ A": (L[0] @ A, L[0] @ D),
        "torch.sparse.mm": (torch.sparse.mm(A, X), D @ X),
        "torch.mm": (torch.mm(A, X), D @ X),
        "A.mm": (A.mm(X), D @ X),
        "torch.matmul": (torch.matmul(A, X), D @ X),
        "torch.mv": (torch.mv(A, x), D @ x),
        "A.mv": (A.mv(x), D @ x),
        "torch.addmm": (torch.addmm(bias, A, X, beta=0.5, alpha=2.0), 0.5 * bias + 2.0 * (D @ X)),
        "torch.addmm beta=0 ignores NaN": (torch.addmm(nan_bias, A, X, beta=0), D @ X),
        "bias.addmm": (bias.expand(pattern.shape[0], 6).addmm(A, X), bias + D @ X),
        "torch.sparse.addmm": (torch.sparse.addmm(bias.expand(pattern.shape[0], 6), A, X), bias + D @ X),
        "torch.addmv": (torch.addmv(y0, A, x, beta=2.0), 2.0 * y0 + D @ x),
        "A.t() @ L.T": (A.t() @ L.T, D.T @ L.T),
        "A.T.to_dense()": (A.T.to_dense(), D.T),
        "2 * A": ((2 * A).to_dense(), 2 * D),
        "A / 4": ((A / 4).to_dense(), D / 4),
        "-A": ((-A).to_dense(), -D),
    }
    for name, (got, want) in cases.items():
        try:
            assert_close_to_reference(got, want)
        except AssertionError as exc:
            raise AssertionError(f"{name}: {exc}") from None


def test_moves_and_casts(device, pattern):
    A = ts.csr(pattern)
    B = A.to(device)
    assert B.device.type == device.type and B.crow.device.type == device.type
    assert A.double().dtype == torch.float64 and A.half().dtype == torch.float16
    assert A.bfloat16().val.dtype == torch.bfloat16
    assert A.to(torch.float64).cpu().dtype == torch.float64
    with pytest.raises(TypeError, match="values must stay floating point"):
        A.to(torch.int32)
    module = torch.nn.Module()
    module.register_buffer("adj", A)
    module.to(device)
    assert isinstance(module.adj, ts.CSRMatrix) and module.adj.device.type == device.type


def test_pickle_and_state_dict(pattern, tmp_path):
    A = ts.csr(pattern)
    B = pickle.loads(pickle.dumps(A))
    assert isinstance(B, ts.CSRMatrix) and torch.equal(B.to_dense(), A.to_dense())
    module = torch.nn.Module()
    module.register_buffer("adj", A)
    torch.save(module.state_dict(), tmp_path / "m.pt")
    state = torch.load(tmp_path / "m.pt", weights_only=False)
    assert torch.equal(state["adj"].to_dense(), A.to_dense())


def test_value_gradients_eager(device, pattern):
    A = ts.csr(pattern, dtype=torch.float64, device=device)
    w = A.values().detach().clone().requires_grad_()
    Aw = A.with_values(w)
    X = torch.randn(pattern.shape[1], 4, dtype=torch.float64, device=device)
    (Aw @ X).square().sum().backward()
    dense = torch.zeros(pattern.shape, dtype=torch.float64, device=device)
    rows = torch.repeat_interleave(torch.arange(pattern.shape[0]), torch.from_numpy(np.diff(pattern.indptr))).to(device)
    cols = A.col.long()
    Wd = dense.index_put((rows, cols), w.detach()).requires_grad_()
    (Wd @ X).square().sum().backward()
    assert_close_to_reference(w.grad, Wd.grad[rows, cols])
    assert torch.autograd.gradcheck(lambda v: (A.with_values(v) @ X), (w.detach().clone().requires_grad_(),))


def test_transpose_and_dense_gradients(pattern):
    A = ts.csr(pattern, dtype=torch.float64)
    w = A.values().detach().clone().requires_grad_()
    assert torch.autograd.gradcheck(lambda v: A.with_values(v).t().to_dense(), (w,))
    assert torch.autograd.gradcheck(lambda v: (3 * A.with_values(v)).to(torch.float64).to_dense(), (w,))


# ------------------------------------------------------------------ the direct eager path


def test_eager_products_skip_the_dispatcher_only_when_nothing_needs_it(monkeypatch):
    from torch.utils._python_dispatch import TorchDispatchMode

    from torch_sparserl import ops

    calls = []
    real = ops.direct
    monkeypatch.setattr(ops, "direct", lambda op, *args: calls.append(op) or real(op, *args))
    M = make_pattern("random")
    A = ts.csr(M, dtype=torch.float32)
    dense = torch.from_numpy(M.toarray()).float()
    X = torch.randn(M.shape[1], 4)
    G = torch.randn(3, M.shape[0])

    torch.testing.assert_close(A @ X, dense @ X)
    torch.testing.assert_close(G @ A, G @ dense)
    torch.testing.assert_close(A @ X[:, 0], dense @ X[:, 0])
    assert calls == ["spmm", "spmm_transposed", "spmv"]

    class Seen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    calls.clear()
    with Seen() as seen:
        A @ X  # a dispatch mode must see the operator
    assert "sparserl.spmm.default" in seen.ops and calls == []
    Xg = X.clone().requires_grad_()
    (A @ Xg).sum().backward()  # autograd needs the operator
    torch.testing.assert_close(Xg.grad, dense.t() @ torch.ones(M.shape[0], 4))
    assert calls == []
    with torch.no_grad():
        A @ Xg  # nothing to differentiate under no_grad
    assert calls == ["spmm"]
    with pytest.raises(ValueError, match="sparserl.spmm: X must have ncols"):
        A @ torch.randn(M.shape[1] + 1, 4)  # same checks, same errors on the direct path
