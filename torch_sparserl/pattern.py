"""Per-pattern state, computed once and cached by tensor identity and version.

A *pattern* is the structure of a CSR matrix: ``crow``, ``col`` and ``ncols``. Everything
derived from it alone — the validation verdict, the row index of every nonzero, the
transposed pattern and the permutation that carries values into it — is computed on first
use and reused while the same ``crow``/``col`` tensors live unmodified. The cache holds
weak references only, so it never keeps a user's adjacency alive.

Values are not part of the pattern: they may change every step (attention-weighted
graphs). The one thing kept about them is the last values carried into the transposed
order (:meth:`Pattern.transposed_values`), checked by identity and version on every use.

The cached tensors are computed by :func:`run_kept`, outside any CUDA graph's private
memory pool: the first product on a pattern may run inside the warm-up of a CUDA graph
(``mode="reduce-overhead"``), where a tensor kept beyond the step is an error.
"""

from __future__ import annotations

import functools
import threading
from concurrent.futures import ThreadPoolExecutor
import weakref

import torch

from .validation import check_csr_values


def row_indices(crow: torch.Tensor, nnz: int) -> torch.Tensor:
    """The row of each of the ``nnz`` nonzeros of the row pointers ``crow``, int64. Uncached
    and traceable (a compiled graph computes it); :meth:`Pattern.row_indices` caches it."""
    lengths = (crow[1:] - crow[:-1]).to(torch.int64)
    rows = torch.arange(crow.shape[0] - 1, device=crow.device)
    return torch.repeat_interleave(rows, lengths, output_size=nnz)


_KEEPER = threading.local()
_KEEPER_POOL: ThreadPoolExecutor | None = None
_KEEPER_LOCK = threading.Lock()
_SIDE_STREAMS: dict[int, torch.cuda.Stream] = {}


def run_kept(device: torch.device, fn, *args):
    """``fn(*args)`` for data kept beyond the current step (pattern data, kernel plans): on CUDA,
    run in a helper thread, on a side stream ordered after the caller's current stream and
    before its later work, so that its tensors come from the caching allocator's ordinary pool.

    The first product on a pattern may run inside the warm-up of a CUDA graph (``mode=
    "reduce-overhead"``), where CUDA graph trees route every allocation of the warming-up
    thread to the graphs' private pool, which must hold only the step's own tensors. Refused
    during a capture, which cannot run the host synchronizations this data needs. ``fn`` must
    not wait for locks its caller holds."""
    global _KEEPER_POOL
    if device.type != "cuda" or getattr(_KEEPER, "active", False):
        return fn(*args)
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError("sparserl: pattern data (transpose, row indices, kernel plans) cannot be computed while "
                           "a CUDA graph is being captured; run the product once before capturing it (CUDA graph "
                           "trees do so in their warm-up)")
    index = device.index if device.index is not None else torch.cuda.current_device()
    caller = torch.cuda.current_stream(index)
    with _KEEPER_LOCK:
        if _KEEPER_POOL is None:
            _KEEPER_POOL = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sparserl-pattern")
    side = _side_stream(index)

    def work():
        _KEEPER.active = True
        try:
            with torch.cuda.device(index), torch.cuda.stream(side):
                side.wait_stream(caller)
                return fn(*args)
        finally:
            _KEEPER.active = False

    out = _KEEPER_POOL.submit(work).result()
    # The kept tensors are freed only when their owner dies; later work on the side stream
    # first waits for the caller's stream, so their memory is not reused under a pending read.
    caller.wait_stream(side)
    return out


def _side_stream(index: int) -> torch.cuda.Stream:
    with _KEEPER_LOCK:
        side = _SIDE_STREAMS.get(index)
        if side is None:
            side = _SIDE_STREAMS[index] = torch.cuda.Stream(index)
        return side


HOST_KEPT_MAX = 1 << 18
"""Index elements (``nrows + 1 + nnz``) up to which a CUDA pattern keeps its host copy
(:meth:`Pattern.host_indices`) and is fingerprinted from it (:mod:`~torch_sparserl.fingerprint`):
1 MiB of int32 indices at most."""


