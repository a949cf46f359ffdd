"""The side stream of each CUDA device, where a pattern's kept data is computed
(:func:`run_kept`) and copied to the host (:func:`to_host`); and the capture mode of the
library's own threads (:func:`relax_capture_mode`)."""

from __future__ import annotations

import ctypes
import logging
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

log = logging.getLogger("torch_sparserl.pattern.streams")

_KEEPER = threading.local()
_KEEPER_POOL: ThreadPoolExecutor | None = None
_KEEPER_LOCK = threading.Lock()
_SIDE_STREAMS: dict[int, torch.cuda.Stream] = {}


def run_kept(device: torch.device, fn, *args):
    """``fn(*args)`` for data kept beyond the current step (pattern data, kernel plans): on CUDA,
    run in a helper thread, on a side stream ordered after the caller's current stream and
    before its later work, so that its tensors come from the caching allocator's ordinary pool.

    The first product on a pattern may run inside the warm-up of a CUDA graph (``mode=
    "reduce-overhead"``), where CUDA graph trees route every allocation of the warming-up
    thread to the graphs' private pool, which must hold only the step's own tensors. Refused
    during a capture, which cannot run the host synchronizations this data needs. ``fn`` must
    not wait for locks its caller holds."""
    global _KEEPER_POOL
    if device.type != "cuda" or getattr(_KEEPER, "active", False):
        return fn(*args)
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError("sparserl: pattern data (transpose, row indices, kernel plans) cannot be computed while "
                           "a CUDA graph is being captured; run the product once before capturing it (CUDA graph "
                           "trees do so in their warm-up)")
    index = device.index if device.index is not None else torch.cuda.current_device()
    caller = torch.cuda.current_stream(index)
    with _KEEPER_LOCK:
        if _KEEPER_POOL is None:
            _KEEPER_POOL = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sparserl-pattern",
                                              initializer=relax_capture_mode)
    side = _side_stream(index)

    def work():
        _KEEPER.active = True
        try:
            with torch.cuda.device(index), torch.cuda.stream(side):
                side.wait_stream(caller)
                return fn(*args)
        finally:
            _KEEPER.active = False

    out = _KEEPER_POOL.submit(work).result()
    # The kept tensors are freed only when their owner dies; later work on the side stream
    # first waits for the caller's stream, so their memory is not reused under a pending read.
    caller.wait_stream(side)
    return out


def _side_stream(index: int) -> torch.cuda.Stream:
    with _KEEPER_LOCK:
        side = _SIDE_STREAMS.get(index)
        if side is None:
            side = _SIDE_STREAMS[index] = torch.cuda.Stream(index)
        return side


def to_host(t: torch.Tensor) -> torch.Tensor:
    """A CPU copy of ``t`` (``t`` itself when on the CPU). A CUDA tensor is copied on the
    device's side stream, ordered after the caller's current stream: the caller's stream does
    not queue behind the copy, so a background thread's copy holds up a training loop's
    kernels less."""
    if t.device.type != "cuda":
        return t
    index = t.device.index if t.device.index is not None else torch.cuda.current_device()
    side = _side_stream(index)
    side.wait_stream(torch.cuda.current_stream(index))
    with torch.cuda.stream(side):
        return t.cpu()


def _side_stream_ready(col: torch.Tensor) -> None:
    """Create the side stream of ``col``'s CUDA device where it does not exist yet. The pattern's
    data and host copy are made on it (run_kept, to_host). Its first creation in a process sets up
    torch's CUDA stream pool, which holds the interpreter lock for milliseconds: made on the
    thread registering the pattern, rather than in the runtime's background thread while the
    training loop waits for the lock."""
    if not col.is_cuda:
        return
    index = col.device.index if col.device.index is not None else torch.cuda.current_device()
    if index not in _SIDE_STREAMS and not torch.cuda.is_current_stream_capturing():
        _side_stream(index)


_CUDA_CAPTURE_MODE_RELAXED = 2  # cudaStreamCaptureModeRelaxed (Global 0, ThreadLocal 1)


def _cudart_function(name: str):
    """``name`` of the CUDA runtime torch loaded, through ctypes; None where there is none (a CPU
    build of torch, a runtime linked statically out of reach)."""
    try:
        return getattr(ctypes.CDLL(None), name)  # torch loads its CUDA libraries with RTLD_GLOBAL
    except (AttributeError, OSError):
        pass
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libcudart.so" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            return getattr(ctypes.CDLL(path), name)
        except (AttributeError, OSError):
            continue
    return None


def relax_capture_mode() -> bool:
    """Put the calling thread (one of the library's background threads) in CUDA's relaxed stream
    capture mode: its potentially unsafe calls (``cudaMalloc``, a synchronization, an event
    query, a module load) no longer invalidate a capture that another thread runs in the
    default, global mode (``torch.cuda.graph``'s, a user's whole-step capture), which is
    otherwise what the runtime's decisions would do to it. Its own work never goes to a
    capturing stream. Whether the mode was set; nothing on a machine without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return False
    exchange = _cudart_function("cudaThreadExchangeStreamCaptureMode")
    if exchange is None:
        log.debug("sparserl: no CUDA runtime function to relax this thread's capture mode")
        return False
    mode = ctypes.c_int(_CUDA_CAPTURE_MODE_RELAXED)
    error = exchange(ctypes.byref(mode))
    if error:
        log.debug("sparserl: cudaThreadExchangeStreamCaptureMode returned %s", error)
    return error == 0
