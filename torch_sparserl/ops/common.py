"""What every operator's implementation shares: a call's validated pattern, and a product on
it served by the runtime's kernel or by torch's own (cuSPARSE on CUDA).

Also the two questions every eager door asks (:func:`eager_ok`, :func:`direct_ok`): whether
anything above the implementation (autograd, a tracer, a dispatch mode) needs to see a call.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import pattern as patterns
from ..dtypes import VALUE_DTYPES
from ..jit import fastpath, runtime
from ..kernels import vendor
from ..pattern.validation import check_csr_meta

NAMESPACE = "sparserl"


def _product(op: str, entry: patterns.Pattern, crow: Tensor, col: Tensor, val: Tensor, X: Tensor) -> Tensor:
    """``A @ X`` (``op="spmm"``) or ``A @ x`` (``"spmv"``) on validated operands.

    The runtime's specialized kernel for this pattern when one is installed (it serves CUDA
    devices); otherwise torch's own sparse kernels: cuSPARSE on CUDA, MKL's or torch's on the CPU.
    Either reads the indices as the pattern validated them (:meth:`Pattern.indices`), never
    the caller's tensors again.
    """
    crow, col = entry.indices(crow, col)
    check = entry.check  # a device check whose verdict has not come: the product is poisoned should it fail
    if not (entry.transient or entry.overfull):
        out = runtime.active().call(op, entry, crow, col, val, X)
        if out is not None:
            return out if check is None else check.poison(out)
    out = _vendor(op, entry, crow, col, val, X)
    return out if check is None else check.poison(out)


def _vendor(op: str, entry: patterns.Pattern, crow: Tensor, col: Tensor, val: Tensor, X: Tensor) -> Tensor:
    """``A @ X`` by torch's own kernels, cuSPARSE's on CUDA: called from C++ where the library is
    loaded (one call, no sparse tensor built; a pattern met once pays no more than this), else,
    and for what that call declines (empty or overfull products, a type cuSPARSE refuses) or Dynamo
    traces (the library's ops have no fake kernels), through torch
    (:mod:`torch_sparserl.kernels.vendor`)."""
    cusparse_once = fastpath.cusparse_once
    if cusparse_once is not None and X.is_cuda and not entry.overfull and not torch.compiler.is_compiling():
        out = cusparse_once(crow, col, val, entry.ncols, X, False)
        if out is not None:
            return out
    return getattr(vendor, op)(entry, crow, col, val, X)


def _pattern(op: str, crow: Tensor, col: Tensor, val: Tensor | None, ncols: int) -> patterns.Pattern:
    entry = patterns.validated(crow, col, ncols)
    if entry is not None and (val is None or (
            isinstance(val, Tensor) and val.dim() == 1 and val.shape[0] == entry.nnz and val.device == entry.device
            and val.dtype in VALUE_DTYPES and val.layout == torch.strided)):
        return entry  # crow and col are the validated ones, unchanged; val fits them
    check_csr_meta(op, crow, col, val, ncols)
    if crow.is_cuda and torch.cuda.is_current_stream_capturing():  # indices a replay may change
        return patterns.in_graph(op, crow, col, ncols)
    entry = patterns.lookup(crow, col, ncols)
    entry.validate(op, crow, col)
    return entry


_DIRECT_DEVICES = ("cuda", "cpu")  # not meta: fake tensors go through the operator's fake implementation


def eager_ok(val: Tensor, X: Tensor) -> bool:
    """Whether no tracer, dispatch mode or functorch transform needs to see a product of
    these operands: eager code on plain CPU or CUDA tensors. Autograd may (see
    :func:`~torch_sparserl.ops.doors.eager_product`)."""
    return (type(X) is Tensor and type(val) is Tensor and X.device.type in _DIRECT_DEVICES
            and not torch.compiler.is_compiling()
            and torch._C._len_torch_dispatch_stack() == 0
            and torch._C._functorch.peek_interpreter_stack() is None)


def direct_ok(val: Tensor, X: Tensor) -> bool:
    """Whether calling an operator's implementation directly is indistinguishable from
    calling the operator: :func:`eager_ok`, and nothing to differentiate.

    The operator's dispatch (custom_op, autograd wrapper) costs tens of microseconds of
    CPU per call, as much as a whole cuSPARSE product on a small graph; ``CSRMatrix``
    products take this path when they can (:func:`~torch_sparserl.ops.doors.direct`).
    """
    return not (torch.is_grad_enabled() and (X.requires_grad or val.requires_grad)) and eager_ok(val, X)


def registered_ops() -> list[str]:
    """Names of every operator registered in the ``sparserl`` namespace (discovered, not listed)."""
    prefix = NAMESPACE + "::"
    return sorted(name[len(prefix):] for name in torch._C._dispatch_get_all_op_names()
                  if name.startswith(prefix))
