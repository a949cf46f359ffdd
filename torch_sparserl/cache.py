"""The specialization cache: memory, then disk, keyed by :class:`SpecializationKey`.

An entry says what was decided for one key: the kernel (its ABI source, family, parameters
and evaluation record) or that none beat cuSPARSE (``spec_source`` is None, with the reason)
— a negative answer is worth caching too, or every process would tune again (not one reached
while the device had no memory free for the search: the runtime caches nothing then,
:class:`~torch_sparserl.evaluate.record.TransientFailure`).

On disk (``<cache_dir>/kernels/<digest>.json``):

* written atomically (a temporary file in the same folder, then ``os.replace``), so a reader
  never sees half an entry;
* checksummed (SHA-256 of the canonical payload) and checked against the key it was asked
  for, so a corrupted or foreign entry (another version, another GPU, a hash collision of
  file names) is detected, removed and rebuilt, never used;
* shared by processes: :meth:`KernelCache.get_or_create` takes an ``flock`` per key, so of
  several processes (DDP ranks, parallel jobs) asking for the same key one builds and the
  others wait and read its entry. The OS releases the lock of a process that dies, so a
  killed builder cannot deadlock the rest.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .fingerprint import SpecializationKey
from .paths import cache_dir

log = logging.getLogger("torch_sparserl.cache")

FORMAT = 1
DEFAULT_LOCK_TIMEOUT_S = 1800.0  # longer than any specialization; a dead holder frees it at once


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


class KernelCache:
    def __init__(self, root: Path | str | None = None, *, lock_timeout_s: float = DEFAULT_LOCK_TIMEOUT_S):
        self.root = Path(root) if root is not None else cache_dir() / "kernels"
        self.root.mkdir(parents=True, exist_ok=True)
        self.lock_timeout_s = lock_timeout_s
        self._memory: dict[str, CacheEntry] = {}
        self._memory_lock = threading.Lock()
        self.stats = {"memory_hits": 0, "disk_hits": 0, "misses": 0, "rejected": 0, "builds": 0}

    def path(self, key: SpecializationKey) -> Path:
        return self.root / f"{key.digest()}.json"

    # ------------------------------------------------------------------ read
    def get(self, key: SpecializationKey) -> CacheEntry | None:
        digest = key.digest()
        entry = self._memory.get(digest)
        if entry is not None:
            self.stats["memory_hits"] += 1
            return entry
        entry = self._read(key)
        if entry is None:
            self.stats["misses"] += 1
            return None
        self.stats["disk_hits"] += 1
        with self._memory_lock:
            self._memory[digest] = entry
        return entry

    def _read(self, key: SpecializationKey) -> CacheEntry | None:
        path = self.path(key)
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return None
        why = None
        try:
            document = json.loads(raw)
            payload = document["payload"]
            if document.get("format") != FORMAT:
                why = f"format {document.get('format')!r}, expected {FORMAT}"
            elif document.get("sha256") != hashlib.sha256(_canonical(payload)).hexdigest():
                why = "checksum mismatch"
            elif payload.get("key") != asdict(key):
                why = f"written for another key ({payload.get('key')})"
            else:
                return CacheEntry.from_payload(payload)
        except (ValueError, KeyError, TypeError) as exc:
            why = f"unreadable ({type(exc).__name__}: {exc})"
        self.stats["rejected"] += 1
        log.warning("cache: discarding %s: %s", path, why)
        try:
            path.unlink()
        except FileNotFoundError:
            pass
        return None

    # ------------------------------------------------------------------ write
    def put(self, entry: CacheEntry) -> Path:
        payload = entry.payload()
        document = {"format": FORMAT, "sha256": hashlib.sha256(_canonical(payload)).hexdigest(),
                    "payload": payload}
        path = self.path(entry.key)
        fd, tmp = tempfile.mkstemp(dir=self.root, prefix=".tmp-", suffix=".json")
        try:
            with os.fdopen(fd, "w") as handle:
                json.dump(document, handle, sort_keys=True)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, path)  # atomic: readers see the old entry or the new one
        except BaseException:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            raise
        with self._memory_lock:
            self._memory[entry.key.digest()] = entry
        return path

    # ------------------------------------------------------------------ build once
    @contextmanager
    def _locked(self, key: SpecializationKey):
        lock_path = self.root / f"{key.digest()}.lock"
        with open(lock_path, "a") as handle:
            deadline = time.monotonic() + self.lock_timeout_s
            while True:
                try:
                    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise CacheError(f"cache: waited {self.lock_timeout_s:g} s for another process "
                                         f"specializing {key.digest()} ({lock_path})") from None
                    time.sleep(0.05)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

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
            with self._memory_lock:
                self._memory[key.digest()] = entry
            return entry

    # ------------------------------------------------------------------ maintenance
    def entries(self) -> list[Path]:
        return sorted(self.root.glob("*.json"))

    def listing(self) -> list[tuple[Path, CacheEntry | None, str]]:
        """Every entry on disk as ``(path, entry, problem)``: the entry, or None with why it
        cannot be read (for listings; :meth:`get` is what checks an entry against its key)."""
        out = []
        for path in self.entries():
            try:
                out.append((path, CacheEntry.from_payload(json.loads(path.read_text())["payload"]), ""))
            except (ValueError, KeyError, TypeError) as exc:
                out.append((path, None, f"{type(exc).__name__}: {exc}"))
        return out

    def clear(self) -> int:
        removed = 0
        for path in self.entries():
            path.unlink(missing_ok=True)
            removed += 1
        # Lock files stay: deleting one that a running process holds would let a second
        # process lock a fresh file of the same name and build the same key concurrently.
        with self._memory_lock:
            self._memory.clear()
        return removed
