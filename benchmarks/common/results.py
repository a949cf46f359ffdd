"""Results files: where they go, and the JSON document with its Markdown summary and plot.

A benchmark writes ``<prefix>-<gpu slug>-<date>.json`` with ``.md`` (and ``.svg``) beside it.
The JSON is written atomically, so a killed run leaves the previous file, never half a file.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Callable

from .environment import gpu_slug


def results_path(out: str | Path, prefix: str, gpu_name: str | None, date: str) -> Path:
    """``out`` itself when it names a .json file, else ``out/<prefix>-<gpu slug>-<date>.json``;
    its folder is created."""
    out = Path(out)
    path = out if out.suffix == ".json" else out / f"{prefix}-{gpu_slug(gpu_name)}-{date}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


# a list of numbers as json.dumps(indent=1) writes it, one per line: written on one line instead
_NUMBER_LIST = re.compile(r"\[\s*((?:-?[0-9][0-9.eE+-]*,\s*)*-?[0-9][0-9.eE+-]*)\s*\]")


def write_json_md(doc: dict, path: Path, markdown: Callable[[dict], str],
                  plot: Callable[[dict], str] | None = None) -> None:
    """The results document as JSON at ``path`` (lists of numbers on one line), ``markdown(doc)``
    beside it (.md), and ``plot(doc)``, an SVG's text, beside it (.svg) where given."""
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(_NUMBER_LIST.sub(lambda m: "[" + ", ".join(m.group(1).split()).replace(",,", ",") + "]",
                                    json.dumps(doc, indent=1)) + "\n")
    tmp.replace(path)
    path.with_suffix(".md").write_text(markdown(doc))
    if plot is not None:
        path.with_suffix(".svg").write_text(plot(doc))


def emit_markdown(text: str, out: str) -> None:
    """A comparison's Markdown: to ``out`` where it names a ``.md`` file, else to stdout."""
    if str(out).endswith(".md"):
        Path(out).write_text(text)
    else:
        print(text, end="")


def json_safe(value):
    """NaN and infinities become None (strict JSON); unknown objects become strings."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if value is None or isinstance(value, (str, int, bool)):
        return value
    if hasattr(value, "item") and callable(value.item):  # numpy scalars
        return json_safe(value.item())
    return str(value)


def dumps(value) -> str:
    """One line of strict JSON (:func:`json_safe`)."""
    return json.dumps(json_safe(value), allow_nan=False, sort_keys=False)


def save_json(document: dict, path: str | os.PathLike) -> None:
    """``document`` as strict JSON (:func:`json_safe`), written atomically."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(json_safe(document), f, indent=1, allow_nan=False)
        f.write("\n")
    os.replace(tmp, path)


def write_text_atomic(path: Path, text: str) -> None:
    """``text`` at ``path``, written atomically."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
