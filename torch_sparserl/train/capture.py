"""A whole training step captured as one CUDA graph: :func:`capture_step`.

On a fixed graph a step (forward, loss, backward, optimizer step) is a few hundred kernels whose
launches cost the host more than the GPU spends running them. Captured once as a CUDA graph, a
step is one ``replay()``. PyTorch's recipe (``torch.cuda.graph``) works on a ``CSRMatrix`` model
once the JIT runtime's decisions are in; :class:`CapturedStep` is that recipe with what the
runtime needs around it:

* **Warm-up, then capture.** The first calls run the step eagerly on a side stream (the recipe's
  warm-up), so that every product is asked of the runtime before the capture: warm-up goes on
  past ``warmup`` calls while the last one left a product unasked (not admitted yet:
  ``jit.admit_calls``, ``jit.admit_age_s``; or not queued: ``jit.queue``) on a pattern older
  than the call, for at most :data:`WARMUP_LIMIT_S` seconds. A matrix the step builds from its
  arguments (a mini-batch's ``ts.csr`` inside the step) is a new pattern at every call and is
  served by cuSPARSE in the graph whatever is decided: it does not hold the capture back. With
  ``wait_s``, the decisions still pending then are waited for (at most ``wait_s`` seconds) and,
  where one landed, warmed up once more. The next call captures, then replays.
* **The capture mode.** ``capture_error_mode="thread_local"``: see :meth:`CudaGraphs.capture`.
* **Re-capture.** Decisions that land after the capture (a pending one, a kernel replaced) bump
  the runtime's :attr:`~torch_sparserl.jit.runtime.Runtime.epoch`. Each call compares it with the
  capture's (one int); when it moved and a record the graph read now holds another kernel, the
  step warms up and is captured again, so a graph recorded with cuSPARSE replays the kernels
  once they are installed.
* **Never stale.** A live graph keeps the runtime, the kernels (installed states) and the
  patterns it may launch alive. What it cannot replay:

  ================================================  ==========================================
  the active runtime changed (``ts.configure``,     captured again under the active one
  ``set_active``), or its runtime closed while
  another is active
  the runtime it was captured under was closed      ``RuntimeError`` (its kernels are not
  (``Runtime.close``) and is still the active one   replayed; make another runtime active)
  a ``CSRMatrix`` argument is another matrix, or    captured again (the kernels serve one
  its values were replaced (``A.val = ...``)        pattern; the graph reads the matrix itself)
  a tensor argument of another shape, dtype or      ``ValueError`` naming what was expected
  device, or another number of arguments            (a step is captured for fixed shapes)
  ================================================  ==========================================

* **The CPU.** Without CUDA, or where the step's tensors are on the CPU, every call runs the
  step eagerly: the same training script runs anywhere. A step whose tensors are on several
  devices also runs eagerly, with a warning.

Calls are one step each, warm-up and capture calls included, so a loop over a captured step
trains exactly as the eager loop does. The tensors a replay returns are the graph's own: the
next call overwrites them (as torch's graphs do): copy what must outlive it
(``loss.detach().clone()``; ``loss.item()`` synchronizes).
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
import warnings
from collections.abc import Callable

import torch
from torch import Tensor

from ..jit import fastpath
from ..jit.decide import warming
from ..jit.decisions import Installed, Pending
from ..jit.runtime import active_or_none
from ..kernels import vendor
from ..pattern import settle_pending
from ..tensor.csr_matrix import CSRMatrix

log = logging.getLogger("torch_sparserl.train.capture")

MAX_WARMUP = 1000
"""The most ``warmup`` calls :func:`capture_step` takes."""
MAX_WAIT_S = 3600.0
"""The longest ``wait_s``."""
WARMUP_LIMIT_S = 30.0
"""Warm-up beyond ``warmup`` calls, while products stay unasked, ends this many seconds after the
first warm-up call: the runtime's counters may move for another thread's products."""
UNASKED = ("unasked_kept",)
"""The runtime's counters of calls that left a product undecided and unqueued on a pattern older
than the warm-up call (:func:`~torch_sparserl.jit.decide.warming`): a warm-up call that moved one
did not ask for every product the graph would replay. Calls C++ served as young count too
(:func:`~torch_sparserl.jit.fastpath.young_served`)."""


class CudaGraphs:
    """The CUDA graph machinery of a :class:`CapturedStep`: run a warm-up call, capture a graph.
    Tests give a step a fake with the same attribute and methods."""

    device_type = "cuda"  # the device type whose steps are captured; others run eagerly

    def __init__(self):
        self._sides: dict[int, torch.cuda.Stream] = {}

    def available(self) -> bool:
        return torch.cuda.is_available()

    def warm(self, step: Callable, inputs: tuple, device: torch.device | None):
        """``step(*inputs)`` on a side stream ordered after the current one, the current one then
        waiting for it (torch's recipe for a call before a capture)."""
        with torch.cuda.device(device):
            index = torch.cuda.current_device()
            side = self._sides.get(index)
            if side is None:
                side = self._sides[index] = torch.cuda.Stream()
            current = torch.cuda.current_stream()
            side.wait_stream(current)
            with torch.cuda.stream(side):
                out = step(*inputs)
            current.wait_stream(side)
            return out

    def capture(self, step: Callable, inputs: tuple, device: torch.device | None):
        """``(graph, outputs)``: ``step(*inputs)`` captured (not run) as a CUDA graph.

        ``capture_error_mode="thread_local"``: in the default global mode a potentially unsafe
        CUDA call of *any* thread while the capture runs (a synchronization, a blocking copy, a
        ``cudaMalloc``) invalidates it (``cudaErrorStreamCaptureInvalidated``), and the runtime's
        background thread makes such calls while it decides (the pattern's host copy, the
        evaluator, installs). In the thread-local mode only this thread's calls are checked; the
        background thread works on streams of its own, never on the capturing one."""
        with torch.cuda.device(device):
            # a product served by cuSPARSE in the graph, whose warm-up calls ran kernels, would make
            # the thread's cuSPARSE handle inside the capture
            vendor.ensure_handle(torch.device("cuda", torch.cuda.current_device()))
            settle_pending()  # the index checks still on the device: their events cannot be asked in the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                out = step(*inputs)
            return graph, out


class _Unwatched:
    """The runtime of a step captured without one (no sparserl product ran): nothing moves."""

    epoch = 0
    closed = False


_UNWATCHED = _Unwatched()


class CapturedStep:
    """A training step run as a CUDA graph: see :func:`capture_step`, which makes one.

    ``captured(*inputs)`` runs one step: eagerly while it warms up, then by replaying the graph
    after copying ``inputs`` into its own input tensors; it returns the step's outputs (on a
    replay the graph's own tensors, overwritten by the next call). Not for use by several
    threads at once. ``graphs``: the CUDA graph machinery (:class:`CudaGraphs`; tests pass a fake).
    """

    def __init__(self, step_fn: Callable, *, warmup: int = 3, wait_s: float = 0.0, graphs=None):
        if not callable(step_fn):
            raise TypeError(f"capture_step: step_fn must be callable (got {type(step_fn).__name__})")
        if isinstance(warmup, bool) or not isinstance(warmup, int) or not 1 <= warmup <= MAX_WARMUP:
            raise ValueError(f"capture_step: warmup must be a whole number of calls from 1 to {MAX_WARMUP} "
                             f"(got {warmup!r})")
        if isinstance(wait_s, bool) or not isinstance(wait_s, (int, float)) or not 0 <= wait_s <= MAX_WAIT_S:
            raise ValueError(f"capture_step: wait_s must be a number of seconds from 0 to {MAX_WAIT_S:g} "
                             f"(got {wait_s!r})")
        self._step = step_fn
        self._warmup = warmup
        self._wait_s = float(wait_s)
        self._graphs = graphs if graphs is not None else CudaGraphs()
        self._eager: bool | None = None  # None until the first call says where the step runs
        self._device: torch.device | None = None
        self.captures = 0  # how many times the step was captured
        self._drop()

    def _drop(self) -> None:
        """Forget the graph (and what it kept alive): the next calls warm up and capture again."""
        self._graph = None
        self._outputs = None
        self._slots: tuple = ()
        self._runtime = _UNWATCHED
        self._epoch = 0
        self._watched: list = []  # (record, its state when captured)
        self._kept: tuple = ()  # what the graph may launch: states, patterns
        self._warm_calls = 0
        self._first_warm: float | None = None
        self._quiet = False  # the last warm-up call asked for every product
        self._mark: tuple = (None, None)  # (runtime, epoch) when the last warm-up call began

    @property
    def captured(self) -> bool:
        """Whether a graph is live: the next matching call replays it."""
        return self._graph is not None

    @property
    def eager(self) -> bool:
        """Whether every call runs the step eagerly (no CUDA, or its tensors are not on one GPU)."""
        return bool(self._eager)

    # ------------------------------------------------------------------ the hot path
    def __call__(self, *inputs):
        graph = self._graph
        if graph is not None and self._runtime.epoch == self._epoch and len(inputs) == len(self._slots):
            try:
                for given, (static, shape, dtype, device, val) in zip(inputs, self._slots):
                    if given is static:
                        if val is not None and given.val is not val:
                            break  # a matrix's values were replaced
                    elif (val is not None or given.shape != shape or given.dtype != dtype or given.device != device
                          or given.requires_grad):
                        break
                    else:
                        static.copy_(given)
                else:
                    graph.replay()
                    return self._outputs
            except AttributeError:  # not a tensor: the slow path names it
                pass
        return self._call(inputs)

    # ------------------------------------------------------------------ everything else
    def _call(self, inputs: tuple):
        _check_inputs(inputs)
        if self._eager is None:
            self._eager = not self._capturable(inputs)
        if self._eager:
            return _checked_outputs(self._step(*inputs))
        if self._graph is not None:
            reason = self._stale(inputs)
            if reason is None:  # the epoch moved, but no kernel the graph may launch changed
                self._epoch = self._runtime.epoch
                for given, (static, *_) in zip(inputs, self._slots):
                    if given is not static:
                        static.copy_(given)
                self._graph.replay()
                return self._outputs
            log.info("capture_step: %s: the step warms up and is captured again", reason)
            self._drop()
        if self._ready():
            return self._capture(inputs)
        return self._warm(inputs)

    def _capturable(self, inputs: tuple) -> bool:
        """Whether the step's inputs say it can be captured: the machinery is available and every
        input is on one device of its type (a step without inputs: decided by its outputs)."""
        if not self._graphs.available():
            return False
        devices = {t.device for t in inputs}
        kind = self._graphs.device_type
        if devices and all(d.type != kind for d in devices):
            return False  # the CPU path: eager, as documented
        if len(devices) > 1:
            warnings.warn(f"capture_step: the step's inputs are on {len(devices)} devices "
                          f"({', '.join(sorted(map(str, devices)))}); it runs eagerly: a captured step "
                          f"reads its inputs on one {kind} device", stacklevel=4)
            return False
        self._device = next(iter(devices), None)
        return True

    def _warm(self, inputs: tuple):
        runtime = active_or_none()
        counts = _unasked(runtime)
        self._mark = (runtime, None if runtime is None else runtime.epoch)
        if self._first_warm is None:
            self._first_warm = time.monotonic()
        with warming():
            out = _checked_outputs(self._graphs.warm(self._step, inputs, self._device))
        if self._warm_calls == 0 and self.captures == 0 and not self._runs_on_one_device(out):
            self._eager = True
            return out
        self._warm_calls += 1
        after = active_or_none()
        self._quiet = after is runtime and _unasked(after) == counts
        return out

    def _runs_on_one_device(self, out) -> bool:
        """After the first call: whether the step's tensors (arguments and outputs) are all on one
        device of the machinery's type, which is then the step's. A step with neither says nothing
        of where it runs: eager, with a warning (its graph could be empty)."""
        kind = self._graphs.device_type
        devices = {t.device for t in _tensors(out)} | ({self._device} if self._device is not None else set())
        if len(devices) == 1 and next(iter(devices)).type == kind:
            self._device = next(iter(devices))
            return True
        if not devices or any(d.type == kind for d in devices):
            where = ", ".join(sorted(map(str, devices))) or "no tensor argument or output"
            warnings.warn(f"capture_step: the step's tensors are on {where}; it runs eagerly: a captured step "
                          f"takes and returns tensors on one {kind} device", stacklevel=5)
        return False

    def _ready(self) -> bool:
        """Whether this call captures: ``warmup`` calls ran, the last one asked for every
        product, and no decision landed since it began (after waiting ``wait_s`` for the pending
        ones). Past :data:`WARMUP_LIMIT_S`, only the ``warmup`` calls count."""
        if self._warm_calls < self._warmup:
            return False
        overdue = time.monotonic() - self._first_warm > WARMUP_LIMIT_S
        if not self._quiet and not overdue:
            return False
        runtime = active_or_none()
        if self._wait_s and runtime is not None:
            pending = [record.state.future for _, record in runtime.records() if record.state.__class__ is Pending]
            if pending:
                concurrent.futures.wait(pending, timeout=self._wait_s)
        ran_with = self._mark
        landed = runtime is not ran_with[0] or (runtime is not None and runtime.epoch != ran_with[1])
        if overdue and (landed or not self._quiet):
            log.info("capture_step: the step is captured after %.0f s of warm-up although its products are not "
                     "all decided; it is captured again when their decisions land", WARMUP_LIMIT_S)
            return True
        return not landed

    def _capture(self, inputs: tuple):
        runtime = active_or_none()
        slots = []
        for given in inputs:
            if isinstance(given, CSRMatrix):  # the graph reads the matrix itself: its kernels serve its pattern
                slots.append((given, given.shape, given.dtype, given.device, given.val))
            else:
                slots.append((given.detach().clone(), given.shape, given.dtype, given.device, None))
        static = tuple(slot[0] for slot in slots)
        before = [] if runtime is None else [(owner, record, record.state) for owner, record in runtime.records()]
        epoch = 0 if runtime is None else runtime.epoch
        try:
            graph, outputs = self._graphs.capture(self._step, static, self._device)
        except Exception as exc:
            self._drop()
            raise RuntimeError(
                f"capture_step: capturing the step as a CUDA graph failed ({type(exc).__name__}: {exc}). A step "
                "must be capturable: optimizers with capturable=True (torch.optim.Adam(..., capturable=True)), no "
                "host synchronization (.item(), .cpu(), printing a tensor), no tensor created from host data, the "
                "same work on every call") from exc
        after = [] if runtime is None else runtime.records()
        # What the graph may launch, kept alive while it lives: the kernels of the states before
        # and after the capture (a decision may land meanwhile), the patterns whose data they
        # read, and the runtime itself. Watched: each record's state from before the capture (a
        # record made during it: none), so that a kernel installed while the capture ran, which
        # the graph may not have, captures again.
        seen = {id(record) for _, record, _ in before}
        states = [state for _, _, state in before] + [record.state for _, record in after]
        self._kept = (runtime, [state for state in states if isinstance(state, Installed)],
                      [owner for owner, _, _ in before] + [owner for owner, _ in after])
        self._watched = [(record, state) for _, record, state in before] + [
            (record, None) for _, record in after if id(record) not in seen]
        self._runtime = runtime if runtime is not None else _UNWATCHED
        self._epoch = epoch  # a decision that landed during the capture moved it: the next call checks
        self._slots = tuple(slots)
        self._graph, self._outputs = graph, _checked_outputs(outputs)
        self.captures += 1
        log.info("capture_step: the step is captured (capture %d)", self.captures)
        graph.replay()  # the capture ran nothing: this call's step
        return self._outputs

    def _stale(self, inputs: tuple) -> str | None:
        """Why the graph cannot serve these inputs, which a new capture fixes, or None where it can.
        Raises where neither can (see the module's table)."""
        if len(inputs) != len(self._slots):
            raise ValueError(f"capture_step: the step was captured with {len(self._slots)} argument(s); this call "
                             f"gave {len(inputs)}")
        for i, (given, (static, shape, dtype, device, val)) in enumerate(zip(inputs, self._slots)):
            if val is not None:
                if not isinstance(given, CSRMatrix):
                    raise ValueError(f"capture_step: argument {i} was a CSRMatrix when the step was captured "
                                     f"(got {type(given).__name__})")
                if given is not static or given.val is not val:
                    return f"argument {i} is another matrix, or its values were replaced"
            elif isinstance(given, CSRMatrix) or (given.shape, given.dtype, given.device) != (shape, dtype, device):
                got = ("a CSRMatrix" if isinstance(given, CSRMatrix) else
                       f"shape {tuple(given.shape)}, {given.dtype}, {given.device}")
                raise ValueError(f"capture_step: argument {i} must be a tensor of shape {tuple(shape)}, {dtype}, on "
                                 f"{device}, as when the step was captured (got {got}); a captured step replays "
                                 "fixed shapes: capture another step for other shapes")
        runtime = self._runtime
        if runtime is _UNWATCHED:
            return None
        active = active_or_none()
        if active is not runtime:
            return "the active JIT runtime changed"
        if runtime.closed:
            raise RuntimeError("capture_step: the JIT runtime the step was captured under was closed "
                               "(Runtime.close) and is still the active one: its kernels are not replayed; make "
                               "another runtime active (ts.configure(...)) before the next step")
        for record, state in self._watched:
            now = record.state
            if now is not state and isinstance(now, Installed) and not (
                    isinstance(state, Installed) and state.entry is not None and now.entry is state.entry):
                return f"a decision landed ({now.description or 'a kernel'})"
        return None


def _check_inputs(inputs: tuple) -> None:
    for i, given in enumerate(inputs):
        if not isinstance(given, Tensor):
            raise TypeError(f"capture_step: the step's arguments must be tensors (argument {i} is a "
                            f"{type(given).__name__}); bind other values into the step (functools.partial)")
        if given.requires_grad and not isinstance(given, CSRMatrix):
            raise ValueError(f"capture_step: argument {i} requires grad; a captured step copies its arguments into "
                             "tensors of its own, which the gradient would not reach: make it a parameter of the "
                             "model, or pass it detached")


def _tensors(out) -> list[Tensor]:
    if isinstance(out, Tensor):
        return [out]
    if isinstance(out, dict):
        out = list(out.values())
    if isinstance(out, (tuple, list)):
        return [t for item in out for t in _tensors(item)]
    return []


def _checked_outputs(out):
    """``out``, once checked to be what a graph can return: tensors, None, and tuples, lists and
    dicts of them (a Python number would be the capture's value on every replay)."""
    def check(value, where: str) -> None:
        if value is None or isinstance(value, Tensor):
            return
        if isinstance(value, dict):
            for key, item in value.items():
                check(item, f"{where}[{key!r}]")
        elif isinstance(value, (tuple, list)):
            for i, item in enumerate(value):
                check(item, f"{where}[{i}]")
        else:
            raise TypeError(f"capture_step: the step must return tensors (a tensor, None, or tuples, lists and dicts "
                            f"of them); it returned a {type(value).__name__} at {where}: return the tensor (for "
                            "a loss: the loss, not loss.item())")
    check(out, "the output")
    return out


def _unasked(runtime) -> tuple:
    if runtime is None:
        return ()
    stats = runtime.stats
    return (*(stats.get(name, 0) for name in UNASKED), fastpath.young_served())


MAX_SHAPES = 64
"""The most ``max_shapes`` :func:`capture_step` takes."""


class CapturedSteps:
    """A training step captured once per argument signature (shapes, dtypes, devices): one
    :class:`CapturedStep` per signature, at most ``max_shapes`` of them. For mini-batches padded
    to a few sizes (:class:`~torch_sparserl.data.buckets.Buckets`), one graph per bucket. Made by
    :func:`capture_step` with ``max_shapes`` above 1."""

    def __init__(self, step_fn: Callable, *, warmup: int = 3, wait_s: float = 0.0, max_shapes: int = 8,
                 graphs=None):
        self._make = lambda: CapturedStep(step_fn, warmup=warmup, wait_s=wait_s, graphs=graphs)
        self._make()  # checks the arguments now
        self.max_shapes = max_shapes
        self.steps: dict[tuple, CapturedStep] = {}  # signature -> its step

    def __call__(self, *inputs):
        try:
            key = tuple((type(t), t.shape, t.dtype, t.device) for t in inputs)
        except AttributeError:
            _check_inputs(inputs)  # names the argument that is not a tensor
            raise
        step = self.steps.get(key)
        if step is None:
            if len(self.steps) >= self.max_shapes:
                got = ", ".join(f"{tuple(t.shape)} {t.dtype}" for t in inputs)
                raise ValueError(f"capture_step: the step was captured for {len(self.steps)} argument signatures, "
                                 f"max_shapes={self.max_shapes}; this call's ({got}) would be one more: pad the "
                                 "inputs to a few sizes (torch_sparserl.data.buckets.Buckets) or raise max_shapes")
            step = self.steps[key] = self._make()
        return step(*inputs)

    @property
    def captures(self) -> int:
        """Captures over every signature."""
        return sum(step.captures for step in self.steps.values())

    @property
    def captured(self) -> int:
        """How many signatures have a live graph."""
        return sum(step.captured for step in self.steps.values())

    @property
    def eager(self) -> bool:
        """Whether the steps run eagerly (no CUDA, or their tensors are not on one GPU)."""
        return any(step.eager for step in self.steps.values())


def capture_step(step_fn: Callable, *, warmup: int = 3, wait_s: float = 0.0,
                 max_shapes: int = 1) -> CapturedStep | CapturedSteps:
    """``step_fn`` (one training step: forward, loss, backward, optimizer step) as a
    :class:`CapturedStep`, replayed as one CUDA graph once warmed up::

        opt = torch.optim.Adam(model.parameters(), lr=0.01, capturable=True)

        def train_step(x, y):
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x, A)[mask], y[mask])
            loss.backward()
            opt.step()
            return loss

        step = ts.capture_step(train_step)
        for epoch in range(epochs):
            loss = step(x, y)  # the first calls warm up, the next captures, the rest replay

    The step's arguments are tensors (a ``CSRMatrix`` among them is read in place, not copied);
    what it reads otherwise (the model, ``A``, the optimizer) must stay alive and in place. It
    returns tensors (tuples, lists, dicts of them). Every call is one step: ``warmup`` (1 to
    :data:`MAX_WARMUP`) eager calls on a side stream first, more while the runtime has not been
    asked for every product; then a capture; then replays, captured again when a decision lands
    or the runtime changes (the module's docstring has the rules). ``wait_s`` (0 to 3600): before
    capturing, wait up to this long for the runtime's pending decisions, so that the first graph
    has the kernels. On the CPU, or without CUDA, the step runs eagerly on every call.

    ``max_shapes`` (1 to :data:`MAX_SHAPES`): with 1, a call with arguments of other shapes,
    dtypes or devices raises; above 1, each argument signature is warmed up, captured and
    replayed as a graph of its own (:class:`CapturedSteps`), up to that many, for a step whose
    inputs come in a few sizes: mini-batches padded to buckets, their ``(crow, col, val)``
    among the arguments and ``ts.csr`` of them inside the step (checked inside the graph at
    every replay, served by cuSPARSE).
    """
    if isinstance(max_shapes, bool) or not isinstance(max_shapes, int) or not 1 <= max_shapes <= MAX_SHAPES:
        raise ValueError(f"capture_step: max_shapes must be a whole number from 1 to {MAX_SHAPES} (got {max_shapes!r})")
    if max_shapes > 1:
        return CapturedSteps(step_fn, warmup=warmup, wait_s=wait_s, max_shapes=max_shapes)
    return CapturedStep(step_fn, warmup=warmup, wait_s=wait_s)
