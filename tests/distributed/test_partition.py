"""The partition orders and the halo bookkeeping, in one process simulating every rank; and a
one-rank process group for what needs one (a product with no halo, the operands' errors)."""

from __future__ import annotations

import datetime
import sys
import types

import numpy as np
import pytest
import scipy.sparse as sp
import torch
import torch.distributed as dist
from scipy.sparse.csgraph import reverse_cuthill_mckee

import torch_sparserl as ts
from torch_sparserl.distributed import Partition, partition, receives, sends_from, split_block
from torch_sparserl.dtypes import assert_close_to_reference
from process_scenarios import free_port, random_with_empty_rows


def _banded_shuffled(n: int = 400, seed: int = 3) -> tuple[sp.csr_matrix, np.ndarray]:
    """A symmetric banded matrix with its rows and columns shuffled by one permutation."""
    band = sp.diags([np.ones(n - abs(k)) for k in range(-3, 4)], list(range(-3, 4)), format="csr")
    shuffle = np.random.default_rng(seed).permutation(n)
    return band[shuffle][:, shuffle].tocsr(), shuffle


def _halo_total(M: sp.csr_matrix, part: Partition) -> int:
    return sum(split_block(M.indptr, M.indices, part, r).halo_columns.numel() for r in range(part.world_size))


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_rows_order_cuts_contiguous_runs_of_nearly_equal_size(world):
    M = random_with_empty_rows(n=103)
    part = partition(M, world)
    assert part.perm is None and part.order == "rows" and part.world_size == world and part.n == 103
    sizes = [part.size_of(r) for r in range(world)]
    assert sum(sizes) == 103 and max(sizes) - min(sizes) <= 1
    assert torch.equal(torch.cat([part.rows_of(r) for r in range(world)]), torch.arange(103))


def test_nnz_balance_evens_out_the_work():
    """A matrix whose first rows are dense: by rows rank 0 gets most nonzeros; by nnz each rank's
    weight (nonzeros + rows) is within one row's weight of the even share."""
    rng = np.random.default_rng(0)
    dense_head = sp.random(40, 400, density=0.5, random_state=rng, format="csr")
    sparse_tail = sp.random(360, 400, density=0.01, random_state=rng, format="csr")
    M = sp.vstack([dense_head, sparse_tail]).tocsr()
    weight = np.diff(M.indptr) + 1.0
    by_rows, by_nnz = partition(M, 4), partition(M, 4, balance="nnz")
    share = weight.sum() / 4
    worst = lambda p: max(abs(weight[p.bounds[r]:p.bounds[r + 1]].sum() - share) for r in range(4))  # noqa: E731
    assert worst(by_nnz) <= weight.max() < worst(by_rows)


def test_degree_order_sorts_rows_by_decreasing_degree():
    M = random_with_empty_rows()
    part = partition(M, 3, order="degree")
    degree = np.diff(M.indptr)[part.perm.numpy()]
    assert part.order == "degree" and (np.diff(degree) <= 0).all()


def test_rcm_order_is_scipys_and_keeps_columns_local():
    """On a shuffled banded matrix, RCM's order finds the band back: the halo shrinks to the
    band's width at each cut, far below the shuffled order's."""
    M, _ = _banded_shuffled()
    part = partition(M, 4, order="rcm")
    expected = reverse_cuthill_mckee(sp.csr_matrix(M + M.T), symmetric_mode=True)
    assert part.order == "rcm"
    # the diagonal is dropped before ordering: same graph, so the same order
    assert torch.equal(part.perm, torch.from_numpy(np.asarray(expected, dtype=np.int64)))
    assert _halo_total(M, part) <= 2 * 3 * 3 < _halo_total(M, partition(M, 4)) / 10


def _fake_pymetis(monkeypatch, parts):
    calls = []

    def part_graph(nparts, xadj, adjncy):
        calls.append((nparts, np.asarray(xadj).copy(), np.asarray(adjncy).copy()))
        return 0, list(parts)

    monkeypatch.setitem(sys.modules, "pymetis", types.SimpleNamespace(part_graph=part_graph))
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: object() if name == "pymetis" else None)
    return calls


