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

Each of those torch operations costs the host a dispatch and a launch, so where a later stage has
registered a fused kernel (:func:`register_fused`: :mod:`torch_sparserl.toolchain.intake`), one
launch of it does the copy, the check, the repair and the verdict's transfer
(:func:`copy_checked`): the verdict lands in a slot of pinned host memory (:class:`SlotPool`)
that the host reads without any CUDA call, and no event is needed. Where the C++ library is loaded
(:func:`register_door`), ``ts.csr`` of a caller's CUDA indices makes the copies and the launch in
one call of it (:func:`intake`). Until the kernel is built,
and wherever it cannot serve (CPU tensors, other index dtypes, another device than the current
one, a launch the driver refuses), the torch operations above serve.
"""

from __future__ import annotations

import threading
import weakref

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

    __slots__ = ("op", "shape", "nnz", "device", "_bad", "_host", "_event", "_failure", "_source", "_named",
                 "_in_graph", "_scratch", "_pool", "_slot", "_bits", "_stream", "__weakref__")

    def __init__(self, op: str, crow: torch.Tensor, col: torch.Tensor, ncols: int, source=None,
                 in_graph: bool = False):
        # in_graph: queued inside a CUDA graph capture (:func:`in_graph`), where no verdict can
        # reach the host: every replay checks its indices again and only poisons its products
        self._common(op, crow, col, ncols, source, in_graph)
        nnz = self.nnz
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

    def _common(self, op, crow, col, ncols, source, in_graph) -> None:
        self.op = op
        self.shape = (crow.shape[0] - 1, ncols)
        self.nnz = col.shape[0]
        self.device = col.device
        self._in_graph = in_graph
        self._failure: str | None = None
        self._source = source
        self._named: str | None = None  # the error naming the exact entry, once found
        # the fused kernel's (copy_checked): its device words (result: bad, bits), the slot of
        # pinned host memory its verdict comes to, the bits once read, the stream it ran on
        self._scratch = self._pool = self._slot = self._bits = self._stream = None

    @classmethod
    def _fused(cls, op, crow, col, ncols, source, in_graph, scratch) -> "DeviceCheck":
        """The check the fused kernel runs (:func:`copy_checked`): its verdict comes to a pinned
        slot (given by :meth:`SlotPool.acquire`), its bad flag for :meth:`poison` is ``scratch``'s
        first word, made a bool mask only where a product needs it."""
        check = cls.__new__(cls)
        check._common(op, crow, col, ncols, source, in_graph)
        check._bad = check._host = check._event = None
        check._scratch = scratch
        return check

    def verdict(self, block: bool = False) -> bool | None:
        """True: the indices passed. False: they failed (:meth:`raise_failure` says why). None:
        the device has not run the check yet (only where ``block`` is false), or a CUDA graph is
        being captured on this thread, where the event may not be asked (``block`` then raises)."""
        if self._failure is not None:
            return False
        if self._in_graph:  # checked inside a CUDA graph: its replays poison, nothing reports
            if block:
                raise RuntimeError(f"{self.op}: the indices of this matrix are checked inside a CUDA graph, "
                                   "whose replays report no verdict to the host")
            return None
        if self._scratch is not None:
            return self._fused_verdict(block)
        event = self._event
        if event is not None:
            if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                # a query or a wait would invalidate the capture: the captured products stay poisoned
                self._capturing(block)
                return None
            if block:
                event.synchronize()
            elif not event.query():
                return None
            self._event = None
        return self._decided(self._host.tolist())

    def _capturing(self, block: bool) -> None:
        # a wait would invalidate the capture: the captured products stay poisoned
        if block:
            raise RuntimeError(f"{self.op}: the indices of this matrix were still being checked on "
                               f"{self.device} when a CUDA graph capture needed them; run the step once "
                               "before capturing it")

    def _fused_verdict(self, block: bool) -> bool | None:
        """The verdict from the pinned slot: read without any CUDA call, so at any time, a capture
        included (where a failure is left for after it); waiting, where ``block``, for an event
        recorded on the kernel's stream."""
        bits = self._bits if self._slot is None else self._pool.take(self)
        if bits is None:
            if not block:
                return None
            if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                self._capturing(block)
            _wait_stream(self._stream, self.device)
            bits = self._bits if self._slot is None else self._pool.take(self)
            if bits is None:
                raise RuntimeError(f"{self.op}: the fused index check on {self.device} ran but left no verdict "
                                   "(an internal error)")
        if bits and self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None  # naming the failed entry reads the device: after the capture; its products stay poisoned
        return self._decided([bits >> k & 1 for k in range(len(_CHECKS))])

    def _decided(self, flags) -> bool:
        failed = [name for name, flag in zip(_CHECKS, flags) if flag]
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
            bad = self._bad
            if bad is None:  # the fused kernel's: its first scratch word (0 or 1) seen as a bool, no kernel
                bad = self._bad = self._scratch.view(torch.uint8)[:1].view(torch.bool)
            if (not self._in_graph and out.is_cuda and out.is_contiguous()
                    and torch.cuda.is_current_stream_capturing()):
                out.view(-1)[:1].masked_fill_(bad, float("nan"))
            else:
                out.masked_fill_(bad, float("nan"))
        return out


