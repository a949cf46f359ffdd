"""``sparserl fastpath``: the C++ fast path of compiled products, built and loaded now."""

from __future__ import annotations

import time

from .common import CommandError


def fastpath_command(args) -> int:
    """Build (once per machine and torch version) and load the C++ fast path of compiled products."""
    from ..jit import fastpath

    why = fastpath.unavailable()
    if why is not None:
        raise CommandError(f"needs a CUDA build of torch, with the fast path not turned off (here: {why})")
    started = time.perf_counter()
    ok = fastpath.ensure(wait=True)
    print(f"C++ fast path: {fastpath.status()} ({time.perf_counter() - started:.1f} s)")
    return 0 if ok else 1


def add_command(commands) -> None:
    """Add this command and its options to the command line's subcommands."""
    p = commands.add_parser("fastpath", help="build and load the C++ fast path of compiled products now (CUDA torch)",
                            description=(
        "Build (once per machine and torch version) and load the C++ library that serves products once Python "
        "has served the same call; needs a CUDA build of torch."))
    p.set_defaults(run=fastpath_command)
