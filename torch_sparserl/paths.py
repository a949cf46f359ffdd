"""Where torch-sparserl keeps files: one per-user cache directory, overridable."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """``$SPARSERL_CACHE_DIR``, else ``$XDG_CACHE_HOME/torch_sparserl``, else ``~/.cache/torch_sparserl``."""
    if os.environ.get("SPARSERL_CACHE_DIR"):
        root = Path(os.environ["SPARSERL_CACHE_DIR"])
    else:
        root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "torch_sparserl"
    root.mkdir(parents=True, exist_ok=True)
    return root
