"""``sparserl cache``: the specialization cache's entries: list, info KEY, clear, prune."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from .. import config
from .common import CommandError, _cache, _describe, _finite, _folder, _listing


def _megabytes(text: str) -> float:
    """--max-mb: from 0 (remove every entry) to the largest cap SPARSERL_CACHE_MAX_MB takes."""
    expected = f"a number of megabytes >= 0 and <= {config.MAX_CACHE_MAX_MB:.0f}"
    value = _finite(text, expected, zero=True)
    if value > config.MAX_CACHE_MAX_MB:
        raise argparse.ArgumentTypeError(f"expected {expected} (got {text!r})")
    return value


def cache_command(args) -> int:
    cache = _cache(args)
    if args.key is not None and args.action != "info":
        raise CommandError(f"{args.action}: expected no KEY (only `cache info KEY` takes one) (got {args.key!r})")
    if args.max_mb is not None and args.action != "prune":
        raise CommandError(f"{args.action}: expected no --max-mb (only `cache prune` takes it) (got {args.max_mb:g})")
    failures = []
    if args.action == "clear":
        removed = cache.clear(failures)
        if failures:
            raise _removal_failed(cache, failures, f"{removed} removed")
        print(f"removed {removed} entries from {cache.root}")
        if not args.dir:  # the cubins live in the user's own cache folder only
            from ..toolchain import cubins

            removed = cubins.clear(failures)
            if failures:
                raise _removal_failed(cache, failures, f"{removed} built kernels removed from "
                                      f"{cache.root.parent / cubins.FOLDER}")
            print(f"removed {removed} built kernels from {cache.root.parent / cubins.FOLDER}")
        return 0
    if args.action == "prune":
        limit = int(args.max_mb * (1 << 20)) if args.max_mb is not None else None
        removed, freed, kept = cache.prune(limit, failures)
        done = (f"removed {removed} least recently used entries ({freed / 2**20:.2f} MB) from {cache.root}; "
                f"{kept / 2**20:.2f} MB kept (limit {(limit if limit is not None else cache.max_bytes) / 2**20:g} MB)")
        if failures:
            raise _removal_failed(cache, failures, done)
        print(done)
        return 0
    if args.action == "list":
        listing = _listing(cache)
        size = cache.disk_bytes()
        print(f"{len(listing)} entries in {cache.root} ({size / 2**20:.2f} MB of at most {cache.max_bytes / 2**20:g} MB)")
        for path, entry, problem in listing:
            if entry is None:
                print(f"{path.stem}  unreadable: {problem}")
                continue
            key = entry.key
            what = entry.family + str(entry.params) if entry.spec_source else "cuSPARSE"
            print(f"{path.stem}  {key.op} n={key.n} {key.dtype} {key.arch} "
                  f"pattern={key.pattern[:12]}  -> {what}  ({entry.reason})")
        return 0
    if args.key is None:
        raise CommandError("info: expected the KEY of an entry, its digest or a prefix of it "
                           "(`sparserl cache list` shows them)")
    matches = [path for path in cache.entries() if path.stem.startswith(args.key)]
    if len(matches) != 1:
        raise CommandError(f"info: expected one entry starting with {args.key!r}, found {len(matches)}")
    document = _entry_document(matches[0])
    print(json.dumps(document, indent=1))
    return 0


def _entry_document(path: Path):
    """The JSON of the entry at ``path``, read as the cache reads entries: a regular file of
    bounded size, never through a symbolic link, never blocking."""
    from ..jit.cache import MAX_ENTRY_BYTES
    from ..toolchain.trust import UnsafeFile, read_regular

    try:
        raw = read_regular(path, MAX_ENTRY_BYTES)
    except FileNotFoundError as exc:
        raise CommandError(f"info: expected the entry {path.name} (got nothing: removed meanwhile, by a prune, a "
                           "clear or a write that found it unusable)") from exc
    except UnsafeFile as exc:
        raise CommandError(f"info: expected a regular file of at most {MAX_ENTRY_BYTES} bytes at {path} (got "
                           f"{exc}, which the cache refuses to read; `sparserl cache clear` removes it)") from exc
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise CommandError(f"info: expected JSON in {path} (got {_describe(exc)})") from exc


def _removal_failed(cache, failures, done: str) -> CommandError:
    """The error of a clear or prune that left entries it could not remove (a read-only folder)."""
    _, exc = failures[0]  # the first says why (the same for all, in a read-only folder)
    return CommandError(f"expected to remove entries from {cache.root}, but {len(failures)} could not be removed "
                        f"({_describe(exc)}); {done}")


def add_command(commands) -> None:
    """Add this command and its options to the command line's subcommands."""
    p = commands.add_parser("cache", help="the specialization cache: list, info KEY, clear, prune", description=(
        "The specialization cache's decisions: list them, show one (info KEY), remove them all (clear), or "
        "remove the least recently used down to a size (prune)."))
    p.add_argument("action", choices=["list", "info", "clear", "prune"], help="what to do")
    p.add_argument("key", nargs="?", help="entry digest (or its prefix) for info")
    p.add_argument("--dir", type=_folder,
                   help="cache folder (default: $SPARSERL_CACHE_DIR or ~/.cache/torch_sparserl/kernels)")
    p.add_argument("--max-mb", type=_megabytes,
                   help="prune: keep at most this many megabytes of entries (default: cache.max_mb, "
                        "$SPARSERL_CACHE_MAX_MB)")
    p.set_defaults(run=cache_command)
