"""``DistributedCSRMatrix``: a square sparse matrix whose rows, and the rows of the dense
operands it multiplies, are split over the ranks of a process group (:func:`distribute_csr`).

Each rank holds its rows as two :class:`~torch_sparserl.CSRMatrix` blocks (:mod:`.halo`): the
columns it owns and the halo, the columns other ranks own. ``D @ X_local`` (this rank's rows of
``X``) returns this rank's rows of ``A @ X``: the halo rows are sent and received while the local
block's product runs, then the halo block's product is added. The backward sends the halo's
gradient back to the rows' owners the same way. Both blocks are ordinary patterns to the JIT:
specialized, cached, and shared between ranks through one cache folder.

Every rank of the group must make the same products in the same order, and the same backward
passes (a rank whose ``X`` needs no gradient while the others' do leaves them waiting: they
fail within the timeout, naming it).
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import time

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor
from torch.autograd.function import once_differentiable

from ..dtypes import VALUE_DTYPES
from ..ops import sddmm, spmm_transposed
from ..tensor.construct import csr
from ..tensor.csr_matrix import CSRMatrix, indices_of, values_of
from .halo import HaloExchange, HaloPlan, exchange_plan, receives, split_block
from .partition import Partition, partition as make_partition

_OP = "torch_sparserl.distributed.distribute_csr"
_RECORD = ("rows", "columns", "nnz", "pattern hash", "values hash", "dtype", "partition world size",
           "partition hash")


def _digest(*arrays: np.ndarray) -> int:
    h = hashlib.blake2b(digest_size=8)
    for a in arrays:
        h.update(np.ascontiguousarray(a).tobytes())
    return int.from_bytes(h.digest(), "little") >> 1  # fits an int64


@contextlib.contextmanager
def _collective(step: str, rank: int, op: str = _OP):
    """A collective of ``op`` whose failure says which step, and why it may have failed (a
    collective cannot say which rank left)."""
    try:
        yield
    except (RuntimeError, dist.DistError) as exc:
        raise RuntimeError(f"{op} (rank {rank}): {step} failed: a rank exited, failed, timed out or did not "
                           f"call {op.rsplit('.', 1)[-1]} with the others ({type(exc).__name__}: {exc})") from exc


def _gather_records(record: list[int], rank: int, world: int, group, device: torch.device, op: str) -> Tensor:
    """Every rank's ``record`` (one row per rank, on the host)."""
    mine = torch.tensor(record, dtype=torch.int64, device=device)
    everyone = [torch.empty_like(mine) for _ in range(world)]
    with _collective("checking that the ranks hold the same matrix and partition", rank, op):
        dist.all_gather(everyone, mine, group=group)
    return torch.stack(everyone).cpu()


def _differing(rows: Tensor, names: tuple[str, ...]) -> list[str]:
    """Per field of ``names`` (the first columns of ``rows``), which ranks differ from rank 0."""
    problems = []
    for field, name in enumerate(names):
        differ = [r for r in range(rows.shape[0]) if rows[r, field] != rows[0, field]]
        if differ:
            problems.append(f"{name} (rank 0: {int(rows[0, field])}; ranks {differ}: "
                            f"{[int(rows[r, field]) for r in differ]})")
    return problems


def _agree(record: list[int], rank: int, world: int, group, device: torch.device) -> None:
    """All-gather every rank's ``record`` (:data:`_RECORD`) and raise naming the ranks whose
    record differs from rank 0's."""
    problems = _differing(_gather_records(record, rank, world, group, device, _OP), _RECORD)
    if problems:
        raise ValueError(f"{_OP} (rank {rank}): the ranks disagree on the matrix or its partition: every "
                         f"rank must pass the same A and partition; they differ in {'; '.join(problems)}")