def test_metis_order_groups_metis_parts_and_local_prefers_it(monkeypatch):
    M = random_with_empty_rows(n=12)
    parts = [2, 0, 1, 0, 2, 1, 1, 0, 2, 2, 0, 1]
    calls = _fake_pymetis(monkeypatch, parts)
    for order in ("metis", "local"):
        part = partition(M, 3, order=order)
        assert part.order == "metis" and part.bounds == (0, 4, 8, 12)
        for rank in range(3):
            assert sorted(part.rows_of(rank).tolist()) == [i for i, p in enumerate(parts) if p == rank]
    nparts, xadj, adjncy = calls[0]
    S = sp.csr_matrix(M + M.T)
    S.setdiag(0)
    S.eliminate_zeros()
    assert nparts == 3 and np.array_equal(xadj, S.indptr)  # METIS reads the symmetrized graph


def test_metis_without_pymetis_is_named_and_local_falls_back_to_rcm(monkeypatch):
    monkeypatch.setitem(sys.modules, "pymetis", None)  # import fails
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None)
    M, _ = _banded_shuffled(n=50)
    with pytest.raises(ImportError, match=r"order='metis' needs the pymetis package \(pip install pymetis\)"):
        partition(M, 2, order="metis")
    assert partition(M, 2, order="local").order == "rcm"


@pytest.mark.parametrize("call, error, match", [
    (lambda M: partition(M, 2, order="random"), ValueError, r"order must be one of rows, degree, rcm, metis, local"),
    (lambda M: partition(M, 2, balance="edges"), ValueError, r"balance must be one of rows, nnz \(got 'edges'\)"),
    (lambda M: partition(M, 0), ValueError, r"world_size must be a positive int \(got 0\)"),
    (lambda M: partition(M[:, :-1], 2), ValueError, r"A must be square.*\(got shape \(20, 19\)\)"),
    (lambda M: partition(M, 21), ValueError, r"A has 20 rows, fewer than the 21 ranks"),
    (lambda M: Partition((0, 5, 3)), ValueError, r"bounds must rise from 0"),
    (lambda M: Partition((0, 5, 5, 9)), ValueError, r"each rank owning at least one row \(got \(0, 5, 5, 9\)\)"),
    (lambda M: Partition((0, 2, 4), perm=torch.tensor([0, 1, 2])), ValueError, r"perm must have 4 entries"),
    (lambda M: Partition((0, 2, 4), perm=torch.tensor([0, 1, 1, 3])), ValueError, r"perm must be a permutation"),
    (lambda M: Partition((0, 2, 4), perm=torch.tensor([0, 1, 2, 4])), ValueError, r"perm must be a permutation"),
    (lambda M: partition(M, 2).rows_of(2), ValueError, r"rank must be in \[0, 2\) \(got 2\)"),
    (lambda M: partition(M, 2).shard_rows(torch.zeros(19, 2), 0), ValueError, r"X must be a tensor with 20 rows"),
    (lambda M: partition(M, 2).gather_rows([torch.zeros(10)]), ValueError, r"expected 2 blocks, one per rank"),
    (lambda M: partition(M, 2).gather_rows([torch.zeros(10), torch.zeros(9)]), ValueError,
     r"block 1 must have 10 rows \(got shape \(9,\)\)"),
])
def test_bad_partitions_are_named(call, error, match):
    with pytest.raises(error, match=match):
        call(random_with_empty_rows(n=20))


@pytest.mark.parametrize("order", ["rows", "degree", "rcm"])
def test_shard_and_gather_are_inverse(order):
    M = random_with_empty_rows(n=50)
    part = partition(M, 3, order=order)
    X = torch.randn(50, 4, dtype=torch.float64)
    blocks = [part.shard_rows(X, r) for r in range(3)]
    for r, block in enumerate(blocks):
        assert torch.equal(block, X[part.rows_of(r)])
    assert torch.equal(part.gather_rows(blocks), X)


