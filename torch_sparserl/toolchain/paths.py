"""Where torch-sparserl keeps files: one per-user cache directory, overridable, private.

The cache holds what the library later compiles and loads into the process (kernel sources,
built libraries), so whoever can write to it could run code as the user: the folder must be
the user's own. :func:`cache_dir` creates it with mode 0o700 and refuses (:class:`CacheDirError`,
naming the folder, what was found and what is expected) a folder that is a symbolic link, is
not a folder, is owned by another user, or that group or others can write. The check is done
once per folder and process. :func:`private_cache_dir` is the form the library uses: the
folder, or None after one logged warning, and the library then runs without a disk cache.
"""

from __future__ import annotations

import logging
import os
import stat
import tempfile
import threading
from pathlib import Path

from .. import config

log = logging.getLogger("torch_sparserl.toolchain.paths")

_CHECKED: dict[str, Path | CacheDirError] = {}  # configured folder -> checked folder, or why refused
_LOCK = threading.Lock()
_PROCESS_BUILD_DIR: Path | None = None


class CacheDirError(OSError):
    """The cache folder cannot be used (not private to the user, or not creatable)."""


def configured_cache_dir() -> Path:
    """``$SPARSERL_CACHE_DIR``, else ``$XDG_CACHE_HOME/torch_sparserl``, else ``~/.cache/torch_sparserl``
    (not checked, not created)."""
    configured = config.read("cache.dir")
    if configured is not None:
        return Path(configured)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "torch_sparserl"


def check_private(root: Path) -> None:
    """Raise :class:`CacheDirError` unless ``root`` is a real folder (not a symbolic link) owned by
    this user that neither group nor others can write."""
    try:
        st = os.lstat(root)
    except OSError as exc:
        raise CacheDirError(f"sparserl: the kernel cache folder {root} cannot be used: {exc.strerror or exc}.") from None
    me = os.getuid()
    found = f"owner uid {st.st_uid}, mode {stat.filemode(st.st_mode)} ({stat.S_IMODE(st.st_mode):o})"
    expected = f"a folder owned by uid {me} (you) that group and others cannot write, e.g. mode 700"
    why = None
    if stat.S_ISLNK(st.st_mode):
        why = "it is a symbolic link"
    elif not stat.S_ISDIR(st.st_mode):
        why = "it is not a folder"
    elif st.st_uid != me:
        why = "it belongs to another user"
    elif st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        why = "group or others can write to it"
    if why is not None:
        raise CacheDirError(f"sparserl: refusing the kernel cache folder {root}: {why} (found {found}; expected "
                            f"{expected}). Anyone who can write there could have code run in your process.")


def cache_dir() -> Path:
    """The per-user cache folder, created private (mode 0o700) and checked (:func:`check_private`);
    raises :class:`CacheDirError` when it cannot be used. Checked once per folder and process."""
    root = configured_cache_dir()
    name = str(root)
    with _LOCK:
        known = _CHECKED.get(name)
        if known is None:
            try:
                root.parent.mkdir(parents=True, exist_ok=True)
                try:
                    os.mkdir(root, 0o700)
                except FileExistsError:
                    pass
                check_private(root)
                known = root
            except CacheDirError as exc:
                known = exc
            except OSError as exc:
                known = CacheDirError(f"sparserl: the kernel cache folder {root} cannot be created: "
                                      f"{type(exc).__name__}: {exc}.")
            _CHECKED[name] = known
            if isinstance(known, CacheDirError):
                log.warning("%s Running without a disk cache (decisions are kept in memory, libraries are built "
                            "in a temporary folder of this process).", known)
    if isinstance(known, CacheDirError):
        raise known
    return known


def private_cache_dir() -> Path | None:
    """:func:`cache_dir`, or None when it cannot be used (logged once, as a warning)."""
    try:
        return cache_dir()
    except CacheDirError:
        return None


def build_root() -> Path:
    """Where built libraries go: ``<cache_dir>/build``, or, without a usable cache folder, a private
    temporary folder of this process (nothing then outlives it)."""
    global _PROCESS_BUILD_DIR
    root = private_cache_dir()
    if root is not None:
        return root / "build"
    with _LOCK:
        if _PROCESS_BUILD_DIR is None:
            _PROCESS_BUILD_DIR = Path(tempfile.mkdtemp(prefix="sparserl-build-"))  # mode 0o700
        return _PROCESS_BUILD_DIR


def forget_checks() -> None:
    """Check every folder again on next use (tests)."""
    with _LOCK:
        _CHECKED.clear()
