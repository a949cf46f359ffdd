"""The identity cache of patterns: :class:`Pattern`, found by :func:`lookup`, and the library's
own index tensors (:func:`own`, :func:`private_copy`, :meth:`Pattern.expose`).

The contract (indices read once, keyed by identity and version) is the package's docstring
(:mod:`torch_sparserl.pattern`). This module holds the one table of patterns (``_CACHE``), the
registry of the library's own tensors (``_OWNED``) and the counters of :func:`stats`.
"""

from __future__ import annotations

import functools
import threading
import time
import weakref

import torch

from . import derived
from .derived import row_indices
from .streams import _side_stream_ready, run_kept, to_host
from . import device_check
from .device_check import DeviceCheck
from .validation import check_csr_values

HOST_KEPT_MAX = 1 << 18
"""Index elements (``nrows + 1 + nnz``) up to which a CUDA pattern keeps its host copy
(:meth:`Pattern.host_indices`) and is fingerprinted from it (:mod:`~torch_sparserl.pattern.fingerprint`):
1 MiB of int32 indices at most."""


def _version(t: torch.Tensor) -> int:
    # Inference tensors have no version counter; they cannot be modified outside
    # inference mode, so treat them as never changing.
    return -1 if t.is_inference() else t._version


def versions(crow: torch.Tensor, col: torch.Tensor) -> tuple[int, int]:
    """The version counters that say whether ``crow``/``col`` were changed in place."""
    return (_version(crow), _version(col))


# id -> tensor, for the index tensors the library made itself and never writes: a pattern on
# them reads them as they are instead of copying them. Weak: the registry keeps nothing alive.
_OWNED: "weakref.WeakValueDictionary[int, torch.Tensor]" = weakref.WeakValueDictionary()


def own(*tensors: torch.Tensor) -> None:
    """Mark index tensors that the library made (its private copies, derived patterns), so
    that a pattern on them needs no copy of its own. Not for a caller's tensors. The library
    writes them only to make indices that failed their device check harmless
    (:class:`~.device_check.DeviceCheck`)."""
    for t in tensors:
        _OWNED[id(t)] = t


def owned(t: torch.Tensor) -> bool:
    """Whether ``t`` is one of the library's own index tensors (:func:`own`)."""
    return _OWNED.get(id(t)) is t


