"""One rank's rows of a partitioned matrix, and the rows of ``X`` they need from the others.

The bookkeeping is pure (testable in one process by simulating every rank):

* :func:`split_block` cuts a rank's rows into the *local* block (the columns the rank owns,
  renumbered from 0) and the *halo* block (the columns other ranks own, renumbered compactly in
  the order of the partition, hence grouped by owner, owners ascending);
* :func:`receives` lists, per owner, which of its rows the halo block reads;
* :func:`sends_from` turns every rank's receives into every rank's sends (what the distributed
  path exchanges with ``all_to_all_single``, :func:`exchange_plan`).

:class:`HaloExchange` moves the rows: forward, each rank sends the rows of ``X`` its peers read
and receives its halo; backward, the gradient of the halo goes back to the rows' owners, which
add it to their own rows' gradient. Every wait is bounded and a failure names the peer.
"""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from ..data.arrays import sorted_unique
from .partition import Partition


class HaloExchangeError(RuntimeError):
    """A halo exchange that failed or timed out; the message names the peer rank."""


@dataclass(frozen=True)
class Block:
    """One rank's rows of the matrix (in the partition's order), as two CSR patterns: ``local``
    reads the rank's own rows of ``X`` (columns renumbered from 0), ``halo`` reads the received
    rows (column ``j`` is the global position ``halo_columns[j]``). ``*_positions`` say which
    entry of the global matrix's values each entry is (its values are gathered from there)."""

    rows: int
    local_crow: Tensor
    local_col: Tensor
    local_positions: Tensor
    halo_crow: Tensor
    halo_col: Tensor
    halo_positions: Tensor
    halo_columns: Tensor


def _sorted_csr(row: np.ndarray, col: np.ndarray, positions: np.ndarray, nrows: int):
    # rows in order, columns sorted within a row: one stable sort of one key (np.lexsort of the
    # two takes about seven times as long)
    order = np.argsort(row * np.int64(int(col.max()) + 1 if col.size else 1) + col, kind="stable")
    crow = np.zeros(nrows + 1, dtype=np.int64)
    np.cumsum(np.bincount(row, minlength=nrows), out=crow[1:])
    return (torch.from_numpy(crow), torch.from_numpy(col[order].astype(np.int64)),
            torch.from_numpy(positions[order].astype(np.int64)))


def split_block(crow: np.ndarray, col: np.ndarray, partition: Partition, rank: int, *,
                own_rows: bool = False) -> Block:
    """``rank``'s rows of the square matrix ``(crow, col)`` (original numbering) split into the
    local and the halo block (:class:`Block`). ``own_rows``: ``(crow, col)`` holds only
    ``rank``'s rows, in the partition's order (columns still in the original numbering), and
    the positions index its entries."""
    crow = np.asarray(crow, dtype=np.int64)
    col = np.asarray(col, dtype=np.int64)
    rows = np.arange(partition.size_of(rank)) if own_rows else partition.rows_of(rank).numpy()
    starts, lengths = crow[rows], crow[rows + 1] - crow[rows]
    total = int(lengths.sum())
    row_of_entry = np.repeat(np.arange(rows.shape[0]), lengths)
    first_of_row = np.cumsum(lengths) - lengths
    positions = np.repeat(starts - first_of_row, lengths) + np.arange(total)
    new_col = partition.new_positions(torch.from_numpy(col[positions])).numpy()
    lo, hi = partition.bounds[rank], partition.bounds[rank + 1]
    mine = (new_col >= lo) & (new_col < hi)
    local = _sorted_csr(row_of_entry[mine], new_col[mine] - lo, positions[mine], rows.shape[0])
    remote = new_col[~mine]
    halo_columns = sorted_unique(remote)
    halo = _sorted_csr(row_of_entry[~mine], np.searchsorted(halo_columns, remote), positions[~mine], rows.shape[0])
    return Block(rows.shape[0], *local, *halo, torch.from_numpy(halo_columns.astype(np.int64)))


def receives(halo_columns: Tensor, partition: Partition) -> dict[int, Tensor]:
    """Per owner rank (ascending), the owner's local indices of the rows ``halo_columns`` (sorted
    global positions) names, in halo order."""
    owners = partition.owner_of(halo_columns)
    found = {}
    for peer in torch.unique(owners).tolist():
        found[peer] = halo_columns[owners == peer] - partition.bounds[peer]
    return found