@pytest.mark.parametrize("order", ["rows", "degree", "rcm"])
@pytest.mark.parametrize("world", [1, 2, 4])
def test_blocks_and_halo_plans_rebuild_every_rank_s_product(order, world):
    """Simulating every rank: the local block on the rank's rows of X plus the halo block on the
    rows its receives name (read from their owners' rows) give the rank's rows of A @ X; every
    entry of A lands in exactly one block; each rank sends exactly what its peers receive."""
    M = random_with_empty_rows(n=90, seed=5)
    part = partition(M, world, order=order)
    X = torch.randn(90, 3, dtype=torch.float64)
    held = [part.shard_rows(X, r) for r in range(world)]
    values = torch.from_numpy(M.data)
    seen = []
    plans = []
    for rank in range(world):
        block = split_block(M.indptr, M.indices, part, rank)
        plan = receives(block.halo_columns, part)
        plans.append(plan)
        assert list(plan) == sorted(plan) and rank not in plan
        halo = torch.cat([held[q][rows] for q, rows in plan.items()]) if plan else X.new_zeros((0, 3))
        assert halo.shape[0] == block.halo_columns.numel()
        local = sp.csr_matrix((values[block.local_positions].numpy(), block.local_col.numpy(), block.local_crow.numpy()),
                              shape=(block.rows, block.rows))
        remote = sp.csr_matrix((values[block.halo_positions].numpy(), block.halo_col.numpy(), block.halo_crow.numpy()),
                               shape=(block.rows, halo.shape[0]))
        out = torch.from_numpy(local @ held[rank].numpy() + remote @ halo.numpy())
        assert_close_to_reference(out, torch.from_numpy(M @ X.numpy())[part.rows_of(rank)])
        seen += block.local_positions.tolist() + block.halo_positions.tolist()
    assert sorted(seen) == list(range(M.nnz))
    sends = sends_from(plans)
    for r in range(world):
        for q, rows in sends[r].items():
            assert torch.equal(rows, plans[q][r]) and int(rows.max()) < part.size_of(r)
    assert sum(len(s) for s in sends) == sum(len(p) for p in plans)


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))
    yield
    dist.destroy_process_group()


def test_one_rank_product_has_no_halo_and_matches(one_rank_group):
    M = random_with_empty_rows(n=60)
    D = ts.distributed.distribute_csr(M, order="rcm")
    assert D.halo is None and D.plan.halo_size == 0 and D.plan.send == {}
    X = torch.randn(60, 4, dtype=torch.float64)
    X_local = D.shard_rows(X).requires_grad_(True)
    out = D @ X_local
    assert_close_to_reference(D.gather_rows(out), torch.from_numpy(M @ X.numpy()))
    out.sum().backward()
    want = torch.from_numpy(M.T @ np.ones((60, 4)))[D.partition.rows_of(0)]
    assert_close_to_reference(X_local.grad, want)
    assert "rank=0/1" in repr(D) and D.stats["products"] == 1


def test_values_that_require_grad_are_read_at_each_product(one_rank_group):
    """Learnable values changed in place (an optimizer's step) after construction: the next
    product, with or without grad, uses them."""
    M = random_with_empty_rows(n=60)
    values = torch.from_numpy(M.data.copy()).requires_grad_(True)
    D = ts.distributed.distribute_csr(ts.csr(M).with_values(values))
    X = torch.randn(60, 3, dtype=torch.float64)
    with torch.no_grad():
        values.mul_(-2.0)
        out = D @ D.shard_rows(X)
    want = torch.from_numpy((-2.0 * M) @ X.numpy())
    assert_close_to_reference(D.gather_rows(out), want)


