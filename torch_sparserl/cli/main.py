"""The command line: its parser, one subcommand per module of this package, and how a command's
errors reach the user (:func:`_run`)."""

from __future__ import annotations

import argparse
import sys

from .. import config
from . import bench, cache, demo, explain, fastpath, info, tune
from .common import CommandError, _describe

# The help's first paragraph (plain text: argparse prints it as it is).
DESCRIPTION = ("sparserl: sparse CSR products for PyTorch on CUDA kernels specialized to each matrix's sparsity "
               "pattern. The commands check them, tune and time them, and show what the runtime decided "
               "(also run as python -m torch_sparserl).")

# The help's epilog: what every command's exit status means.
EXIT_STATUSES = ("Exit status: 0 done; 1 a check failed (a wrong result, a kernel that did not compile) or an "
                 "internal error; 2 a bad invocation, or a command that needs what this machine lacks (a CUDA "
                 "GPU, a CUDA build of torch, nvcc), one line on stderr saying what; 130 interrupted. "
                 "SPARSERL_DEBUG=1 shows the traceback of any error.")

# What a bad invocation or a broken file raises: one line, exit status 2 (the library's own
# errors too: any exception class defined in torch_sparserl). Anything else is a bug.
_EXPECTED = (CommandError, ValueError, TypeError, OSError, EOFError, RecursionError)


class _Parser(argparse.ArgumentParser):
    """argparse's own errors as one line too (``sparserl tune: argument --n: ...``), status 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: {' '.join(message.split())} (`{self.prog} --help` for usage)\n")


def _run(args) -> int:
    """Run a subcommand: an expected error is one line on stderr and exit status 2, anything
    else (a bug) one line and status 1; ``SPARSERL_DEBUG=1`` raises either with its traceback."""
    command = f"sparserl {args.command}"
    try:
        debug = config.from_environment(warn=False).log.debug  # every variable checked: none is read half way
    except ValueError as exc:  # a variable cannot be read, or is out of its range
        print(f"{command}: {exc}", file=sys.stderr)
        return 2
    if hasattr(sys.stdout, "reconfigure"):  # each result line as it is printed, also into a pipe
        sys.stdout.reconfigure(line_buffering=True)
    try:
        from .. import ops  # noqa: F401  the operators: ``import torch_sparserl`` defers them in the command
        return args.run(args)
    except KeyboardInterrupt:
        print(f"{command}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        if debug:
            raise
        if isinstance(exc, _EXPECTED) or type(exc).__module__.startswith(__name__.partition(".")[0] + "."):
            print(f"{command}: {_describe(exc)}", file=sys.stderr)
            return 2
        print(f"{command}: internal error, {type(exc).__name__}: {_describe(exc)} "
              "(SPARSERL_DEBUG=1 shows its traceback)", file=sys.stderr)
        return 1


def _parser() -> _Parser:
    """The command line: every command and option with its help text."""
    parser = _Parser(prog="sparserl", description=DESCRIPTION, epilog=EXIT_STATUSES)
    commands = parser.add_subparsers(dest="command", required=True, help="sparserl COMMAND --help describes each")
    for command in (demo, info, tune, bench, explain, fastpath, cache):
        command.add_command(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    return _run(_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
