"""Run untrusted candidates in a child process, so a crash or a hang never takes the caller down.

A :class:`Sandbox` keeps one persistent worker process: a fresh interpreter started with
``subprocess`` (CUDA cannot be forked), so the caller's main module is never imported in it
and a flat script without an ``if __name__ == "__main__":`` guard is not run a second time.
The worker initializes CUDA once, caches the matrices it was sent, and runs one task at a
time. The parent waits with a timeout:

* no answer in time → the worker's process group is killed (SIGKILL): ``timeout``;
* the worker died → ``crash``, with its exit code or signal and the tail of its output;
* the task left the CUDA context broken (a sticky error such as an illegal address) → the
  worker answers, exits, and a fresh worker (matrices re-sent lazily) takes the next task.

Tasks are functions defined at the top level of a module the worker can import: the sandbox
sends the worker their import path (:func:`task_path`), so the machinery is tested on CPU with
hostile Python tasks (hang, ``os._exit``, abort, segfault, megabytes of output), and the
layout test sees which modules a sandbox runs.
"""

from __future__ import annotations

import json
import logging
import multiprocessing.connection
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import types
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from . import _worker
from .config import DEFAULT_TIMEOUT_S, EvalConfig
from .record import ErrorKind, EvalRecord, clip_log, dtype_name

log = logging.getLogger(__name__)


class _Harness:
    """The default of a :class:`Sandbox`'s hooks: the CUDA harness's function for it
    (:mod:`~torch_sparserl.evaluate.harness`, imported when the sandbox is made)."""

    def __repr__(self) -> str:
        return "HARNESS"


HARNESS = _Harness()
DEFAULT_START_TIMEOUT_S = 300.0  # importing torch and creating a CUDA context, cold
LOG_TAIL_BYTES = 8192


class SandboxError(RuntimeError):
    """The sandbox itself failed (the worker cannot start): not the candidate's fault."""


def task_path(function: Callable, what: str = "task") -> str:
    """``"module:function"``: the name the worker imports ``function`` by. It must be a
    function defined at the top level of a module the worker can import: not a lambda, a
    nested function, a method or a builtin, nor a function of ``__main__`` (the worker's main
    module is its own). ``what`` names the argument in the error."""
    if not isinstance(function, types.FunctionType):
        raise TypeError(f"Sandbox: the {what} must be a function defined at the top level of a module "
                        f"(got {type(function).__name__} {function!r})")
    module, name = function.__module__, function.__qualname__
    if module == "__main__" or "." in name or getattr(sys.modules.get(module), name, None) is not function:
        raise ValueError(f"Sandbox: the {what} {module}.{name} cannot be imported by the worker: it must be a "
                         f"function defined at the top level of a module other than __main__")
    return f"{module}:{name}"


@dataclass
class TaskOutcome:
    """What became of one task in the worker."""

    status: str                     # "ok" | "error" (the task raised) | "timeout" | "crash"
    value: Any = None               # the task's return value when status == "ok"
    error: str = ""                 # "ExceptionType: message", or how the worker died
    traceback: str = ""
    exitcode: int | None = None     # the worker's exit code (negative: killed by a signal)
    signal: str | None = None       # e.g. "SIGSEGV"
    output_tail: str = ""           # the end of what the worker printed during this task
    stages: list = field(default_factory=list)  # progress reported by the task, in order
    restarted: bool = False         # the worker is gone after this task
    elapsed_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def _describe_exit(exitcode: int | None) -> tuple[str, str | None]:
    if exitcode is None:
        return "the worker did not exit", None
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"the worker was killed by {name}", name
    return f"the worker exited with code {exitcode}", None


