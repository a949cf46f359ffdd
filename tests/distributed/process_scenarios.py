"""What each process of tests/distributed/test_distributed_gloo.py (and ``_gpu.py``) runs: a
process group (gloo on the CPU, NCCL or gloo with CUDA tensors on GPUs), one scenario, and a JSON
file per rank saying what happened (an assertion that fails in a rank is written there, so that
the test names the rank and the check)."""

from __future__ import annotations

import datetime
import faulthandler
import json
import os
import socket
import time
import traceback
from pathlib import Path

import numpy as np
import scipy.sparse as sp
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import torch_sparserl as ts
from torch_sparserl.dtypes import assert_close_to_reference

TIMEOUT_S = 3.0   # how long a rank waits for a peer that left in the failure scenarios
HANG_S = 7.0      # how long the hanging rank sleeps: well past TIMEOUT_S, well short of the test's patience


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(world: int, scenario: str, out: Path, patience_s: float = 90.0, backend: str = "gloo",
        device: str = "cpu", wait_for: list[int] | None = None) -> list[dict]:
    """Run ``scenario`` in ``world`` fresh processes, over ``backend`` with the matrix and
    operands on ``device`` (``cuda``: rank r on GPU r modulo the GPUs); every rank's report, in
    rank order (a rank that wrote none reports its exit code). With ``wait_for``, the other
    ranks are stopped once those ranks are done (a rank left hanging on purpose)."""
    context = mp.start_processes(_main, args=(world, free_port(), scenario, str(out), backend, device), nprocs=world,
                                 join=False, start_method="spawn")
    deadline = time.monotonic() + patience_s
    waited = [context.processes[r] for r in wait_for] if wait_for is not None else context.processes
    for process in waited:
        process.join(max(0.0, deadline - time.monotonic()))
    alive = [p for p in waited if p.is_alive()]
    for p in context.processes:
        if p.is_alive():
            p.kill()
            p.join()
    reports = []
    for rank, process in enumerate(context.processes):
        path = out / f"rank{rank}.json"
        report = json.loads(path.read_text()) if path.exists() else {"ok": False, "error": "no report"}
        report["exitcode"] = process.exitcode
        report["hung"] = process in alive
        reports.append(report)
    return reports


DEVICE = torch.device("cpu")  # where a scenario's matrix and operands live (set by _main)


def _main(rank: int, world: int, port: int, scenario: str, out: str, backend: str, device: str) -> None:
    global DEVICE
    torch.set_num_threads(1)  # 2-4 processes on a 2-core machine
    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())  # before the group: NCCL binds to it
        DEVICE = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    report = {"ok": True}
    if scenario.startswith("peer_"):  # a rank still running well past the scenario's waits says where it is
        faulthandler.dump_traceback_later(HANG_S + TIMEOUT_S + 30, exit=True)
    try:
        report.update(SCENARIOS[scenario](rank, world) or {})
    except Exception as exc:  # noqa: BLE001 - written for the test to name
        report = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    Path(out, f"rank{rank}.json").write_text(json.dumps(report))
    if scenario.startswith("peer_"):
        os._exit(0)  # the group has a member that is gone: leave without its teardown
    dist.destroy_process_group()


# ------------------------------------------------------------------------------ matrices


def random_with_empty_rows(n: int = 240, seed: int = 0) -> sp.csr_matrix:
    """A random square matrix whose every 7th row and every 11th column are empty."""
    rng = np.random.default_rng(seed)
    A = sp.random(n, n, density=0.04, random_state=rng, format="csr", dtype=np.float64)
    A = A.tolil()
    A[::7, :] = 0
    A[:, ::11] = 0
    A = A.tocsr()
    A.eliminate_zeros()
    A.data = rng.standard_normal(A.nnz)
    return A


