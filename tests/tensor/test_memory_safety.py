"""No write a caller can make to a tensor it can reach leads a product to read out of bounds.

A matrix's own indices (``ts.csr``'s copies, the transposed pattern ``A.t()`` hands out) are never
handed out: ``A.crow``, ``A.col``, ``crow_indices()`` and ``col_indices()`` are copies. Whatever is
written to them — in place, through ``.data``, through NumPy — the matrix's products give the
validated matrix's result; a product of the written copies as raw tensors either reads the
validated indices (a write torch does not count) or validates the new ones and names what is
wrong. Each case runs in a child process: an out-of-bounds read would kill the test run.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

import torch_sparserl as ts
from torch_sparserl.dtypes import assert_close_to_reference

from helpers import make_pattern, raises_index_error, ref_spmm, ref_spmm_transposed

BIG = 10**9  # far beyond any column: read as an index, a crash rather than a wrong number

# Each write reaches the matrix's indices by a route a caller has: (what it reads, how it writes).
WRITES = {
    "col in place": "A.col.fill_(BIG)",
    "col through .data": "A.col.data.fill_(BIG)",
    "crow through .data": "A.crow.data[1:] = BIG",
    "col_indices() through .data": "A.col_indices().data.fill_(BIG)",
    "crow_indices() in place": "A.crow_indices()[1:] = BIG",
    "the transpose's col through .data": "A.t().col.data.fill_(BIG)",
    "the transpose's crow in place": "A.t().crow[1:] = BIG",
    "col through NumPy": "A.col.numpy()[:] = BIG",  # CPU tensors only
}

_CHILD = """
import sys, numpy as np, scipy.sparse as sp, torch, torch_sparserl as ts
BIG = {big}
device = torch.device({device!r})
M = sp.random(60, 40, density=0.1, format="csr", random_state=np.random.default_rng(3))
A = ts.csr(M, dtype=torch.float32, device=device)
X = torch.randn(40, 8, device=device)
G = torch.randn(60, 8, device=device)
before = (A @ X, G.t() @ A, A.t() @ G)  # decided, recorded, the transpose computed
{write}
after = [A @ X, (G.t() @ A).t(), A.t() @ G, torch.mv(A, X[:, 0]), A.to_dense()]
if device.type == "cuda":
    torch.cuda.synchronize()
torch.save([t.cpu() for t in [X, G] + after], sys.argv[1])
"""


@pytest.mark.slow
@pytest.mark.parametrize("route", list(WRITES))
def test_writes_to_reachable_index_tensors_leave_the_matrix_as_validated(tmp_path, device, route):
    if "NumPy" in route and device.type != "cpu":
        pytest.skip("NumPy shares memory with CPU tensors only")
    import numpy as np
    import scipy.sparse as sp

    out = tmp_path / "after.pt"
    script = _CHILD.format(big=BIG, device=str(device), write=WRITES[route])
    done = subprocess.run([sys.executable, "-c", script, str(out)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"exit {done.returncode} after `{WRITES[route]}`:\n{done.stderr[-3000:]}"
    X, G, Y, GA, AtG, y, D = torch.load(out)
    M = sp.random(60, 40, density=0.1, format="csr", random_state=np.random.default_rng(3))
    parts = [torch.from_numpy(a) for a in (M.indptr, M.indices, M.data.astype(np.float32))]
    assert torch.equal(D, torch.from_numpy(M.toarray()).float())
    assert_close_to_reference(Y, ref_spmm(*parts, 40, X), torch.float32)
    assert_close_to_reference(GA, ref_spmm_transposed(*parts, 40, G), torch.float32)
    assert_close_to_reference(AtG, ref_spmm_transposed(*parts, 40, G), torch.float32)
    assert_close_to_reference(y, ref_spmm(*parts, 40, X[:, :1]).squeeze(1), torch.float32)


@pytest.mark.parametrize("route", [r for r in WRITES if "NumPy" not in r and "transpose" not in r])
def test_products_after_a_write_read_the_validated_indices(device, route, poison_uninitialized):
    """In process, with the values compared: writes that fit in range (so that reading them would
    give a different, not a crashing, result) change none of the matrix's products."""
    M = make_pattern("random", seed=4)
    A = ts.csr(M, dtype=torch.float32, device=device)
    crow, col, val = (torch.from_numpy(a) for a in (M.indptr, M.indices, M.data))
    X = torch.randn(M.shape[1], 5, dtype=torch.float64).float().to(device)
    G = torch.randn(M.shape[0], 5, dtype=torch.float64).float().to(device)
    A @ X
    At = A.t()
    exec(WRITES[route].replace("BIG", "0"), {"A": A})
    assert_close_to_reference(A @ X, ref_spmm(crow, col, val, M.shape[1], X.cpu()), torch.float32)
    assert_close_to_reference((G.t() @ A).t(), ref_spmm_transposed(crow, col, val, M.shape[1], G.cpu()),
                              torch.float32)
    assert_close_to_reference(At @ G, ref_spmm_transposed(crow, col, val, M.shape[1], G.cpu()), torch.float32)


