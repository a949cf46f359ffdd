"""Built NVRTC kernels on disk: a cubin compiled once per machine is loaded, not compiled, after.

The kernel space (:mod:`~torch_sparserl.specialize.families`) does not depend on the pattern:
the same few hundred sources come back for every matrix, and NVRTC spends tens of milliseconds
on each. This cache keeps each source's cubin, with the compiler's log (ptxas's resource report,
which the evaluator reads for spills), in ``<cache_dir>/cubins/<name>.cubin``, where ``name``
is the SHA-256 of everything the build depends on: this format, the target architecture,
NVRTC's version, the options (include folders included) and the source.

What a loaded cubin runs is device code with access to the process's GPU memory, so an entry
is trusted as the kernel cache's are (:mod:`.trust`):

* only in the user's private cache folder, and only with the user's key: without either
  (a refused folder, no key) there is no disk cache and every build compiles;
* each file carries the HMAC-SHA256, under that key, of its name, its log and its cubin, so
  a planted, truncated or swapped file is refused (and removed), never loaded;
* read with :func:`~.trust.read_regular` (a regular file of this user, mode 600, at most
  :data:`MAX_ENTRY_BYTES`, never through a link, never blocking); the bytes checked are the
  bytes handed to the driver;
* written atomically (a temporary file, then ``os.replace``), so concurrent builders of one
  source (the worker's NVRTC threads, other processes) each leave a whole file;
* bounded: past :data:`MAX_ENTRIES` files a write removes the least recently used quarter (a
  hit refreshes the file's time). ``sparserl cache clear`` empties it.

``SPARSERL_CACHE_CUBINS=0`` (``cache.cubins``) turns it off.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import hmac
import json
import logging
import os
import re
import secrets
import struct
import time
from pathlib import Path

from .. import config
from . import paths, trust

log = logging.getLogger("torch_sparserl.toolchain.cubins")

FORMAT = 1
MAGIC = b"SPRLCUBIN1\n"
FOLDER = "cubins"
MAX_ENTRY_BYTES = 16 << 20  # a family's cubin is tens of kB
MAX_ENTRIES = 4096
STALE_TEMP_S = 3600.0
_NAME = re.compile(r"^[0-9a-f]{64}\.cubin$")
_PURPOSE = b"cubin"
_DIGEST_HEX = 64
_warned = False  # a refusal was logged as a warning in this process


class Rejected(ValueError):
    """An entry that is not this cache's, whole and signed."""


@functools.cache
def nvrtc_version() -> str:
    """NVRTC's version as ``major.minor`` (part of every entry's name)."""
    from . import driver

    major, minor = ctypes.c_int(), ctypes.c_int()
    code = driver.nvrtc().nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    return f"{major.value}.{minor.value}" if code == 0 else f"unknown({code})"


def entry_name(source: str, arch: str, options: list[str]) -> str:
    """The file name of a build: the SHA-256 of everything its cubin depends on."""
    h = hashlib.sha256()
    for part in (str(FORMAT), arch, nvrtc_version(), "\0".join(options), source):
        h.update(part.encode())
        h.update(b"\0\1")
    return h.hexdigest() + ".cubin"


def folder() -> Path | None:
    """The cache's folder (created), or None where there is none: switched off, no private
    cache folder, or no key."""
    if not config.read("cache.cubins"):
        return None
    root = paths.private_cache_dir()
    if root is None or trust.key() is None:
        return None
    path = root / FOLDER
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        log.debug("cubins: cannot create %s: %s", path, exc)
        return None
    try:
        paths.check_private(path)
    except paths.CacheDirError as exc:
        log.warning("%s Building kernels without the cubin cache.", exc)
        return None
    return path


def _encode(name: str, cubin: bytes, compile_log: str, secret: bytes) -> bytes:
    header = json.dumps({"format": FORMAT, "name": name, "log": compile_log, "bytes": len(cubin)}).encode()
    body = MAGIC + struct.pack("<I", len(header)) + header + cubin
    return body + trust.digest(secret, _PURPOSE, body).encode()


