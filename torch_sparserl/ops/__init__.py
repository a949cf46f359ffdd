"""The ``sparserl`` operators: each defined once, with schema, fake and autograd.

Pipeline stage 9 of 14: the ``torch.ops.sparserl`` operators: schema, checks, fake and autograd,
served by the runtime.
May import: config, dtypes, data, pattern, kernels, abi, toolchain, evaluate, specialize, jit.

=========================================================  ==================================
``sparserl::spmm(crow, col, val, ncols, X)``               A @ X, X of shape (ncols, N)
``sparserl::spmv(crow, col, val, ncols, x)``               A @ x, x of shape (ncols,)
``sparserl::spmm_transposed(crow, col, val, ncols, G)``    Aᵀ @ G, G of shape (nrows, N)
``sparserl::spmv_transposed(crow, col, val, ncols, g)``    Aᵀ @ g, g of shape (nrows,)
``sparserl::sddmm(crow, col, Y, X)``                       out[k] = dot(Y[row(k)], X[col(k)])
``sparserl::spmm_epilogue(crow, col, val, ncols, X,``      relu(scale[:, None] * (A @ X) + bias),
``scale, bias, relu)``                                     each step optional (post-grad fusion)
``sparserl::spmm_heads(crow, col, val, ncols, X)``         out[:, h] = A_h @ X[:, h], val (nnz, H),
                                                           X (ncols, H, C): attention heads
``sparserl::spmm_heads_transposed(crow, col, val,``        out[:, h] = A_hᵀ @ G[:, h]
``ncols, G)``
``sparserl::sddmm_heads(crow, col, Y, X)``                 out[k, h] = dot(Y[row(k), h], X[col(k), h])
=========================================================  ==================================

A is the CSR matrix ``(crow, col, val)`` with ``crow.numel() - 1`` rows and ``ncols``
columns. The transposed operators run on the transposed *pattern*, which is computed once
per pattern and cached (:mod:`torch_sparserl.pattern`); they are what the backward of the
forward products calls, and SDDMM gives the gradient of the values. The ``_heads`` operators
run one product per attention head as a single product on the pattern's block-diagonal form
(computed once per pattern and number of heads). The products close under differentiation
(the plain ones among themselves, the heads ones likewise), so higher-order gradients work too.

The package, a module per part:

=====================  =====================================================================
module                 what it holds
=====================  =====================================================================
:mod:`.common`         a call's validated pattern; a product served by the runtime's kernel or
                       torch's own; whether anything above the implementation needs to see a call
:mod:`.backward`       the backward formulas, and the implementations a backward runs
:mod:`.products`       ``spmm``, ``spmv`` and their transposes, from one table
:mod:`.sampled`        ``sddmm``
:mod:`.heads`          the ``_heads`` operators
:mod:`.epilogue`       ``spmm_epilogue``
:mod:`.doors`          the one eager door (:func:`~.doors.product`) and recording for C++
:mod:`.twins`          the ``sparserl_direct`` and ``sparserl_fast`` libraries
=====================  =====================================================================
"""

from __future__ import annotations

from .common import NAMESPACE, registered_ops
from .epilogue import spmm_epilogue
from .heads import check_heads_index, sddmm_heads, spmm_heads, spmm_heads_transposed
from .products import spmm, spmm_transposed, spmv, spmv_transposed
from .sampled import sddmm
from .twins import DIRECT_NAMESPACE, DIRECT_OPS, FAST_NAMESPACE, FAST_OPS

__all__ = ["spmm", "spmv", "spmm_transposed", "spmv_transposed", "sddmm", "spmm_epilogue", "spmm_heads",
           "spmm_heads_transposed", "sddmm_heads", "NAMESPACE", "DIRECT_NAMESPACE", "DIRECT_OPS", "FAST_NAMESPACE",
           "FAST_OPS", "check_heads_index", "registered_ops"]
