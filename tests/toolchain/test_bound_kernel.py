"""BoundKernel's argument packing, and the installed launch the runtime binds around it
(``install._bind_spec``), with a launch that records what it was given (CPU)."""

from __future__ import annotations

import ctypes
import gc
import weakref

import numpy as np
import pytest
import torch

from torch_sparserl.abi import KernelSpec
from torch_sparserl.abi import prepare as preparing
from torch_sparserl.abi.prepare import prepare
from torch_sparserl.jit import install
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


# ------------------------------------------------------------------ install._bind_spec (an installed launch)

STREAM = 4242  # the raw stream address the fixture's current_raw_stream answers for device 0


@pytest.fixture
def on_host(monkeypatch):
    """_bind_spec on CPU tensors (no synchronize, device 0, a fixed stream); returns the list of
    the plans prepare() was called for."""
    monkeypatch.setattr(install, "_finish_copies", lambda device: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(install, "current_raw_stream", lambda index: STREAM + index)
    planned = []
    monkeypatch.setattr(preparing, "prepare", lambda plan, *args: planned.append(plan) or prepare(plan, *args))
    return planned


def test_an_installed_launch_of_an_int64_pattern_runs_on_int32_copies(on_host, poison_uninitialized):
    """Plan data prepared once from the host indices; each call launches on int32 copies of the
    indices (never the caller's int64 ones) with the call's operands, on the current stream,
    into an output of the plan's shape allocated zeroed for an init=zero plan."""
    spec = render("nnz_split", {"chunk": 16}, op="spmm", dtype="f32", n=32)
    A, crow32, col32 = pattern()
    crow, col = crow32.long(), col32.long()
    want = prepare(spec.plan, crow32, col32, A.shape, 32)
    assert want.init_zero and want.aux is not None
    launches = []
    launch = install._bind_spec(spec, crow, col, A.shape[1], 32,
                                kernel=Kernel(spec, recorder(launches), backend="test", launcher=0xBEEF))
    assert on_host == [spec.plan]
    copies = launch.fast.copies
    assert [t.dtype for t in copies] == [torch.int32, torch.int32]
    assert torch.equal(copies[0], crow32) and torch.equal(copies[1], col32)
    for seed in (0, 1):
        g = torch.Generator().manual_seed(seed)
        val, X = torch.randn(A.nnz, generator=g), torch.randn(A.shape[1], 32, generator=g)
        y = launch(crow, col, val, X)
        grid, block, smem, stream, ptrs, ints, _ = launches[-1]
        assert ptrs[:5] == [copies[0].data_ptr(), copies[1].data_ptr(), val.data_ptr(), X.data_ptr(), y.data_ptr()]
        assert (grid, block, smem, stream) == (want.grid, want.block, want.smem, STREAM)
        assert ints == [A.shape[0], A.shape[1], 32, A.nnz, want.parts]
        assert y.shape == (A.shape[0], 32) and bool((y == 0).all())  # the launch wrote nothing: zeros, not NaN
    assert torch.equal(launch.kernel.prepared.aux, want.aux) and on_host == [spec.plan]
    fast = launch.fast
    assert (fast.launcher, fast.function, fast.grid, fast.block, fast.smem, fast.ints, fast.init_zero) == \
        (0xBEEF, 0, want.grid, want.block, want.smem, (A.shape[0], A.shape[1], 32, A.nnz, want.parts), True)


def test_an_installed_launch_of_an_int32_pattern_holds_no_index_tensor(on_host):
    """int32 indices are launched as passed, and the launch keeps no reference to them: an
    installed kernel does not keep the user's adjacency alive."""
    spec = render("group_row", None, op="spmm", dtype="f32", n=32)
    A, crow, col = pattern()
    launches = []
    launch = install._bind_spec(spec, crow, col, A.shape[1], 32, kernel=Kernel(spec, recorder(launches), "test"))
    assert not hasattr(launch, "fast")  # neither a C launcher nor a CUfunction: nothing for C++
    val, X = torch.randn(A.nnz), torch.randn(A.shape[1], 32)
    y = launch(crow, col, val, X)
    assert launches[-1][4][:5] == [crow.data_ptr(), col.data_ptr(), val.data_ptr(), X.data_ptr(), y.data_ptr()]
    watched = weakref.ref(col)
    del crow, col
    gc.collect()
    assert watched() is None


def test_an_install_like_an_earlier_one_reuses_its_plan_data(on_host):
    """``like``: the same source on the same pattern and width takes the earlier launch's plan
    data and index copies (the library after the interim NVRTC build); anything else prepares its own."""
    spec = render("rowchunks", {"seg": 64}, op="spmm", dtype="f32", n=32)
    A, crow32, col32 = pattern()
    crow, col = crow32.long(), col32.long()
    kernel = Kernel(spec, recorder([]), "test", launcher=1)
    first = install._bind_spec(spec, crow, col, A.shape[1], 32, kernel=kernel)
    again = install._bind_spec(spec, crow, col, A.shape[1], 32, kernel=kernel, like=first)
    assert len(on_host) == 1 and again.fast.copies is first.fast.copies
    assert again.kernel.prepared is first.kernel.prepared
    other_crow, other_col = crow.clone(), col.clone()  # another pattern's tensors
    install._bind_spec(spec, other_crow, other_col, A.shape[1], 32, kernel=kernel, like=first)
    wider = render("rowchunks", {"seg": 64}, op="spmm", dtype="f32", n=64)
    install._bind_spec(wider, crow, col, A.shape[1], 64, kernel=Kernel(wider, recorder([]), "test"), like=first)
    assert len(on_host) == 3


def test_an_nvrtc_kernels_launch_is_handed_to_cpp_with_its_shared_memory_allowed(on_host):
    """An NVRTC build (a CUfunction, no C launcher): C++ launches it through the driver, so its
    dynamic shared memory limit is raised here. A plan with an epilogue is never C++'s."""
    allowed = []
    module = type("Module", (), {"allow_dynamic_smem": lambda self, smem: allowed.append(smem)})()
    spec = KernelSpec('// sparserl: op=spmm dtype=f32 n=32 block=128 grid=ceil(rows/4) smem=n*512\n'
                      'extern "C" __global__ void sparserl_kernel() {}\n', "dynamic shared memory")
    A, crow, col = pattern()
    want = prepare(spec.plan, crow, col, A.shape, 32)
    assert want.smem == 32 * 512
    kernel = Kernel(spec, recorder([]), "test", keepalive=module, function=0x5150)
    launch = install._bind_spec(spec, crow, col, A.shape[1], 32, kernel=kernel)
    assert (launch.fast.launcher, launch.fast.function, launch.fast.smem) == (0, 0x5150, want.smem)
    assert allowed == [want.smem]
    fused = render("group_row", {"epilogue": "relu"}, op="spmm", dtype="f32", n=32)
    launch = install._bind_spec(fused, crow, col, A.shape[1], 32, kernel=Kernel(fused, recorder([]), "test",
                                                                                 launcher=1))
    assert not hasattr(launch, "fast")
