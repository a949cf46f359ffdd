"""``sparserl explain``: which kernel the cache says serves a matrix's products, and why."""

from __future__ import annotations

from .common import _cache, _columns, _folder, _listing, _matrix


def explain_command(args) -> int:
    """What the cache says about a matrix: which kernel serves each product, or why none does."""
    import numpy as np
    import torch

    from ..pattern.fingerprint import pattern_hash

    M = _matrix(args.matrix)
    if args.transposed:
        M = M.T.tocsr()
    hashes = {}
    for index_dtype in (torch.int32, torch.int64):
        crow = torch.from_numpy(M.indptr.astype(np.int64)).to(index_dtype)
        col = torch.from_numpy(M.indices.astype(np.int64)).to(index_dtype)
        hashes[pattern_hash(crow, col, M.shape[1])] = str(index_dtype).replace("torch.", "")
    cache = _cache(args)
    listing = _listing(cache)
    print(f"matrix   {args.matrix}{' (transposed)' if args.transposed else ''}: {M.shape[0]} x {M.shape[1]}, "
          f"{M.nnz} nonzeros; fingerprints " + ", ".join(f"{h[:12]} ({d})" for h, d in hashes.items()))
    found = 0
    for path, entry, _ in listing:
        if entry is None:
            continue
        key = entry.key
        if key.pattern not in hashes or (args.op and key.op != args.op) or (args.n and key.n != args.n):
            continue
        found += 1
        what = f"kernel {entry.family}{entry.params}" if entry.spec_source else "cuSPARSE"
        record = entry.record or {}
        timing = ""
        if record.get("runtime_us") and record.get("cusparse_us"):
            timing = f"; measured {record['runtime_us']:.1f} us vs cuSPARSE {record['cusparse_us']:.1f} us"
        print(f"{key.op} n={key.n} {key.dtype} {hashes[key.pattern]} indices, {key.arch}, policy {key.policy}, "
              f"torch {key.torch_version}: {what} because {entry.reason}{timing}  [{path.stem[:12]}]")
    if not found:
        # only a command that runs here: bench needs a GPU
        now = (f"(or run `sparserl bench {args.matrix}` now)" if torch.cuda.is_available() else
               "(this machine has none: `sparserl bench`, which decides it now, needs one)")
        print(f"no decision in {cache.root} for this pattern"
              f"{' and ' + args.op if args.op else ''}{f' n={args.n}' if args.n else ''}: it is decided the first "
              f"time the product runs on a GPU {now}")
    return 0


def add_command(commands) -> None:
    """Add this command and its options to the command line's subcommands."""
    p = commands.add_parser("explain", help="why a kernel was or was not installed for a matrix", description=(
        "Which kernel the specialization cache says serves each product of a matrix's pattern, and why; or that "
        "none was decided yet."))
    p.add_argument("matrix", help="shipped name or .npz/.mtx path")
    p.add_argument("--op", choices=["spmm", "spmv"], help="only this op")
    p.add_argument("--n", type=_columns, help="only this N")
    p.add_argument("--transposed", action="store_true", help="the transposed pattern (what the backward uses)")
    p.add_argument("--dir", type=_folder,
                   help="cache folder (default: $SPARSERL_CACHE_DIR or ~/.cache/torch_sparserl/kernels)")
    p.set_defaults(run=explain_command)
