"""CSRMatrix: construction from every source, the mapped functions, moves, gradients."""

import pickle

import numpy as np
import pytest
import scipy.sparse as sp
import torch

import torch_sparserl as ts
from torch_sparserl.dtypes import assert_close_to_reference
from torch_sparserl.config import JitOptions

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


@pytest.mark.parametrize("product", ["A @ X", "A @ x", "X @ A", "x @ A"])
def test_eager_gradients_match_float64(device, product):
    """The lean eager autograd node (:func:`ops.doors.eager_product`): gradients of the values and
    of the dense operand, first and second order, against dense float64 on fresh data."""
    M = make_pattern("empty rows in the middle", seed=np.random.randint(1 << 30))
    A = ts.csr(M, dtype=torch.float64, device=device)
    rows = torch.repeat_interleave(torch.arange(M.shape[0]), torch.from_numpy(np.diff(M.indptr))).to(device)
    cols = A.col.long()
    operand = {"A @ X": (M.shape[1], 5), "A @ x": (M.shape[1],), "X @ A": (3, M.shape[0]), "x @ A": (M.shape[0],)}
    X = torch.randn(operand[product], dtype=torch.float64, device=device)

    def run(w, X, dense):
        matrix = (torch.zeros(M.shape, dtype=torch.float64, device=device).index_put((rows, cols), w)
                  if dense else A.with_values(w))
        out = matrix @ X if product.startswith("A") else X @ matrix
        return out, out.square().sum()

    grads = []
    for dense in (False, True):
        w = A.values().detach().clone().requires_grad_()
        Xl = X.clone().requires_grad_()
        out, loss = run(w, Xl, dense)
        if not dense:  # X @ A is (Aᵀ Xᵀ)ᵀ: the node is under the transpose's
            node = out.grad_fn if product != "X @ A" else out.grad_fn.next_functions[0][0]
            assert type(node).__name__ == "_EagerProductBackward"
        g_w, g_X = torch.autograd.grad(loss, (w, Xl), create_graph=True)
        second = torch.autograd.grad(g_w.square().sum() + g_X.square().sum(), (w, Xl))
        grads.append((g_w, g_X, *second))
    for got, want in zip(*grads):
        assert_close_to_reference(got.detach(), want.detach())


def test_eager_products_skip_the_dispatcher_only_when_nothing_needs_it(monkeypatch):
    from torch.utils._python_dispatch import TorchDispatchMode

    from torch_sparserl.ops import doors

    calls = []
    real = doors.direct
    monkeypatch.setattr(doors, "direct", lambda op, *args: calls.append(op) or real(op, *args))
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
    lean = []
    real_eager = doors.eager_product
    monkeypatch.setattr(doors, "eager_product", lambda op, *args: lean.append(op) or real_eager(op, *args))
    Xg = X.clone().requires_grad_()
    out = A @ Xg  # autograd needs a node, not the operator's dispatch
    assert type(out.grad_fn).__name__ == "_EagerProductBackward" and lean == ["spmm"]
    out.sum().backward()
    torch.testing.assert_close(Xg.grad, dense.t() @ torch.ones(M.shape[0], 4))
    assert calls == []
    with Seen() as seen:
        A @ Xg  # under a dispatch mode, with a gradient, the operator again
    assert "sparserl.spmm.default" in seen.ops and lean == ["spmm"]
    with torch.no_grad():
        A @ Xg  # nothing to differentiate under no_grad
    assert calls == ["spmm"]
    with pytest.raises(ValueError, match="sparserl.spmm: X must have ncols"):
        A @ torch.randn(M.shape[1] + 1, 4)  # same checks, same errors on the direct path


