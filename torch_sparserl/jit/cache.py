"""The specialization cache: memory, then disk, keyed by :class:`SpecializationKey`.

An entry says what was decided for one key: the kernel (its ABI source, family, parameters
and evaluation record) or that none beat cuSPARSE (``spec_source`` is None, with the reason)
— a negative answer is worth caching too, or every process would tune again (not one reached
while the device had no memory free for the search: the runtime caches nothing then,
:class:`~torch_sparserl.evaluate.record.TransientFailure`).

On disk (``<cache_dir>/kernels/<digest>.json``):

* written atomically (a temporary file in the same folder, then ``os.replace``), so a reader
  never sees half an entry;
* signed (HMAC-SHA256 of the canonical payload under the user's key, :mod:`~torch_sparserl.toolchain.trust`)
  and checked against the key it was asked for, and its kernel source against the ABI with
  no host code (:func:`~torch_sparserl.abi.check_source`), so a corrupted, foreign or planted
  entry (another version, another GPU, a hash collision of file names, a forgery) is
  detected, removed and rebuilt, never used;
* read only as a regular file of bounded size, never through a symbolic link, never blocking
  (:func:`~torch_sparserl.toolchain.trust.read_regular`);
* shared by processes: :meth:`KernelCache.get_or_create` takes an ``flock`` for the key, so of
  several processes (DDP ranks, parallel jobs) asking for the same key one builds and the
  others wait and read its entry. The OS releases the lock of a process that dies, so a
  killed builder cannot deadlock the rest. The locks are striped over 256 files by the key's
  first byte, so that their number stays bounded however many patterns pass;
* bounded, across the processes sharing the folder: after each write, under an exclusive
  ``flock`` of ``prune.lock``, the entries on disk are measured, and when they pass
  ``cache.max_mb`` the least recently used ones are removed (a read from disk counts as a use);
  :meth:`KernelCache.prune` does it on demand (``sparserl cache prune``). What the folder holds
  is measured, not what this process wrote, so writers together stay under the cap, each
  write's entry at most past it until its prune. Memory keeps the most recent
  :data:`MEMORY_ENTRIES`.

A cache never raises for its folder: where the folder cannot be created, read or written
(a file in its place, no permission, a refused folder, no key), it logs one warning and
keeps its decisions in memory only.
"""

from __future__ import annotations

import collections
import fcntl
import hmac
import json
import logging
import os
import re
import tempfile
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .. import config
from ..pattern.fingerprint import SpecializationKey
from ..toolchain import trust
from ..toolchain.paths import configured_cache_dir, private_cache_dir

log = logging.getLogger("torch_sparserl.jit.cache")

FORMAT = 2  # 2: signed with the user's key (1 carried a plain SHA-256, which anyone could forge)
DEFAULT_LOCK_TIMEOUT_S = 1800.0  # longer than any specialization; a dead holder frees it at once
MAX_ENTRY_BYTES = 4 << 20  # an entry is a kernel source and its record: tens of kB
STALE_TEMP_S = 3600.0  # clear() removes another process's temporary file only when older than this
MEMORY_ENTRIES = 4096  # decisions kept in memory (a few kB each), most recently used
PRUNE_TO = 0.8  # a write past the cap removes entries until they take this fraction of it
ENTRY_NAME = re.compile(r"^[0-9a-f]{16,64}\.json$")  # an entry's file name
_KEY_LOCK_NAME = re.compile(r"^[0-9a-f]{16,64}\.lock$")  # one lock per key: earlier versions' scheme
PRUNE_LOCK = "prune.lock"  # serializes the measure-and-remove of every process sharing the folder
MAX_BYTES = int(config.MAX_CACHE_MAX_MB) << 20  # the largest cap, in bytes
_PURPOSE = b"cache-entry"


@dataclass
class CacheEntry:
    """What was decided for one key."""

    key: SpecializationKey
    spec_source: str | None            # the kernel's ABI source; None: cuSPARSE serves
    family: str = ""
    params: dict = field(default_factory=dict)
    record: dict | None = None         # EvalRecord.to_dict() of the deciding evaluation
    reason: str = ""                   # why this kernel, or why none
    created: float = field(default_factory=time.time)

    def payload(self) -> dict:
        data = asdict(self)
        data["key"] = asdict(self.key)
        return data

    @classmethod
    def from_payload(cls, data: dict) -> CacheEntry:
        data = dict(data)
        data["key"] = SpecializationKey(**data["key"])
        return cls(**data)


def _canonical(payload: dict) -> bytes:
    return json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()


class CacheError(RuntimeError):
    pass


class _Rejected(ValueError):
    """An entry on disk that must not be used."""


