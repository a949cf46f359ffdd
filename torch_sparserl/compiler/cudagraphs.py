"""CUDA graphs that follow the JIT: recorded once with cuSPARSE, recorded again with the kernels.

Under ``mode="reduce-overhead"`` Inductor records each compiled graph (the forward, the
backward) as a CUDA graph on its first calls and then only replays it: the kernel that served
a sparse product while the graph was recorded is the one every later step runs. The runtime
decides its kernels in the background, seconds after the first step; a graph recorded before
then would replay cuSPARSE for good, and waiting for the decisions at compile time costs
those seconds before the first step.

Instead, the backend has the graph recorded at once, with cuSPARSE serving, and recorded
again when its decisions are taken: :class:`Decisions` holds the futures of one compiled
graph's pending decisions and the CUDA-graph callables Inductor made for it. At the first
forward call after the last of them is decided, when at least one installed a kernel, each
callable is replaced by a fresh one made from the same arguments. Inductor's CUDA graph
trees see a new function, as after a recompilation: it is warmed up on its next call and
recorded on the one after, now with the kernels, then replayed. Where the decisions land
before any of the graph's callables can have recorded (under CUDA graph trees a callable's
first call warms up, its second records), nothing is made again: the callables record with
the kernels as they are, which saves a warm-up step.

How the callables are found: Inductor wraps a compiled graph by calling
``torch._inductor.compile_fx.cudagraphify``, which returns a callable that records on its
first call. While the backend compiles a graph, and when AOTAutograd compiles its backward
(lazily, through the backend's inner compile), that function is replaced by one that keeps
its arguments and returns a :class:`Recording` in their place. :func:`supported` says whether
this torch has that function; where it does not, the backend waits for the decisions before
compiling, as it did before.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from concurrent.futures import Future

log = logging.getLogger("torch_sparserl.compiler.cudagraphs")

_PATCH_LOCK = threading.RLock()


def _compile_fx_module():
    import torch._inductor.compile_fx as compile_fx

    return compile_fx


def supported() -> bool:
    """Whether Inductor wraps graphs for CUDA graphs through ``compile_fx.cudagraphify``."""
    try:
        return callable(getattr(_compile_fx_module(), "cudagraphify", None))
    except ImportError:
        return False


class Recording:
    """A compiled graph's CUDA-graph callable, which :meth:`rerecord` replaces by a fresh one."""

    def __init__(self, decisions: Decisions, make, is_backward: bool):
        self._decisions = decisions
        self._make = make
        self.is_backward = is_backward
        self._records_at = _recording_call()
        self.calls = 0  # of the current callable, while its graph's decisions are pending
        self._run = make()

    def __call__(self, *args, **kwargs):
        # Only a forward call swaps the graphs: a step's backward then runs the recording
        # made in the same generation as its forward.
        if self._decisions.waiting:
            if not self.is_backward:
                self._decisions.poll()
            self.calls += 1  # counted only while a poll can still read it
        return self._run(*args, **kwargs)

    @property
    def may_have_recorded(self) -> bool:
        return self.calls >= self._records_at

    def rerecord(self) -> None:
        self._run = self._make()
        self.calls = 0


class Decisions:
    """The pending decisions of one compiled graph and the CUDA-graph callables made for it."""

    def __init__(self, futures: list[Future], what: str = "graph"):
        self._futures = list(futures)
        self.what = what
        self.recordings: list[Recording] = []
        self.rerecorded = 0
        self.decided_before_recording = False  # and so recorded with the kernels at once

    @property
    def waiting(self) -> bool:
        return bool(self._futures)

    def poll(self) -> bool:
        """Once every decision is taken: record the graph again if one installed a kernel.
        Returns whether it did."""
        if not all(future.done() for future in self._futures):
            return False
        from ..jit.runtime import Installed

        installed = sum(isinstance(_result(future), Installed) for future in self._futures)
        self._futures = []
        if not installed or not self.recordings:
            return False
        if not any(recording.may_have_recorded for recording in self.recordings):
            self.decided_before_recording = True
            log.info("sparserl: %d kernel(s) of %s decided before its CUDA graphs were recorded: they record "
                     "with them", installed, self.what)
            return False
        for recording in self.recordings:
            recording.rerecord()
        self.rerecorded += 1
        log.info("sparserl: %d kernel(s) of %s decided: its %d CUDA graph(s) are recorded again", installed,
                 self.what, len(self.recordings))
        return True

    def wrap(self, original):
        """``original`` (Inductor's cudagraphify) as one that makes :class:`Recording` s."""

        def cudagraphify(model, *args, **kwargs):
            recording = Recording(self, functools.partial(original, model, *args, **kwargs),
                                  is_backward=bool(kwargs.get("is_backward", False)))
            self.recordings.append(recording)
            return recording

        cudagraphify._sparserl_decisions = self
        return cudagraphify

    @contextlib.contextmanager
    def collecting(self):
        """Within it, the CUDA-graph callables Inductor makes are this graph's recordings."""
        module = _compile_fx_module()
        with _PATCH_LOCK:
            current = module.cudagraphify
            if getattr(current, "_sparserl_decisions", None) is self:
                yield  # already collecting (the inner compile within the backend's call)
                return
            module.cudagraphify = self.wrap(current)
            try:
                yield
            finally:
                module.cudagraphify = current

    def inner_compile(self, *args, **kwargs):
        """Inductor's ``compile_fx_inner``, collecting: also for the backward, which AOTAutograd
        compiles at the first backward call, after the backend has returned."""
        from torch._inductor.compile_fx import compile_fx_inner

        with self.collecting():
            return compile_fx_inner(*args, **kwargs)


def _recording_call() -> int:
    """The call on which the callable Inductor's ``cudagraphify`` makes records: the second
    under CUDA graph trees (the first warms the function up), else the first."""
    try:
        from torch._inductor import config

        return 2 if getattr(config.triton, "cudagraph_trees", True) else 1
    except (ImportError, AttributeError):
        return 1  # the earliest: a graph is recorded again unless no call has run


def _result(future: Future):
    try:
        return future.result(timeout=0)
    except Exception:  # noqa: BLE001 - a failed decision serves cuSPARSE; nothing to record again
        return None
