"""Bad command-line input: one line on stderr and exit status 2, no traceback."""

from __future__ import annotations

import sys


def usage_error(message: str) -> SystemExit:
    """Print ``message`` on stderr and return the ``SystemExit(2)`` for the caller to raise."""
    print(message, file=sys.stderr)
    return SystemExit(2)