def _parent_cuda_device() -> str | None:
    """The physical GPU of this thread's current CUDA device, as ``CUDA_VISIBLE_DEVICES`` names
    it, so that a worker measures on the GPU its parent uses (each DDP rank its own); None
    when this process has not started CUDA (the worker then sees what the parent sees)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return None
    index = torch.cuda.current_device()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return str(index)
    names = [name.strip() for name in visible.split(",") if name.strip()]
    return names[index] if index < len(names) else None


# The child's command line: ``-c BOOTSTRAP ARGUMENTS_JSON *PARENT_SYS_PATH``. The parent's
# sys.path is installed before anything is imported (only the builtin sys before it), so the
# worker imports what the parent would, and tasks importable only through the parent's path
# (a test directory) resolve. runpy, not an import of this package: see _worker's docstring.
_BOOTSTRAP = ("import sys; sys.path[:] = sys.argv[2:]; del sys.argv[2:]; import runpy; "
              f"runpy.run_path({_worker.__file__!r}, run_name={_worker.RUN_NAME!r})")
_POLL_S = 0.05  # how often wait() checks the worker's life without a pidfd


class _Worker:
    """One child process and its end of the pipe (a socket pair, as ``multiprocessing.Pipe``)."""

    def __init__(self, sandbox: Sandbox):
        parent_sock, child_sock = socket.socketpair()
        hooks = {name: None if function is None else task_path(function, name)
                 for name, function in (("init", sandbox.init), ("matrix_loader", sandbox.matrix_loader),
                                        ("health_check", sandbox.health_check))}
        arguments = dict(fd=child_sock.fileno(), log_path=sandbox.log_path, parent_pid=os.getpid(), **hooks,
                         cuda_visible_devices=_parent_cuda_device())
        path = [os.fsdecode(entry) for entry in sys.path if isinstance(entry, (str, bytes, os.PathLike))]
        try:
            # Its output goes to the log from the start (the worker redirects it there too):
            # an interpreter that fails before main() still leaves its traceback for the parent.
            with open(sandbox.log_path, "ab") as output:
                self.popen = subprocess.Popen(
                    [sys.executable, "-c", _BOOTSTRAP, json.dumps(arguments), *path],
                    stdin=subprocess.DEVNULL, stdout=output, stderr=output,
                    pass_fds=(child_sock.fileno(),), start_new_session=True)
        except (OSError, subprocess.SubprocessError) as exc:
            parent_sock.close()
            raise SandboxError(f"Sandbox: cannot start the worker ({exc})") from exc
        finally:
            child_sock.close()
        self.conn = multiprocessing.connection.Connection(parent_sock.detach())
        self.pid = self.popen.pid
        try:  # readable once the worker exits: wait() sees a message or the death at once
            self.pidfd: int | None = os.pidfd_open(self.pid)
        except (AttributeError, OSError):  # not Linux >= 5.3: wait() polls instead
            self.pidfd = None
        self.matrices: set[str] = set()
        self.info: dict = {}

    @property
    def exitcode(self) -> int | None:
        """None while the worker runs; negative: killed by that signal (as multiprocessing)."""
        return self.popen.poll()

    def join(self, timeout: float | None) -> None:
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def wait(self, timeout: float | None) -> str:
        """``"message"``, ``"dead"`` or ``"timeout"``."""
        if self.pidfd is not None:
            ready = multiprocessing.connection.wait([self.conn, self.pidfd], timeout)
            if self.conn in ready:
                return "message"
            return "dead" if ready else "timeout"
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = _POLL_S if deadline is None else min(_POLL_S, max(0.0, deadline - time.monotonic()))
            if self.conn.poll(left):
                return "message"
            if self.exitcode is not None:  # what it sent before dying is read first
                return "message" if self.conn.poll(0) else "dead"
            if deadline is not None and time.monotonic() >= deadline:
                return "timeout"

    def kill(self) -> None:
        """SIGKILL the worker's whole process group (compilers it started die with it), reap it."""
        if self.exitcode is None:
            try:
                if os.getpgid(self.pid) == self.pid:  # its own session (start_new_session)
                    os.killpg(self.pid, signal.SIGKILL)
                else:  # not its own group (no setsid): kill the worker alone
                    self.popen.kill()
            except (ProcessLookupError, PermissionError):
                pass
        self.join(10)
        self.conn.close()
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None

    def stop(self, timeout: float = 5.0) -> None:
        try:
            if self.exitcode is None:
                self.conn.send(("stop",))
                self.join(timeout)
        except (OSError, BrokenPipeError):
            pass
        self.kill()