def test_gather_rows_takes_any_dtype(one_rank_group):
    D = ts.distributed.distribute_csr(random_with_empty_rows(n=60), order="rcm")
    labels = torch.randint(0, 5, (60,))
    gathered = D.gather_rows(D.shard_rows(labels))
    assert gathered.dtype == torch.int64 and torch.equal(gathered, labels)


def test_the_local_product_runs_while_the_halo_travels(one_rank_group):
    """The forward's order: the halo's sends and receives are posted, the local block multiplies,
    then the product waits for the halo; the first product multiplies first (its kernels load
    before an exchange runs on the device)."""
    D = ts.distributed.distribute_csr(random_with_empty_rows(n=60))
    events = []

    class Recorded:
        def __init__(self, inner, name):
            self.inner, self.name = inner, name

        def __getattr__(self, attr):
            value = getattr(self.inner, attr)
            if attr.startswith(("start_", "finish_")):
                def call(*args):
                    events.append(f"{self.name}.{attr}")
                    return value(*args)
                return call
            return value

    class LocalBlock(Recorded):
        def __matmul__(self, X):
            events.append("local product")
            return self.inner @ X

    D.exchange, D.local = Recorded(D.exchange, "exchange"), LocalBlock(D.local, "local")
    X = torch.randn(60, 2, dtype=torch.float64)
    D @ X
    assert events == ["local product", "exchange.start_forward", "exchange.finish_forward"]
    events.clear()
    D @ X
    assert events == ["exchange.start_forward", "local product", "exchange.finish_forward"]


def test_a_second_backward_through_the_exchange_is_refused(one_rank_group):
    D = ts.distributed.distribute_csr(random_with_empty_rows(n=60))
    X = torch.randn(60, 2, dtype=torch.float64, requires_grad=True)
    (grad,) = torch.autograd.grad((D @ X).square().sum(), X, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice a function that was marked with @once_differentiable"):
        grad.sum().backward()


@pytest.mark.parametrize("make, error, match", [
    (lambda D: torch.zeros(59, 2, dtype=torch.float64), ValueError,
     r"DistributedCSRMatrix.matmul: X_local must have 60 rows, rank 0's rows of the partition"),
    (lambda D: torch.zeros(60, 2, 2, dtype=torch.float64), ValueError, r"and 1 or 2 dimensions \(got shape"),
    (lambda D: torch.zeros(60, 2, dtype=torch.float32), TypeError,
     r"X_local must have the matrix's dtype torch.float64 \(got torch.float32\)"),
    (lambda D: torch.zeros(60, 2, dtype=torch.float64, device="meta"), ValueError,
     r"X_local must be on the matrix's device cpu \(got meta\)"),
    (lambda D: D.local, TypeError, r"X_local must be a dense tensor \(got CSRMatrix\)"),
    (lambda D: [[1.0]], TypeError, r"X_local must be a dense tensor \(got list\)"),
])
def test_bad_operands_are_named(one_rank_group, make, error, match):
    D = ts.distributed.distribute_csr(random_with_empty_rows(n=60))
    with pytest.raises(error, match=match):
        D @ make(D)


@pytest.mark.parametrize("kwargs, error, match", [
    ({"timeout": -1}, ValueError, r"timeout must be a positive timedelta or number of seconds \(got"),
    ({"partition": (0, 60)}, TypeError, r"partition must be a Partition \(got tuple\)"),
    ({"partition": Partition((0, 59))}, ValueError, r"the partition splits 59 rows over 1 ranks; A has 60 rows"),
])
def test_bad_arguments_are_named(one_rank_group, kwargs, error, match):
    with pytest.raises(error, match=match):
        ts.distributed.distribute_csr(random_with_empty_rows(n=60), **kwargs)


def test_a_rectangular_matrix_is_refused(one_rank_group):
    with pytest.raises(ValueError, match=r"distribute_csr: A must be square.*\(got shape \(60, 59\)\)"):
        ts.distributed.distribute_csr(random_with_empty_rows(n=60)[:, :59])