def sends_from(receives_by_rank: list[dict[int, Tensor]]) -> list[dict[int, Tensor]]:
    """Every rank's sends from every rank's receives: rank ``r`` sends peer ``q`` the rows
    ``q`` receives from ``r``."""
    sends = [{} for _ in receives_by_rank]
    for q, wanted in enumerate(receives_by_rank):
        for r, rows in wanted.items():
            sends[r][q] = rows
    return [dict(sorted(s.items())) for s in sends]


@dataclass(frozen=True)
class HaloPlan:
    """What one rank exchanges: ``recv[q]``, the local indices (on ``q``) of the rows it reads
    from ``q``, whose halo rows they fill in ascending ``q``; ``send[q]``, its own local rows that
    ``q`` reads."""

    rank: int
    recv: dict[int, Tensor]
    send: dict[int, Tensor]

    @property
    def halo_size(self) -> int:
        return sum(int(v.numel()) for v in self.recv.values())

    def send_index(self) -> Tensor:
        """Every row sent, peers ascending: what the backward adds the returned gradient to."""
        parts = list(self.send.values())
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)


def exchange_plan(recv: dict[int, Tensor], rank: int, world_size: int, group, device: torch.device) -> HaloPlan:
    """This rank's :class:`HaloPlan` from its receives, every rank of ``group`` calling it: the
    counts and then the indices go through ``all_to_all_single`` (on ``device``, the group's)."""
    counts = torch.zeros(world_size, dtype=torch.int64)
    for peer, rows in recv.items():
        counts[peer] = rows.numel()
    incoming = torch.empty(world_size, dtype=torch.int64, device=device)
    dist.all_to_all_single(incoming, counts.to(device), group=group)
    incoming = incoming.cpu()
    wanted = torch.cat([recv.get(q, torch.zeros(0, dtype=torch.int64)) for q in range(world_size)])
    asked = torch.empty(int(incoming.sum()), dtype=torch.int64, device=device)
    dist.all_to_all_single(asked, wanted.to(device), output_split_sizes=incoming.tolist(),
                           input_split_sizes=counts.tolist(), group=group)
    asked = asked.cpu()
    send, start = {}, 0
    for peer, count in enumerate(incoming.tolist()):
        if count:
            send[peer] = asked[start:start + count]
        start += count
    return HaloPlan(rank, dict(recv), send)


def _bounded(work, timeout: datetime.timedelta, poll_s: float = 2e-4) -> None:
    """``work.wait()`` once ``work`` is done on its device, polled from the host (no
    synchronization: an event query), raising ``TimeoutError`` when ``timeout`` passes first."""
    deadline = time.monotonic() + timeout.total_seconds()
    delay = poll_s / 8
    while not work.is_completed():
        if time.monotonic() > deadline:
            raise TimeoutError(f"not done after {timeout.total_seconds():g} s")
        time.sleep(delay)
        delay = min(delay * 2, poll_s)
    work.wait()


@dataclass
class _Pending:
    """An exchange in flight: its works with the peer each waits on, the one buffer the peers' rows
    arrive in (each peer's a slice of it, peers ascending; None where nothing comes), and the
    tensors the works use (kept alive until the wait)."""

    works: list
    peers: list[int]
    received: Tensor | None
    keep: list[Tensor]