class _Product(torch.autograd.Function):
    """``D @ X`` for this rank's rows; the backward returns the halo's gradient to its owners."""

    @staticmethod
    def forward(ctx, D: "DistributedCSRMatrix", X: Tensor, val_local, val_halo):
        local = D.local if val_local is None else D.local.with_values(val_local.detach())
        halo_matrix = D.halo if val_halo is None or D.halo is None else D.halo.with_values(val_halo.detach())
        started = time.perf_counter()
        if D.overlaps("forward", X):
            pending = D.exchange.start_forward(X)
            out = local @ X  # while the halo is on its way
        else:
            out = local @ X
            pending = D.exchange.start_forward(X)
        computed = time.perf_counter()
        halo = D.exchange.finish_forward(pending, X)
        waited = time.perf_counter()
        if halo_matrix is not None:
            out = out + halo_matrix @ halo
        D.stats["compute_s"] += computed - started + time.perf_counter() - waited
        D.stats["wait_s"] += waited - computed
        D.stats["products"] += 1
        ctx.D, ctx.matrices = D, (local, halo_matrix)
        ctx.save_for_backward(X if val_local is not None else None, halo if val_halo is not None else None)
        return out

    @staticmethod
    @once_differentiable  # the exchange itself is not differentiable: a second backward raises, naming it
    def backward(ctx, G: Tensor):
        D, (local, halo_matrix) = ctx.D, ctx.matrices
        X, halo = ctx.saved_tensors
        G = G.contiguous()
        started = time.perf_counter()
        if halo_matrix is not None:
            crow, col = indices_of(halo_matrix, "DistributedCSRMatrix backward")
            grad_halo = spmm_transposed(crow, col, halo_matrix.val, halo_matrix.shape[1], G)
        else:
            grad_halo = G.new_zeros((0, G.shape[1]))
        overlaps = D.overlaps("backward", G)
        if overlaps:
            pending = D.exchange.start_backward(grad_halo)
        crow, col = indices_of(local, "DistributedCSRMatrix backward")
        grad_X = spmm_transposed(crow, col, local.val, local.shape[1], G)  # while the halo's gradient travels
        grad_val_local = sddmm(crow, col, G, X) if X is not None else None
        if not overlaps:
            pending = D.exchange.start_backward(grad_halo)
        grad_val_halo = None
        if halo is not None and halo_matrix is not None:
            crow, col = indices_of(halo_matrix, "DistributedCSRMatrix backward")
            grad_val_halo = sddmm(crow, col, G, halo)
        computed = time.perf_counter()
        grad_X = D.exchange.finish_backward(pending, grad_X)
        D.stats["wait_s"] += time.perf_counter() - computed
        D.stats["compute_s"] += computed - started
        return None, grad_X, grad_val_local, grad_val_halo