class Sandbox:
    """A persistent worker process that runs tasks with a timeout. Use as a context manager.

    ``init``, ``matrix_loader`` and ``health_check`` are functions (:func:`task_path` says
    which) run in the worker: once at start (returns a dict of facts, e.g. the device), on every
    matrix sent (``loader(rowptr=, col=, shape=)`` → the object tasks receive), and after
    every task (returns False when the worker must be replaced). The defaults (:data:`HARNESS`)
    are the CUDA harness's; pass ``None`` for plain Python workers. ``task`` is what
    :meth:`evaluate` runs, ``release_task`` what :meth:`release` runs.
    """

    def __init__(self, task: Callable = HARNESS, *, init: Callable | None = HARNESS,
                 release_task: Callable | None = HARNESS,
                 matrix_loader: Callable | None = HARNESS,
                 health_check: Callable | None = HARNESS,
                 start_timeout_s: float = DEFAULT_START_TIMEOUT_S, log_tail_bytes: int = LOG_TAIL_BYTES):
        hooks = dict(task=task, init=init, release_task=release_task, matrix_loader=matrix_loader,
                     health_check=health_check)
        if HARNESS in hooks.values():
            from . import harness

            defaults = dict(task=harness.sandbox_task, init=harness.worker_init,
                            release_task=harness.release_memory, matrix_loader=harness.load_matrix,
                            health_check=harness.cuda_context_ok)
            hooks = {name: defaults[name] if value is HARNESS else value for name, value in hooks.items()}
        if hooks["task"] is None:
            raise TypeError("Sandbox: the task must be a function defined at the top level of a module (got None)")
        for name, value in hooks.items():
            if value is not None:
                task_path(value, name)  # named errors now, not when the worker starts
        self.task = hooks["task"]
        self.release_task = hooks["release_task"]
        self.init = hooks["init"]
        self.matrix_loader = hooks["matrix_loader"]
        self.health_check = hooks["health_check"]
        self.start_timeout_s = start_timeout_s
        self.log_tail_bytes = log_tail_bytes
        fd, self.log_path = tempfile.mkstemp(prefix="sparserl-sandbox-", suffix=".log")
        os.close(fd)
        self._matrices: dict[str, dict] = {}
        self._worker: _Worker | None = None
        self.starts = 0          # workers started so far (1 + restarts)
        self.closed = False
        self.aborted = False     # abort(): no worker starts again

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    def abort(self) -> None:
        """Kill the worker now, from any thread (the runtime's exit hook): a task waiting on it
        ends as a crash, and no worker starts again. Its pipe is left to :meth:`close`, which
        the thread using the sandbox may still be waiting on."""
        self.aborted = True
        worker = self._worker
        if worker is None or worker.exitcode is not None:
            return
        try:
            if os.getpgid(worker.pid) == worker.pid:
                os.killpg(worker.pid, signal.SIGKILL)
            else:
                worker.popen.kill()
        except (ProcessLookupError, PermissionError):
            pass

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self._worker is not None:
            self._worker.stop()
            self._worker = None
        try:
            os.unlink(self.log_path)
        except OSError:
            pass

    def release(self, timeout_s: float = 30.0) -> int | None:
        """Ask a running worker to drop what it keeps between evaluations (inputs and float64
        references shared by the candidates of one problem, cached GPU blocks) and return the
        bytes its device allocator still reserves; None without a worker (none is started).
        Tuners call it after each problem: on a graph of tens of millions of nonzeros the
        worker otherwise keeps most of the GPU's memory from the training it specializes for."""
        if self.release_task is None or self._worker is None or self._worker.exitcode is not None:
            return None
        outcome = self.run(self.release_task, timeout_s=timeout_s)
        if outcome.status != "ok":
            log.warning("sandbox: releasing the worker's memory failed (%s): %s", outcome.status, outcome.error)
            return None
        return outcome.value

    @property
    def worker_pid(self) -> int | None:
        return self._worker.pid if self._worker is not None else None

    @property
    def worker_info(self) -> dict:
        """What the worker's ``init`` returned (started on demand)."""
        return self._ensure_worker().info

    def _drop_worker(self) -> None:
        if self._worker is not None:
            self._worker.kill()
            self._worker = None

    def _ensure_worker(self) -> _Worker:
        if self.closed:
            raise SandboxError("Sandbox: used after close()")
        if self.aborted:
            raise SandboxError("Sandbox: aborted (the process exits)")
        if self._worker is not None and self._worker.exitcode is None:
            return self._worker
        self._drop_worker()
        self._truncate_log()
        worker = _Worker(self)
        self.starts += 1
        state = worker.wait(self.start_timeout_s)
        message = self._recv(worker) if state == "message" else None
        if message is None or message[0] != "ready":
            detail = message[1] if message and message[0] == "init_error" else {
                "timeout": f"no answer within {self.start_timeout_s} s",
                "dead": _describe_exit(worker.exitcode)[0],
                "message": "it closed the pipe"}[state]
            worker.kill()
            raise SandboxError(f"Sandbox: the worker did not start ({detail})\n"
                               f"worker output:\n{self._log_tail()}")
        worker.info = message[2]
        self._worker = worker
        return worker

    def _recv(self, worker: _Worker):
        try:
            return worker.conn.recv()
        except (EOFError, OSError):
            return None
        except Exception as exc:  # noqa: BLE001 - a half-sent message from a dying worker
            return ("error", type(exc).__name__, f"sandbox: unreadable message: {exc}", "", True)

    def _truncate_log(self) -> None:
        try:
            os.truncate(self.log_path, 0)
        except OSError:
            pass

    def _log_tail(self) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                size = f.tell()
                f.seek(max(0, size - self.log_tail_bytes))
                data = f.read()
        except OSError:
            return ""
        text = data.decode(errors="replace")
        return text if size <= self.log_tail_bytes else f"[... {size - len(data)} bytes before ...]\n{text}"

    # ------------------------------------------------------------------ matrices
    def has_matrix(self, key: str) -> bool:
        """Whether a matrix is registered under ``key``."""
        return key in self._matrices

    def set_matrix(self, key: str, rowptr, col, shape) -> None:
        """Register a matrix (numpy int arrays); it is sent to a worker once, when a task needs it."""
        rows, cols = (int(s) for s in shape)
        if len(rowptr) != rows + 1:
            raise ValueError(f"Sandbox.set_matrix: rowptr must have rows + 1 = {rows + 1} entries (got {len(rowptr)})")
        self._matrices[key] = dict(rowptr=rowptr, col=col, shape=(rows, cols))
        if self._worker is not None:
            self._worker.matrices.discard(key)  # a new matrix under an old key is sent again

    def _ensure_matrix(self, worker: _Worker, key: str) -> None:
        if key in worker.matrices:
            return
        if key not in self._matrices:
            raise KeyError(f"Sandbox: matrix {key!r} is unknown (call set_matrix first; known: "
                           f"{', '.join(sorted(self._matrices)) or 'none'})")
        self._truncate_log()
        worker.conn.send(("matrix", key, self._matrices[key]))
        state = worker.wait(self.start_timeout_s)
        message = self._recv(worker) if state == "message" else None
        if message is None or message[0] != "ack":
            why = message[2] if message and message[0] == "error" else state
            self._drop_worker()
            raise SandboxError(f"Sandbox: the worker failed to load matrix {key!r} ({why})\n"
                               f"worker output:\n{self._log_tail()}")
        worker.matrices.add(key)

    # ------------------------------------------------------------------ tasks
    def run(self, task: Callable, args: tuple = (), kwargs: dict | None = None, *, timeout_s: float,
            matrix_key: str | None = None, matrix_arg: str = "matrix", progress: bool = False) -> TaskOutcome:
        """Run ``task(*args, **kwargs)`` in the worker, at most ``timeout_s`` seconds. ``task``
        is a function the worker imports (:func:`task_path`).

        With ``matrix_key``, the worker's cached matrix is passed as ``kwargs[matrix_arg]``;
        with ``progress``, the task gets a ``progress(stage)`` callable whose stages come
        back in :attr:`TaskOutcome.stages` even when the task later dies.
        """
        path = task_path(task)
        worker = self._ensure_worker()
        if matrix_key is not None:
            self._ensure_matrix(worker, matrix_key)
        self._truncate_log()
        outcome = TaskOutcome(status="ok")
        start = time.monotonic()
        deadline = start + timeout_s
        worker.conn.send(("task", path, tuple(args), dict(kwargs or {}), matrix_key, matrix_arg, progress))
        while True:
            state = worker.wait(max(0.0, deadline - time.monotonic()))
            message = self._recv(worker) if state == "message" else None
            if message is not None and message[0] == "progress":
                outcome.stages.append(message[1])
                continue
            break
        outcome.elapsed_s = time.monotonic() - start
        if message is not None and message[0] in ("ok", "error"):
            if message[0] == "ok":
                outcome.value = message[1]
            else:
                outcome.status = "error"
                outcome.error = f"{message[1]}: {message[2]}"
                outcome.traceback = message[3]
                outcome.output_tail = self._log_tail()
            outcome.restarted = bool(message[-1])
            if outcome.restarted:
                worker.join(10)
                self._drop_worker()
            return outcome
        if state == "timeout":
            outcome.status = "timeout"
            outcome.error = f"no answer within {timeout_s:g} s; the worker was killed"
            self._drop_worker()
        else:  # the worker died (or closed the pipe, then died)
            worker.join(10)
            outcome.status = "crash"
            outcome.exitcode = worker.exitcode
            outcome.error, outcome.signal = _describe_exit(outcome.exitcode)
            self._drop_worker()
        outcome.restarted = True
        outcome.output_tail = self._log_tail()
        return outcome

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, spec, matrix_key: str, n: int, dtype, config: EvalConfig | dict | None = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S) -> EvalRecord:
        """Evaluate one candidate in the worker; always returns a record, never raises for the
        candidate's faults (only :class:`SandboxError` when the sandbox itself cannot work)."""
        config = EvalConfig.from_dict(config.to_dict() if isinstance(config, EvalConfig) else config)
        dtype = dtype_name(dtype)
        outcome = self.run(self.task, (_fields(spec),), dict(n=int(n), dtype=dtype, config=config.to_dict()),
                           timeout_s=timeout_s, matrix_key=matrix_key, progress=True)
        if outcome.ok:
            try:
                record = EvalRecord.from_dict(outcome.value)
            except (TypeError, ValueError) as exc:
                record = _stub(spec, n, dtype, matrix_key)
                record.fail(ErrorKind.CRASH, f"the task returned no record: {exc}")
        else:
            record = _stub(spec, n, dtype, matrix_key)
            # The task reports "compiled" once the build succeeded: a hang or crash after
            # that is a kernel that compiles but is not correct (reward 0, not −0.5).
            record.compiled = "compiled" in outcome.stages
            if outcome.status == "timeout":
                record.fail(ErrorKind.TIMEOUT, outcome.error)
            else:
                record.fail(ErrorKind.CRASH, outcome.error)
                if outcome.status == "error":
                    log.warning("sandbox: the evaluation task raised for %s: %s", record.key, outcome.error)
            if outcome.stages:
                record.add_log(f"stages reached: {', '.join(outcome.stages)}")
            if outcome.traceback:
                record.add_log(outcome.traceback)
            if outcome.output_tail.strip():
                record.add_log("worker output (tail):\n" + clip_log(outcome.output_tail, 6000))
            if outcome.restarted:
                record.add_log("the worker was replaced for the next candidate")
        record.matrix = matrix_key
        record.timing.setdefault("sandbox_s", round(outcome.elapsed_s, 6))
        return record

    def prebuild(self, specs: Iterable, workers: int = 4, timeout_s: float = DEFAULT_TIMEOUT_S) -> dict[str, float]:
        """Compile ``specs`` in the worker, up to ``workers`` at once, before they are evaluated
        one by one (:func:`~torch_sparserl.toolchain.prebuild_nvrtc`). Returns each built key's
        compile seconds; {} when the worker's task failed (the evaluations then compile, and
        record, as they would have)."""
        from .harness import prebuild_task

        specs = [_fields(s) for s in specs]
        if not specs:
            return {}
        outcome = self.run(prebuild_task, (specs,), dict(workers=int(workers)), timeout_s=timeout_s)
        if not outcome.ok:
            log.warning("sandbox: prebuilding %d candidates failed (%s): %s", len(specs), outcome.status,
                        outcome.error)
            return {}
        return dict(outcome.value)

    def evaluate_many(self, specs: Iterable, matrix_key: str, n: int, dtype,
                      config: EvalConfig | dict | None = None,
                      timeout_s: float = DEFAULT_TIMEOUT_S) -> Iterator[EvalRecord]:
        """Records one by one, in the order of ``specs`` (a generator: the autotuner can stop early)."""
        for spec in specs:
            yield self.evaluate(spec, matrix_key, n, dtype, config, timeout_s)


