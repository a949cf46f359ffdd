"""What the commands share: the error of a bad invocation, the checks of their arguments, the
matrix and cache folder a command names, and its lines on stderr."""

from __future__ import annotations

import argparse
import math
import os
import stat
import sys
import time
from pathlib import Path

# Only what parsing needs is imported here: ``sparserl --help`` and a usage error answer without
# importing torch, NumPy or SciPy (tests/cli/test_cli.py checks it); each command imports its own.
from .. import config

MAX_N = 65536  # dense columns: --n beyond this is a typo, not a product anyone runs


class CommandError(Exception):
    """A bad invocation found after parsing; its message is the line the user sees."""


def _matrix(name: str, what: str = "matrix"):
    """A matrix named on the command line, loaded and checked: a real-valued CSR matrix with at
    least one row, one column and one nonzero."""
    from ..data.datasets import load_matrix

    try:
        M = load_matrix(name).tocsr()
    except (FileNotFoundError, ValueError) as exc:
        raise CommandError(f"{what}: {str(exc).removeprefix('load_matrix: ')}") from exc
    if M.dtype.kind not in "biuf":
        raise CommandError(f"{what}: expected real values in {name!r} (got {M.dtype})")
    if min(M.shape) == 0 or M.nnz == 0:
        raise CommandError(f"{what}: expected a matrix with at least one row, column and nonzero in {name!r} "
                           f"(got {M.shape[0]} x {M.shape[1]}, {M.nnz} nonzeros)")
    return M


def _columns(text: str) -> int:
    """--n: dense columns."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= MAX_N:
        raise argparse.ArgumentTypeError(f"expected a positive integer up to {MAX_N} (got {text!r})")
    return value


def _finite(text: str, expected: str, *, zero: bool) -> float:
    """``text`` as a finite number > 0 (>= 0 with ``zero``); else argparse's error saying ``expected``."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (0 <= value if zero else 0 < value) or not value < math.inf:
        raise argparse.ArgumentTypeError(f"expected {expected} (got {text!r})")
    return value


def _seconds(text: str) -> float:
    return _finite(text, "a positive number of seconds", zero=False)


# --dtype: the documented names, and the ABI's short ones, which tune once took (accepted as well).
DTYPES = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}
_DTYPE_METAVAR = "{" + ",".join(DTYPES) + "}"
_DTYPE_HELP = "value dtype (default float32; f32, f16, bf16 are accepted too)"
_OP_HELP = "the product: spmm (A @ X, the default) or spmv (A @ x)"


def _dtype(text: str) -> str:
    """--dtype: a documented name (float32, float16, bfloat16), or its short form, as the documented name."""
    for name, short in DTYPES.items():
        if text in (name, short):
            return name
    raise argparse.ArgumentTypeError(f"expected one of {', '.join(DTYPES)} (got {text!r})")


def _folder(text: str) -> str:
    if os.path.exists(text) and not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"expected a folder (got a file: {text!r})")
    return text


def _cache(args):
    """The command's cache folder (--dir, else $SPARSERL_CACHE_DIR or the default)."""
    from ..jit.cache import KernelCache

    configured = None if args.dir else config.read("cache.dir")
    where = (f"--dir {args.dir!r}" if args.dir else f"$SPARSERL_CACHE_DIR={str(configured)!r}"
             if configured is not None else "the default cache folder")
    try:
        cache = KernelCache(args.dir) if args.dir else KernelCache()
    except OSError as exc:
        got = (f"a file in the way: {exc.filename}" if isinstance(exc, (FileExistsError, NotADirectoryError))
               else _describe(exc))
        raise CommandError(f"expected a usable cache folder at {where} (got {got})") from exc
    if not cache.disk:  # the library runs on without it (memory only); a command about it cannot
        raise CommandError(f"expected a usable cache folder at {where} (got {cache.root}: {cache.problem})")
    return cache


def _entry(cache, path: Path) -> Path:
    """``path`` once checked to be a file: a FIFO would block its read, a link to /dev/zero
    would never end."""
    if not stat.S_ISREG(path.stat().st_mode):
        raise CommandError(f"expected cache entries to be files in {cache.root} (got "
                           f"{'a folder' if path.is_dir() else 'a FIFO or device'} {path.name}: remove it)")
    return path


def _listing(cache):
    """``cache.listing()``, every entry checked first (:func:`_entry`). An entry removed between
    the folder's listing and its reading (by another process's write, prune or clear) is left
    out, as it would be had the listing come a moment later."""
    for path in cache.entries():
        try:
            _entry(cache, path)
        except FileNotFoundError:
            continue
    return cache.listing()  # lists an entry it cannot read (corrupt, nested too deeply) with why


def _describe(exc: BaseException) -> str:
    """An exception as part of one line."""
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror + (f": {exc.filename}" if exc.filename else "")
    return " ".join(str(exc).split()) or type(exc).__name__


# Results go to stdout, a line as soon as it is known; a line before each slow step, saying what
# starts and roughly how long it takes, goes to stderr, as does the progress of a loop that prints
# nothing per item (_progress). A loop that prints a line per item counts in it ("12/30").
def _note(text: str) -> None:
    """A line on stderr before a slow step: what starts and roughly how long it takes."""
    print(text, file=sys.stderr, flush=True)


def _count(done: int, total: int) -> str:
    """``done/total``, as wide for every ``done``."""
    return f"{done:>{len(str(total))}}/{total}"


def _progress(what: str, *, every_s: float = 10.0):
    """``report(done, total)`` for a loop's progress on stderr: a bar rewritten in place on a
    terminal; elsewhere (a log) a line at most every ``every_s`` seconds and at the end."""
    start = time.monotonic()
    last = [start]

    def report(done: int, total: int) -> None:
        now = time.monotonic()
        if sys.stderr.isatty():
            width = 30
            filled = width * done // max(total, 1)
            sys.stderr.write(f"\r{what} [{'#' * filled}{'.' * (width - filled)}] {done}/{total} "
                             f"{now - start:5.1f} s" + ("\n" if done >= total else ""))
        elif done >= total or now - last[0] >= every_s:
            last[0] = now
            sys.stderr.write(f"{what} {done}/{total}, {now - start:.1f} s\n")
        sys.stderr.flush()

    return report
