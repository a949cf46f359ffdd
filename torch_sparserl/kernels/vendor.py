"""torch's own sparse kernels through ``torch.sparse``: the baseline and the fallback.

On CUDA they are NVIDIA's cuSPARSE: the baseline every specialized kernel is timed against,
and what serves a product until one is installed. On the CPU they are MKL's or torch's native
CSR kernels, which serve every CPU product: they are faster than the gather and ``index_add_``
of :mod:`~torch_sparserl.kernels.reference` (``benchmarks/bench_cpu.py`` compares them).
SDDMM goes through ``torch.sparse.sampled_addmm`` (``cusparseSDDMM`` on CUDA).

Products go through the functional ``torch.sparse.mm`` / ``torch.mv``, as a user's would.
While :mod:`torch_sparserl.tensor.intercept` overrides those for CSR tensors, calls go through the
``out=`` overloads of ``aten::addmm`` / ``aten::addmv`` instead, which still reach cuSPARSE
directly, so the fallback never re-enters the override.

The CSR tensor is built per call (it references ``val``, which may change every step):
with ``check_invariants=False`` and no context managers, a few microseconds. torch warns
once per process that CSR support is in beta; the first construction silences that.
"""

from __future__ import annotations

import functools
import threading
import warnings

import torch

from ..dtypes import HALF_DTYPES
from ..pattern import Pattern


_BETA_WARNING_SEEN = False
# Whether the override of aten::addmm / mv / addmv for CSR tensors is in place
# (torch_sparserl.tensor.intercept, a later stage, says so through override_installed()).
_override_installed = False


def override_installed(installed: bool) -> None:
    """Called by :mod:`torch_sparserl.tensor.intercept` as its override goes in (True) and out
    (False): while it is in, the products here go around it."""
    global _override_installed
    _override_installed = installed


def _outside_cpu_autocast(fn):
    """``fn`` with the CPU's autocast off while it runs on CPU tensors: autocast would cast
    its float32 operands (half types are widened to float32 here) back to bfloat16, which
    torch's CPU sparse kernels lack ("addmm_out_sparse_csr_impl_mkl" not implemented for
    'BFloat16'). The caller casts the result to the product's dtype."""
    @functools.wraps(fn)
    def run(pattern, crow, col, a, b, *rest):
        if a.device.type == "cpu" and torch.is_autocast_enabled("cpu"):
            with torch.autocast("cpu", enabled=False):
                return fn(pattern, crow, col, a, b, *rest)
        return fn(pattern, crow, col, a, b, *rest)

    return run


_HANDLES = threading.local()  # .devices: the CUDA devices whose cuSPARSE handle this thread has made


def ensure_handle(device: torch.device) -> None:
    """Have torch make this thread's cuSPARSE handle on ``device`` now (one tiny product), unless
    it did already. torch makes it at a thread's first cuSPARSE call; a first call made while a
    CUDA graph is captured (a product served by cuSPARSE inside the graph, after the warm-up
    calls ran specialized kernels) would initialize there, which invalidates the capture. Where
    this thread is capturing, nothing is done: the capture's own checks report what fails."""
    if device.type != "cuda":
        return
    index = device.index if device.index is not None else torch.cuda.current_device()
    made = getattr(_HANDLES, "devices", None)
    if made is None:
        made = _HANDLES.devices = set()
    if index in made or torch.cuda.is_current_stream_capturing():
        return
    with torch.cuda.device(index), torch.no_grad():
        one = torch.ones(1, device=device)
        crow = torch.tensor([0, 1], dtype=torch.int32, device=device)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "sparse CSR support is in beta state"
            A = torch.sparse_csr_tensor(crow, crow[:1], one, (1, 1), check_invariants=False)
        out = torch.empty(1, 1, device=device)
        torch.addmm(out, A, one.view(1, 1), beta=0, alpha=1, out=out)
    made.add(index)


def as_torch_csr(pattern: Pattern, crow, col, val) -> torch.Tensor:
    # The pattern was validated once (pattern/__init__.py): opt out of torch's per-call invariant
    # check explicitly, which also keeps torch from warning that it was skipped.
    global _BETA_WARNING_SEEN
    if not _BETA_WARNING_SEEN:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "sparse CSR support is in beta state", once per process
            csr = torch.sparse_csr_tensor(crow, col, val, (pattern.nrows, pattern.ncols), check_invariants=False)
        _BETA_WARNING_SEEN = True
        return csr
    return torch.sparse_csr_tensor(crow, col, val, (pattern.nrows, pattern.ncols), check_invariants=False)


