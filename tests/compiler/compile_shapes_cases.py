"""The cases of the compiled-shapes tests (``test_compile_shapes*.py``, whose docstring tells the
story): matrices of given sizes, size sequences, the product spellings, and the check every
product case runs (:func:`product_tests`, one sixth of them per file)."""

import pytest
import torch

import torch_sparserl as ts
from torch_sparserl.dtypes import assert_close_to_reference


def _matrix(nrows: int, ncols: int, nnz: int, seed: int):
    """A float32 CSRMatrix with exactly ``nnz`` entries, and its float64 dense twin."""
    g = torch.Generator().manual_seed(seed)
    where = torch.randperm(nrows * ncols, generator=g)[:nnz]
    dense = torch.zeros(nrows * ncols, dtype=torch.float64)
    dense[where] = torch.randn(nnz, generator=g, dtype=torch.float64)
    dense = dense.view(nrows, ncols)
    A = ts.csr(dense.to(torch.float32).to_sparse_csr())
    assert A.nnz == nnz
    return A, dense.to(torch.float32).double()


# (nrows, ncols, nnz, columns of the dense operand) per call; each sequence goes back to
# sizes it had before, after the graph was made dynamic.
SEQUENCES = {
    "issue": [(2, 4, 8, 3), (2, 9, 18, 3), (2, 2, 4, 3), (2, 4, 8, 3), (2, 9, 18, 3)],
    "ncols only": [(3, 4, 6, 3), (3, 9, 6, 3), (3, 2, 6, 3), (3, 4, 6, 3), (3, 9, 6, 3)],
    "nrows only": [(4, 3, 6, 3), (9, 3, 6, 3), (2, 3, 6, 3), (4, 3, 6, 3), (9, 3, 6, 3)],
    "nnz only": [(5, 6, 30, 3), (5, 6, 12, 3), (5, 6, 3, 3), (5, 6, 30, 3), (5, 6, 12, 3)],
    "operand only": [(5, 6, 12, 3), (5, 6, 12, 7), (5, 6, 12, 2), (5, 6, 12, 3), (5, 6, 12, 7)],
    "everything": [(3, 4, 5, 3), (7, 9, 20, 5), (2, 2, 3, 2), (3, 4, 5, 3), (7, 9, 20, 5)],
}


def _operand(shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# name -> (the compiled function of (A, X), X's shape from (nrows, ncols, n), the float64 reference of (D, X))
SPELLINGS = {
    "A @ X": (lambda A, X: A @ X, lambda r, c, n: (c, n), lambda D, X: D @ X),
    "X @ A": (lambda A, X: X @ A, lambda r, c, n: (n, r), lambda D, X: X @ D),
    "(X.t() @ A).t()": (lambda A, X: (X.t() @ A).t(), lambda r, c, n: (r, n), lambda D, X: D.t() @ X),
    "torch.mv(A, x)": (lambda A, x: torch.mv(A, x), lambda r, c, n: (c,), lambda D, x: D @ x),
    "x @ A": (lambda A, x: x @ A, lambda r, c, n: (r,), lambda D, x: x @ D),
    "A.to_dense()": (lambda A, X: A.to_dense() * X.sum(), lambda r, c, n: (n,), lambda D, X: D * X.sum()),
    "torch.sparse.mm(A, X)": (lambda A, X: torch.sparse.mm(A, X), lambda r, c, n: (c, n), lambda D, X: D @ X),
    "torch.addmm(b, A, X)": (lambda A, X: torch.addmm(X[:1].sum(0), A, X), lambda r, c, n: (c, n),
                             lambda D, X: X[:1].sum(0) + D @ X),
}

DYNAMIC = {"automatic": None, "dynamic": True, "static": False}


def _run_sequence(compiled, spelling: str, changes: str):
    _, x_shape, reference = SPELLINGS[spelling]
    for step, (nrows, ncols, nnz, n) in enumerate(SEQUENCES[changes]):
        A, D = _matrix(nrows, ncols, nnz, seed=step)
        X = _operand(x_shape(nrows, ncols, n), seed=100 + step)
        out = compiled(A, X)
        try:
            assert_close_to_reference(out, reference(D, X.double()))
        except AssertionError as exc:
            raise AssertionError(f"{spelling}, call {step} with A of {nrows}×{ncols} (nnz {nnz}), "
                                 f"X of {tuple(X.shape)}: {exc}") from None


def _graphs() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def _distinct_sizes(spelling: str, changes: str) -> int:
    x_shape = SPELLINGS[spelling][1]
    return len({(r, c, nnz, x_shape(r, c, n)) for r, c, nnz, n in SEQUENCES[changes]})


def products_follow_every_size(spelling: str, changes: str, flatten: bool, dynamic: str) -> None:
    """One compiled product (``spelling``) through a sequence of sizes (``changes``), every call
    against float64; static shapes compile each size once, dynamic ones at most twice."""
    fn = SPELLINGS[spelling][0]
    compiled = torch.compile(fn, backend="sparserl", fullgraph=True, dynamic=DYNAMIC[dynamic],
                             options={"flatten_matrices": flatten})
    _run_sequence(compiled, spelling, changes)
    # Static shapes compile each size once (going back to a size finds its graph); dynamic
    # ones do not compile per size: automatic dynamic shapes compile the first size and
    # then one symbolic graph, dynamic=True at most one more where duck sizing had tied two
    # sizes that later differ.
    graphs, distinct = _graphs(), _distinct_sizes(spelling, changes)
    if dynamic == "static":
        assert graphs == distinct, (graphs, distinct)
    else:
        assert graphs <= 2, graphs


def product_tests(flatten: bool, dynamic: str):
    """The product cases for one (``flatten``, ``dynamic``) pair, every spelling and sequence: a
    test function for a module to bind as ``test_compiled_products_follow_every_size``."""
    @pytest.mark.slow
    @pytest.mark.usefixtures("fresh_dynamo")
    @pytest.mark.parametrize("changes", sorted(SEQUENCES))
    @pytest.mark.parametrize("spelling", sorted(SPELLINGS))
    def test(spelling, changes):
        products_follow_every_size(spelling, changes, flatten=flatten, dynamic=dynamic)

    return test
