"""The sandbox's worker process: runs tasks for :class:`~.sandbox.Sandbox`, one at a time.

This module must not import ``torch_sparserl`` (or torch) at module level. The sandbox
starts it in a fresh interpreter (``subprocess``, never the caller's main module) with
``runpy.run_path`` rather than by import, so that starting a worker does not import the
package (seconds: it imports torch); a worker for GPU tasks imports what its task needs,
once. Messages carry only builtins and numpy arrays for the same reason. Its arguments come
as JSON in ``sys.argv[1]``; the pipe is a socket inherited as file descriptor ``fd``.

Protocol (parent → worker): ``("matrix", key, payload)``, ``("task", path, args, kwargs,
matrix_key, matrix_arg, progress)``, ``("stop",)``. Worker → parent: ``("ready", pid,
info)``, ``("init_error", text)``, ``("ack", key)``, ``("progress", stage)``,
``("ok", value, restart)``, ``("error", type, message, traceback, restart)``.
"""

from __future__ import annotations

import faulthandler
import importlib
import json
import os
import sys
import threading
import time
import traceback

RUN_NAME = "__sparserl_sandbox_worker__"


def resolve(path: str):
    """``"package.module:function"`` (as :func:`~.sandbox.task_path` names it) → the function."""
    module_name, sep, attr = path.rpartition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"sandbox: a task is named 'module:function' (got {path!r})")
    module = importlib.import_module(module_name)
    try:
        return getattr(module, attr)
    except AttributeError:
        raise AttributeError(f"sandbox: {module_name} has no attribute {attr!r}") from None


def _watch_parent(parent_pid: int) -> None:
    # The worker runs in its own session, so it is not killed with its parent's group;
    # a worker whose parent died (even by SIGKILL) must not hold the GPU forever.
    while True:
        time.sleep(0.5)
        if os.getppid() != parent_pid:
            os._exit(70)


def _redirect_output(log_path: str) -> None:
    # O_APPEND: the parent truncates the file before each task, and the worker's later
    # writes then start again at offset 0 (its own file offset does not matter).
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    # Line buffering: what a task printed right before it crashed reaches the log.
    sys.stdout.reconfigure(line_buffering=True)
    sys.stderr.reconfigure(line_buffering=True)


def main(conn, log_path: str, parent_pid: int, init: str | None, matrix_loader: str | None,
         health_check: str | None, cuda_visible_devices: str | None = None) -> None:
    if cuda_visible_devices is not None:  # the parent's device (a DDP rank's own GPU), before torch starts
        os.environ["CUDA_VISIBLE_DEVICES"] = cuda_visible_devices
    try:
        os.setsid()  # own process group: the parent kills the worker and its children together
    except OSError:
        pass
    _redirect_output(log_path)
    faulthandler.enable()  # a segfault leaves a Python traceback in the log
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()

    try:
        info = resolve(init)() if init else {}
        loader = resolve(matrix_loader) if matrix_loader else None
        healthy = resolve(health_check) if health_check else None
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises
        conn.send(("init_error", traceback.format_exc()))
        return
    conn.send(("ready", os.getpid(), info or {}))

    matrices: dict = {}
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        kind = message[0]
        if kind == "stop":
            return
        if kind == "matrix":
            _, key, payload = message
            try:
                matrices[key] = loader(**payload) if loader else payload
            except BaseException as exc:  # noqa: BLE001
                conn.send(("error", type(exc).__name__, str(exc), traceback.format_exc(), True))
                return
            conn.send(("ack", key))
            continue
        if kind != "task":
            conn.send(("error", "ProtocolError", f"unknown message {kind!r}", "", True))
            return
        _, path, args, kwargs, matrix_key, matrix_arg, progress = message
        restart = False
        try:
            function = resolve(path)
            kwargs = dict(kwargs)
            if matrix_key is not None:
                if matrix_key not in matrices:
                    raise KeyError(f"sandbox worker: matrix {matrix_key!r} was never sent")
                kwargs[matrix_arg] = matrices[matrix_key]
            if progress:
                kwargs["progress"] = lambda stage: conn.send(("progress", str(stage)))
            value = function(*args, **kwargs)
            reply = ("ok", value)
        except BaseException as exc:  # noqa: BLE001 - everything goes back to the parent
            reply = ("error", type(exc).__name__, str(exc)[-4000:], traceback.format_exc()[-8000:])
        try:
            # A task that poisoned its process (a sticky CUDA error) answers, then the worker
            # leaves, and the parent starts a fresh one for the next task.
            restart = healthy is not None and not healthy()
        except BaseException:  # noqa: BLE001
            restart = True
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            conn.send((*reply, restart))
        except Exception as exc:  # noqa: BLE001 - e.g. a result that cannot be pickled
            conn.send(("error", type(exc).__name__, f"sandbox worker: cannot send the result: {exc}", "", restart))
        if restart:
            conn.close()
            os._exit(0)


if __name__ == RUN_NAME:  # started by sandbox._Worker, which has set sys.path to its own
    from multiprocessing.connection import Connection

    _arguments = json.loads(sys.argv[1])
    del sys.argv[1:]
    os.set_inheritable(_arguments["fd"], False)  # not passed on to programs a task runs
    main(Connection(_arguments.pop("fd")), **_arguments)