def matrices() -> dict[str, sp.csr_matrix]:
    cora = ts.load_matrix("cora").tocsr().astype(np.float64)
    cora.data = np.random.default_rng(1).standard_normal(cora.nnz)
    return {"cora": cora, "random_with_empty_rows": random_with_empty_rows()}


# ------------------------------------------------------------------------------ scenarios


def _products(rank: int, world: int, dtypes=(torch.float64, torch.float32, torch.bfloat16)) -> dict:
    """Forward, the gradient of X and of the values, and two products in a row, against one
    process's float64 reference, for every order, in each of ``dtypes``."""
    checked = []
    for name, M in matrices().items():
        n = M.shape[0]
        g = torch.Generator().manual_seed(2)  # the same X and W on every rank
        X64 = torch.randn(n, 5, generator=g, dtype=torch.float64)
        W64 = torch.randn(n, 5, generator=g, dtype=torch.float64)
        A64 = torch.from_numpy(M.toarray())
        rows_ref = A64 @ X64
        grad_x_ref = A64.T @ W64
        coo = M.tocoo()  # M is canonical CSR: its COO entries are in its CSR order
        grad_val_ref = (W64[torch.from_numpy(coo.row).long()] * X64[torch.from_numpy(coo.col).long()]).sum(1)
        two_ref = A64 @ (A64 @ X64)
        for order in ("rows", "degree", "rcm"):
            for dtype in dtypes:
                values = torch.from_numpy(M.data).to(dtype).requires_grad_(True)
                A = ts.csr(M, dtype=dtype).with_values(values)
                D = ts.distributed.distribute_csr(A, order=order, timeout=30, device=DEVICE)
                rows = D.partition.rows_of(rank)
                X_local = D.shard_rows(X64.to(dtype)).requires_grad_(True)
                Y_local = D @ X_local
                assert Y_local.device == DEVICE
                assert_close_to_reference(Y_local, rows_ref[rows], dtype)
                assert_close_to_reference(D.gather_rows(Y_local), rows_ref, dtype)
                (Y_local * D.shard_rows(W64.to(dtype))).sum().backward()
                assert_close_to_reference(X_local.grad, grad_x_ref[rows], dtype)
                grad_val = values.grad.to(D.exchange.comm_device)  # this rank's entries; the ranks' sum is the whole
                dist.all_reduce(grad_val)
                assert_close_to_reference(grad_val, grad_val_ref, dtype)
                # two products in a row (two exchanges each way), the gradient through both
                X2 = D.shard_rows(X64.to(dtype)).requires_grad_(True)
                Z = D @ (D @ X2)
                assert_close_to_reference(Z, two_ref[rows], dtype)
                Z.sum().backward()
                assert_close_to_reference(X2.grad, (A64.T @ (A64.T @ torch.ones_like(X64)))[rows], dtype)
                v = D @ D.shard_rows(X64[:, 0].to(dtype))  # a vector
                assert_close_to_reference(v, rows_ref[rows, 0], dtype)
                checked.append(f"{name}/{order}/{dtype}")
        # a partition for another number of ranks is refused before any rank waits
        other = ts.distributed.partition(M, world + 1)
        try:
            ts.distributed.distribute_csr(M, other)
        except ValueError as exc:
            assert f"over {world + 1} ranks" in str(exc) and f"the group {world} ranks" in str(exc), exc
        else:
            raise AssertionError("a partition for another world size was accepted")
    return {"checked": checked, "halo_rows": D.plan.halo_size}


def _disagreements(rank: int, world: int) -> dict:
    """Rank 1 holds a matrix with one value changed, then one with another pattern, then asks for
    another order: each time every rank refuses, naming rank 1 (and stays in step for the next)."""
    M = random_with_empty_rows()
    changed_value, changed_pattern = M.copy(), M.copy()
    changed_value.data[3] += 1.0
    changed_pattern.indices[[0, -1]] = changed_pattern.indices[[0, -1]] ^ 1  # same nnz, other columns
    changed_pattern.sort_indices()
    cases = {"values": (changed_value, "rows"), "pattern": (changed_pattern, "rows"), "partition": (M, "rcm")}
    raised = {}
    for name, (other, order) in cases.items():
        try:
            ts.distributed.distribute_csr(other if rank == 1 else M, order=order if rank == 1 else "rows",
                                          timeout=TIMEOUT_S)
        except ValueError as exc:
            raised[name] = str(exc)
        else:
            raised[name] = None
    return {"raised": raised}


