"""``torch_sparserl.csr``: a :class:`~.csr_matrix.CSRMatrix` from whatever holds a matrix.

Torch sparse tensors (CSR, COO, CSC; COO and CSC indices checked before torch reads them), dense
tensors, SciPy matrices, another CSRMatrix, or a ``(crow, col, val)`` triple; the indices are
copied into tensors the library owns and validated once, so that no product waits for the device
to check them: host arrays bound for a CUDA device on the host (through the C++ library's one-pass
copy and check where it is loaded), CUDA indices on their device (a CUDA triple's metadata checks,
copies and check's launch in one call of the C++ library where it is loaded), the host reading the
verdict later (:class:`~torch_sparserl.pattern.device_check.DeviceCheck`).
"""

from __future__ import annotations

import contextlib
import operator
import warnings
from typing import Sequence

import numpy as np
import torch
from torch import Tensor

from .. import pattern as patterns
from ..dtypes import INDEX_DTYPES
from ..ops import doors
from ..pattern import device_check
from ..pattern.validation import check_csr_values
from .csr_matrix import CSRMatrix, _check_parts, values_of


def _staged_matrix(data, shape, dtype, index_dtype, device) -> CSRMatrix | None:
    """:func:`csr`'s short path for host ``(crow, col, val)`` tensors bound for a CUDA device (a
    sampled mini-batch, every step a new pattern): one C++ call checks their metadata and
    indices, copies the indices and sends the three (:func:`torch_sparserl.ops.doors.stage`), and the
    pattern is registered as validated. While it is young (``jit.admit_age_s``), C++ serves its
    products by cuSPARSE, and the matrix's door asks C++ first. None where it does not apply
    (conversions, autograd on the values, inference mode, a check that fails): :func:`csr`'s
    general path then converts, checks and names what is wrong."""
    crow, col, val = data
    if (type(crow) is not Tensor or type(col) is not Tensor or type(val) is not Tensor or val.requires_grad
            or crow.device.type != "cpu" or (dtype is not None and dtype != val.dtype)
            or (index_dtype is not None and index_dtype != crow.dtype) or torch.is_inference_mode_enabled()):
        return None
    try:
        nrows, ncols = shape
        nrows, ncols = operator.index(nrows), operator.index(ncols)
        device = torch.device(device)
    except (TypeError, ValueError, RuntimeError):
        return None
    if device.type != "cuda":
        return None
    staging = doors.stage(crow, col, val, nrows, ncols, device, young=True)
    if staging is None or len(staging[0]) != 3:
        return None
    (crow, col, val), door = staging
    patterns.staged(crow, col, ncols)
    A = CSRMatrix._wrap(crow, col, val, (nrows, ncols))
    if door is not None:  # C++ serves it while young: its eager products go to C++'s door first
        A.__dict__["_door"] = door
    return A


def _intake_matrix(data, shape, dtype, index_dtype, device) -> CSRMatrix | None:
    """:func:`csr`'s short path for a caller's CUDA ``(crow, col, val)`` tensors (a subgraph
    sampled on the GPU, every step a new pattern): one call of the C++ library checks their
    metadata, makes the library's copies of the indices and queues their check on the device
    (:func:`torch_sparserl.pattern.intake`). None where it does not apply (conversions, another
    device, the library or the kernel not loaded, a check that fails): :func:`csr`'s general
    path then converts, checks and names what is wrong."""
    crow, col, val = data
    if (type(crow) is not Tensor or type(col) is not Tensor or type(val) is not Tensor or crow.dim() != 1
            or not device_check.defers(crow, col) or (dtype is not None and dtype != val.dtype)
            or (index_dtype is not None and index_dtype != crow.dtype)):
        return None
    try:
        nrows, ncols = shape
        nrows, ncols = operator.index(nrows), operator.index(ncols)
        if device is not None:
            device = torch.device(device)
            if device.type != "cuda" or device.index not in (None, crow.device.index):
                return None
    except (TypeError, ValueError, RuntimeError):
        return None
    made = patterns.intake("torch_sparserl.csr", crow, col, val, nrows, ncols)
    if made is None:
        return None
    if val.is_inference():  # what the matrix keeps must be an ordinary tensor
        with torch.inference_mode(False):
            val = val.clone()
    return _made(made[0], made[1], val, (nrows, ncols))


