"""Hostile Python tasks for the sandbox's CPU tests: they hang, crash, raise, flood output.

Passed to the sandbox as functions (``adversarial.hostile_tasks.hang``), which the worker imports
through its parent's sys.path; imports nothing heavy, so a worker for them starts in a fraction
of a second.
"""

import ctypes
import os
import signal
import sys
import time

_POISONED = False


def init():
    return {"pid": os.getpid(), "kind": "cpu-test"}


def load_matrix(rowptr, col, shape):
    return {"rows": int(shape[0]), "cols": int(shape[1]), "nnz": len(col), "rowptr_sum": int(sum(rowptr))}


def healthy():
    return not _POISONED


def echo(value, matrix=None):
    return {"value": value, "pid": os.getpid(), "matrix": matrix}


def getpid():
    return os.getpid()


def hang(seconds=3600):
    time.sleep(seconds)


def busy_loop():
    while True:  # spins in Python without sleeping: only SIGKILL helps
        pass


def ignore_sigterm_and_hang():
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(3600)


def exit_hard(code=9):
    print("about to exit", flush=True)
    os._exit(code)


def abort():
    os.abort()


def segfault():
    ctypes.string_at(0)


def raise_error():
    raise ValueError("hostile task raised on purpose")


def print_megabytes(mb=8):
    line = "x" * 1023 + "\n"
    for _ in range(mb * 1024):
        sys.stdout.write(line)
    sys.stderr.write("last words on stderr\n")
    return "printed"


def unpicklable():
    return lambda: None


def poison():
    # Like a sticky CUDA error: the task answers, but the process is no longer usable.
    global _POISONED
    _POISONED = True
    return "poisoned"


def spawn_grandchild_and_hang():
    # The grandchild sleeps too; killing the process group must take it down as well.
    pid = os.fork()
    if pid == 0:
        time.sleep(3600)
        os._exit(0)
    with open(os.environ.get("SPARSERL_TEST_GRANDCHILD_FILE", "/dev/null"), "w") as f:
        f.write(str(pid))
    time.sleep(3600)


# ---- tasks with the signature of harness.sandbox_task -----------------------------------

def _record(spec, matrix, n, dtype, **extra):
    import hashlib
    record = {"key": hashlib.sha256(spec["source"].encode()).hexdigest()[:20], "family": spec["family"],
              "params": dict(spec["params"]), "n": n, "dtype": dtype, "compiled": True, "correct": True,
              "runtime_us": 10.0, "cusparse_us": 20.0, "trials": 1}
    record.update(extra)
    return record


def eval_ok(spec, matrix, n, dtype, config, progress=None):
    progress("compiled")
    return _record(spec, matrix, n, dtype, log=f"nnz={matrix['nnz']} trials={config['trials']}")


def eval_hang(spec, matrix, n, dtype, config, progress=None):
    progress("compiled")
    time.sleep(3600)


def eval_hang_compiling(spec, matrix, n, dtype, config, progress=None):
    time.sleep(3600)


def eval_segfault(spec, matrix, n, dtype, config, progress=None):
    progress("compiled")
    print("launching", flush=True)
    ctypes.string_at(0)


def eval_raise(spec, matrix, n, dtype, config, progress=None):
    raise RuntimeError("harness bug on purpose")


def eval_poison(spec, matrix, n, dtype, config, progress=None):
    global _POISONED
    _POISONED = True
    progress("compiled")
    return _record(spec, matrix, n, dtype, compiled=True, correct=False, error_kind="crash",
                   runtime_us=None, cusparse_us=None, log="illegal memory access (simulated)")


def eval_garbage(spec, matrix, n, dtype, config, progress=None):
    return {"not": "a record"}


def eval_by_source(spec, matrix, n, dtype, config, progress=None):
    """Behaves as the last line of the source says: OK, HANG, SEGV, RAISE, POISON, GARBAGE."""
    word = spec["source"].rstrip().rsplit("// ", 1)[-1]
    task = {"OK": eval_ok, "HANG": eval_hang, "HANG_COMPILING": eval_hang_compiling, "SEGV": eval_segfault,
            "RAISE": eval_raise, "POISON": eval_poison, "GARBAGE": eval_garbage}[word]
    record = task(spec, matrix, n, dtype, config, progress)
    if isinstance(record, dict) and "key" in record:
        record["op"] = "spmm"
        record["runtime_us"], record["cusparse_us"] = (10.0, 20.0) if word == "OK" else (None, None)
    return record