def own_rows(M: sp.csr_matrix, part, rank: int) -> sp.csr_matrix:
    """``rank``'s rows of ``M`` in the partition's order, all columns (what a rank loads)."""
    return M[part.rows_of(rank).numpy()].tocsr()


def _from_local(rank: int, world: int, dtypes=(torch.float64, torch.float32)) -> dict:
    """Each rank passes only its rows (DistributedCSRMatrix.from_local): the product, X's and
    the values' gradients equal the whole-matrix path's (bitwise on the CPU: the same blocks) and one
    process's float64 reference, for every order."""
    checked = []
    for name, M in matrices().items():
        n = M.shape[0]
        g = torch.Generator().manual_seed(3)
        X64 = torch.randn(n, 4, generator=g, dtype=torch.float64)
        W64 = torch.randn(n, 4, generator=g, dtype=torch.float64)
        A64 = torch.from_numpy(M.toarray())
        for order in ("rows", "rcm"):
            part = ts.distributed.partition(M, world, order=order)
            mine = own_rows(M, part, rank)
            rows = part.rows_of(rank)
            coo = mine.tocoo()
            grad_val_ref = (W64[rows][torch.from_numpy(coo.row).long()] * X64[torch.from_numpy(coo.col).long()]).sum(1)
            for dtype in dtypes:
                results = []
                values = torch.from_numpy(mine.data).to(dtype).requires_grad_(True)
                for D in (ts.distributed.distribute_csr(ts.csr(M, dtype=dtype), part, timeout=30, device=DEVICE),
                          ts.distributed.DistributedCSRMatrix.from_local(ts.csr(mine, dtype=dtype).with_values(values),
                                                                         part, timeout=30, device=DEVICE)):
                    X_local = D.shard_rows(X64.to(dtype)).requires_grad_(True)
                    Y_local = D @ X_local
                    (Y_local * D.shard_rows(W64.to(dtype))).sum().backward()
                    results.append((Y_local.detach(), X_local.grad, D))
                (Y_whole, gx_whole, _), (Y_own, gx_own, D) = results
                if DEVICE.type == "cpu":  # the same blocks, the same kernels (a GPU's atomics may sum in another order)
                    assert torch.equal(Y_own, Y_whole) and torch.equal(gx_own, gx_whole), f"{name}/{order}/{dtype}"
                assert_close_to_reference(Y_own, Y_whole.double(), dtype)
                assert_close_to_reference(Y_own, (A64 @ X64)[rows], dtype)
                assert_close_to_reference(gx_own, (A64.T @ W64)[rows], dtype)
                assert values.grad is not None and values.grad.shape == (mine.nnz,)
                assert_close_to_reference(values.grad, grad_val_ref, dtype)
                checked.append(f"{name}/{order}/{dtype}")
    return {"checked": checked, "halo_rows": D.plan.halo_size}


def _from_local_refusals(rank: int, world: int) -> dict:
    """Rank 1 passes too many rows, then too many columns, then another partition, then another
    dtype: every rank raises a ValueError naming rank 1 (and stays in step for the next)."""
    M = random_with_empty_rows()
    part = ts.distributed.partition(M, world)
    mine = own_rows(M, part, rank)
    wider = sp.csr_matrix((mine.data, mine.indices, mine.indptr), shape=(mine.shape[0], M.shape[1] + 1))
    cases = {"rows": (own_rows(M, part, rank)[: mine.shape[0] - 1] if rank == 1 else mine, part),
             "columns": (wider if rank == 1 else mine, part),
             "partition": (mine, ts.distributed.partition(M, world, order="rcm") if rank == 1 else part),
             "dtype": (mine.astype(np.float32) if rank == 1 else mine, part)}
    raised = {}
    for case, (rows, partition) in cases.items():
        try:
            ts.distributed.DistributedCSRMatrix.from_local(rows, partition, timeout=TIMEOUT_S, device=DEVICE)
        except ValueError as exc:
            raised[case] = str(exc)
        else:
            raised[case] = None
    return {"raised": raised, "rows": part.size_of(1)}