def _byte_count(what: str, value, low: int) -> int:
    """``value`` if it is a whole number of bytes from ``low`` to :data:`MAX_BYTES`; else a
    ValueError naming ``what``."""
    if not (isinstance(value, int) and not isinstance(value, bool) and low <= value <= MAX_BYTES):
        raise ValueError(f"{what} must be a whole number of bytes >= {low} and <= {MAX_BYTES} (got {value!r})")
    return value


class KernelCache:
    def __init__(self, root: Path | str | None = None, *, lock_timeout_s: float = DEFAULT_LOCK_TIMEOUT_S,
                 max_bytes: int | None = None):
        self.lock_timeout_s = lock_timeout_s
        if max_bytes is None:
            max_bytes = int(config.read("cache.max_mb") * (1 << 20))  # in range: read() checks it
        self.max_bytes = _byte_count("KernelCache: max_bytes", max_bytes, 1)
        self._memory: collections.OrderedDict[str, CacheEntry] = collections.OrderedDict()
        self._memory_lock = threading.Lock()
        self.stats = {"memory_hits": 0, "disk_hits": 0, "misses": 0, "rejected": 0, "builds": 0, "evicted": 0}
        self.disk = True  # False: memory only (the folder could not be used; warned once)
        self.problem = ""  # why not, when not
        if root is None:
            base = private_cache_dir()  # a refused folder was warned about there
            self.root = (base if base is not None else configured_cache_dir()) / "kernels"
            if base is None:
                self.disk, self.problem = False, "the cache folder is refused"
                return
        else:
            self.root = Path(root)
        try:
            self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
            if not self.root.is_dir():
                raise NotADirectoryError(f"{self.root} is not a folder")
        except OSError as exc:
            self._disable(f"cannot create it ({type(exc).__name__}: {exc})")
            return
        if trust.key() is None:  # warned about there
            self.disk, self.problem = False, "no key to sign entries with"

    def _disable(self, why: str) -> None:
        """Memory only from now on; one warning per cache."""
        if self.disk:
            self.disk, self.problem = False, why
            log.warning("cache: %s: %s; running without a disk cache (decisions are kept in memory only)",
                        self.root, why)

    def path(self, key: SpecializationKey) -> Path:
        return self.root / f"{key.digest()}.json"

    def lock_path(self, key: SpecializationKey) -> Path:
        """The file whose ``flock`` serializes builds of ``key`` (and of the keys sharing its stripe)."""
        return self.root / f"{key.digest()[:2]}.lock"

    def _remember(self, digest: str, entry: CacheEntry) -> None:
        with self._memory_lock:
            self._memory[digest] = entry
            self._memory.move_to_end(digest)
            while len(self._memory) > MEMORY_ENTRIES:
                self._memory.popitem(last=False)

    # ------------------------------------------------------------------ read
    def get(self, key: SpecializationKey) -> CacheEntry | None:
        digest = key.digest()
        with self._memory_lock:
            entry = self._memory.get(digest)
            if entry is not None:
                self._memory.move_to_end(digest)
        if entry is not None:
            self.stats["memory_hits"] += 1
            return entry
        entry = self._read(key)
        if entry is None:
            self.stats["misses"] += 1
            return None
        self.stats["disk_hits"] += 1
        self._remember(digest, entry)
        return entry

    def _load(self, path: Path) -> CacheEntry:
        """The signed entry at ``path``: raises FileNotFoundError, or _Rejected saying why not."""
        try:
            raw = trust.read_regular(path, MAX_ENTRY_BYTES)
        except FileNotFoundError:
            raise
        except (OSError, trust.UnsafeFile) as exc:
            raise _Rejected(f"unreadable ({exc})") from None
        try:
            document = json.loads(raw)
            if not isinstance(document, dict):
                raise _Rejected("not an entry")
            if document.get("format") != FORMAT:
                raise _Rejected(f"format {document.get('format')!r}, expected {FORMAT} (unsigned or from another "
                                "version)")
            payload = document["payload"]
            secret = trust.key()
            signature = document.get("hmac_sha256")
            if secret is None or not isinstance(signature, str) or not hmac.compare_digest(
                    signature, trust.digest(secret, _PURPOSE, _canonical(payload))):
                raise _Rejected("bad signature (not written by you on this machine: forged, copied or corrupted)")
            return CacheEntry.from_payload(payload)
        except _Rejected:
            raise
        except (ValueError, KeyError, TypeError, RecursionError) as exc:
            raise _Rejected(f"unreadable ({type(exc).__name__}: {str(exc)[:200]})") from None

    def _read(self, key: SpecializationKey) -> CacheEntry | None:
        if not self.disk:
            return None
        path = self.path(key)
        try:
            entry = self._load(path)
            if entry.key != key:
                raise _Rejected(f"written for another key ({entry.key})")
            if entry.spec_source is not None:
                from ..abi import PlanError, check_source

                try:
                    check_source(entry.spec_source)
                except PlanError as exc:
                    raise _Rejected(f"its kernel source fails the ABI check: {exc}") from None
            try:
                os.utime(path)  # a use: the least recently used entries are removed first
            except OSError:
                pass
            return entry
        except FileNotFoundError:
            return None
        except _Rejected as exc:
            why = str(exc)
        self.stats["rejected"] += 1
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            # one warning for both: the entry is bad and stays, so this cache cannot use the folder
            self._disable(f"discarding {path.name}: {why}; it cannot be removed ({type(exc).__name__}: {exc})")
            return None
        log.warning("cache: discarding %s: %s", path, why)
        return None

    # ------------------------------------------------------------------ write
    def put(self, entry: CacheEntry) -> Path:
        path = self.path(entry.key)
        self._remember(entry.key.digest(), entry)
        secret = trust.key() if self.disk else None
        if secret is None:
            return path
        payload = entry.payload()
        document = {"format": FORMAT, "hmac_sha256": trust.digest(secret, _PURPOSE, _canonical(payload)),
                    "payload": payload}
        try:
            fd, tmp = tempfile.mkstemp(dir=self.root, prefix=".tmp-", suffix=".json")
        except OSError as exc:
            self._disable(f"cannot write to it ({type(exc).__name__}: {exc})")
            return path
        try:
            with os.fdopen(fd, "w") as handle:
                json.dump(document, handle, sort_keys=True)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, path)  # atomic: readers see the old entry or the new one
        except BaseException as exc:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            if not isinstance(exc, OSError):
                raise
            self._disable(f"cannot write {path.name} ({type(exc).__name__}: {exc})")
            return path
        self._grew()
        return path

    def _grew(self) -> None:
        """After a write: prune when the entries on disk, every process's, pass the cap. They
        are measured each time (a listing and a stat per entry: milliseconds, against the
        seconds of the specialization that wrote the entry); a count kept by this process would
        miss what the others write."""
        with self._prune_lock():
            usage = self._usage()
            if sum(size for _, size, _ in usage) > self.max_bytes:
                self._remove_oldest(usage, int(self.max_bytes * PRUNE_TO), None)

    @contextmanager
    def _prune_lock(self):
        """Held while one process measures the entries and removes some, so that two processes
        past the cap at once do not both remove the oldest entries. Without it (the lock file
        cannot be made: a read-only folder; it is a symbolic link, not followed) the pruning goes
        on unserialized: the cap still holds, more may be removed than needed."""
        try:
            fd = trust.open_lock(self.root / PRUNE_LOCK)
        except OSError as exc:
            log.debug("cache: pruning %s without its lock: %s", self.root, exc)
            yield
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # held for the milliseconds of a prune; a dead holder's is freed
            yield
        finally:
            os.close(fd)  # releases the lock

    def _usage(self) -> list[tuple[Path, int, float]]:
        """Every entry as ``(path, bytes, last use)``, least recently used first."""
        out = []
        for path in self.entries():
            try:
                st = os.lstat(path)
            except OSError:
                continue
            out.append((path, st.st_size, st.st_mtime))
        out.sort(key=lambda item: item[2])
        return out

    # ------------------------------------------------------------------ build once
    @contextmanager
    def _locked(self, key: SpecializationKey):
        lock_path = self.lock_path(key)
        fd = None
        if self.disk:
            try:
                fd = trust.open_lock(lock_path)
            except OSError as exc:
                self._disable(f"cannot lock {lock_path.name} ({type(exc).__name__}: {exc})")
        if fd is None:  # memory only: nothing to share with other processes
            yield
            return
        try:
            deadline = time.monotonic() + self.lock_timeout_s
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise CacheError(f"cache: waited {self.lock_timeout_s:g} s for another process "
                                         f"specializing {key.digest()} ({lock_path})") from None
                    time.sleep(0.05)
            try:
                yield
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    def get_or_create(self, key: SpecializationKey, create: Callable[[SpecializationKey], CacheEntry]) -> CacheEntry:
        """The entry for ``key``; built by ``create`` in exactly one of the processes asking."""
        entry = self.get(key)
        if entry is not None:
            return entry
        with self._locked(key):
            entry = self._read(key)  # another process may have finished while we waited
            if entry is None:
                entry = create(key)
                if entry.key != key:
                    raise CacheError(f"cache: create() returned an entry for another key ({entry.key})")
                self.stats["builds"] += 1
                self.put(entry)
            self._remember(key.digest(), entry)
            return entry

    # ------------------------------------------------------------------ maintenance
    def _names(self) -> list[str]:
        if not self.disk:
            return []
        try:
            return sorted(os.listdir(self.root))
        except OSError:
            return []

    def entries(self) -> list[Path]:
        """The entries' files (not the temporary files of writes in flight, not the locks)."""
        return [self.root / name for name in self._names() if ENTRY_NAME.match(name)]

    def listing(self) -> list[tuple[Path, CacheEntry | None, str]]:
        """Every entry on disk as ``(path, entry, problem)``: the signed entry, or None with why
        it cannot be used (for listings; :meth:`get` is what checks an entry against its key and
        its source against the ABI, and removes what fails)."""
        out = []
        for path in self.entries():
            try:
                out.append((path, self._load(path), ""))
            except FileNotFoundError:
                continue
            except _Rejected as exc:
                out.append((path, None, str(exc)))
        return out

    def disk_bytes(self) -> int:
        """What the entries on disk take now, in bytes."""
        return sum(size for _, size, _ in self._usage())

    def clear(self, failures: list[tuple[Path, OSError]] | None = None) -> int:
        """Remove the entries, and temporary files older than :data:`STALE_TEMP_S` (a write in
        flight in another process keeps its file). Returns the entries removed; an entry that
        cannot be removed (a read-only folder) stays, and goes to ``failures`` when given."""
        removed = 0
        now = time.time()
        for name in self._names():
            path = self.root / name
            try:
                if ENTRY_NAME.match(name):
                    os.unlink(path)
                    removed += 1
                elif name.startswith(".tmp-") and now - os.lstat(path).st_mtime > STALE_TEMP_S:
                    os.unlink(path)
            except FileNotFoundError:  # gone meanwhile: another process's clear or prune
                pass
            except OSError as exc:  # a folder, no permission: left as it is
                log.debug("cache: cannot remove %s: %s", path, exc)
                if failures is not None and ENTRY_NAME.match(name):
                    failures.append((path, exc))
        # Lock files stay: deleting one that a running process holds would let a second
        # process lock a fresh file of the same name and build the same key concurrently.
        with self._memory_lock:
            self._memory.clear()
        return removed

    def prune(self, max_bytes: int | None = None,
              failures: list[tuple[Path, OSError]] | None = None) -> tuple[int, int, int]:
        """Remove the least recently used entries until the rest take at most ``max_bytes``
        (default: the cache's cap), with temporary files older than :data:`STALE_TEMP_S` and the
        one-lock-per-key files of earlier versions that no process holds. Returns ``(entries
        removed, bytes freed, bytes kept)``; an entry that cannot be removed stays, counted as
        kept, and goes to ``failures`` when given. A removed entry is decided again when next asked."""
        limit = self.max_bytes if max_bytes is None else _byte_count("prune: max_bytes", max_bytes, 0)
        with self._prune_lock():
            return self._remove_oldest(self._usage(), limit, failures)

    def _remove_oldest(self, usage: list[tuple[Path, int, float]], limit: int,
                       failures: list[tuple[Path, OSError]] | None) -> tuple[int, int, int]:
        """:meth:`prune`'s work on the entries ``usage`` measured, under the prune lock."""
        kept = sum(size for _, size, _ in usage)
        removed = freed = 0
        for path, size, _ in usage:
            if kept <= limit:
                break
            try:
                os.unlink(path)
            except FileNotFoundError:  # another process removed it meanwhile: freed all the same
                kept -= size
                continue
            except OSError as exc:
                log.debug("cache: cannot remove %s: %s", path, exc)
                if failures is not None:
                    failures.append((path, exc))
                continue
            kept -= size
            freed += size
            removed += 1
            with self._memory_lock:
                self._memory.pop(path.stem, None)
        self.stats["evicted"] += removed
        self._sweep()
        if removed:
            log.info("cache: %s: removed the %d least recently used entries (%d kB); %d kB kept",
                     self.root, removed, freed >> 10, kept >> 10)
        return removed, freed, kept

    def _sweep(self) -> None:
        """Stale temporary files, and per-key lock files of earlier versions no process holds."""
        now = time.time()
        for name in self._names():
            path = self.root / name
            try:
                if name.startswith(".tmp-") and now - os.lstat(path).st_mtime > STALE_TEMP_S:
                    os.unlink(path)
                elif _KEY_LOCK_NAME.match(name):
                    fd = trust.open_lock(path)
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held elsewhere: BlockingIOError
                        os.unlink(path)
                    finally:
                        os.close(fd)
            except OSError as exc:  # held, gone meanwhile, a symbolic link: left as it is
                log.debug("cache: %s stays: %s", path, exc)