def _product(pattern: Pattern, crow: torch.Tensor, col: torch.Tensor, val: torch.Tensor, X: torch.Tensor) -> torch.Tensor:
    """``A @ X`` for a matrix X (nrows, N) or ``A @ x`` for a vector x."""
    if val.dtype in HALF_DTYPES:
        # cuSPARSE through torch sums a row of 4096 float16 ones to 4768, so half inputs
        # are widened and summed in float32.
        return _product(pattern, crow, col, val.float(), X.float()).to(val.dtype)
    matrix = X.dim() == 2
    shape = (pattern.nrows, X.shape[1]) if matrix else (pattern.nrows,)
    if pattern.nnz == 0 or pattern.ncols == 0 or 0 in shape:
        return torch.zeros(shape, dtype=val.dtype, device=val.device)
    if pattern.overfull:  # cuSPARSE refuses it; its dense form is smaller than its nonzeros
        dense = torch.zeros((pattern.nrows, pattern.ncols), dtype=val.dtype, device=val.device)
        dense.index_put_((pattern.row_indices(crow), col.to(torch.int64)), val, accumulate=True)
        return dense @ X
    A = as_torch_csr(pattern, crow, col, val)
    X = X.contiguous()
    if not _override_installed:
        return torch.sparse.mm(A, X) if matrix else torch.mv(A, X)
    out = torch.empty(shape, dtype=val.dtype, device=val.device)
    # beta=0: cuSPARSE does not read `out`, so its uninitialized contents cannot leak in.
    (torch.addmm if matrix else torch.addmv)(out, A, X, beta=0, alpha=1, out=out)
    return out


@_outside_cpu_autocast
def spmm(pattern: Pattern, crow: torch.Tensor, col: torch.Tensor, val: torch.Tensor,
         X: torch.Tensor) -> torch.Tensor:
    """``A @ X``, X of shape (ncols, N)."""
    return _product(pattern, crow, col, val, X)


@_outside_cpu_autocast
def spmv(pattern: Pattern, crow: torch.Tensor, col: torch.Tensor, val: torch.Tensor,
         x: torch.Tensor) -> torch.Tensor:
    """``A @ x``, x of length ncols."""
    return _product(pattern, crow, col, val, x)


def sddmm(pattern: Pattern, crow: torch.Tensor, col: torch.Tensor, Y: torch.Tensor,
          X: torch.Tensor) -> torch.Tensor:
    """out[k] = dot(Y[row(k)], X[col(k)]); Y is (nrows, N), X (ncols, N)."""
    if Y.dtype in HALF_DTYPES:  # summed in float32, as in spmm
        return sddmm(pattern, crow, col, Y.float(), X.float()).to(Y.dtype)
    out = torch.zeros(pattern.nnz, dtype=Y.dtype, device=Y.device)
    if pattern.nnz == 0 or Y.shape[1] == 0:
        return out
    if pattern.overfull:
        # More nonzeros than positions: duplicates for sure, which torch's sampled_addmm
        # answers by shrinking the output's indices (its out= CSR tensor shares them with the
        # pattern) to one value per position. Each duplicate gets its own value here, as
        # torch's own products count each.
        rows = pattern.row_indices(crow)
        return torch.mul(Y.index_select(0, rows), X.index_select(0, col.to(torch.int64))).sum(1)
    return sddmm_out(pattern, crow, col, Y, X, out)


@_outside_cpu_autocast
def sddmm_out(pattern: Pattern, crow: torch.Tensor, col: torch.Tensor, Y: torch.Tensor, X: torch.Tensor,
              out: torch.Tensor) -> torch.Tensor:
    """:func:`sddmm` into ``out`` (nnz values of Y's dtype holding finite numbers: cuSPARSE
    computes ``0 * out + Y Xᵀ`` at the nonzeros, and ``0 * NaN`` would stay NaN). Only for
    patterns of at most ``nrows * ncols`` nonzeros (see :func:`sddmm`)."""
    if pattern.overfull:
        raise ValueError(f"sddmm_out: {pattern.nnz} nonzeros in a {pattern.nrows}x{pattern.ncols} pattern "
                         "hold duplicates that torch's sampled_addmm would merge")
    A = as_torch_csr(pattern, crow, col, out)  # shares out's storage: the result lands there
    torch.sparse.sampled_addmm(A, Y.contiguous(), X.contiguous().t(), beta=0.0, alpha=1.0, out=A)
    return out
