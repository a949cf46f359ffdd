"""``sparserl::spmm_epilogue``: ``relu(scale[:, None] * (A @ X) + bias)``, each step optional, in
one kernel where the installed SpMM kernel can store its rows through the epilogue (what the
backend's post-grad pass writes for a GNN layer's tail)."""

from __future__ import annotations

import torch
from torch import Tensor

from ..abi import EPILOGUE_STEPS
from ..dtypes import VALUE_DTYPES
from ..jit import runtime
from ..pattern.validation import check_csr_meta, check_dense, check_tensor, require
from .common import _pattern, _product

def _check_epilogue(op: str, crow: Tensor, X: Tensor, scale: Tensor | None, bias: Tensor | None) -> None:
    rows, n = crow.shape[0] - 1, X.shape[1]
    if scale is not None:
        check_tensor(op, "scale", scale, dtypes=VALUE_DTYPES)
        require(op, scale.dim() in (1, 2) and scale.numel() == rows and scale.shape[0] == rows,
                lambda: f"scale must have nrows = {rows} values, shape ({rows},) or ({rows}, 1) "
                        f"(got shape {tuple(scale.shape)})")
    if bias is not None:
        check_tensor(op, "bias", bias, dtypes=VALUE_DTYPES)
        require(op, bias.dim() in (1, 2) and bias.numel() == n and bias.shape[-1] == n,
                lambda: f"bias must have N = {n} values, shape ({n},) or (1, {n}) (got shape {tuple(bias.shape)})")
    for name, t in (("scale", scale), ("bias", bias)):
        if t is not None and (t.dtype != X.dtype or t.device != X.device):
            raise ValueError(f"{op}: {name} must be {X.dtype} on {X.device}, like X (got {t.dtype} on {t.device})")


def _spmm_epilogue(crow: Tensor, col: Tensor, val: Tensor, ncols: int, X: Tensor, scale: Tensor | None,
                   bias: Tensor | None, relu: bool) -> Tensor:
    op = "sparserl.spmm_epilogue"
    entry = _pattern(op, crow, col, val, ncols)
    check_dense(op, "X", X, dim=2, rows=ncols, rows_name="ncols", like=val)
    _check_epilogue(op, crow, X, scale, bias)
    scale = scale.reshape(-1) if scale is not None else None
    bias = bias.reshape(-1) if bias is not None else None
    steps = "+".join(step for step, on in zip(EPILOGUE_STEPS, (scale is not None, bias is not None, relu)) if on)
    if steps and X.device.type == "cuda" and not (entry.transient or entry.overfull):
        out = runtime.active().call_fused(entry, *entry.indices(crow, col), val, X, steps, bias, scale)
        if out is not None:
            return out
    Y = _product("spmm", entry, crow, col, val, X)
    if scale is not None and bias is not None:
        Y = torch.addcmul(bias, Y, scale.unsqueeze(1))  # one kernel for both
    elif scale is not None:
        Y = Y.mul_(scale.unsqueeze(1))
    elif bias is not None:
        Y = Y.add_(bias)
    return Y.relu_() if relu else Y


@torch.library.custom_op("sparserl::spmm_epilogue", mutates_args=())
def spmm_epilogue(crow: Tensor, col: Tensor, val: Tensor, ncols: int, X: Tensor, scale: Tensor | None,
                  bias: Tensor | None, relu: bool) -> Tensor:
    """``relu(scale[:, None] * (A @ X) + bias)``, each step optional: the product with what
    follows it in a GNN layer, in one kernel where the installed SpMM kernel can store its
    rows through the epilogue (else the product, then the steps).

    The backend's post-grad pass writes it into compiled graphs in place of ``spmm``
    followed by a row scaling, a bias add and a ReLU (``passes.fuse_epilogues``); it has no
    autograd of its own, since post-grad graphs are already differentiated (there it runs as
    ``sparserl_direct::spmm_epilogue``, see :data:`~torch_sparserl.ops.DIRECT_OPS`).
    """
    return _spmm_epilogue(crow, col, val, ncols, X, scale, bias, relu)


def _spmm_epilogue_backward(ctx, grad):
    raise RuntimeError("sparserl.spmm_epilogue: not differentiable (it is the fused form the post-grad pass "
                       "writes into already differentiated graphs); use A @ X and apply the epilogue with torch "
                       "operations")


spmm_epilogue.register_autograd(_spmm_epilogue_backward, setup_context=lambda ctx, inputs, output: None)


@spmm_epilogue.register_fake
def _spmm_epilogue_fake(crow, col, val, ncols, X, scale, bias, relu):
    op = "sparserl.spmm_epilogue"
    check_csr_meta(op, crow, col, val, ncols)
    check_dense(op, "X", X, dim=2, rows=ncols, rows_name="ncols", like=val)
    _check_epilogue(op, crow, X, scale, bias)
    return X.new_empty((crow.shape[0] - 1, X.shape[1]))