class DistributedCSRMatrix:
    """This rank's rows of an ``n x n`` sparse matrix partitioned over a process group (built by
    :func:`distribute_csr`). ``D @ X_local`` takes this rank's rows of ``X``
    (:meth:`shard_rows`) and returns this rank's rows of ``A @ X``, differentiable in
    ``X_local`` and in ``A``'s values where they require grad.

    Attributes: ``shape`` (the whole matrix's), ``partition``, ``rank``, ``local`` and ``halo``
    (the two :class:`~torch_sparserl.CSRMatrix` blocks; ``halo`` is None when no column is
    remote), ``plan`` (the :class:`~.halo.HaloPlan`), ``stats`` (seconds spent computing and
    waiting for the exchange, and the number of products)."""

    def __init__(self, *, partition: Partition, rank: int, local: CSRMatrix, halo: CSRMatrix | None,
                 exchange: HaloExchange, group, source: CSRMatrix | None, positions: tuple[Tensor, Tensor]):
        self.partition, self.rank, self.local, self.halo, self.exchange, self.group = (
            partition, rank, local, halo, exchange, group)
        self.plan: HaloPlan = exchange.plan
        self.shape = torch.Size((partition.n, partition.n))
        self._source, self._positions = source, positions
        self.stats = {"compute_s": 0.0, "wait_s": 0.0, "products": 0}
        self._overlapped: set[tuple] = set()

    def overlaps(self, direction: str, X: Tensor) -> bool:
        """Whether this product's local work runs while its exchange travels: from the second
        product of a direction (on a device) on. The first runs it before posting the exchange: its
        kernels (cuSPARSE's, torch's) load lazily on first use (CUDA's default module loading),
        and a load waits for the kernels running on the device, which, over NCCL, include the
        exchange's; should a peer have left, that one never ends and the rank would hang before
        its timeout could name the peer."""
        key = (direction, X.dtype, X.device)
        if key in self._overlapped:
            return True
        self._overlapped.add(key)
        return False

    @property
    def device(self) -> torch.device:
        return self.local.device

    @property
    def dtype(self) -> torch.dtype:
        return self.local.dtype

    @property
    def local_rows(self) -> int:
        return self.local.shape[0]

    def __repr__(self) -> str:
        return (f"DistributedCSRMatrix(shape={tuple(self.shape)}, rank={self.rank}/{self.partition.world_size}, "
                f"local_rows={self.local_rows}, local_nnz={self.local.nnz}, "
                f"halo_nnz={0 if self.halo is None else self.halo.nnz}, halo_rows={self.plan.halo_size}, "
                f"order={self.partition.order!r}, dtype={self.dtype}, device={self.device})")

    def halo_bytes(self, columns: int, dtype: torch.dtype | None = None) -> dict[str, int]:
        """Bytes this rank sends and receives in one product with ``columns`` columns."""
        size = torch.empty((), dtype=dtype or self.dtype).element_size() * columns
        return {"sent": size * sum(int(v.numel()) for v in self.plan.send.values()),
                "received": size * self.plan.halo_size}

    def shard_rows(self, X: Tensor) -> Tensor:
        """This rank's rows of ``X`` (all ``n`` rows, the original order), on its device."""
        return self.partition.shard_rows(X, self.rank).to(self.device)

    def gather_rows(self, Y_local: Tensor) -> Tensor:
        """Every rank's rows (``Y_local``: this rank's, of any dtype), as one tensor in the
        original order, on every rank (a collective: every rank calls it). Not differentiable."""
        self._check_operand("DistributedCSRMatrix.gather_rows", "Y_local", Y_local, any_dtype=True)
        most = max(self.partition.size_of(r) for r in range(self.partition.world_size))
        comm = self.exchange.comm_device
        padded = Y_local.detach().new_zeros((most, *Y_local.shape[1:]), device=comm)
        padded[:Y_local.shape[0]] = Y_local.detach().to(comm)
        everyone = [torch.empty_like(padded) for _ in range(self.partition.world_size)]
        dist.all_gather(everyone, padded, group=self.group)
        blocks = [t[:self.partition.size_of(r)] for r, t in enumerate(everyone)]
        return self.partition.gather_rows(blocks).to(self.device)

    def _check_operand(self, op: str, name: str, X, any_dtype: bool = False) -> None:
        if not isinstance(X, Tensor) or isinstance(X, CSRMatrix) or X.layout != torch.strided:
            raise TypeError(f"{op}: {name} must be a dense tensor (got {type(X).__name__})")
        if X.dim() not in (1, 2) or X.shape[0] != self.local_rows:
            raise ValueError(f"{op}: {name} must have {self.local_rows} rows, rank {self.rank}'s rows of the "
                             f"partition (shard_rows gives them), and 1 or 2 dimensions (got shape {tuple(X.shape)})")
        if X.dtype != self.dtype and not any_dtype:
            raise TypeError(f"{op}: {name} must have the matrix's dtype {self.dtype} (got {X.dtype})")
        if X.device != self.device:
            raise ValueError(f"{op}: {name} must be on the matrix's device {self.device} (got {X.device})")

    def matmul(self, X_local: Tensor) -> Tensor:
        """This rank's rows of ``A @ X``, from its rows ``X_local`` of ``X``."""
        self._check_operand("DistributedCSRMatrix.matmul", "X_local", X_local)
        vector = X_local.dim() == 1
        X = X_local.unsqueeze(1) if vector else X_local
        val_local = val_halo = None
        if self._source is not None:  # values that may have changed since (an optimizer's step): read them now
            values = values_of(self._source)
            val_local = values.index_select(0, self._positions[0].to(values.device)).to(self.device)
            if self.halo is not None:
                val_halo = values.index_select(0, self._positions[1].to(values.device)).to(self.device)
        out = _Product.apply(self, X.contiguous(), val_local, val_halo)
        return out.squeeze(1) if vector else out

    __matmul__ = matmul

    @classmethod
    def from_local(cls, rows, partition: Partition, *, group=None, device=None,
                   timeout: datetime.timedelta | float | None = None) -> "DistributedCSRMatrix":
        """This rank's matrix from its own rows alone (as ``DTensor.from_local`` builds a
        distributed tensor from each rank's shard): ``rows`` (anything
        :func:`torch_sparserl.csr` takes) holds the ``partition.size_of(rank)`` rows
        ``partition.rows_of(rank)``, in that order, with all ``partition.n`` columns in the
        original numbering. No rank reads another's rows; every rank of ``group`` calls it with
        the same ``partition``. ``device`` and ``timeout`` as :func:`distribute_csr`; gradients
        of ``rows``' values land on this rank's ``rows``.

        The ranks all-gather, per rank, the partition's hash and world size, the dtype, the row
        and column counts and the largest column, and raise a ``ValueError`` on every rank naming
        the ranks whose partition or dtype differ from rank 0's, or whose rows are not the
        partition's count or whose columns are not ``partition.n``."""
        op = "torch_sparserl.distributed.DistributedCSRMatrix.from_local"
        timeout, rank, world, backend, comm_device = _joined(op, group, timeout)
        if not isinstance(partition, Partition):
            raise TypeError(f"{op}: partition must be a Partition (got {type(partition).__name__})")
        if not isinstance(rows, CSRMatrix):
            rows = csr(rows)
        if rows.dtype not in VALUE_DTYPES:
            raise TypeError(f"{op}: rows' values must be one of {VALUE_DTYPES} (got {rows.dtype})")
        crow_t, col_t = indices_of(rows, op)
        crow, col = crow_t.cpu().numpy().astype(np.int64), col_t.cpu().numpy().astype(np.int64)
        largest = int(col.max()) if col.size else -1
        record = [partition.world_size, partition.digest(), VALUE_DTYPES.index(rows.dtype), rows.shape[0],
                  rows.shape[1], largest]
        everyone = _gather_records(record, rank, world, group, comm_device, op)
        other_world = [q for q in range(world) if everyone[q, 0] != world]
        problems = [f"ranks {other_world} passed a partition for {[int(everyone[q, 0]) for q in other_world]} "
                    f"ranks, the group has {world}"] if other_world else []
        problems += _differing(everyone[:, 1:3], ("partition hash", "dtype"))
        if not problems:  # the same partition everywhere: each rank's share is known
            for q in range(world):
                got_rows, got_cols, got_largest = (int(v) for v in everyone[q, 3:])
                if got_rows != partition.size_of(q):
                    problems.append(f"rank {q} passed {got_rows} rows, the partition gives it {partition.size_of(q)}")
                if got_cols != partition.n or got_largest >= partition.n:
                    problems.append(f"rank {q} passed {got_cols} columns (largest index {got_largest}), the "
                                    f"partition's matrix has {partition.n}")
        if problems:
            raise ValueError(f"{op} (rank {rank}): every rank must pass the same partition and its own "
                             f"rows of the {partition.n} x {partition.n} matrix with all its columns; "
                             f"{'; '.join(problems)}")
        device = torch.device(device) if device is not None else (comm_device if backend == "nccl" else rows.device)
        return _build(crow, col, values_of(rows), partition, rank, group, device, comm_device, timeout,
                      source=rows if rows.requires_grad else None, own_rows=True, op=op)