def _staged(op: str, crow: Tensor, col: Tensor, val: Tensor, size: tuple, device) -> list[Tensor] | None:
    """Host CSR arrays on their way to a CUDA device through the C++ library, where it is loaded:
    the indices copied to private pinned memory, checked there and sent; the values too, unless
    autograd records their copy. None where it is not loaded or declines (a check that
    fails among them): the caller's Python path then copies, checks and names the error."""
    if not doors.can_stage():
        return None
    _check_parts(op, crow, col, None, size)
    carried = val.device.type == "cpu" and not val.requires_grad
    staged, _ = doors.stage(crow, col, val if carried else None, size[0], size[1], torch.device(device))
    return staged if len(staged) == (3 if carried else 2) else None


def _ordinary_tensors():
    """``inference_mode(False)`` where inference mode is on (what ``ts.csr`` keeps must have
    version counters); else nothing, since entering the mode costs microseconds per matrix."""
    return torch.inference_mode(False) if torch.is_inference_mode_enabled() else contextlib.nullcontext()


def _host_copy(t: Tensor, pinned: bool) -> Tensor:
    """A contiguous host copy of ``t`` (in pinned memory with ``pinned``), autograd-aware."""
    return torch.empty_like(t, memory_format=torch.contiguous_format, pin_memory=pinned).copy_(t)


def _tensor(x, name: str) -> Tensor:
    """``x`` as a tensor. Anything that is not already a torch tensor (NumPy arrays, lists) is
    copied: torch cannot see writes to memory it shares with NumPy."""
    if isinstance(x, Tensor):
        return x
    try:
        return torch.tensor(np.asarray(x))
    except Exception as exc:  # noqa: BLE001 - re-raised with the op's name
        raise TypeError(f"torch_sparserl.csr: {name} must be a tensor or array (got {type(x).__name__})") from exc


def _as_index_dtype(op: str, name: str, t: Tensor, dtype: torch.dtype) -> Tensor:
    """``t`` in the index dtype ``dtype``, refusing values it cannot hold instead of wrapping them."""
    if t.dtype == dtype:
        return t
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise TypeError(f"{op}: {name} must hold integers (got dtype {t.dtype})")
    info = torch.iinfo(dtype)
    if t.numel() and (int(t.min()) < info.min or int(t.max()) > info.max):
        bad = t[(t < info.min) | (t > info.max)][0]
        raise ValueError(f"{op}: {name} holds {int(bad)}, which {dtype} cannot represent; "
                         f"use index_dtype=torch.int64")
    return t.to(dtype)


def _check_coo_indices(A: Tensor) -> None:
    """The indices of a COO tensor, checked before torch reads them: a tensor built with
    ``check_invariants=False`` may hold any, and torch's ``coalesce`` trusts them."""
    op = "torch_sparserl.csr"
    indices = A._indices()
    for axis, name in ((0, "row"), (1, "column")):
        line = indices[axis]
        bad = (line < 0) | (line >= A.shape[axis])
        if line.numel() and bool(bad.any()):
            at = int(bad.nonzero()[0])
            raise ValueError(f"{op}: the COO tensor's {name} indices must be in [0, {A.shape[axis]}) "
                             f"(got {int(line[at])} at entry {at})")


def _check_csc_indices(A: Tensor) -> None:
    """The indices of a CSC tensor, checked before torch converts them (a tensor built with
    ``check_invariants=False`` may hold any): as the CSR matrix of its transpose."""
    op = "torch_sparserl.csr (a CSC tensor, checked as its transpose: crow = ccol_indices(), col = row_indices())"
    check_csr_values(op, A.ccol_indices(), A.row_indices(), A.shape[0])


def _from_torch_sparse(A: Tensor):
    if A.layout != torch.sparse_csr:
        if A.layout in (torch.sparse_coo, torch.sparse_csc, torch.strided):
            if A.dim() != 2:
                raise ValueError(f"torch_sparserl.csr: expected a 2-D matrix (got shape {tuple(A.shape)})")
            if A.layout == torch.sparse_coo:
                _check_coo_indices(A)
                A = A.coalesce()
            elif A.layout == torch.sparse_csc:
                _check_csc_indices(A)
            with warnings.catch_warnings():  # torch's note that CSR support is in beta: internal here
                warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")
                A = A.to_sparse_csr()
        else:
            raise TypeError(f"torch_sparserl.csr: cannot convert layout {A.layout}; "
                            "expected sparse_csr, sparse_coo, sparse_csc or a dense 2-D tensor")
    if A.dim() != 2 or A.values().dim() != 1:
        raise ValueError("torch_sparserl.csr: expected a 2-D CSR matrix without batch or dense "
                         f"dimensions (got shape {tuple(A.shape)}, values of shape {tuple(A.values().shape)})")
    # Views of a sparse tensor keep it as their base, which Dynamo cannot wrap: detach
    # (or clone where values carry a gradient, so that it still flows back to A).
    val = A.values().clone() if A.requires_grad else A.values().detach()
    return A.crow_indices().detach(), A.col_indices().detach(), val, tuple(A.shape)


