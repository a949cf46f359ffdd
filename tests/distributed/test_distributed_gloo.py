"""``DistributedCSRMatrix`` in 2 and 4 CPU processes over gloo, against one process's float64
reference; and how it fails: no process group, ranks with different matrices, a rank that
exits or hangs before the halo exchange (the others raise naming it, within the timeout)."""

from __future__ import annotations

import pytest
import torch

import torch_sparserl as ts
from process_scenarios import HANG_S, TIMEOUT_S, random_with_empty_rows, run


def _failures(reports: list[dict]) -> str:
    return "\n".join(f"rank {r}: {rep.get('error')}\n{rep.get('traceback', '')}" for r, rep in enumerate(reports)
                     if not rep["ok"])


@pytest.mark.parametrize("world, scenario, dtypes", [(2, "products", 3), (4, "products_float64", 1)])
def test_products_and_gradients_match_one_process(tmp_path, world, scenario, dtypes):
    """Every rank's rows of A @ X, of Aᵀ G (X's gradient), of the values' gradient and of
    A @ (A @ X) equal one process's float64 reference, for the shipped cora and a random matrix
    with empty rows and columns, in every order; float64, float32 and bfloat16 on 2 ranks, float64
    on 4 (4 processes share this machine's 2 cores)."""
    reports = run(world, scenario, tmp_path)
    assert all(rep["ok"] for rep in reports), _failures(reports)
    assert all(len(rep["checked"]) == 2 * 3 * dtypes for rep in reports)
    assert all(rep["halo_rows"] > 0 for rep in reports)  # the exchange was exercised on every rank


def test_a_compiled_model_on_a_distributed_matrix_trains_as_the_eager_one(tmp_path):
    reports = run(2, "compiled", tmp_path)
    assert all(rep["ok"] for rep in reports), _failures(reports)


def test_no_process_group_is_named():
    assert not torch.distributed.is_initialized()
    with pytest.raises(RuntimeError, match=r"distribute_csr: torch.distributed's default process group is not "
                                           r"initialized; call torch.distributed.init_process_group"):
        ts.distributed.distribute_csr(random_with_empty_rows())


def test_ranks_that_disagree_all_refuse_naming_the_rank(tmp_path):
    """Rank 1 passes other values, another pattern (same nnz), another partition: every rank
    raises a ValueError naming rank 1 and what differs."""
    reports = run(2, "disagreements", tmp_path)
    assert all(rep["ok"] for rep in reports), _failures(reports)
    differs = {"values": "values hash (rank 0: ", "pattern": "pattern hash (rank 0: ", "partition": "partition hash (rank 0: "}
    for rank, rep in enumerate(reports):
        for case, field in differs.items():
            message = rep["raised"][case]
            assert message is not None, f"rank {rank} accepted a rank 1 with other {case}"
            assert message.startswith(f"torch_sparserl.distributed.distribute_csr (rank {rank}): the ranks disagree"), message
            assert field in message and "ranks [1]:" in message, message
            assert not any(other in message for other in differs.values() if other != field), message  # that alone


@pytest.mark.parametrize("how", ["exits", "hangs"])
def test_a_rank_that_leaves_before_the_exchange_is_named(tmp_path, how):
    """Rank 1 exits (or sleeps) after building its matrix: rank 0's product raises a
    HaloExchangeError naming rank 1 at once (or when the timeout passes), never hangs."""
    reports = run(2, f"peer_{how}", tmp_path, patience_s=60, wait_for=[0])
    rank0 = reports[0]
    assert rank0["ok"] and not rank0["hung"], _failures(reports)
    assert rank0["raised"] is not None, "rank 0's product returned although rank 1 sent nothing"
    assert rank0["raised"].startswith("DistributedCSRMatrix.matmul (rank 0): the halo exchange with rank 1 failed "
                                      f"or did not finish within 0:00:0{int(TIMEOUT_S)}"), rank0["raised"]
    if how == "exits":
        assert rank0["after_s"] < TIMEOUT_S
    else:
        assert TIMEOUT_S * 0.9 < rank0["after_s"] < HANG_S


def test_a_rank_that_exits_before_construction_is_reported_not_waited_for(tmp_path):
    reports = run(2, "peer_exits_early", tmp_path, patience_s=60, wait_for=[0])
    rank0 = reports[0]
    assert rank0["ok"] and not rank0["hung"], _failures(reports)
    assert rank0["raised"] is not None and rank0["raised"].startswith(
        "torch_sparserl.distributed.distribute_csr (rank 0): checking that the ranks hold the same matrix and "
        "partition failed: a rank exited"), rank0["raised"]
    assert rank0["after_s"] < TIMEOUT_S



@pytest.mark.parametrize("world, scenario, dtypes", [(2, "from_local", 2), (4, "from_local_float64", 1)])
def test_each_rank_passing_only_its_rows_matches_the_whole_matrix(tmp_path, world, scenario, dtypes):
    """DistributedCSRMatrix.from_local with each rank's own rows: products and gradients equal
    distribute_csr's with the whole matrix (bitwise) and one process's float64 reference; the
    values' gradient lands on the rank's own rows (2 ranks: float64 and float32; 4: float64)."""
    reports = run(world, scenario, tmp_path)
    assert all(rep["ok"] for rep in reports), _failures(reports)
    assert all(len(rep["checked"]) == 2 * 2 * dtypes for rep in reports)
    assert all(rep["halo_rows"] > 0 for rep in reports)


def test_a_rank_passing_wrong_rows_is_named_by_every_rank(tmp_path):
    reports = run(2, "from_local_refusals", tmp_path)
    assert all(rep["ok"] for rep in reports), _failures(reports)
    rows = reports[0]["rows"]
    expected = {"rows": f"rank 1 passed {rows - 1} rows, the partition gives it {rows}",
                "columns": "rank 1 passed 241 columns (largest index",
                "partition": "partition hash (rank 0: ", "dtype": "dtype (rank 0: "}
    for rank, rep in enumerate(reports):
        for case, text in expected.items():
            message = rep["raised"][case]
            assert message is not None, f"rank {rank} accepted a rank 1 with wrong {case}"
            assert message.startswith(f"torch_sparserl.distributed.DistributedCSRMatrix.from_local (rank {rank}): "
                                      "every rank must pass the same partition and its own rows"), message
            assert text in message, message
            if case in ("partition", "dtype"):
                assert "ranks [1]:" in message, message