class HaloExchange:
    """Moves rows between the ranks of ``group`` by ``plan``, through P2P operations on
    ``comm_device`` (the host for gloo, the rank's GPU for NCCL). ``timeout``: how long a wait
    may take (``None``: the group's own timeout)."""

    def __init__(self, plan: HaloPlan, group, comm_device: torch.device, device: torch.device,
                 timeout: datetime.timedelta | None, op: str):
        self.plan, self.group, self.comm_device, self.device, self.timeout, self.op = (
            plan, group, comm_device, device, timeout, op)
        self._send_index = plan.send_index().to(device)  # every row sent, peers ascending
        self._send_rows = {q: int(rows.numel()) for q, rows in plan.send.items() if rows.numel()}
        self._recv_rows = {q: int(rows.numel()) for q, rows in plan.recv.items() if rows.numel()}
        self._global = {q: q if group is None else dist.get_global_rank(group, q)
                        for q in set(plan.send) | set(plan.recv)}

    def _post(self, sends: Tensor, send_rows: dict[int, int], recv_rows: dict[int, int], width: tuple, dtype,
              what: str) -> _Pending:
        """Post the exchange: ``sends`` holds the rows for every peer of ``send_rows`` one after the
        other (peers ascending, each its count); the rows of ``recv_rows`` arrive the same way in one
        buffer. One allocation and no concatenation however many peers."""
        ops, peers, keep = [], [], []
        total = sum(recv_rows.values())
        received = torch.empty((total, *width), dtype=dtype, device=self.comm_device) if total else None
        start = 0
        for peer, rows in recv_rows.items():
            ops.append(dist.P2POp(dist.irecv, received[start:start + rows], self._global[peer], self.group))
            peers.append(peer)
            start += rows
        if send_rows:
            sends = sends.to(self.comm_device).contiguous()
            keep.append(sends)
        start = 0
        for peer, rows in send_rows.items():
            ops.append(dist.P2POp(dist.isend, sends[start:start + rows], self._global[peer], self.group))
            peers.append(peer)
            start += rows
        try:
            works = dist.batch_isend_irecv(ops) if ops else []
        except Exception as exc:  # noqa: BLE001 - NCCL raises here once it knows a peer is gone; named as a wait is
            raise self._failed(sorted(set(peers)), what, exc) from exc
        if len(works) != len(ops):  # coalesced (NCCL): one work for all, any peer may be the one
            peers = [sorted(set(peers))] * len(works)
        return _Pending(list(works), peers, received, keep)

    def _failed(self, peer, what: str, exc: Exception) -> "HaloExchangeError":
        """The error of an exchange with ``peer`` (a rank, or a list of ranks any of which may be the one)."""
        who = (f"rank {peer}" if isinstance(peer, int) else f"rank {peer[0]}" if len(peer) == 1
               else f"one of ranks {peer}")
        return HaloExchangeError(
            f"{self.op} (rank {self.plan.rank}): the {what} with {who} failed or did not finish "
            f"within {self.timeout or 'the group timeout'}: {who} exited, failed, or is not running "
            f"the same products in the same order ({type(exc).__name__}: {exc})")

    def wait(self, pending: _Pending, what: str) -> Tensor | None:
        """Wait for ``pending``'s works, each within the timeout; a failure names its peer. Returns
        the rows received (on this rank's device), or None where none were to come.

        Over NCCL (``comm_device`` a GPU) a work's ``wait`` only orders the current stream after
        it: the host does not wait, and a peer that left is found by NCCL's watchdog after the
        group's timeout, which ends the process. With a ``timeout`` the host therefore polls the
        work (:func:`_bounded`) until it is done or the timeout passed, so that a peer that left
        is named here; each exchange then costs the host a wait for it. Without one, nothing
        waits on the host."""
        for peer, work in zip(pending.peers, pending.works):
            try:
                if self.timeout is None:
                    work.wait()
                elif self.comm_device.type == "cuda":
                    _bounded(work, self.timeout)
                else:
                    work.wait(self.timeout)
            except Exception as exc:  # noqa: BLE001 - gloo and NCCL raise several types; re-raised naming the peer
                raise self._failed(peer, what, exc) from exc
        return None if pending.received is None else pending.received.to(self.device)

    def start_forward(self, X: Tensor) -> _Pending:
        """Send the rows of ``X`` (this rank's) that peers read, gathered by one ``index_select``;
        receive this rank's halo."""
        return self._post(X.index_select(0, self._send_index), self._send_rows, self._recv_rows, tuple(X.shape[1:]),
                          X.dtype, "halo exchange")

    def finish_forward(self, pending: _Pending, X: Tensor) -> Tensor:
        """The halo: the rows received, in the halo block's column order."""
        received = self.wait(pending, "halo exchange")
        return received if received is not None else X.new_zeros((0, *X.shape[1:]))

    def start_backward(self, grad_halo: Tensor) -> _Pending:
        """Send each owner the gradient of the halo rows it sent (the halo's rows are its peers',
        one after the other); receive the gradient of the rows this rank sent."""
        return self._post(grad_halo, self._recv_rows, self._send_rows, tuple(grad_halo.shape[1:]), grad_halo.dtype,
                          "gradient exchange")

    def finish_backward(self, pending: _Pending, grad_X: Tensor) -> Tensor:
        """``grad_X`` plus what the peers sent back for this rank's rows."""
        received = self.wait(pending, "gradient exchange")
        if received is None:
            return grad_X
        return grad_X.index_add(0, self._send_index, received)