def to_host(t: torch.Tensor) -> torch.Tensor:
    """A CPU copy of ``t`` (``t`` itself when on the CPU). A CUDA tensor is copied on the
    device's side stream, ordered after the caller's current stream: the caller's stream does
    not queue behind the copy, so a background thread's copy holds up a training loop's
    kernels less."""
    if t.device.type != "cuda":
        return t
    index = t.device.index if t.device.index is not None else torch.cuda.current_device()
    side = _side_stream(index)
    side.wait_stream(torch.cuda.current_stream(index))
    with torch.cuda.stream(side):
        return t.cpu()


def _version(t: torch.Tensor) -> int:
    # Inference tensors have no version counter; they cannot be modified outside
    # inference mode, so treat them as never changing.
    return -1 if t.is_inference() else t._version


def versions(crow: torch.Tensor, col: torch.Tensor) -> tuple[int, int]:
    """The version counters that say whether ``crow``/``col`` were changed in place."""
    return (_version(crow), _version(col))


class Pattern:
    """Derived data of one CSR pattern. Create through :func:`lookup`."""

    __slots__ = ("_crow_ref", "_col_ref", "_versions", "ncols", "nrows", "nnz", "device", "index_dtype",
                 "validated", "fingerprint", "specializations", "_row_indices", "_transpose", "_diagonal",
                 "_no_diagonal", "_heads", "_heads_t", "_values_t", "_host", "_lock", "fast_recorded", "is_transpose",
                 "__weakref__")

    def __init__(self, crow: torch.Tensor, col: torch.Tensor, ncols: int, key: int | None = None):
        # key: the id of crow in the cache (lookup), whose entry goes when crow dies
        self._crow_ref = weakref.ref(crow, None if key is None else functools.partial(_forget, key))
        self._col_ref = weakref.ref(col)
        self._versions = (_version(crow), _version(col))
        self.ncols = int(ncols)
        self.nrows = crow.shape[0] - 1
        self.nnz = col.shape[0]
        self.device = col.device
        self.index_dtype = col.dtype
        self.validated = False
        self.fingerprint: str | None = None  # set by fingerprint.fingerprint()
        self.specializations: dict = {}  # (op, n, dtype) -> runtime state (runtime.py)
        self._row_indices: torch.Tensor | None = None
        self._transpose: tuple[Pattern, torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._diagonal: tuple | None = None
        self._no_diagonal: tuple | None = None
        self._heads: dict[int, tuple] = {}  # heads -> with_heads(...)
        self._heads_t: dict[int, tuple] = {}  # heads -> with_heads_transposed(...)
        self._values_t: tuple | None = None  # (weakref to val, its version, val[perm] or None)
        self._host: tuple[torch.Tensor, torch.Tensor] | None = None  # host_indices(), small CUDA patterns
        self._lock = threading.Lock()
        self.fast_recorded: set = set()  # what fastpath.record gave the C++ registry
        self.is_transpose = False  # the transpose of another pattern (Pattern.transpose)

    def matches(self, crow: torch.Tensor, col: torch.Tensor, ncols: int) -> bool:
        return (self._crow_ref() is crow and self._col_ref() is col and self.ncols == ncols
                and self._versions == (_version(crow), _version(col)))

    def validate(self, op: str, crow: torch.Tensor, col: torch.Tensor) -> None:
        if not self.validated:
            check_csr_values(op, crow, col, self.ncols)
            self.validated = True

    def host_indices(self, crow: torch.Tensor, col: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(crow, col)`` on the host (:func:`to_host`). A CUDA pattern of at most
        :data:`HOST_KEPT_MAX` index elements keeps its copy, so that its fingerprint and the
        specializer's searches (one per op and width) share one device-to-host copy; CPU
        indices are returned as they are and never kept (the cache holds no strong reference
        to a user's tensors)."""
        kept = self._host
        if kept is not None:
            return kept
        host = (to_host(crow), to_host(col))
        if crow.is_cuda and crow.numel() + col.numel() <= HOST_KEPT_MAX:
            self._host = host
        return host

    def row_indices(self, crow: torch.Tensor) -> torch.Tensor:
        """The row of each nonzero, shape (nnz,), int64."""
        if self._row_indices is None:
            self._row_indices = run_kept(crow.device, row_indices, crow, self.nnz)
        return self._row_indices

    def transpose(self, crow: torch.Tensor, col: torch.Tensor):
        """``(pattern_t, crow_t, col_t, perm)``: the transposed pattern and its tensors.

        ``perm[k]`` is the position in the original ``val`` of the k-th nonzero of the
        transpose, so ``val_t = val[perm]``. Columns within each transposed row stay
        sorted, because the sort by column is stable and rows are visited in order.
        """
        with self._lock:
            if self._transpose is None:
                self._transpose = run_kept(col.device, self._transposed, crow, col)
                _STATS["transposes"] += 1
            return self._transpose

    def transposed_values(self, val: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
        """``val[perm]``: values in the order of the transposed pattern (``perm`` from
        :meth:`transpose`), which the backward of ``A @ X`` needs every step.

        A GCN's adjacency values are the same tensor, unmodified, step after step: values
        seen twice with the same identity and version are gathered once more into a kept
        tensor (:func:`run_kept`) and served from it while they stay so. Values that change
        (attention weights, a new tensor each step) are gathered each call, as are values
        that need a gradient, inference tensors (no version counter) and calls inside a
        CUDA graph capture, where a replay must read the values of its own step.
        """
        if (val.requires_grad or val.is_inference()
                or (val.is_cuda and torch.cuda.is_current_stream_capturing())):
            return val.index_select(0, perm)
        version = val._version
        seen = self._values_t
        if seen is not None and seen[0]() is val and seen[1] == version:
            if seen[2] is None:
                seen = self._values_t = (seen[0], version, run_kept(val.device, torch.index_select, val, 0, perm))
                _STATS["transposed_values"] += 1
            return seen[2]
        self._values_t = (weakref.ref(val), version, None)
        return val.index_select(0, perm)

    def _transposed(self, crow: torch.Tensor, col: torch.Tensor):
        rows = self.row_indices(crow)
        perm = torch.argsort(col, stable=True)
        col_t = rows.index_select(0, perm).to(self.index_dtype)
        counts = torch.bincount(col.to(torch.int64), minlength=self.ncols)
        crow_t = torch.zeros(self.ncols + 1, dtype=self.index_dtype, device=col.device)
        crow_t[1:] = counts.cumsum(0)
        # In the identity cache too (it holds weak references only), so that what reaches the
        # transposed tensors by lookup (the specializer's host copy) meets this entry.
        pattern_t = lookup(crow_t, col_t, self.nrows)
        pattern_t.validated = self.validated
        pattern_t.is_transpose = True
        return pattern_t, crow_t, col_t, perm

    def with_diagonal(self, crow: torch.Tensor, col: torch.Tensor):
        """``(crow_d, col_d, src_pos, diag_pos)``: the pattern with every diagonal position
        ``(i, i)``, ``i < min(nrows, ncols)``, present — the structure of ``A + c·I``.

        ``src_pos[k]`` is where the k-th nonzero of this pattern sits in the new one;
        ``diag_pos[i]`` is where ``(i, i)`` sits (an existing entry when there was one, its
        first occurrence if repeated). Rows come out with their columns sorted. The new
        tensors are registered in the cache, validated, so products on them skip the checks.
        """
        with self._lock:
            if self._diagonal is None:
                self._diagonal = run_kept(col.device, _with_diagonal, self, crow, col)
                _STATS["diagonals"] += 1
            return self._diagonal

    def without_diagonal(self, crow: torch.Tensor, col: torch.Tensor):
        """``(crow_n, col_n, keep)``: the pattern with its diagonal entries ``(i, i)`` removed
        (PyG's ``remove_self_loops``); ``keep`` holds the positions of the entries kept, in
        their order. Computed once per pattern and registered, validated, like the others."""
        with self._lock:
            if self._no_diagonal is None:
                self._no_diagonal = run_kept(col.device, _without_diagonal, self, crow, col)
                _STATS["diagonals"] += 1
            return self._no_diagonal

    def with_heads(self, crow: torch.Tensor, col: torch.Tensor, heads: int):
        """``(crow_h, col_h, order, position)``: the pattern of ``heads`` products on this one
        at once, as one block-diagonal matrix of ``heads * nrows`` rows and ``heads * ncols``
        columns, node-major: its row ``i * heads + h`` holds head ``h`` of row ``i``, with
        columns ``col[k] * heads + h``. Features of shape ``(ncols, heads, C)`` are then its
        operand as they lie, ``(ncols * heads, C)``, and the product comes out as
        ``(nrows, heads, C)``; attention values ``(nnz, heads)``, flattened, reach the new
        order through ``order`` (``val_h = val.reshape(-1)[order]``), and values in the new
        order go back through ``position`` (``val = val_h[position].view(nnz, heads)``).
        Computed once per pattern and number of heads, registered and validated like the others.
        """
        with self._lock:
            found = self._heads.get(heads)
            if found is None:
                found = self._heads[heads] = run_kept(col.device, _with_heads, self, crow, col, heads)
            return found

    def with_heads_transposed(self, crow: torch.Tensor, col: torch.Tensor, heads: int):
        """``(pattern_t, crow_t, col_t, order_t)``: the transpose of :meth:`with_heads`' form
        (cached by that form), and where each of its nonzeros' values lies in the flattened
        ``(nnz, heads)`` values: ``val_t = val.reshape(-1)[order_t]``, one gather where going
        through the form's order and then the transpose's would take two."""
        crow_h, col_h, order, _ = self.with_heads(crow, col, heads)
        form_t, crow_t, col_t, perm = lookup(crow_h, col_h, self.ncols * heads).transpose(crow_h, col_h)
        with self._lock:
            order_t = self._heads_t.get(heads)
            if order_t is None:
                order_t = self._heads_t[heads] = run_kept(col.device, torch.index_select, order, 0, perm)
        return form_t, crow_t, col_t, order_t

    def heads_forms(self) -> list[tuple[int, "Pattern", "Pattern | None"]]:
        """``(heads, pattern, its transpose or None)`` of each block-diagonal form computed so
        far (:meth:`with_heads`), the transpose where a backward has computed it."""
        with self._lock:
            found = sorted(self._heads.items())
        forms = []
        for heads, (crow_h, col_h, _, _) in found:
            entry = lookup(crow_h, col_h, self.ncols * heads)
            forms.append((heads, entry, entry._transpose[0] if entry._transpose is not None else None))
        return forms


def _with_heads(pattern: Pattern, crow: torch.Tensor, col: torch.Tensor, heads: int):
    device, nnz = col.device, pattern.nnz
    starts = crow.to(torch.int64)
    rows = pattern.row_indices(crow)
    lengths = starts[1:] - starts[:-1]
    head = torch.arange(heads, device=device)
    first = starts[:-1].unsqueeze(1) * heads + head * lengths.unsqueeze(1)  # (nrows, heads): where row (i, h) starts
    crow_h = torch.full((pattern.nrows * heads + 1,), nnz * heads, dtype=torch.int64, device=device)
    crow_h[:-1] = first.reshape(-1)
    within = torch.arange(nnz, device=device) - starts.index_select(0, rows)
    position = (first.index_select(0, rows) + within.unsqueeze(1)).reshape(-1)  # of entry (k, h), flat k * heads + h
    order = torch.empty_like(position)
    order[position] = torch.arange(nnz * heads, device=device)
    col_h = torch.empty(nnz * heads, dtype=pattern.index_dtype, device=device)
    col_h[position] = (col.to(torch.int64).unsqueeze(1) * heads + head).reshape(-1).to(pattern.index_dtype)
    crow_h = crow_h.to(pattern.index_dtype)
    entry = lookup(crow_h, col_h, pattern.ncols * heads)
    entry.validated = pattern.validated
    # gather indices in the pattern's index dtype: half the memory for int32 patterns, whose
    # form's positions fit int32 by the operators' check
    return crow_h, col_h, order.to(pattern.index_dtype), position.to(pattern.index_dtype)


def _without_diagonal(pattern: Pattern, crow: torch.Tensor, col: torch.Tensor):
    rows = pattern.row_indices(crow)
    keep = (rows != col.to(torch.int64)).nonzero().squeeze(1)
    counts = torch.bincount(rows.index_select(0, keep), minlength=pattern.nrows)
    crow_n = torch.zeros(pattern.nrows + 1, dtype=pattern.index_dtype, device=col.device)
    crow_n[1:] = counts.cumsum(0)
    col_n = col.index_select(0, keep)
    entry = lookup(crow_n, col_n, pattern.ncols)
    entry.validated = pattern.validated
    return crow_n, col_n, keep


def _with_diagonal(pattern: Pattern, crow: torch.Tensor, col: torch.Tensor):
    n = min(pattern.nrows, pattern.ncols)
    device = col.device
    rows = pattern.row_indices(crow)
    cols = col.to(torch.int64)
    on_diagonal = (rows == cols).nonzero().squeeze(1)
    # first existing entry of each diagonal position, or -1
    first = torch.full((n,), pattern.nnz, dtype=torch.int64, device=device)
    first.scatter_reduce_(0, rows[on_diagonal], on_diagonal, reduce="amin")
    missing = (first == pattern.nnz).nonzero().squeeze(1)
    all_rows = torch.cat([rows, missing])
    all_cols = torch.cat([cols, missing])
    order = torch.argsort(all_rows * max(pattern.ncols, 1) + all_cols, stable=True)
    position = torch.empty_like(order)
    position[order] = torch.arange(order.shape[0], device=device)
    src_pos = position[:pattern.nnz]
    diag_pos = torch.where(first < pattern.nnz, src_pos[first.clamp(max=max(pattern.nnz - 1, 0))]
                           if pattern.nnz else first, torch.zeros_like(first))
    diag_pos[missing] = position[pattern.nnz:]
    counts = torch.bincount(all_rows, minlength=pattern.nrows)
    crow_d = torch.zeros(pattern.nrows + 1, dtype=pattern.index_dtype, device=device)
    crow_d[1:] = counts.cumsum(0)
    col_d = all_cols.index_select(0, order).to(pattern.index_dtype)
    entry = lookup(crow_d, col_d, pattern.ncols)
    entry.validated = pattern.validated
    return crow_d, col_d, src_pos, diag_pos


# id(crow) -> Pattern; an entry is dropped when its crow dies (the weak reference's
# callback), so ids are never confused and no adjacency is kept alive. A plain dict: the
# operators look their pattern up on every call.
_CACHE: dict[int, Pattern] = {}
_CACHE_LOCK = threading.Lock()
_STATS = {"lookups": 0, "misses": 0, "transposes": 0, "diagonals": 0, "transposed_values": 0}


def _forget(key: int, ref: weakref.ref, cache: dict[int, Pattern] = _CACHE) -> None:
    # crow died; runs at garbage collection, maybe inside a lock holder's thread: no lock.
    # The cache is bound as a default: at interpreter exit the module's globals are gone
    # before the last tensors die.
    entry = cache.get(key)
    if entry is not None and entry._crow_ref is ref:
        cache.pop(key, None)


def lookup(crow: torch.Tensor, col: torch.Tensor, ncols: int) -> Pattern:
    """The cached :class:`Pattern` of ``(crow, col, ncols)``, created on first use.

    Keyed by the identity of ``crow`` and checked against ``col``'s identity and both
    version counters, so an in-place change of the indices invalidates the entry.
    """
    _STATS["lookups"] += 1
    entry = _CACHE.get(id(crow))
    if entry is not None and entry.matches(crow, col, ncols):
        return entry
    with _CACHE_LOCK:
        entry = _CACHE.get(id(crow))
        if entry is not None and entry.matches(crow, col, ncols):
            return entry
        _STATS["misses"] += 1
        entry = Pattern(crow, col, ncols, key=id(crow))
        _CACHE[id(crow)] = entry
    if col.is_cuda and not torch.cuda.is_current_stream_capturing():
        # The pattern's data and host copy are made on this side stream (run_kept, to_host).
        # Its first creation in a process sets up torch's CUDA stream pool, which holds the
        # interpreter lock for 3-5 ms (H100, benchmarks/profile_first_waits.py): made here, on
        # the thread registering the pattern, rather than in the runtime's background thread
        # while the training loop waits for the lock.
        _side_stream(col.device.index if col.device.index is not None else torch.cuda.current_device())
    return entry


def host_indices(crow: torch.Tensor, col: torch.Tensor, ncols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(crow, col)`` on the host, shared with the pattern's entry (:meth:`Pattern.host_indices`)."""
    return lookup(crow, col, ncols).host_indices(crow, col)


def validated(crow, col, ncols) -> Pattern | None:
    """The cached entry of ``(crow, col, ncols)`` if it exists, matches and was validated
    (its metadata and index values checked); else None. The operators' fast lookup."""
    entry = _CACHE.get(id(crow))
    if entry is not None and entry.validated and entry.matches(crow, col, ncols):
        _STATS["lookups"] += 1
        return entry
    return None


def live_patterns() -> list[Pattern]:
    """The cached patterns whose index tensors are still alive."""
    with _CACHE_LOCK:
        return [entry for entry in list(_CACHE.values()) if entry._crow_ref() is not None]


def stats() -> dict[str, int]:
    """Counters of cache use (lookups, misses, transposes, diagonals and transposed values kept); for tests and logs."""
    return dict(_STATS)
