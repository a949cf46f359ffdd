"""BoundKernel's argument packing, with a launch that records what it was given (CPU)."""

from __future__ import annotations

import ctypes

import numpy as np
import torch

from torch_sparserl.abi.prepare import prepare
from torch_sparserl.specialize.families import render
from torch_sparserl.toolchain.kernel import Kernel

from helpers import make_pattern


def recorder(launches):
    def launch(grid, block, smem, stream, params):
        ptrs = [ctypes.cast(params[i], ctypes.POINTER(ctypes.c_void_p))[0] or 0 for i in range(7)]
        ints = [ctypes.cast(params[7 + i], ctypes.POINTER(ctypes.c_int))[0] for i in range(5)]
        launches.append((grid, block, smem, stream, ptrs, ints, len(params)))
    return launch


def pattern(name="short and huge rows"):
    A = make_pattern(name)
    crow = torch.from_numpy(A.indptr.astype(np.int32))
    col = torch.from_numpy(A.indices.astype(np.int32))
    return A, crow, col


def test_the_bound_kernel_packs_its_pattern_once_and_each_call_s_operands():
    launches = []
    spec = render("rowchunks", {"seg": 64}, op="spmm", dtype="f32", n=32)  # plan data and a workspace
    A, crow, col = pattern()
    prepared = prepare(spec.plan, crow, col, A.shape, 32)
    assert prepared.aux is not None and prepared.work_numel and prepared.work_once
    bound = Kernel(spec, recorder(launches), backend="test").bind(prepared)
    for seed in (0, 1):  # new operands each call, the same packed array
        g = torch.Generator().manual_seed(seed)
        val, X = torch.randn(A.nnz, generator=g), torch.randn(A.shape[1], 32, generator=g)
        y, work = torch.full((A.shape[0], 32), 7.0), torch.zeros(prepared.work_numel)
        assert bound(crow, col, val, X, y, 5, work=work) is y
        grid, block, smem, stream, ptrs, ints, count = launches[-1]
        assert (grid, block, smem, stream) == (prepared.grid, prepared.block, prepared.smem, 5)
        assert ptrs == [crow.data_ptr(), col.data_ptr(), val.data_ptr(), X.data_ptr(), y.data_ptr(),
                        prepared.aux.data_ptr(), work.data_ptr()]
        assert ints == [A.shape[0], A.shape[1], 32, A.nnz, prepared.parts]
        assert count == 12  # no epilogue pointers
        assert bool((y == 7.0).all())  # no zero-fill: the plan writes every row
    y = torch.zeros(A.shape[0], 32)
    bound(crow, col, val, X, y, 5)  # no workspace given: a zeroed one is made for the call
    assert launches[-1][4][6] not in (0, work.data_ptr())


def test_an_init_zero_plan_zeroes_y_unless_the_caller_has():
    launches = []
    spec = render("nnz_split", {"chunk": 64}, op="spmv", dtype="f32", n=1)
    A, crow, col = pattern("empty rows in the middle")
    prepared = prepare(spec.plan, crow, col, A.shape, 1)
    assert prepared.init_zero
    bound = Kernel(spec, recorder(launches), backend="test").bind(prepared)
    val, x = torch.randn(A.nnz), torch.randn(A.shape[1])
    y = torch.full((A.shape[0],), float("nan"))
    bound(crow, col, val, x, y, 0)
    assert bool((y == 0).all())  # the launch writes nothing here: the zeros are the zero-fill's
    y.fill_(float("nan"))
    bound(crow, col, val, x, y, 0, zeroed=True)
    assert bool(y.isnan().all()) and len(launches) == 2