def in_graph(op: str, crow: torch.Tensor, col: torch.Tensor, ncols: int
             ) -> tuple[torch.Tensor, torch.Tensor, DeviceCheck]:
    """Indices first met inside a CUDA graph capture (the placeholders of a graph whose replays
    copy each step's indices in, as Inductor's CUDA graph trees do): copies of them made inside
    the graph, their check queued there too, and the copies made harmless should it fail.
    Every replay copies, checks and repairs again; the products on the copies poison their whole
    output with NaN where the check failed (:meth:`DeviceCheck.poison`), as no error can be
    raised from a replay. Returns ``(crow copy, col copy, check)``."""
    return copy_checked(op, crow, col, ncols, in_graph=True)


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


class SlotPool:
    """Slots of pinned host memory that the fused kernel writes its verdicts into, two int32 words
    each (the check's bits, then a done marker), with two device work words per slot (the
    kernel's flags and its count of blocks done, zero between launches).

    A slot goes back to the pool only once its done marker was seen: by :meth:`take` (the check
    read its verdict) or by a reclaim when the pool runs dry, which hands the bits to the check if
    it still lives (one dropped before its verdict leaves its slot out until the marker shows).
    Grown a chunk at a time, never shrunk (a slot may be written until its kernel ran); None from
    :meth:`acquire` past ``max_chunks`` with nothing to reclaim. Thread-safe.

    ``allocate(words)`` -> ``(host array, device address of the host memory, device address of
    ``words`` zeroed device words, the memory to keep alive, fence)``: ``fence()`` orders the
    caller's stream after the zeroing of the device words and says whether it is known done (the
    pool then stops asking); None where they are zero already.
    """

    def __init__(self, allocate, chunk_slots: int = 1024, max_chunks: int = 256):
        self._allocate = allocate
        self.chunk_slots = chunk_slots
        self.max_chunks = max_chunks
        self._lock = threading.Lock()
        self._chunks: list[tuple] = []  # (host array, host slot addresses, device work addresses, kept)
        self._fences: list = []  # per chunk: what orders a launch after its words' zeroing, None once done
        self._free: list[int] = []
        self._out: dict[int, weakref.ref] = {}  # slot -> its check, until the marker was seen

    @property
    def slots(self) -> int:
        """Slots made so far (free and out)."""
        return len(self._chunks) * self.chunk_slots

    @property
    def out(self) -> int:
        """Slots whose marker has not been seen yet."""
        return len(self._out)

    def acquire(self, check: DeviceCheck) -> tuple[int, int] | None:
        """``(host slot address for the kernel, device work address)`` for ``check``, its marker
        zeroed; None where the pool is full."""
        with self._lock:
            if not self._free:
                reclaimed = self._reclaim()
                if reclaimed < max(1, self.chunk_slots // 4) and len(self._chunks) < self.max_chunks:
                    self._grow()
                if not self._free:
                    return None
            slot = self._free.pop()
            chunk = slot // self.chunk_slots
            host, host_at, work_at, _ = self._chunks[chunk]
            fence = self._fences[chunk]
            if fence is not None and fence():
                self._fences[chunk] = None
            i = slot % self.chunk_slots
            host[2 * i] = host[2 * i + 1] = 0
            self._out[slot] = weakref.ref(check)
            check._pool, check._slot = self, slot
            return host_at + 8 * i, work_at + 8 * i

    def take(self, check: DeviceCheck) -> int | None:
        """``check``'s bits where its kernel wrote them (its slot then goes back), else None."""
        with self._lock:
            slot = check._slot
            if slot is None:  # reclaimed: the bits were handed over
                return check._bits
            bits = self._read(slot)
            if bits is not None:
                self._release(slot, check, bits)
            return bits

    def take_back(self, check: DeviceCheck) -> None:
        """Return ``check``'s slot, which no kernel will write (its launch was refused)."""
        with self._lock:
            slot = check._slot
            if slot is not None and slot in self._out:
                del self._out[slot]
                self._free.append(slot)
            check._slot = check._pool = None

    def _read(self, slot: int) -> int | None:
        host = self._chunks[slot // self.chunk_slots][0]
        i = slot % self.chunk_slots
        if not host[2 * i + 1]:  # the marker, written after the bits
            return None
        return int(host[2 * i])

    def _release(self, slot: int, check: DeviceCheck | None, bits: int) -> None:
        if check is not None:
            check._bits, check._slot = bits, None
        del self._out[slot]
        self._free.append(slot)

    def _reclaim(self) -> int:
        done = 0
        for slot, ref in list(self._out.items()):
            bits = self._read(slot)
            if bits is not None:
                check = ref()
                self._release(slot, check if check is not None and check._slot == slot else None, bits)
                done += 1
        return done

    def _grow(self) -> None:
        try:
            host, host_at, work_at, kept, fence = self._allocate(2 * self.chunk_slots)
        except Exception:  # noqa: BLE001 - no more pinned memory: the torch way serves
            self.max_chunks = len(self._chunks)
            return
        first = len(self._chunks) * self.chunk_slots
        self._chunks.append((host, host_at, work_at, kept))
        self._fences.append(fence)
        self._free.extend(range(first + self.chunk_slots - 1, first - 1, -1))


_FUSED = None  # the registered provider of the fused kernel (register_fused)
_POOLS: dict[int, SlotPool] = {}
_POOLS_LOCK = threading.Lock()
FUSED_LAUNCHES = [0]  # launches of the fused kernel in this process (tests, benchmarks)


def register_fused(provider) -> None:
    """Register the fused intake kernel: ``provider.launcher(device_index)`` returns a launcher or
    None (not built yet: the provider builds it meanwhile, never blocking), ``provider.mapped(
    host_address)`` the device address of pinned host memory. A launcher is called as
    :func:`_fused_copy_checked` does; for :func:`intake` it also has ``function(dtype)`` (the
    kernel's ``CUfunction`` address for that index dtype, or None) and ``geometry`` (threads per
    block, indices per thread, most blocks). None unregisters."""
    global _FUSED
    _FUSED = provider


_DOOR = None  # the C++ library's intake() (register_door)


def register_door(door) -> None:
    """Register the C++ library's ``intake(crow, col, val, nrows, ncols, function, host, work,
    block, per_thread, max_grid) -> (crow copy, col copy, result words, stream) | None``: the
    metadata checks, the allocations and the fused kernel's launch of :func:`intake` in one call
    (``csrc/fastpath/intake.h``). None unregisters."""
    global _DOOR
    _DOOR = door


def intake(op: str, crow: torch.Tensor, col: torch.Tensor, val: torch.Tensor | None, nrows: int, ncols: int,
           source=None) -> tuple[torch.Tensor, torch.Tensor, DeviceCheck] | None:
    """``ts.csr``'s intake of a caller's CUDA indices by one call of the C++ library (:func:`register_door`):
    the metadata of ``crow``, ``col`` and ``val`` (where given) checked as ``ts.csr``'s Python path
    checks it, the library's copies allocated and the fused kernel launched on the current stream,
    its verdict coming to a pinned slot as :func:`copy_checked`'s. Returns ``(crow', col', check)``;
    None where the library, the kernel or a slot is not there, or the library declines (metadata
    that fails a check among the reasons): nothing was queued then, and the caller's Python path
    checks, names what is wrong and copies. ``source``: as :class:`DeviceCheck`'s."""
    door = _DOOR
    if door is None:
        return None
    launcher = _fusable(crow, col)
    if launcher is None:
        return None
    function = launcher.function(crow.dtype)
    if function is None:
        return None
    check = DeviceCheck._fused(op, crow, col, ncols, source, False, None)
    pool = _pool(crow.device.index, _FUSED)
    found = pool.acquire(check)
    if found is None:
        return None
    made = door(crow, col, val, nrows, ncols, function, found[0], found[1], *launcher.geometry)
    if made is None:
        pool.take_back(check)
        return None
    crow_copy, col_copy, check._scratch, check._stream = made
    FUSED_LAUNCHES[0] += 1
    return crow_copy, col_copy, check


def _pool(index: int, provider) -> SlotPool:
    pool = _POOLS.get(index)
    if pool is None:
        def allocate(words: int):
            host = torch.zeros(words, dtype=torch.int32, pin_memory=True)
            work = torch.zeros(words, dtype=torch.int32, device=torch.device("cuda", index))
            zeroed = torch.cuda.Event()
            zeroed.record()  # the zeroing runs on this stream: a launch on another one waits for it

            def fence() -> bool:
                if zeroed.query():
                    return True
                torch.cuda.current_stream(index).wait_event(zeroed)
                return False

            return host.numpy(), provider.mapped(host.data_ptr()), work.data_ptr(), (host, work), fence

        with _POOLS_LOCK:
            pool = _POOLS.setdefault(index, SlotPool(allocate))
    return pool


def _fusable(crow: torch.Tensor, col: torch.Tensor):
    """The launcher that may serve these indices, or None: CUDA indices of one dtype, int32 or
    int64, contiguous, at least one row, on the current device, the kernel built."""
    provider = _FUSED
    if provider is None or not crow.is_cuda or crow.dtype != col.dtype or crow.dtype not in _INDEX_DTYPES:
        return None
    if crow.dim() != 1 or col.dim() != 1 or crow.shape[0] < 2 or col.device != crow.device:
        return None
    if not (crow.is_contiguous() and col.is_contiguous()):
        return None
    index = crow.device.index
    if index != torch.cuda.current_device():
        return None
    return provider.launcher(index)


_INDEX_DTYPES = (torch.int32, torch.int64)


def _raw_stream(index: int) -> int:
    try:
        return torch._C._cuda_getCurrentRawStream(index)
    except AttributeError:  # not in this torch: the public way
        return torch.cuda.current_stream(index).cuda_stream


def _wait_stream(stream: int, device: torch.device) -> None:
    """Wait for what is queued on the raw CUDA ``stream`` now (through an event: a stream's own
    synchronization counts as one for ``torch.cuda.set_sync_debug_mode``, as an event's wait has
    never done here)."""
    event = torch.cuda.Event()
    event.record(torch.cuda.default_stream(device) if stream == 0 else torch.cuda.ExternalStream(stream, device=device))
    event.synchronize()


def copy_checked(op: str, crow: torch.Tensor, col: torch.Tensor, ncols: int, source=None, in_graph: bool = False,
                 copy: bool = True) -> tuple[torch.Tensor, torch.Tensor, DeviceCheck]:
    """``(crow', col', check)``: copies of ``crow`` and ``col`` (``copy``; else the tensors
    themselves, the library's own) and their :class:`DeviceCheck`, queued on the current stream,
    the copies made harmless should it fail. The copies are ordinary contiguous tensors (with a
    version counter, under ``inference_mode`` too) of the indices' dtype. One launch of the fused
    kernel where it can serve (:func:`register_fused`), else torch operations. ``in_graph``: queued
    inside a CUDA graph capture, checked on each replay (:func:`in_graph`)."""
    launcher = _fusable(crow, col)
    if launcher is not None:
        made = _fused_copy_checked(launcher, op, crow, col, ncols, source, in_graph, copy)
        if made is not None:
            return made
    if copy:
        with torch.inference_mode(False):
            crow, col = crow.clone(memory_format=torch.contiguous_format), col.clone(
                memory_format=torch.contiguous_format)
    return crow, col, DeviceCheck(op, crow, col, ncols, source, in_graph)


def _fused_copy_checked(launcher, op, crow, col, ncols, source, in_graph, copy):
    """:func:`copy_checked` by one launch of the fused kernel; None where it cannot serve (the pool
    is full, the driver refused the launch): nothing was queued then."""
    if torch.is_inference_mode_enabled():  # what the library keeps must be ordinary tensors
        with torch.inference_mode(False):
            return _fused_copy_checked(launcher, op, crow, col, ncols, source, in_graph, copy)
    device = crow.device
    index = device.index
    if in_graph:  # the graph's own words (result, then work), zeroed by each replay
        scratch = torch.zeros(4, dtype=torch.int32, device=device)
    else:  # result words only: the work words are the slot's
        scratch = torch.empty(2, dtype=torch.int32, device=device)
    if copy:
        crow_dst, col_dst = torch.empty_like(crow), torch.empty_like(col)
    else:
        crow_dst, col_dst = crow, col
    check = DeviceCheck._fused(op, crow, col, ncols, source, in_graph, scratch)
    scratch_at = scratch.data_ptr()
    if in_graph:
        host_at, work_at = 0, scratch_at + 8
    else:
        pool = _pool(index, _FUSED)
        found = pool.acquire(check)
        if found is None:
            return None
        host_at, work_at = found
    stream = _raw_stream(index)
    if not launcher(crow.dtype, crow.data_ptr(), col.data_ptr(), crow_dst.data_ptr(), col_dst.data_ptr(),
                    crow.shape[0] - 1, col.shape[0], ncols, copy, work_at, scratch_at, host_at, stream):
        if check._pool is not None:  # nothing will write the slot: it goes back now
            check._pool.take_back(check)
        return None
    check._stream = stream
    FUSED_LAUNCHES[0] += 1
    return crow_dst, col_dst, check
