"""The index check of a CUDA pattern, run on its device without the host waiting for it.

Reading a verdict about device memory on the host is a device-to-host synchronization: the
host stops until the GPU has run everything queued before, so a training loop that builds a
matrix per mini-batch could never run ahead of its GPU. Instead, :class:`DeviceCheck` queues
the check on the caller's stream (a handful of reductions into five flags), a copy of the
flags into pinned host memory and an event, and the host reads the verdict only once the
event says it is there (:meth:`DeviceCheck.verdict`, a query that never blocks), or where it
waits for the device anyway (:meth:`DeviceCheck.wait`).

Until then nothing may read out of bounds and no result may pass for a right one, so the
same stream also makes the library's own copy of the indices harmless should the check
fail: every nonzero moved to the last row and column 0 (a valid CSR structure, whatever
reads it: a kernel, cuSPARSE, the transpose's sort), and :meth:`DeviceCheck.poison` fills
the outputs of the products that run in the meantime with NaN (in a CUDA graph capture, their
first element). The error itself is raised
by the first use of the pattern after the verdict arrived, naming the check that failed
(the exact entry too, where the caller's tensors are still as they were).
"""

from __future__ import annotations

import torch

from .validation import check_csr_values

_CHECKS = ("crow[0] must be 0", "crow[-1] must equal nnz = len(col) = {nnz}", "crow must be non-decreasing",
           "col must be >= 0", "col must be < ncols = {ncols}")


def defers(crow: torch.Tensor, col: torch.Tensor) -> bool:
    """Whether the check of these indices runs on their device without the host waiting (CUDA,
    at least one row). Elsewhere :func:`check_csr_values` checks them at once: on the host there
    is nothing to wait for, and a matrix without rows has no row to move bad nonzeros to."""
    return crow.is_cuda and crow.shape[0] > 1


def _record_event(device: torch.device):
    """An event recorded on ``device``'s current stream, or None off CUDA (nothing to wait for)."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


class DeviceCheck:
    """The check of one pattern's indices (``crow``, ``col``: the library's own copy, which it
    makes harmless in place should the check fail), queued on the current stream.

    ``op`` names the call that asked for it; ``source``: the tensors the caller handed over
    (held until the verdict, so that a failure can name the entry; dropped after), or None.
    """

    __slots__ = ("op", "shape", "nnz", "device", "_bad", "_host", "_event", "_failure", "_source", "_named")

    def __init__(self, op: str, crow: torch.Tensor, col: torch.Tensor, ncols: int, source=None,
                 in_graph: bool = False):
        # in_graph: queued inside a CUDA graph capture (:func:`in_graph`), where no verdict can
        # reach the host: every replay checks its indices again and only poisons its products
        self.op = op
        self.shape = (crow.shape[0] - 1, ncols)
        self.nnz = nnz = col.shape[0]
        self.device = col.device
        flags = _flags(crow, col, ncols)
        self._bad = bad = flags.any()
        # A failed check leaves a valid structure behind: all nonzeros in the last row, column 0.
        # Written through .data: the pattern's version counters must not move (a write they
        # count would make the copy a new, unchecked pattern).
        crow.data.masked_fill_(bad, 0)
        crow.data[-1:].masked_fill_(bad, nnz)
        if nnz:
            col.data.masked_fill_(bad, 0)
        if in_graph:
            host = None
        elif flags.is_cuda:
            host = torch.empty(flags.shape, dtype=flags.dtype, pin_memory=True)
            host.copy_(flags, non_blocking=True)
        else:
            host = flags
        self._host = host
        self._event = None if in_graph else _record_event(flags.device)
        self._failure: str | None = None
        self._source = source
        self._named: str | None = None  # the error naming the exact entry, once found

    def verdict(self, block: bool = False) -> bool | None:
        """True: the indices passed. False: they failed (:meth:`raise_failure` says why). None:
        the device has not run the check yet (only where ``block`` is false), or a CUDA graph is
        being captured on this thread, where the event may not be asked (``block`` then raises)."""
        if self._failure is not None:
            return False
        if self._host is None:  # checked inside a CUDA graph: its replays poison, nothing reports
            if block:
                raise RuntimeError(f"{self.op}: the indices of this matrix are checked inside a CUDA graph, "
                                   "whose replays report no verdict to the host")
            return None
        event = self._event
        if event is not None:
            if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                # a query or a wait would invalidate the capture: the captured products stay poisoned
                if block:
                    raise RuntimeError(f"{self.op}: the indices of this matrix were still being checked on "
                                       f"{self.device} when a CUDA graph capture needed them; run the step once "
                                       "before capturing it")
                return None
            if block:
                event.synchronize()
            elif not event.query():
                return None
            self._event = None
        failed = [name for name, flag in zip(_CHECKS, self._host.tolist()) if flag]
        if not failed:
            self._source = None
            return True
        self._failure = "; ".join(failed).format(nnz=self.nnz, ncols=self.shape[1])
        return False

    def wait(self) -> bool:
        """The verdict, waiting for the device where it is not there yet."""
        return self.verdict(block=True)

    def raise_failure(self) -> None:
        """Raise the ``ValueError`` of a failed check: the exact entry as :func:`check_csr_values`
        names it where the caller's tensors are still unchanged, else the checks that failed."""
        source, self._source = self._source, None
        if source is not None:
            crow, col, versions = source
            if (crow._version, col._version) == versions:
                try:
                    with _sync_allowed(crow):  # an error path: reading the exact entry may wait
                        check_csr_values(self.op, crow, col, self.shape[1])  # raises
                except ValueError as error:
                    self._named = str(error)  # every later use names it too, the tensors let go
                    raise
        if self._named is not None:
            raise ValueError(self._named)
        nrows, ncols = self.shape
        raise ValueError(f"{self.op}: {self._failure} (the indices of a {nrows} x {ncols} matrix with {self.nnz} "
                         f"nonzeros on {self.device}, checked there after the call returned)")

    def poison(self, out: torch.Tensor) -> torch.Tensor:
        """``out``, a product on these indices made before the verdict: NaN throughout should the
        check fail (queued on the stream, no wait). Inside a CUDA graph capture, for a check queued
        before it, only its first element: the fill is replayed with the graph, where a pass over
        the whole output on every replay would cost more than a check already decided is worth
        (and a NaN reaches the loss). A check made in the graph (:func:`in_graph`) poisons all."""
        if out.is_floating_point() and out.numel():
            if (self._host is not None and out.is_cuda and out.is_contiguous()
                    and torch.cuda.is_current_stream_capturing()):
                out.view(-1)[:1].masked_fill_(self._bad, float("nan"))
            else:
                out.masked_fill_(self._bad, float("nan"))
        return out