def _group_device(group, backend: str) -> torch.device:
    """Where the group's collectives take their tensors: the rank's current GPU for NCCL, else
    the host."""
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _joined(op: str, group, timeout):
    """The checked ``timeout`` (a timedelta or None), this process's rank and the group's size,
    backend and collective device; raises, naming ``op``, without a process group."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(f"{op}: torch.distributed's default process group is not initialized; call "
                           "torch.distributed.init_process_group(backend) on every rank first")
    if isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        timeout = datetime.timedelta(seconds=timeout)
    if timeout is not None and (not isinstance(timeout, datetime.timedelta) or timeout.total_seconds() <= 0):
        raise ValueError(f"{op}: timeout must be a positive timedelta or number of seconds (got {timeout!r})")
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if rank < 0:
        raise ValueError(f"{op}: this process is not a member of the group it was given")
    backend = dist.get_backend(group)
    return timeout, rank, world, backend, _group_device(group, backend)


def _block_matrix(crow: Tensor, col: Tensor, values: Tensor, shape: tuple, device) -> CSRMatrix:
    index_dtype = torch.int32 if max(col.numel(), shape[1]) < 2**31 else torch.int64
    return csr((crow, col, values), shape, index_dtype=index_dtype, device=device)


def distribute_csr(A, partition: Partition | None = None, *, group=None, device=None, order: str = "rows",
                   timeout: datetime.timedelta | float | None = None) -> DistributedCSRMatrix:
    """This rank's :class:`DistributedCSRMatrix` of the square matrix ``A`` (anything
    :func:`torch_sparserl.csr` takes; every rank passes the same), every rank of ``group`` (the
    default group when None) calling it.

    ``partition`` splits the rows (default: :func:`~.partition.partition` of ``A`` in ``order``
    over the group's ranks). ``device``: where this rank's blocks and operands live (default: its
    current GPU under NCCL, else ``A``'s device). ``timeout`` (a timedelta or seconds) bounds every
    wait for a peer's rows; None leaves it to the group's own timeout. Over NCCL a timeout makes
    the host wait for each exchange (polling it, so that a peer that left is named within the
    timeout); without one the host never waits, and NCCL's watchdog ends the process once the
    group's timeout passes.

    The ranks check that they agree (shape, pattern, values, dtype, partition) and raise a
    ``ValueError`` naming those that differ; then each builds its blocks and they exchange which
    rows each needs from which (once: every product reuses the plan)."""
    timeout, rank, world, backend, comm_device = _joined(_OP, group, timeout)
    if not isinstance(A, CSRMatrix):
        A = csr(A)
    if A.dtype not in VALUE_DTYPES:
        raise TypeError(f"{_OP}: A's values must be one of {VALUE_DTYPES} (got {A.dtype})")
    n = A.shape[0]
    if A.shape[0] != A.shape[1]:
        raise ValueError(f"{_OP}: A must be square, its columns split as its rows (got shape {tuple(A.shape)})")
    if partition is None:
        partition = make_partition(A, world, order=order)
    elif not isinstance(partition, Partition):
        raise TypeError(f"{_OP}: partition must be a Partition (got {type(partition).__name__})")
    if partition.world_size != world or partition.n != n:
        raise ValueError(f"{_OP}: the partition splits {partition.n} rows over {partition.world_size} ranks; "
                         f"A has {n} rows and the group {world} ranks")
    device = torch.device(device) if device is not None else (comm_device if backend == "nccl" else A.device)
    crow_t, col_t = indices_of(A, _OP)
    crow, col = crow_t.cpu().numpy().astype(np.int64), col_t.cpu().numpy().astype(np.int64)
    values = values_of(A)
    dtype_code = VALUE_DTYPES.index(A.dtype)
    value_bytes = values.detach().cpu().contiguous().view(torch.uint8).numpy()  # any dtype, bfloat16 included
    record = [n, A.shape[1], col.shape[0], _digest(crow, col), _digest(value_bytes), dtype_code,
              partition.world_size, partition.digest()]
    _agree(record, rank, world, group, comm_device)

    return _build(crow, col, values, partition, rank, group, device, comm_device, timeout,
                  source=A if A.requires_grad else None, own_rows=False, op=_OP)


def _build(crow: np.ndarray, col: np.ndarray, values: Tensor, partition: Partition, rank: int, group, device,
           comm_device, timeout, *, source: CSRMatrix | None, own_rows: bool, op: str) -> DistributedCSRMatrix:
    """This rank's blocks of ``(crow, col, values)`` (the whole matrix, or with ``own_rows`` this
    rank's rows alone) and the exchange plan agreed with the other ranks (a collective)."""
    world = partition.world_size
    block = split_block(crow, col, partition, rank, own_rows=own_rows)
    rows = block.rows
    local = _block_matrix(block.local_crow, block.local_col, values.detach()[block.local_positions.to(values.device)],
                          (rows, rows), device)
    halo = None
    if block.halo_columns.numel():
        halo = _block_matrix(block.halo_crow, block.halo_col, values.detach()[block.halo_positions.to(values.device)],
                             (rows, block.halo_columns.numel()), device)
    with _collective("exchanging which rows each rank reads from the others", rank, op):
        plan = exchange_plan(receives(block.halo_columns, partition), rank, world, group, comm_device)
    exchange = HaloExchange(plan, group, comm_device, device, timeout, "DistributedCSRMatrix.matmul")
    return DistributedCSRMatrix(partition=partition, rank=rank, local=local, halo=halo, exchange=exchange, group=group,
                                source=source, positions=(block.local_positions, block.halo_positions))
