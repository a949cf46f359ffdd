"""What the library trusts on disk, and how it checks it (docs/trust-model.md).

* **The key.** Cache entries and built libraries are authenticated with HMAC-SHA256 under a
  per-user secret key, ``<cache_dir>/hmac.key`` (32 random bytes, mode 0600, created with
  ``O_CREAT | O_EXCL | O_NOFOLLOW`` through a temporary file and ``link``, so a reader never sees
  half a key). It lives inside the cache folder itself, which is acceptable only because
  :func:`~torch_sparserl.toolchain.paths.cache_dir` refuses a folder that is not the user's own and
  private (owner, mode, no symbolic link): nobody else can create, replace or read a file in
  it. A folder the cache's writers choose (``<cache_dir>/..``, an explicit ``KernelCache(root)``
  such as a folder shared by DDP ranks) never holds it, so an entry planted in a shared folder
  cannot be signed. Without a usable cache folder there is no key: the entry cache runs in
  memory only, and libraries are signed with a key of this process (:func:`library_key`).
* **Files** the library reads are opened with ``O_NOFOLLOW | O_NONBLOCK`` and read only when
  ``fstat`` says they are regular files, at most a given size (:func:`read_regular`): a FIFO,
  a device, a folder or a symbolic link where a file should be is refused, never waited on.
* **Locks** are opened with ``O_CREAT | O_NOFOLLOW`` and without ``O_TRUNC`` (:func:`open_lock`).
* **Libraries** are loaded only when the marker written after their build holds the HMAC of
  their bytes (:func:`write_marker`, :func:`verified_library`); the bytes checked are the bytes
  loaded (copied to a sealed memory file first where the system has one).
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import json
import logging
import os
import secrets
import stat
import threading
from pathlib import Path

from . import paths

log = logging.getLogger("torch_sparserl.toolchain.trust")

KEY_NAME = "hmac.key"
KEY_BYTES = 32
MAX_LIBRARY_BYTES = 1 << 30
_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)

_lock = threading.Lock()
_keys: dict[str, bytes | None] = {}  # cache folder -> its key (None: refused, warned once)
_process_key = secrets.token_bytes(KEY_BYTES)  # signs libraries where no cache folder is usable


class UnsafeFile(ValueError):
    """A path that is not a regular file of an acceptable size."""


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a symbolic link")):
        if test(mode):
            return name
    return "not a regular file"


def read_regular(path: Path | str, limit: int, *, private: bool = False) -> bytes:
    """The bytes of ``path`` if it is a regular file (not a symbolic link) of at most ``limit``
    bytes; ``private``: also owned by this user and unreadable by others. Raises
    :class:`FileNotFoundError` when it is missing, :class:`UnsafeFile` or another ``OSError``
    otherwise. Never blocks on a FIFO or device."""
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafeFile("a symbolic link") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeFile(_kind(st.st_mode))
        if private and (st.st_uid != os.getuid() or st.st_mode & 0o077):
            raise UnsafeFile(f"owned by uid {st.st_uid} with mode {stat.S_IMODE(st.st_mode):o} (expected uid "
                             f"{os.getuid()}, mode 600)")
        if st.st_size > limit:
            raise UnsafeFile(f"{st.st_size} bytes, more than the {limit} expected")
        chunks, left = [], limit + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        data = b"".join(chunks)
        if len(data) > limit:
            raise UnsafeFile(f"more than the {limit} bytes expected")
        return data
    finally:
        os.close(fd)


def open_lock(path: Path | str) -> int:
    """A file descriptor to ``flock``: created if missing, never truncated, never through a symbolic link."""
    return os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o600)


# ------------------------------------------------------------------ the key

def _create_key(path: Path) -> None:
    tmp = path.with_name(f".{KEY_NAME}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o600)
    try:
        try:
            os.write(fd, secrets.token_bytes(KEY_BYTES))
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, path)  # atomic, and fails where another process made the key first
        except FileExistsError:
            pass
    finally:
        os.unlink(tmp)


def key() -> bytes | None:
    """The user's key (created on first use), or None where the cache folder cannot be used or
    its key file is not a private regular file of the right size (logged once, as a warning)."""
    root = paths.private_cache_dir()
    if root is None:
        return None
    name = str(root)
    with _lock:
        if name in _keys:
            return _keys[name]
        path = root / KEY_NAME
        found = None
        try:
            try:
                found = read_regular(path, KEY_BYTES, private=True)
            except FileNotFoundError:
                _create_key(path)
                found = read_regular(path, KEY_BYTES, private=True)
            if len(found) != KEY_BYTES:
                raise UnsafeFile(f"{len(found)} bytes, expected {KEY_BYTES}")
        except (OSError, UnsafeFile) as exc:
            found = None
            log.warning("sparserl: cannot use the cache's key file %s (%s); running without a disk cache (remove "
                        "the file to have a new key made)", path, exc)
        _keys[name] = found
        return found


def library_key() -> bytes:
    """The key that signs built libraries: the user's, else this process's (libraries are then
    built in a temporary folder of this process, :func:`~torch_sparserl.toolchain.paths.build_root`)."""
    return key() or _process_key


def digest(secret: bytes, purpose: bytes, data: bytes) -> str:
    return hmac.new(secret, purpose + b"\0" + data, hashlib.sha256).hexdigest()


def forget_keys() -> None:
    """Read the keys again on next use (tests)."""
    with _lock:
        _keys.clear()


# ------------------------------------------------------------------ built libraries

_MARKER_LIMIT = 1 << 16


def write_marker(library: Path, marker: Path, **extra) -> None:
    """After a complete build of ``library``: record its keyed digest in ``marker`` (atomically)."""
    data = read_regular(library, MAX_LIBRARY_BYTES)
    body = json.dumps({"library": library.name, "hmac_sha256": digest(library_key(), b"library", data), **extra})
    tmp = marker.with_name(f".{marker.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o600)
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(body)
        os.replace(tmp, marker)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def library_bytes(library: Path, marker: Path) -> bytes | None:
    """The bytes of ``library`` when ``marker`` holds their keyed digest, else None (missing, from
    an older version, planted, or a library changed since its build)."""
    try:
        document = json.loads(read_regular(marker, _MARKER_LIMIT))
        data = read_regular(library, MAX_LIBRARY_BYTES)
    except (OSError, ValueError, RecursionError):
        return None
    want = document.get("hmac_sha256") if isinstance(document, dict) else None
    if not isinstance(want, str) or document.get("library") != library.name:
        return None
    if not hmac.compare_digest(want, digest(library_key(), b"library", data)):
        return None
    return data


def is_verified(library: Path, marker: Path) -> bool:
    return library_bytes(library, marker) is not None


def clear_build(folder: Path, keep: tuple[str, ...]) -> None:
    """Remove what an earlier build left in ``folder`` (all but ``keep``), so that a rebuild
    cannot reuse an unverified library or object file as up to date."""
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return
    for name in names:
        if name in keep:
            continue
        path = folder / name
        try:
            if path.is_dir() and not path.is_symlink():
                import shutil

                shutil.rmtree(path)
            else:
                os.unlink(path)
        except FileNotFoundError:
            pass


_LOADED_FDS: list[int] = []
"""Memory files of loaded libraries, open for the process's life: dlopen knows a library by its
path, so a closed descriptor's number, and with it the path ``/proc/self/fd/N``, reused by the
next library would be taken for the library already loaded (its symbols then missing)."""


def _seal(fd: int) -> bool:
    """Forbid any further write, growth, shrinking or change of seals on the memory file ``fd``;
    False where the platform has no seals (``fcntl`` lacks them, or the kernel refuses)."""
    try:
        import fcntl
    except ImportError:
        return False
    names = ("F_ADD_SEALS", "F_SEAL_WRITE", "F_SEAL_GROW", "F_SEAL_SHRINK", "F_SEAL_SEAL")
    if not all(hasattr(fcntl, name) for name in names):  # CPython < 3.8, or not Linux
        return False
    try:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS,
                    fcntl.F_SEAL_WRITE | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL)
    except OSError:
        return False
    return True


def loadable_path(library: Path, data: bytes) -> tuple[str, int | None]:
    """A path to dlopen that holds exactly ``data`` (the verified bytes): a sealed memory file
    where the system has them (kept open: :data:`_LOADED_FDS`), else ``library`` itself (its
    folder is private to the user). Returns ``(path, None)``: nothing for the caller to close."""
    memfd_create = getattr(os, "memfd_create", None)
    if memfd_create is None or not os.path.isdir("/proc/self/fd"):
        return str(library), None
    try:
        flags = getattr(os, "MFD_CLOEXEC", 0) | getattr(os, "MFD_ALLOW_SEALING", 0)
        fd = memfd_create(library.name, flags)
    except OSError:
        return str(library), None
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        _seal(fd)
    except OSError:
        os.close(fd)
        return str(library), None
    _LOADED_FDS.append(fd)
    return f"/proc/self/fd/{fd}", None