def _from_scipy(A):
    # Copies: writes to the SciPy matrix (A.data *= 3, A.sort_indices()) must not reach the
    # CSRMatrix, and torch cannot see writes to memory it shares with NumPy.
    A = A.tocsr()
    return (torch.tensor(A.indptr), torch.tensor(A.indices), torch.tensor(A.data), tuple(A.shape))


def csr(data, shape: Sequence[int] | None = None, *, dtype: torch.dtype | None = None,
        index_dtype: torch.dtype | None = None, device=None, validate: bool = True) -> CSRMatrix:
    """Build a :class:`CSRMatrix`.

    ``data`` is a torch sparse tensor (CSR, COO or CSC), a dense 2-D tensor, a SciPy sparse
    matrix, a :class:`CSRMatrix`, or a triple ``(crow, col, val)`` of tensors or arrays
    (then ``shape`` is required). ``dtype``, ``index_dtype`` and ``device`` convert the
    values, the indices and the whole; integer or boolean values become the default float
    dtype; complex values are refused. With ``validate`` (the default) the index data is
    checked once here (monotone row pointers, columns in range), so later products skip that
    check. Indices already on a CUDA device are checked there without the host waiting for
    the device: bad ones raise their ``ValueError`` at the first use of the matrix after the
    device ran the check (products made before then are NaN, never out-of-bounds reads). Inside
    a CUDA graph capture (a captured training step whose indices are refilled before each
    replay) they are copied and checked inside the graph, again at every replay, and served
    by cuSPARSE; bad ones make that replay's products NaN, as a replay cannot raise.

    The matrix owns its indices: they are copied (once; a CSRMatrix's own are reused), so
    that nothing later written to the caller's arrays reaches it. Values given as a torch
    tensor are shared (every product reads them as they are, and gradients flow to them);
    values from NumPy or SciPy are copied.
    """
    op = "torch_sparserl.csr"
    if isinstance(data, (tuple, list)) and len(data) == 3 and shape is not None and validate:
        made = _intake_matrix(data, shape, dtype, index_dtype, device)
        if made is None and device is not None and doors.can_stage():
            made = _staged_matrix(data, shape, dtype, index_dtype, device)
        if made is not None:
            return made
    if isinstance(data, CSRMatrix):
        crow, col, val, size = data._crow, data._col, values_of(data), tuple(data.shape)
    elif isinstance(data, Tensor):
        crow, col, val, size = _from_torch_sparse(data)
        if validate and data.layout == torch.sparse_csr:  # a CUDA CSR tensor: one call of the C++ library
            made = _intake_matrix((crow, col, val), size, dtype, index_dtype, device)
            if made is not None:
                return made
    elif hasattr(data, "tocsr") and hasattr(data, "indptr") or type(data).__module__.startswith("scipy.sparse"):
        crow, col, val, size = _from_scipy(data)
    elif isinstance(data, (tuple, list)) and len(data) == 3:
        if shape is None:
            raise ValueError(f"{op}: shape=(nrows, ncols) is required with a (crow, col, val) triple")
        crow, col, val = (_tensor(x, n) for x, n in zip(data, ("crow", "col", "val")))
        size = shape
    else:
        raise TypeError(f"{op}: expected a torch sparse or dense tensor, a SciPy sparse matrix or "
                        f"a (crow, col, val) triple (got {type(data).__name__})")
    try:
        size = tuple(int(d) for d in size)
    except (TypeError, ValueError):
        raise TypeError(f"{op}: shape must be a pair of ints (nrows, ncols) (got {size!r})") from None
    if shape is not None and tuple(shape) != size:
        raise ValueError(f"{op}: shape {tuple(shape)} does not match the matrix's shape {size}")
    if len(size) != 2 or min(size) < 0:
        raise ValueError(f"{op}: shape must be (nrows, ncols), non-negative (got {size})")
    if val.is_complex():
        raise TypeError(f"{op}: complex values are not supported (got {val.dtype}); the products are real: "
                        f"pass the real and imaginary parts as two matrices")
    if not val.is_floating_point():
        val = val.to(torch.get_default_dtype())
    if index_dtype is not None and index_dtype not in INDEX_DTYPES:
        raise TypeError(f"{op}: index_dtype must be torch.int32 or torch.int64 (got {index_dtype})")
    if index_dtype is None and (crow.dtype != col.dtype or crow.dtype not in INDEX_DTYPES):
        # SciPy may give int64 indptr with int32 indices: widen both
        index_dtype = torch.int64
    if index_dtype is not None:
        if index_dtype == torch.int32 and max(size[0], size[1], col.shape[0] if col.dim() else 0) > torch.iinfo(torch.int32).max:
            raise ValueError(f"{op}: a matrix of shape {size} with {col.numel()} nonzeros needs int64 indices "
                             f"(got index_dtype=torch.int32)")
        crow = _as_index_dtype(op, "crow", crow, index_dtype)
        col = _as_index_dtype(op, "col", col, index_dtype)
    if dtype is not None:
        val = val.to(dtype)
    checked = False
    if device is not None and torch.device(device).type != "cpu" and crow.device.type == "cpu" \
            and col.device.type == "cpu":
        # Host indices bound for a GPU (a mini-batch sampled on the host): checked on a private
        # host copy, the one that travels, so that no product waits for the device to check
        # them (a device-to-host synchronization per new pattern) and no write to the caller's
        # arrays between the check and the copy reaches the matrix. To a CUDA device the copy
        # is pinned and travels without blocking the host (torch's pinned-memory allocator
        # keeps it until the transfer is done).
        pinned = torch.device(device).type == "cuda" and torch.cuda.is_available()
        with _ordinary_tensors():
            staged = _staged(op, crow, col, val, size, device) if validate and pinned else None
            if staged is not None:  # the C++ library's copy, check and transfer
                crow, col, val = staged[0], staged[1], staged[2] if len(staged) == 3 else val
                checked = True
            else:
                crow, col = _host_copy(crow, pinned), _host_copy(col, pinned)
                if validate:
                    _check_parts(op, crow, col, None, size)  # val is checked below, where it travels to
                    check_csr_values(op, crow, col, size[1])
                    checked = True
                crow, col = crow.to(device, non_blocking=pinned), col.to(device, non_blocking=pinned)
        patterns.own(crow, col)
        if pinned and val.device.type == "cpu":  # the values travel the same way (a copy either way)
            val = _host_copy(val, True).to(device, non_blocking=True)  # made here from the private copies: nobody else holds them
    if device is not None:
        if not checked:  # else crow and col are there already
            crow, col = crow.to(device), col.to(device)
        val = val.to(device)
    _check_parts(op, crow, col, val, size)
    # The matrix owns its indices: a copy, so that no later write to the caller's arrays (in
    # place, through .data, through NumPy, under inference_mode) reaches it, made an ordinary
    # tensor with a version counter even under inference_mode (pattern.private_copy).
    if val.is_inference():
        with torch.inference_mode(False):
            val = val.clone()
    if validate and not checked and crow.is_cuda and torch.cuda.is_current_stream_capturing():
        # Built inside a captured step (a mini-batch's padded indices, refilled before each
        # replay): copied, checked and repaired inside the graph, again at every replay.
        return _made(*patterns.in_graph_copies(op, crow, col, size[1]), val, size)
    if validate and not checked:  # a caller's CUDA indices: copied and checked at once, on the device
        copies = patterns.checked_copies(op, crow, col, size[1])
        if copies is not None:
            return _made(*copies, val, size)
    given = (crow, col)
    crow, col = (t if patterns.owned(t) else patterns.private_copy(t) for t in (crow, col))
    if validate:
        entry = patterns.lookup(crow, col, size[1])
        if checked:
            entry.checked_on_host(crow, col)
        else:  # CUDA indices are checked on the device, the host not waiting (Pattern.validate)
            entry.validate(op, crow, col, source=None if given[0] is crow else given)
    return _made(crow, col, val, size)


def _made(crow: Tensor, col: Tensor, val: Tensor, size: tuple) -> CSRMatrix:
    """The matrix of parts checked above: linked to ``val``'s autograd graph where it has one."""
    if val.requires_grad and torch.is_grad_enabled():
        return CSRMatrix(crow, col, val, size)  # linked to val's graph (_FromParts)
    return CSRMatrix._wrap(crow, col, val, size)