def in_graph(op: str, crow: torch.Tensor, col: torch.Tensor, ncols: int
             ) -> tuple[torch.Tensor, torch.Tensor, DeviceCheck]:
    """Indices first met inside a CUDA graph capture (the placeholders of a graph whose replays
    copy each step's indices in, as Inductor's CUDA graph trees do): copies of them made inside
    the graph, their check queued there too, and the copies made harmless should it fail.
    Every replay copies, checks and repairs again; the products on the copies poison their whole
    output with NaN where the check failed (:meth:`DeviceCheck.poison`), as no error can be
    raised from a replay. Returns ``(crow copy, col copy, check)``."""
    crow, col = crow.clone(), col.clone()
    return crow, col, DeviceCheck(op, crow, col, ncols, in_graph=True)


class _sync_allowed:
    """Lift :func:`torch.cuda.set_sync_debug_mode` for a block that must wait for the device."""

    def __init__(self, like: torch.Tensor):
        self._mode = torch.cuda.get_sync_debug_mode() if like.is_cuda else 0

    def __enter__(self):
        if self._mode:
            torch.cuda.set_sync_debug_mode(0)

    def __exit__(self, *exc):
        if self._mode:
            torch.cuda.set_sync_debug_mode(self._mode)


def _flags(crow: torch.Tensor, col: torch.Tensor, ncols: int) -> torch.Tensor:
    """The five checks of :data:`_CHECKS` as a bool tensor on the indices' device, no host read."""
    nnz = col.shape[0]
    monotone = (crow[1:] < crow[:-1]).any().reshape(1)
    ends = torch.stack([crow[0] != 0, crow[-1] != nnz])
    if nnz:
        low, high = torch.aminmax(col)
        columns = torch.stack([low < 0, high >= ncols])
    else:
        columns = torch.zeros(2, dtype=torch.bool, device=col.device)
    return torch.cat([ends, monotone, columns])