def test_the_exposed_indices_are_keys_of_the_matrix_until_written(device):
    """``A.crow`` / ``A.col`` (copies) find the matrix's own pattern, so that the runtime's records
    and the operators know them as the matrix; after a write torch counts they are a pattern of
    their own, validated again: a column out of range is named, never read."""
    from torch_sparserl import pattern as patterns

    M = make_pattern("random", seed=5)
    A = ts.csr(M, dtype=torch.float32, device=device)
    crow, col = A.crow, A.col
    assert crow is A.crow and col is A.col  # made once, kept
    assert crow.data_ptr() != A._crow.data_ptr() and col.data_ptr() != A._col.data_ptr()
    own = patterns.lookup(A._crow, A._col, M.shape[1])
    assert patterns.lookup(crow, col, M.shape[1]) is own
    X = torch.randn(M.shape[1], 3, device=device)
    ref = ref_spmm(*(torch.from_numpy(a) for a in (M.indptr, M.indices, M.data)), M.shape[1], X.cpu())
    col.data.fill_(M.shape[1] + 7)  # not counted: still the matrix, read as validated
    assert_close_to_reference(torch.ops.sparserl.spmm(crow, col, A.val, M.shape[1], X), ref, torch.float32)
    col.fill_(M.shape[1] + 7)  # counted: a new pattern, validated, refused
    assert patterns.lookup(crow, col, M.shape[1]) is not own
    raises_index_error(lambda: torch.ops.sparserl.spmm(crow, col, A.val, M.shape[1], X),
                       r"sparserl.spmm: col must be < ncols = \d+ \(got col\[0\]")
    assert_close_to_reference(A @ X, ref, torch.float32)  # the matrix itself never changed


def test_the_indices_of_a_matrix_cannot_be_replaced():
    A = ts.csr(make_pattern("random"))
    for name in ("crow", "col"):
        with pytest.raises(AttributeError, match=rf"CSRMatrix.{name}: the indices of a matrix cannot be replaced"):
            setattr(A, name, getattr(A, name).clone())


def test_a_matrix_on_the_callers_tensors_hands_back_those_tensors():
    """A CSRMatrix made directly on the caller's index tensors gives them back as they are: they
    were the caller's already, and the pattern validated a private copy of them."""
    M = make_pattern("random")
    crow, col = torch.from_numpy(M.indptr).clone(), torch.from_numpy(M.indices).clone()
    A = ts.CSRMatrix(crow, col, torch.from_numpy(M.data), M.shape)
    assert A.crow is crow and A.col is col


@pytest.mark.parametrize("code", [
    textwrap.dedent("""
        import torch, torch_sparserl as ts
        i = torch.tensor([[0, 1, 2], [0, -5, 1]])
        S = torch.sparse_coo_tensor(i, torch.ones(3), (3, 3), check_invariants=False)
        ts.csr(S)
    """),
    textwrap.dedent("""
        import torch, torch_sparserl as ts
        i = torch.tensor([[0, 7, 2], [0, 1, 1]])
        S = torch.sparse_coo_tensor(i, torch.ones(3), (3, 3), check_invariants=False)
        ts.csr(S)
    """),
])
def test_a_coo_tensor_with_indices_out_of_range_is_refused_before_torch_reads_it(code):
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, (done.returncode, done.stderr[-2000:])
    assert "ValueError: torch_sparserl.csr: the COO tensor's" in done.stderr, done.stderr[-2000:]
