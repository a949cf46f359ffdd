"""The one CSR validator every entry point shares.

Errors name the op, what was expected and what came. Checks on metadata (dtypes, shapes,
devices) are cheap and run on every call, also while tracing with fake tensors. Checks on
index values (monotone row pointers, column range) need the data; they run once per
pattern and the result is cached (see :mod:`torch_sparserl.pattern`).
"""

from __future__ import annotations

import torch

from ..dtypes import INDEX_DTYPES, VALUE_DTYPES


def _fail(op: str, message: str, exc: type[Exception] = ValueError) -> None:
    raise exc(f"{op}: {message}")


def require(op: str, condition, message) -> None:
    """Raise ``ValueError`` naming ``op`` unless ``condition`` holds. ``message`` is a string or
    a function returning one, called only when the check fails (the checks run on every call,
    and formatting their messages cost more than the checks).

    With symbolic sizes (tracing) the condition is handed to ``torch._check``, so it
    becomes a runtime assertion instead of a guard that specializes the graph.
    """
    if isinstance(condition, bool):
        if not condition:
            _fail(op, message() if callable(message) else message)
    else:
        torch._check(condition, lambda: f"{op}: {message() if callable(message) else message}")


def _describe(t) -> str:
    if isinstance(t, torch.Tensor):
        return f"Tensor(shape={tuple(t.shape)}, dtype={t.dtype}, device={t.device})"
    return f"{type(t).__name__}"


def check_tensor(op: str, name: str, t, *, dim: int | None = None, dtypes=None) -> None:
    if not isinstance(t, torch.Tensor):
        _fail(op, f"{name} must be a torch.Tensor (got {_describe(t)})", TypeError)
    if t.layout != torch.strided:
        _fail(op, f"{name} must be a dense (strided) tensor (got layout {t.layout})", TypeError)
    if dim is not None and t.dim() != dim:
        _fail(op, f"{name} must be {dim}-D (got shape {tuple(t.shape)})")
    if dtypes is not None and t.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        _fail(op, f"{name} must have dtype in ({names}) (got {t.dtype})", TypeError)


def check_csr_meta(op: str, crow, col, val, ncols) -> None:
    """Dtype, shape and device checks on a CSR triple; no data is read."""
    check_tensor(op, "crow", crow, dim=1, dtypes=INDEX_DTYPES)
    check_tensor(op, "col", col, dim=1, dtypes=INDEX_DTYPES)
    if val is not None:
        check_tensor(op, "val", val, dim=1, dtypes=VALUE_DTYPES)
    if col.dtype != crow.dtype:
        _fail(op, f"crow and col must have the same index dtype (got crow {crow.dtype}, col {col.dtype})", TypeError)
    devices = {("crow", crow.device), ("col", col.device)}
    if val is not None:
        devices.add(("val", val.device))
    if len({d for _, d in devices}) > 1:
        listing = ", ".join(f"{n}={d}" for n, d in sorted(devices, key=lambda p: p[0]))
        _fail(op, f"crow, col and val must be on the same device (got {listing})")
    require(op, crow.shape[0] >= 1, lambda: f"crow must have nrows + 1 >= 1 elements (got {crow.shape[0]})")
    if val is not None:
        require(op, col.shape[0] == val.shape[0],
                lambda: f"col and val must have the same length nnz (got col {col.shape[0]}, val {val.shape[0]})")
    if not isinstance(ncols, (int, torch.SymInt)) or isinstance(ncols, bool):
        _fail(op, f"ncols must be an int (got {type(ncols).__name__})", TypeError)
    require(op, ncols >= 0, lambda: f"ncols must be >= 0 (got {ncols})")


def check_dense(op: str, name: str, t, *, dim: int, rows, rows_name: str, like: torch.Tensor) -> None:
    """A dense operand of a sparse product: its rank, leading size, dtype and device."""
    check_tensor(op, name, t)
    if t.dim() != dim:
        _fail(op, f"{name} must be {dim}-D (got shape {tuple(t.shape)})")
    require(op, t.shape[0] == rows, lambda: f"{name} must have {rows_name} = {rows} rows (got shape {tuple(t.shape)})")
    if t.dtype != like.dtype:
        _fail(op, f"{name} must have the dtype of the sparse values, {like.dtype} (got {t.dtype})", TypeError)
    if t.device != like.device:
        _fail(op, f"{name} must be on the device of the sparse matrix, {like.device} (got {t.device})")


def check_csr_values(op: str, crow: torch.Tensor, col: torch.Tensor, ncols: int) -> None:
    """Checks that read the index data: one device-to-host transfer for all of them."""
    nnz = col.shape[0]
    if crow.shape[0] == 1:
        flags = [bool(crow[0] != 0), bool(crow[0] != nnz), False, False, False]
    elif crow.device.type == "cpu" and col.device.type == "cpu":
        # host indices (a mini-batch sampled on the host): NumPy reads them without torch's
        # per-operator cost, which here is most of the check's time
        c, k = crow.numpy(), col.numpy()
        flags = [c[0] != 0, c[-1] != nnz, bool((c[1:] < c[:-1]).any()),
                 bool(nnz and k.min() < 0), bool(nnz and k.max() >= ncols)]
    else:
        lengths = crow[1:] - crow[:-1]
        checks = [
            crow[0] != 0,
            crow[-1] != nnz,
            (lengths < 0).any(),
            (col < 0).any() if nnz else torch.zeros((), dtype=torch.bool, device=col.device),
            (col >= ncols).any() if nnz else torch.zeros((), dtype=torch.bool, device=col.device),
        ]
        flags = torch.stack([c.reshape(()) for c in checks]).tolist()
    if flags[0]:
        _fail(op, f"crow[0] must be 0 (got {int(crow[0])})")
    if flags[1]:
        _fail(op, f"crow[-1] must equal nnz = len(col) = {nnz} (got {int(crow[-1])})")
    if flags[2]:
        row = int(((crow[1:] - crow[:-1]) < 0).nonzero()[0])
        _fail(op, f"crow must be non-decreasing (got crow[{row}] = {int(crow[row])} > crow[{row + 1}] = {int(crow[row + 1])})")
    if flags[3]:
        k = int((col < 0).nonzero()[0])
        _fail(op, f"col must be >= 0 (got col[{k}] = {int(col[k])})")
    if flags[4]:
        k = int((col >= ncols).nonzero()[0])
        _fail(op, f"col must be < ncols = {ncols} (got col[{k}] = {int(col[k])})")