def private_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` that the library owns: contiguous, an ordinary tensor (with a version
    counter) even under ``inference_mode``, and registered by :func:`own`."""
    with torch.inference_mode(False):
        copy = t.clone(memory_format=torch.contiguous_format)
    own(copy)
    return copy


def _with_versions(source):
    """``source`` (the caller's ``crow, col``) with their versions: what a device check needs to
    tell whether they still hold the indices it checked, when it names a failure."""
    return None if source is None else (source[0], source[1], (_version(source[0]), _version(source[1])))


def _intact(tensors: tuple, versions: tuple) -> bool:
    return all(_version(t) == v for t, v in zip(tensors, versions))


def _ordinary(fn, *args):
    """``fn(*args)`` outside ``inference_mode``: what a pattern keeps must be ordinary tensors,
    usable by later calls that autograd records."""
    with torch.inference_mode(False):
        return fn(*args)


class Pattern:
    """Derived data of one CSR pattern. Create through :func:`lookup`."""

    __slots__ = ("_crow_ref", "_col_ref", "_versions", "ncols", "nrows", "nnz", "device", "index_dtype",
                 "validated", "fingerprint", "_row_indices", "_transpose", "_diagonal",
                 "_no_diagonal", "_heads", "_heads_t", "_host", "_lock", "is_transpose", "check",
                 "_frozen", "_owned", "_freeze_lock", "transient", "in_graph", "transposed_products", "created",
                 "_aliases", "__weakref__")

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
        # the check of CUDA indices still on the device (DeviceCheck), or the one that failed;
        # None once it passed, and for indices checked on the host
        self.check: DeviceCheck | None = None
        self.fingerprint: str | None = None  # set by fingerprint.fingerprint()
        self._row_indices: torch.Tensor | None = None
        # derived forms, each (value, the index tensors it hands out, their versions): _derived()
        self._transpose: tuple | None = None
        self._diagonal: tuple | None = None
        self._no_diagonal: tuple | None = None
        self._heads: dict[int, tuple] = {}  # heads -> with_heads(...)
        self._heads_t: dict[int, tuple] = {}  # heads -> (the form's transpose perm, the order it gives)
        self._host: tuple[torch.Tensor, torch.Tensor] | None = None  # host_indices(), small CUDA patterns
        self._lock = threading.Lock()
        self.is_transpose = False  # the transpose of another pattern (Pattern.transpose)
        # the indices products read (indices()): the private copy validate() takes of a caller's
        # tensors; None for the library's own tensors, read through the weak references
        self._frozen: tuple[torch.Tensor, torch.Tensor] | None = None
        self._owned = owned(crow) and owned(col)  # read as they are: no copy (known once, not per call)
        self._freeze_lock = threading.Lock()
        self.transient = False  # not cached: inference-tensor indices, validated on every call (lookup)
        self.in_graph = False  # met while a CUDA graph was captured: its data lives in the graph (in_graph())
        self.transposed_products = 0  # asked before the transpose was computed (ops: _transposed_once)
        self.created = time.monotonic()  # the runtime's admission by age (jit.admit_age_s)
        # copies of the library's own indices handed to a caller (expose()): keys of this pattern,
        # each (crow ref, col ref, their versions at exposure, the own indices they stand for)
        self._aliases: list[tuple] = []

    @property
    def overfull(self) -> bool:
        """More nonzeros than positions (duplicates for sure): cuSPARSE refuses such a matrix
        and torch's sampled_addmm merges its duplicates, so torch's kernels cannot serve it
        (:mod:`~torch_sparserl.kernels.vendor` multiplies its dense form, which is smaller)."""
        return self.nnz > self.nrows * self.ncols

    def matches(self, crow: torch.Tensor, col: torch.Tensor, ncols: int) -> bool:
        """Whether ``(crow, col, ncols)`` is this pattern: the tensors it was made for, alive
        and unmodified by any write torch counts, or its own private copy of them."""
        if self.ncols != ncols:
            return False
        if self._crow_ref() is crow and self._col_ref() is col:
            return self._versions == (_version(crow), _version(col))
        frozen = self._frozen
        if frozen is not None and frozen[0] is crow and frozen[1] is col:
            return True
        for crow_ref, col_ref, at_exposure, _ in self._aliases:
            if crow_ref() is crow and col_ref() is col:
                return at_exposure == (_version(crow), _version(col))
        return False

    def expose(self, crow: torch.Tensor, col: torch.Tensor) -> None:
        """Make ``crow`` and ``col``, copies of this pattern's own indices that the library hands
        to a caller (``CSRMatrix.crow`` / ``.col``), keys of this pattern: a lookup of them finds
        it while no write torch counts has changed them, so that the runtime's records and the
        operators treat them as the matrix. Products still read the pattern's own indices, never
        the copies: a write torch does not count (``.data``, NumPy) changes no result, and a
        write it counts makes the copies a pattern of their own, validated again."""
        if not self._owned:
            raise ValueError("Pattern.expose: only for a pattern on the library's own indices")
        own_indices = (self._crow_ref(), self._col_ref())
        key = id(crow)
        ref = weakref.ref(crow, functools.partial(_forget_alias, key, weakref.ref(self)))
        with _CACHE_LOCK:
            self._aliases.append((ref, weakref.ref(col), (_version(crow), _version(col)), own_indices))
            _CACHE[key] = self

    def validate(self, op: str, crow: torch.Tensor, col: torch.Tensor, source=None) -> None:
        """Check the index data once (monotone rows, columns in range), on the copy that every
        later product of this pattern reads (:meth:`indices`). CUDA indices are checked on
        their device without the host waiting (:class:`~.device_check.DeviceCheck`): the
        verdict is read by a later use (:meth:`settle`). ``source``: the caller's tensors that
        the library's own ``crow``/``col`` were copied from, which a failure names."""
        if not self.validated:
            if crow.is_cuda and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"{op}: the indices of a matrix first used while a CUDA graph is captured "
                                   "cannot be checked there; use the matrix once before capturing (a warm-up step)")
            own_crow, own_col = self._freeze(crow, col, op, source)
            if self.check is not None:  # copied and checked at once (_freeze)
                _PENDING.add(self)
            elif (self._owned or own_crow is not crow) and device_check.defers(own_crow, own_col):
                # only the library holds them: checked in place on the device
                source = _with_versions(source if source is not None or own_crow is crow else (crow, col))
                self.check = device_check.copy_checked(op, own_crow, own_col, self.ncols, source, copy=False)[2]
                _PENDING.add(self)
            else:
                check_csr_values(op, own_crow, own_col, self.ncols)
            self.validated = True

    def settle(self, block: bool = False) -> bool:
        """Whether this pattern's indices are known to have passed their check: True for indices
        checked on the host, and once a device check's verdict came (waiting for it with
        ``block``); False while the device has not run it. Raises the check's ``ValueError``
        when they failed, at this and every later use."""
        check = self.check
        if check is None:
            return True
        verdict = check.verdict(block)
        if verdict is None:
            return False
        if not verdict:
            check.raise_failure()
        self.check = None
        return True

    def checked_on_host(self, crow: torch.Tensor, col: torch.Tensor) -> None:
        """Mark the pattern validated: ``crow`` and ``col`` are the library's own tensors, copied
        to the device from host indices that passed :func:`check_csr_values` (``ts.csr``)."""
        if not (owned(crow) and owned(col)):
            raise ValueError("checked_on_host: only for the library's own index tensors")
        self._freeze(crow, col)
        self.validated = True

    def _freeze(self, crow: torch.Tensor, col: torch.Tensor, op: str | None = None, source=None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """The indices this pattern reads from now on: the library's own tensors as they are, a
        caller's copied once (:func:`private_copy`, outside any CUDA graph pool) and registered
        under the copy's identity too, so that a lookup of the copy finds this entry. Given the
        ``op`` that validates them, a caller's CUDA indices are copied and checked together
        (:func:`~.device_check.copy_checked`: one launch of the fused kernel where it is built),
        the check left in :attr:`check`; ``source``: what a failure names (else ``crow, col``)."""
        frozen = self._frozen
        if frozen is not None:
            return frozen
        if self.transient:
            return crow, col
        if self._owned:  # read through the references: the caller may hold exposed copies (expose())
            return self._crow_ref(), self._col_ref()
        with self._freeze_lock:
            if self._frozen is None:
                if op is not None and device_check.defers(crow, col):
                    source = _with_versions(source if source is not None else (crow, col))
                    *copies, self.check = run_kept(col.device, device_check.copy_checked, op, crow, col,
                                                   self.ncols, source)
                    copies = tuple(copies)
                    own(*copies)
                else:
                    copies = run_kept(col.device, lambda: (private_copy(crow), private_copy(col)))
                self._frozen = copies
                if not self.transient:
                    with _CACHE_LOCK:
                        _CACHE[id(copies[0])] = self
            return self._frozen

    def indices(self, crow: torch.Tensor | None = None, col: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(crow, col)`` as validated: what every product of this pattern reads. ``crow`` and
        ``col`` are the tensors the pattern was looked up with (the library's own ones are
        read through the pattern's weak references when not given). Raises the ``ValueError``
        of a device check that failed, once its verdict came (:meth:`settle`)."""
        if self.check is not None:
            self.settle()
        frozen = self._frozen
        if frozen is not None:
            return frozen
        if crow is None:
            crow, col = self._crow_ref(), self._col_ref()
        return self._freeze(crow, col)

    def host_indices(self, crow: torch.Tensor, col: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(crow, col)`` on the host (:func:`to_host`). A CUDA pattern of at most
        :data:`HOST_KEPT_MAX` index elements keeps its copy, so that its fingerprint and the
        specializer's searches (one per op and width) share one device-to-host copy; CPU
        indices are returned as they are and never kept (the cache holds no strong reference
        to a user's tensors). Waits for the device check's verdict (the copy waits for the device
        anyway): the host never reads indices that failed it."""
        if self.check is not None:
            self.settle(block=True)
        kept = self._host
        if kept is not None:
            return kept
        crow, col = self.indices(crow, col)
        host = (to_host(crow), to_host(col))
        if crow.is_cuda and crow.numel() + col.numel() <= HOST_KEPT_MAX:
            self._host = host
        return host

    def row_indices(self, crow: torch.Tensor) -> torch.Tensor:
        """The row of each nonzero, shape (nnz,), int64."""
        if self._row_indices is None:
            crow, _ = self.indices(crow, None if self._frozen is None and crow is None else self._col_ref())
            self._row_indices = self._compute(crow.device, _ordinary, row_indices, crow, self.nnz)
        return self._row_indices

    def _compute(self, device: torch.device, fn, *args):
        """``fn(*args)`` for this pattern's derived data: by :func:`run_kept`, outside any CUDA
        graph's memory, except for a pattern met inside a capture, whose data is the graph's own
        and is computed again by every replay."""
        return fn(*args) if self.in_graph else run_kept(device, fn, *args)

    def _derived(self, name: str, key, compute, crow: torch.Tensor, col: torch.Tensor, *args):
        """A derived form of this pattern (``compute(self, crow, col, *args)``, run by
        :func:`run_kept` on the validated indices), cached under ``name`` (and ``key``) while
        the index tensors it hands out are unmodified: a caller who writes to them in place
        (``A.t()`` hands them out) gets a new form computed rather than a stale one."""
        crow, col = self.indices(crow, col)
        with self._lock:
            store = getattr(self, name)
            found = store.get(key) if isinstance(store, dict) else store
            if found is not None and _intact(found[1], found[2]):
                return found[0]
            value = self._compute(col.device, _ordinary, compute, self, crow, col, *args)
            exposed = value[1:3] if name == "_transpose" else value[0:2]
            own(*exposed)
            found = (value, exposed, tuple(_version(t) for t in exposed))
            if isinstance(store, dict):
                store[key] = found
            else:
                setattr(self, name, found)
            return value

    def transpose(self, crow: torch.Tensor, col: torch.Tensor):
        """``(pattern_t, crow_t, col_t, perm)``: the transposed pattern and its tensors.

        ``perm[k]`` is the position in the original ``val`` of the k-th nonzero of the
        transpose, so ``val_t = val[perm]``. Columns within each transposed row stay
        sorted, because the sort by column is stable and rows are visited in order.
        """
        return self._derived("_transpose", None, _transposed, crow, col)

    @property
    def has_transpose(self) -> bool:
        """Whether :meth:`transpose` has been computed (it may still be recomputed, where the
        tensors it handed out were written to)."""
        return self._transpose is not None

    def transposed_values(self, val: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
        """``val[perm]``: values in the order of the transposed pattern (``perm`` from
        :meth:`transpose`). Gathered on every call: values are read as they are, and no
        counter says reliably whether they changed (writes through ``.data`` bump none)."""
        return val.index_select(0, perm)

    def with_diagonal(self, crow: torch.Tensor, col: torch.Tensor):
        """``(crow_d, col_d, src_pos, diag_pos)``: the pattern with every diagonal position
        ``(i, i)``, ``i < min(nrows, ncols)``, present — the structure of ``A + c·I``.

        ``src_pos[k]`` is where the k-th nonzero of this pattern sits in the new one;
        ``diag_pos[i]`` is where ``(i, i)`` sits (an existing entry when there was one, its
        first occurrence if repeated). Rows come out with their columns sorted. The new
        tensors are registered in the cache, validated, so products on them skip the checks.
        """
        return self._derived("_diagonal", None, _with_diagonal, crow, col)

    def without_diagonal(self, crow: torch.Tensor, col: torch.Tensor):
        """``(crow_n, col_n, keep)``: the pattern with its diagonal entries ``(i, i)`` removed
        (PyG's ``remove_self_loops``); ``keep`` holds the positions of the entries kept, in
        their order. Computed once per pattern and registered, validated, like the others."""
        return self._derived("_no_diagonal", None, _without_diagonal, crow, col)

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
        return self._derived("_heads", heads, _with_heads, crow, col, heads)

    def with_heads_transposed(self, crow: torch.Tensor, col: torch.Tensor, heads: int):
        """``(pattern_t, crow_t, col_t, order_t)``: the transpose of :meth:`with_heads`' form
        (cached by that form), and where each of its nonzeros' values lies in the flattened
        ``(nnz, heads)`` values: ``val_t = val.reshape(-1)[order_t]``, one gather where going
        through the form's order and then the transpose's would take two."""
        crow_h, col_h, order, _ = self.with_heads(crow, col, heads)
        form_t, crow_t, col_t, perm = lookup(crow_h, col_h, self.ncols * heads).transpose(crow_h, col_h)
        with self._lock:
            found = self._heads_t.get(heads)
            if found is None or found[0] is not perm:
                found = self._heads_t[heads] = (perm, run_kept(col.device, _ordinary, torch.index_select,
                                                                    order, 0, perm))
        return form_t, crow_t, col_t, found[1]

    def heads_forms(self) -> list[tuple[int, "Pattern", "Pattern | None"]]:
        """``(heads, pattern, its transpose or None)`` of each block-diagonal form computed so
        far (:meth:`with_heads`), the transpose where a backward has computed it."""
        with self._lock:
            found = sorted((heads, kept[0]) for heads, kept in self._heads.items())
        forms = []
        for heads, (crow_h, col_h, _, _) in found:
            entry = lookup(crow_h, col_h, self.ncols * heads)
            forms.append((heads, entry, entry._transpose[0][0] if entry._transpose is not None else None))
        return forms


def _transposed(pattern: Pattern, crow: torch.Tensor, col: torch.Tensor):
    crow_t, col_t, perm = derived.transposed(pattern, crow, col)
    # In the identity cache too (it holds weak references only), so that what reaches the
    # transposed tensors by lookup (the specializer's host copy) meets this entry.
    pattern_t = _derived_entry(pattern, crow_t, col_t, pattern.nrows)
    pattern_t.is_transpose = True
    _STATS["transposes"] += 1
    return pattern_t, crow_t, col_t, perm


def _derived_entry(pattern: Pattern, crow: torch.Tensor, col: torch.Tensor, ncols: int) -> Pattern:
    """The cache entry of a form derived from ``pattern``: the library's own tensors, valid
    when ``pattern`` is."""
    own(crow, col)
    entry = lookup(crow, col, ncols)
    entry.validated = pattern.validated
    entry.check = pattern.check  # computed from the same indices: the same verdict
    entry.transient = pattern.transient  # a form of an uncached pattern is used once, never specialized
    entry.in_graph = pattern.in_graph
    return entry


def _with_heads(pattern: Pattern, crow: torch.Tensor, col: torch.Tensor, heads: int):
    crow_h, col_h, order, position = derived.with_heads(pattern, crow, col, heads)
    _derived_entry(pattern, crow_h, col_h, pattern.ncols * heads)
    return crow_h, col_h, order, position


def _without_diagonal(pattern: Pattern, crow: torch.Tensor, col: torch.Tensor):
    crow_n, col_n, keep = derived.without_diagonal(pattern, crow, col)
    _derived_entry(pattern, crow_n, col_n, pattern.ncols)
    _STATS["diagonals"] += 1
    return crow_n, col_n, keep


def _with_diagonal(pattern: Pattern, crow: torch.Tensor, col: torch.Tensor):
    crow_d, col_d, src_pos, diag_pos = derived.with_diagonal(pattern, crow, col)
    _derived_entry(pattern, crow_d, col_d, pattern.ncols)
    _STATS["diagonals"] += 1
    return crow_d, col_d, src_pos, diag_pos


_CACHE: dict[int, Pattern] = {}
_CACHE_LOCK = threading.Lock()
_STATS = {"lookups": 0, "misses": 0, "transposes": 0, "transposes_avoided": 0, "diagonals": 0}


def _forget(key: int, ref: weakref.ref, cache: dict[int, Pattern] = _CACHE) -> None:
    # crow died; runs at garbage collection, maybe inside a lock holder's thread: no lock.
    # The cache is bound as a default: at interpreter exit the module's globals are gone
    # before the last tensors die.
    entry = cache.get(key)
    if entry is not None and entry._crow_ref is ref:
        cache.pop(key, None)
        _drop_frozen_key(entry, cache)


def _forget_alias(key: int, entry_ref: weakref.ref, ref: weakref.ref, cache: dict[int, Pattern] = _CACHE) -> None:
    # an exposed copy died (Pattern.expose): its key and record go; no lock, as in _forget
    entry = entry_ref()
    if entry is None:
        return
    entry._aliases = [alias for alias in entry._aliases if alias[0] is not ref]
    if cache.get(key) is entry:
        cache.pop(key, None)


def _drop_frozen_key(entry: Pattern, cache: dict[int, Pattern] = _CACHE) -> None:
    """Remove the key of ``entry``'s private copy (:meth:`Pattern._freeze`), which would
    otherwise keep the entry and its copy alive once the caller's key is gone."""
    frozen = entry._frozen
    if frozen is not None and cache.get(id(frozen[0])) is entry:
        cache.pop(id(frozen[0]), None)


def lookup(crow: torch.Tensor, col: torch.Tensor, ncols: int) -> Pattern:
    """The cached :class:`Pattern` of ``(crow, col, ncols)``, created on first use.

    Keyed by the identity of ``crow`` and checked against ``col``'s identity and both
    version counters, so an in-place change of the indices invalidates the entry. Indices
    that are inference tensors have no version counter: their pattern is not cached (a new,
    ``transient`` one per call, validated again and never specialized).
    """
    _STATS["lookups"] += 1
    if crow.is_inference() or col.is_inference():
        entry = Pattern(crow, col, ncols)
        entry.transient = True
        return entry
    entry = _CACHE.get(id(crow))
    if entry is not None and entry.matches(crow, col, ncols):
        return entry
    with _CACHE_LOCK:
        entry = _CACHE.get(id(crow))
        if entry is not None and entry.matches(crow, col, ncols):
            return entry
        entry = _enter(crow, col, ncols)
    _side_stream_ready(col)
    return entry


def in_graph(op: str, crow: torch.Tensor, col: torch.Tensor, ncols: int) -> Pattern:
    """The pattern of CUDA indices an operator first meets while a CUDA graph is captured: never
    cached nor specialized (``transient``), as the graph's replays may bring other indices in
    the same tensors. It reads copies of them made, checked and repaired inside the graph
    (:func:`~.device_check.in_graph`), which it holds for the call, so every replay serves its
    own indices correctly; its derived forms (the backward's transpose) are computed in the
    graph too."""
    own_crow, own_col, check = device_check.in_graph(op, crow, col, ncols)
    entry = Pattern(own_crow, own_col, ncols)
    entry._frozen = (own_crow, own_col)
    return _made_in_graph(entry, check)


def in_graph_copies(op: str, crow: torch.Tensor, col: torch.Tensor, ncols: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """For a matrix built while a CUDA graph is captured (``ts.csr`` in a captured step): the
    copies of ``crow`` and ``col`` that :func:`in_graph` would read, which the caller holds, and
    their pattern cached under them while they live, so that each product of the matrix finds it."""
    own_crow, own_col, check = device_check.in_graph(op, crow, col, ncols)
    own(own_crow, own_col)
    with _CACHE_LOCK:
        entry = _enter(own_crow, own_col, ncols)
    _made_in_graph(entry, check)
    return own_crow, own_col


def _made_in_graph(entry: Pattern, check: DeviceCheck) -> Pattern:
    entry.transient = entry.in_graph = True
    entry.check = check
    entry.validated = True
    return entry


def _enter(crow: torch.Tensor, col: torch.Tensor, ncols: int) -> Pattern:
    """A new cache entry for ``(crow, col, ncols)``, replacing what ``id(crow)`` held (a dead
    tensor's entry whose callback has not run yet, a write, other ncols). Under _CACHE_LOCK."""
    _STATS["misses"] += 1
    previous = _CACHE.get(id(crow))
    if previous is not None:
        _drop_frozen_key(previous)
    entry = _CACHE[id(crow)] = Pattern(crow, col, ncols, key=id(crow))
    return entry


def checked_copies(op: str, crow: torch.Tensor, col: torch.Tensor, ncols: int
                   ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``ts.csr``'s intake of a caller's CUDA indices: the library's own copies of them, made and
    checked on the device by one call (:func:`~.device_check.copy_checked`, one kernel launch
    where the fused kernel is built), their pattern entered in the cache, validated, the check's
    verdict to be read by a later use (:meth:`Pattern.settle`). None where this does not apply
    (indices checked on the host, a tensor the library already owns): :func:`private_copy`,
    :func:`lookup` and :meth:`Pattern.validate` then."""
    if not device_check.defers(crow, col) or owned(crow) or owned(col):
        return None
    return _checked_entry(*device_check.copy_checked(op, crow, col, ncols, _with_versions((crow, col))), ncols)


def intake(op: str, crow: torch.Tensor, col: torch.Tensor, val: torch.Tensor, nrows: int, ncols: int
           ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """:func:`checked_copies` by one call of the C++ library (:func:`~.device_check.intake`), which
    also checks the metadata of ``crow``, ``col`` and ``val`` against ``(nrows, ncols)`` as
    ``ts.csr``'s Python path does. None where it does not serve: the Python path then."""
    if owned(crow) or owned(col):
        return None
    made = device_check.intake(op, crow, col, val, nrows, ncols, _with_versions((crow, col)))
    return None if made is None else _checked_entry(*made, ncols)


def _checked_entry(own_crow: torch.Tensor, own_col: torch.Tensor, check: DeviceCheck, ncols: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The cache entry of the library's copies ``own_crow``, ``own_col`` whose ``check`` is queued:
    validated, its verdict to be read by a later use."""
    own(own_crow, own_col)
    _STATS["lookups"] += 1
    with _CACHE_LOCK:
        entry = _enter(own_crow, own_col, ncols)
    entry.check = check
    entry.validated = True
    _PENDING.add(entry)
    _side_stream_ready(own_col)
    return own_crow, own_col


def staged(crow: torch.Tensor, col: torch.Tensor, ncols: int) -> Pattern:
    """The cached, validated :class:`Pattern` of index tensors the library has just made from host
    indices it checked (``ts.csr``'s staged path: new tensors, so no entry can match them):
    :func:`own`, :func:`lookup` and :meth:`Pattern.checked_on_host` in one step."""
    own(crow, col)
    _STATS["lookups"] += 1
    with _CACHE_LOCK:
        entry = _enter(crow, col, ncols)
        entry.validated = True
    _side_stream_ready(col)
    return entry


def host_indices(crow: torch.Tensor, col: torch.Tensor, ncols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(crow, col)`` on the host, shared with the pattern's entry (:meth:`Pattern.host_indices`)."""
    return lookup(crow, col, ncols).host_indices(crow, col)


_PENDING: "weakref.WeakSet[Pattern]" = weakref.WeakSet()  # patterns validated by a DeviceCheck not read yet


def settle_pending() -> None:
    """Read the verdict of every device check still out, waiting for the device where it has not
    run one yet: before a CUDA graph capture, during which a check's event may not be asked
    (:meth:`DeviceCheck.verdict`), so that the captured products of indices that passed are not
    poisoned. Raises nothing: a pattern whose check failed raises at its next use."""
    for entry in list(_PENDING):
        check = entry.check
        if check is not None and check.wait():
            entry.check = None
        _PENDING.discard(entry)


def validated(crow, col, ncols) -> Pattern | None:
    """The cached entry of ``(crow, col, ncols)`` if it exists, matches and was validated
    (its metadata and index values checked); else None. The operators' fast lookup."""
    entry = _CACHE.get(id(crow))
    if entry is not None and entry.validated and entry.matches(crow, col, ncols):
        _STATS["lookups"] += 1
        return entry
    return None


def stats() -> dict[str, int]:
    """Counters of cache use (lookups, misses, transposes, transposed products served without
    one, diagonals); for tests and logs."""
    return dict(_STATS)


def count(name: str) -> None:
    """One more of the counter ``name`` of :func:`stats`."""
    _STATS[name] += 1

