"""The Markdown machinery of the results summaries: table rows, headers, the runs line.

Each benchmark writes its own tables (what they hold is its business); the shape of a row,
a header and the line naming the commands that made a file is written here once. An empty
cell is one space wide (``| a | | b |``), as the summaries have always had it.
"""

from __future__ import annotations

from typing import Callable, Iterable, Sequence


def fmt(value, spec: str = ".2f", suffix: str = "") -> str:
    """``value`` formatted with ``spec`` and ``suffix``; "—" for None."""
    return "—" if value is None else f"{value:{spec}}{suffix}"


def row(cells: Iterable) -> str:
    """One table row: ``| a | b |``; an empty cell is ``| |``."""
    return "|" + "|".join(f" {c} " if str(c) != "" else " " for c in map(str, cells)) + "|"


def header(columns: Sequence[str], align: str = "") -> list[str]:
    """A table's first two lines. ``align`` has a letter per column, ``l`` (``---``) or ``r``
    (``---:``); columns it does not reach are ``l``."""
    marks = ["---:" if a == "r" else "---" for a in align.ljust(len(columns), "l")]
    return [row(columns), "|" + "|".join(marks) + "|"]


def runs_line(runs: Iterable[dict], label: str = "Runs") -> str:
    """``Runs: `command` (started); ...``, each run's ``note`` after its start where it has one."""
    return f"{label}: " + "; ".join(f"`{r['command']}` ({r['started']}" + (f"; {r['note']}" if r.get("note") else "")
                                    + ")" for r in runs)


def run_bullets(runs: Iterable[dict], detail: Callable[[dict], str] | None = None) -> list[str]:
    """One bullet per run: ``- `command` (started)``, or ``(started; detail(run))``."""
    return [f"- `{r['command']}` ({r['started']}" + (f"; {detail(r)}" if detail else "") + ")" for r in runs]


def command_line(command: str, started: str | None = None, label: str | None = "Command") -> str:
    """``Command: `command` (started)``; without ``label``, the command alone in backquotes."""
    text = f"`{command}`" + (f" ({started})" if started else "")
    return f"{label}: {text}" if label else text
