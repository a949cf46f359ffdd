"""The shipped policy: its checkpoint folder, the checkpoint's content id (part of the kernel
cache key) and :func:`load_default`, which loads it once per (folder, device) and shares it."""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path

CHECKPOINT_DIR = Path(__file__).resolve().parent / "checkpoint"

_lock = threading.Lock()
_loaded: dict[tuple[str, str], object] = {}


_ids: dict[tuple[str, float], str] = {}


def checkpoint_id(folder: str | Path = CHECKPOINT_DIR) -> str:
    """A short content hash of a checkpoint's weights: part of the kernel cache key
    (computed once per file version)."""
    weights = Path(folder) / "model.safetensors"
    if not weights.exists():
        raise FileNotFoundError(f"policy: no checkpoint at {folder} (model.safetensors is missing)")
    key = (str(weights.resolve()), weights.stat().st_mtime)
    if key not in _ids:
        h = hashlib.sha256()
        with open(weights, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
        _ids[key] = h.hexdigest()[:12]
    return _ids[key]


def load_default(device: str = "cpu", folder: str | Path = CHECKPOINT_DIR):
    """The shipped policy, loaded once per (folder, device) and shared."""
    from .model import KernelPolicy

    key = (str(folder), str(device))
    with _lock:
        if key not in _loaded:
            _loaded[key] = KernelPolicy.load(folder, device)
        return _loaded[key]
