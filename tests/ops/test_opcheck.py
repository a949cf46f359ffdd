"""torch.library.opcheck on every operator registered in the sparserl namespace.

opcheck's schema test also checks that no operator writes to its inputs (none is declared
mutable), on every sample, duplicates included.

The operators are discovered from the dispatcher, not listed: an operator added without
samples here fails ``test_every_op_has_samples``.
"""

import pytest
import torch

from torch_sparserl.dtypes import assert_close_to_reference
from torch_sparserl.ops import DIRECT_OPS, FAST_OPS, registered_ops

from helpers import make_pattern, to_parts


def _parts(device, dtype=torch.float64, name="short and huge rows"):
    A = make_pattern(name, seed=21)
    crow, col, val = to_parts(A, dtype, torch.int64, device)
    return crow, col, val, A.shape


def _samples(op, device):
    out = []
    for name in ("short and huge rows", "empty rows in the middle", "all rows empty (nnz = 0)",
                 "duplicates, more than rows x cols"):
        crow, col, val, (m, n) = _parts(device, name=name)
        grad = dict(requires_grad=True)
        if op == "spmm":
            out.append((crow, col, val.clone().requires_grad_(), n, torch.randn(n, 5, device=device, dtype=torch.float64, **grad)))
        elif op == "spmv":
            out.append((crow, col, val.clone().requires_grad_(), n, torch.randn(n, device=device, dtype=torch.float64, **grad)))
        elif op == "spmm_transposed":
            out.append((crow, col, val.clone().requires_grad_(), n, torch.randn(m, 5, device=device, dtype=torch.float64, **grad)))
        elif op == "spmv_transposed":
            out.append((crow, col, val.clone().requires_grad_(), n, torch.randn(m, device=device, dtype=torch.float64, **grad)))
        elif op == "spmm_epilogue":  # post-grad only: no gradients
            f64 = dict(device=device, dtype=torch.float64)
            out.append((crow, col, val, n, torch.randn(n, 5, **f64), torch.randn(m, 1, **f64), torch.randn(5, **f64), True))
            out.append((crow, col, val, n, torch.randn(n, 5, **f64), None, torch.randn(1, 5, **f64), False))
            out.append((crow, col, val, n, torch.randn(n, 5, **f64), torch.randn(m, **f64), None, True))
        elif op in ("spmm_heads", "spmm_heads_transposed"):
            rows = n if op == "spmm_heads" else m
            out.append((crow, col, torch.randn(col.shape[0], 3, device=device, dtype=torch.float64, **grad), n,
                        torch.randn(rows, 3, 4, device=device, dtype=torch.float64, **grad)))
        elif op == "sddmm_heads":
            out.append((crow, col, torch.randn(m, 3, 4, device=device, dtype=torch.float64, **grad),
                        torch.randn(n, 3, 4, device=device, dtype=torch.float64, **grad)))
        elif op == "sddmm":
            out.append((crow, col, torch.randn(m, 5, device=device, dtype=torch.float64, **grad),
                        torch.randn(n, 5, device=device, dtype=torch.float64, **grad)))
    return out


def _without_grad(args):
    return tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)


def test_every_op_has_samples():
    ops = registered_ops()
    assert {"spmm", "spmv", "spmm_transposed", "spmv_transposed", "sddmm", "spmm_heads", "spmm_heads_transposed",
            "sddmm_heads"} <= set(ops)
    for op in ops:
        assert _samples(op, "cpu"), f"sparserl::{op} has no opcheck samples"


@pytest.mark.parametrize("op", registered_ops())
def test_opcheck(op, device):
    for args in _samples(op, device):
        torch.library.opcheck(getattr(torch.ops.sparserl, op).default, args)


@pytest.mark.parametrize("twins", [DIRECT_OPS, FAST_OPS], ids=["direct", "fast"])
@pytest.mark.parametrize("op", registered_ops())
def test_implementation_twin_opcheck(op, device, twins):
    """Each operator's implementation-only twins (what compiled graphs call: ops.DIRECT_OPS, and
    ops.FAST_OPS for the products): same schema, a fake that agrees with the kernel, and no
    autograd kernel to check."""
    public = getattr(torch.ops.sparserl, op).default
    if public not in twins:
        assert twins is FAST_OPS and op in ("sddmm", "spmm_epilogue", "spmm_heads", "spmm_heads_transposed",
                                            "sddmm_heads")
        return
    twin = twins[public]
    assert str(twin._schema).split("::", 1)[1] == str(public._schema).split("::", 1)[1]
    for args in _samples(op, device):
        args = _without_grad(args)
        torch.library.opcheck(twin, args)
        assert_close_to_reference(twin(*args), public(*args).double())