def _fields(spec) -> dict:
    """A spec as builtins for the pipe."""
    return dict(source=spec.source, family=spec.family, params=tuple(spec.params))


def _stub(spec, n: int, dtype: str, matrix_key: str | None) -> EvalRecord:
    """A record for a candidate whose evaluation produced none (hang, crash)."""
    record = EvalRecord(key=str(getattr(spec, "key", "")), family=getattr(spec, "family", ""),
                        params=getattr(spec, "params", ()), n=int(n), dtype=dtype, matrix=matrix_key)
    try:
        record.op = spec.plan.op
    except Exception:  # noqa: BLE001 - the worker reports plan errors; a stub needs no plan
        pass
    return record


def evaluate_many(specs: Iterable, rowptr, col, shape, n: int, dtype, config: EvalConfig | dict | None = None,
                  *, timeout_s: float = DEFAULT_TIMEOUT_S, sandbox: Sandbox | None = None,
                  matrix_key: str = "matrix") -> Iterator[EvalRecord]:
    """Evaluate ``specs`` on one matrix (numpy ``rowptr``/``col``) in a sandbox, streaming records.

    Uses ``sandbox`` when given (and leaves it open), else opens one for the duration.
    """
    own = sandbox is None
    box = Sandbox() if own else sandbox
    try:
        box.set_matrix(matrix_key, rowptr, col, shape)
        yield from box.evaluate_many(specs, matrix_key, n, dtype, config, timeout_s)
    finally:
        if own:
            box.close()