def _decode(name: str, data: bytes, secret: bytes) -> tuple[bytes, str]:
    if len(data) < len(MAGIC) + 4 + _DIGEST_HEX or not data.startswith(MAGIC):
        raise Rejected("not a cubin entry of this version")
    body, signature = data[:-_DIGEST_HEX], data[-_DIGEST_HEX:]
    if not hmac.compare_digest(signature, trust.digest(secret, _PURPOSE, body).encode()):
        raise Rejected("its signature does not match the user's key")
    (size,) = struct.unpack_from("<I", body, len(MAGIC))
    start = len(MAGIC) + 4
    try:
        header = json.loads(body[start:start + size])
    except ValueError as exc:
        raise Rejected(f"unreadable header ({exc})") from None
    cubin = body[start + size:]
    if not isinstance(header, dict) or header.get("name") != name or header.get("bytes") != len(cubin) \
            or not isinstance(header.get("log"), str):
        raise Rejected("its header does not describe this build")
    return cubin, header["log"]


def lookup(source: str, arch: str, options: list[str]) -> tuple[bytes, str] | None:
    """The (cubin, log) built before from ``source`` for ``arch`` with ``options``, or None. An
    entry that fails its checks is removed (and logged) and counts as a miss."""
    root = folder()
    if root is None:
        return None
    name = entry_name(source, arch, options)
    path = root / name
    try:
        data = trust.read_regular(path, MAX_ENTRY_BYTES, private=True)
        found = _decode(name, data, trust.key())
    except FileNotFoundError:
        return None
    except (OSError, trust.UnsafeFile, Rejected, struct.error) as exc:
        global _warned
        # A new key refuses every entry at once: one warning, the rest at debug level.
        log.log(logging.DEBUG if _warned else logging.WARNING, "cubins: refusing %s (%s); it is removed and the "
                "kernel compiled again%s", path, exc, "" if _warned else " (further refusals: debug level)")
        _warned = True
        _remove(path)
        return None
    try:
        os.utime(path, follow_symlinks=False)  # least recently used goes first
    except OSError:
        pass
    return found


def store(source: str, arch: str, options: list[str], cubin: bytes, compile_log: str) -> bool:
    """Keep a build's cubin and log; False where there is no cache or the write failed."""
    root = folder()
    if root is None:
        return False
    name = entry_name(source, arch, options)
    data = _encode(name, cubin, compile_log, trust.key())
    if len(data) > MAX_ENTRY_BYTES:
        return False
    tmp = root / f".tmp-{os.getpid()}-{secrets.token_hex(6)}"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o600)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)
        os.replace(tmp, root / name)
    except OSError as exc:
        log.debug("cubins: cannot write %s: %s", root / name, exc)
        _remove(tmp)
        return False
    _bound(root)
    return True


def _remove(path: Path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _entries(root: Path) -> list[tuple[float, Path]]:
    out = []
    try:
        names = os.listdir(root)
    except OSError:
        return out
    now = time.time()
    for name in names:
        path = root / name
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if _NAME.match(name):
            out.append((st.st_mtime, path))
        elif name.startswith(".tmp-") and now - st.st_mtime > STALE_TEMP_S:
            _remove(path)
    return out


def _bound(root: Path) -> None:
    try:
        count = len(os.listdir(root))
    except OSError:
        return
    if count <= MAX_ENTRIES:
        return
    entries = sorted(_entries(root))
    for _, path in entries[:max(len(entries) - MAX_ENTRIES * 3 // 4, 0)]:
        _remove(path)


def clear(failures: list[tuple[Path, OSError]] | None = None) -> int:
    """Remove every built kernel of the user's cache; returns how many were removed. One that
    cannot be removed (a read-only folder) stays, and goes to ``failures`` when given."""
    root = paths.private_cache_dir()
    if root is None or not (root / FOLDER).is_dir():
        return 0
    removed = 0
    for _, path in _entries(root / FOLDER):
        try:
            os.unlink(path)
            removed += 1
        except FileNotFoundError:  # another process's clear
            pass
        except OSError as exc:
            if failures is not None:
                failures.append((path, exc))
    return removed


def count() -> tuple[int, int]:
    """(entries, bytes) of the user's cache, without creating anything."""
    root = paths.configured_cache_dir() / FOLDER
    total = n = 0
    try:
        for entry in os.scandir(root):
            if _NAME.match(entry.name):
                n += 1
                total += entry.stat(follow_symlinks=False).st_size
    except OSError:
        pass
    return n, total