def test_every_eager_spelling_launches_the_kernel_the_matrix_kept(tmp_path):
    """The one eager door (ops.doors.product): once an installed kernel served a direct product of
    a matrix, its door keeps the record, and every spelling of that product (not only ``@``)
    launches the kernel again with no pattern lookup; a product of another shape, or a matrix that
    needs a gradient, goes through the Python path."""
    from torch_sparserl import pattern as patterns
    from torch_sparserl.jit import runtime as rt
    from torch_sparserl.jit.cache import CacheEntry, KernelCache

    launched = []

    def specializer(key, crow, col, ncols):
        return CacheEntry(key, "// fake", family="fake", params={"p": 1}, reason="2.0x cuSPARSE")

    def installer(entry, crow, col, ncols):
        def launch(crow, col, val, X):
            launched.append(tuple(X.shape))
            return torch.sparse_csr_tensor(crow, col, val, (crow.numel() - 1, ncols)).to_dense() @ X
        return launch

    runtime = rt.Runtime(JitOptions(mode="sync", admit_age_s=0), cache=KernelCache(tmp_path),
                         specializer=specializer, installer=installer, devices=("cpu",))
    previous = rt.set_active(runtime)
    try:
        M = make_pattern("random", seed=np.random.randint(1 << 30))
        A = ts.csr(M, dtype=torch.float32)
        dense = torch.from_numpy(M.toarray())

        def check(product, X):
            want = dense @ X.double()
            assert_close_to_reference(product(X), want, torch.float32)

        check(lambda X: A @ X, torch.randn(M.shape[1], 4))  # decided, installed, kept on the matrix's door
        assert launched == [(M.shape[1], 4)] and (2, 4) in A.__dict__["_door"].hot
        lookups = patterns.stats()["lookups"]
        for product in (lambda X: A @ X, lambda X: torch.mm(A, X), lambda X: torch.sparse.mm(A, X),
                        lambda X: torch.matmul(A, X), lambda X: torch.addmm(torch.zeros(M.shape[0], 4), A, X)):
            check(product, torch.randn(M.shape[1], 4))
        assert patterns.stats()["lookups"] == lookups and len(launched) == 6  # each from the door
        check(lambda X: torch.mm(A, X), torch.randn(M.shape[1], 3))  # another N: decided, then kept too
        assert len(launched) == 7 and patterns.stats()["lookups"] > lookups
        B = A.with_values(A.values().clone().requires_grad_())
        check(lambda X: torch.mm(B, X).detach(), torch.randn(M.shape[1], 4))  # autograd: the Python path
        assert "_door" not in B.__dict__
    finally:
        rt.set_active(previous)
        runtime.close()


def test_host_indices_bound_for_another_device_are_checked_on_the_host(monkeypatch):
    """``ts.csr(host data, device=...)`` checks the indices on the host copy that travels (no
    device-to-host synchronization per new pattern), so its products find the pattern
    validated; bad indices are refused before anything travels, with the usual message."""
    import scipy.sparse as sp

    from torch_sparserl import pattern as patterns
    from torch_sparserl.tensor import construct

    checked = []
    real = construct.check_csr_values
    monkeypatch.setattr(construct, "check_csr_values",
                        lambda op, crow, col, ncols: checked.append((crow.device.type, col.device.type)) or
                        real(op, crow, col, ncols))
    M = sp.random(20, 10, density=0.3, format="csr", random_state=np.random.default_rng(0))
    with torch.inference_mode():
        A = ts.csr(M, device="meta")
    assert checked == [("cpu", "cpu")] and A._crow.device.type == "meta"
    assert not A._crow.is_inference() and patterns.owned(A._crow) and patterns.owned(A._col)
    assert patterns.validated(A._crow, A._col, 10) is not None
    crow, col = torch.tensor([0, 2, 1]), torch.tensor([0, 1])
    with pytest.raises(ValueError, match=r"torch_sparserl.csr: crow\[-1\] must equal nnz = len\(col\) = 2 \(got 1\)"):
        ts.csr((crow, col, torch.ones(2)), (2, 3), device="meta")
    with pytest.raises(ValueError, match=r"col must be < ncols = 3"):
        ts.csr((torch.tensor([0, 1, 2]), torch.tensor([0, 3]), torch.ones(2)), (2, 3), device="meta")


def test_to_sparse_csr_gives_torchs_csr_tensor_of_the_matrix(device):
    M = make_pattern("random", seed=6)
    w = torch.from_numpy(M.data).to(device).requires_grad_()
    A = ts.csr((torch.from_numpy(M.indptr), torch.from_numpy(M.indices), w), M.shape, device=device)
    S = A.to_sparse_csr()
    assert S.layout == torch.sparse_csr and tuple(S.shape) == M.shape and S.device.type == device.type
    torch.testing.assert_close(S.to_dense().cpu(), torch.from_numpy(M.toarray()), rtol=0, atol=0)
    S.crow_indices().data.zero_()  # the caller's copy: the matrix is untouched
    torch.testing.assert_close(A.to_dense().cpu(), torch.from_numpy(M.toarray()), rtol=0, atol=0)
    S = A.to_sparse_csr()
    S.to_dense().sum().backward()  # the gradient reaches the values
    torch.testing.assert_close(w.grad.cpu(), torch.ones(M.nnz, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"CSRMatrix.to_sparse_csr: dense_dim must be None or 0 \(got 1\)"):
        A.to_sparse_csr(dense_dim=1)


def test_building_and_using_a_matrix_passes_on_no_warning_of_torchs():
    """torch notes once per process that its sparse CSR support is in beta: an internal step of
    the library is no reason to show the user that (a new process, so the note is not spent)."""
    code = """
import warnings, numpy as np, scipy.sparse as sp, torch, torch_sparserl as ts
M = sp.random(30, 20, density=0.2, format="csr", random_state=np.random.default_rng(0))
coo = torch.sparse_coo_tensor(np.stack([M.tocoo().row, M.tocoo().col]), M.tocoo().data, M.shape)
warnings.simplefilter("error")
for data in (coo, coo.to_dense(), M):
    A = ts.csr(data)
    A @ torch.randn(20, 3, dtype=torch.float64)
    A.to_sparse_csr()
"""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