def _peer_leaves(how: str):
    def scenario(rank: int, world: int) -> dict:
        M = random_with_empty_rows()
        D = ts.distributed.distribute_csr(M, order="rows", timeout=TIMEOUT_S, device=DEVICE)
        dist.barrier()  # every rank has its plan: the next thing rank 1 does not do is the exchange
        if rank == 1:
            if how == "exits":
                os._exit(0)
            time.sleep(HANG_S)
            return {"slept": True}
        X = D.shard_rows(torch.ones(M.shape[0], 3, dtype=torch.float64))
        started = time.monotonic()
        try:
            D @ X
            if DEVICE.type == "cuda":
                torch.cuda.synchronize()  # NCCL's wait without a timeout does not block the host
        except ts.distributed.HaloExchangeError as exc:
            return {"raised": str(exc), "after_s": time.monotonic() - started}
        return {"raised": None}
    return scenario


def _leaves_before_construction(rank: int, world: int) -> dict:
    """Rank 1 exits before distribute_csr: rank 0's construction raises, saying which step."""
    if rank == 1:
        os._exit(0)
    started = time.monotonic()
    try:
        ts.distributed.distribute_csr(random_with_empty_rows(), timeout=TIMEOUT_S, device=DEVICE)
    except RuntimeError as exc:
        return {"raised": str(exc), "after_s": time.monotonic() - started}
    return {"raised": None}


def _compiled(rank: int, world: int) -> dict:
    """A two-layer GCN over a DistributedCSRMatrix under ``torch.compile(backend="sparserl")``:
    its loss and gradients equal the same model's run eagerly (Dynamo runs the exchange between
    the compiled pieces)."""
    M = matrices()["cora"]
    D = ts.distributed.distribute_csr(ts.csr(M, dtype=torch.float64), order="rcm", timeout=30, device=DEVICE)
    g = torch.Generator().manual_seed(3)  # the same weights and features on every rank
    x = D.shard_rows(torch.randn(M.shape[0], 6, generator=g, dtype=torch.float64))
    weights = [torch.randn(6, 8, generator=g, dtype=torch.float64), torch.randn(8, 3, generator=g, dtype=torch.float64)]

    def model(x, w1, w2):
        return (D @ (torch.relu(D @ (x @ w1)) @ w2)).square().sum()

    results = []
    for run in (model, torch.compile(model, backend="sparserl")):
        w1, w2 = (w.clone().requires_grad_(True) for w in weights)
        for _ in range(2):  # the second call runs what the first compiled
            w1.grad = w2.grad = None
            loss = run(x, w1, w2)
            loss.backward()
        results.append((loss.detach(), w1.grad, w2.grad))
    for want, got in zip(results[0], results[1]):
        assert_close_to_reference(got, want, torch.float64)
    return {"loss": float(results[1][0])}


SCENARIOS = {"peer_exits_early": _leaves_before_construction, "products": _products, "compiled": _compiled,
             "products_float64": lambda rank, world: _products(rank, world, (torch.float64,)), "disagreements": _disagreements,
             "peer_exits": _peer_leaves("exits"),
             "from_local": _from_local, "from_local_float64": lambda rank, world: _from_local(rank, world, (torch.float64,)),
             "from_local_refusals": _from_local_refusals, "peer_hangs": _peer_leaves("hangs")}
