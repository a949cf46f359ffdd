"""The builders: nvcc (CPU, the compile tier), NVRTC and the lean extension build (GPU)."""

from __future__ import annotations

import subprocess
import threading
import time

import numpy as np
import scipy.sparse as sp
import pytest
import torch

from torch_sparserl.abi import KernelSpec
from torch_sparserl.abi.prepare import prepare
from torch_sparserl.dtypes import close_to_reference
from torch_sparserl.toolchain import CompileError, LaunchError, load_kernel
from torch_sparserl.toolchain import inline, nvcc

from helpers import make_pattern

needs_nvcc = pytest.mark.skipif(nvcc.nvcc_path() is None, reason="nvcc not installed")

ROW_PER_THREAD = """// sparserl: op=spmv dtype=f32 rows=natural split=none block=128 grid=ceil(rows/128)
#define SR_TAG {tag}
extern "C" __global__ void sparserl_kernel(const int* __restrict__ rowptr, const int* __restrict__ col,
    const float* __restrict__ val, const float* __restrict__ x, float* __restrict__ y,
    const int* __restrict__ aux, float* __restrict__ work, int rows, int cols, int n, int nnz, int parts) {{
  int r = blockIdx.x * blockDim.x + threadIdx.x;
  if (r >= rows) return;
  float s = 0.f;
  for (int k = rowptr[r]; k < rowptr[r + 1]; ++k) s += val[k] * x[col[k]];
  y[r] = s;
}}
"""


def spec(tag: int = 0) -> KernelSpec:
    return KernelSpec(ROW_PER_THREAD.format(tag=tag), family="test", params=(("tag", tag),))


@needs_nvcc
def test_nvcc_compiles_to_cubin_and_reports_resources():
    result = nvcc.compile(spec().source)
    assert result.binary[:4] == b"\x7fELF"
    assert result.registers and result.registers > 0 and result.spill_bytes == 0
    ptx = nvcc.compile(spec().source, fmt="ptx")
    assert b".entry sparserl_kernel" in ptx.binary


@needs_nvcc
def test_nvcc_reports_spills_of_a_runtime_indexed_local_array():
    source = spec().source.replace("float s = 0.f;", "float big[512]; for (int i = 0; i < 512; ++i) big[i] = x[i];"
                                   " float s = big[rowptr[r] & 511];")
    result = nvcc.compile(source)
    assert result.stack_bytes >= 2048


@needs_nvcc
def test_nvcc_failure_carries_the_log():
    with pytest.raises(CompileError) as info:
        nvcc.compile(spec().source.replace("float s = 0.f;", "float s = undefined_name;"))
    assert "undefined_name" in info.value.log and "kernel.cu" in info.value.log


def test_nvcc_names_bad_arguments():
    with pytest.raises(ValueError, match="fmt must be 'cubin' or 'ptx'"):
        nvcc.compile(spec().source, fmt="fatbin")
    with pytest.raises(ValueError, match="arch must look like 'sm_90'"):
        nvcc.compile(spec().source, arch="hopper")


@needs_nvcc
def test_inline_translation_unit_renames_the_kernel_and_compiles(tmp_path):
    unit = inline._translation_unit(spec(3))
    assert f"sparserl_kernel_{spec(3).key}(" in unit and "sparserl_kernel(" not in unit
    path = tmp_path / "k.cu"
    path.write_text(unit)
    subprocess.run([nvcc.nvcc_path(), "-c", "-arch=sm_90", "-o", str(tmp_path / "k.o"), str(path)],
                   check=True, capture_output=True)


def test_inline_module_names_hash_sources_and_toolchain():
    a, b = spec(1), spec(2)
    assert inline.module_name([a, b], "sm_90") == inline.module_name([b, a], "sm_90")
    assert inline.module_name([a], "sm_90") != inline.module_name([a, b], "sm_90")
    assert inline.module_name([a], "sm_90") != inline.module_name([a], "sm_80")


def test_inline_module_names_change_with_the_launcher(monkeypatch):
    """A library built with another launcher (another C signature) is never loaded."""
    before = inline.module_name([spec(1)], "sm_90")
    monkeypatch.setattr(inline, "_LAUNCHER", inline._LAUNCHER.replace("cudaLaunchKernel(", "cudaLaunchKernel ("))
    assert inline.module_name([spec(1)], "sm_90") != before


def test_inline_lock_clears_the_file_a_killed_build_leaves(tmp_path):
    (tmp_path / "lock").write_text("")  # what torch's FileBaton leaves when its builder is killed
    with inline.exclusive(tmp_path):
        assert not (tmp_path / "lock").exists()


def test_inline_lock_excludes_a_concurrent_builder(tmp_path):
    order = []

    def other():
        with inline.exclusive(tmp_path):
            order.append("other")

    with inline.exclusive(tmp_path):
        thread = threading.Thread(target=other)
        thread.start()
        time.sleep(0.3)
        order.append("first")
    thread.join(5)
    assert order == ["first", "other"]


def test_load_kernel_reports_a_bad_plan_as_a_compile_error():
    with pytest.raises(CompileError, match="load_kernel: plan: block must be"):
        load_kernel(KernelSpec(spec().source.replace("block=128", "block=100")))
    with pytest.raises(ValueError, match="backend must be one of"):
        load_kernel(spec(), backend="clang")


# ----------------------------------------------------------------------------- GPU

def _operands(A, device="cuda"):
    rowptr = torch.from_numpy(A.indptr.astype(np.int32)).to(device)
    col = torch.from_numpy(A.indices.astype(np.int32)).to(device)
    val = torch.randn(A.nnz, device=device)
    x = torch.randn(A.shape[1], device=device)
    return rowptr, col, val, x


def _reference(rowptr, col, val, x, shape):
    A = torch.sparse_csr_tensor(rowptr.long().cpu(), col.long().cpu(), val.double().cpu(), shape)
    return (A @ x.double().cpu().unsqueeze(1)).squeeze(1)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["nvrtc", "inline"])
def test_builders_launch_a_correct_kernel(backend, tmp_path, monkeypatch):
    monkeypatch.setenv("SPARSERL_CACHE_DIR", str(tmp_path))
    A = make_pattern("empty rows in the middle")
    rowptr, col, val, x = _operands(A)
    kernel = load_kernel(spec(10 + len(backend)), backend=backend)
    assert kernel.registers and kernel.max_threads >= 128
    prep = prepare(kernel.plan, rowptr, col, A.shape, n=1)
    y = torch.full((A.shape[0],), float("nan"), device="cuda")
    kernel(rowptr, col, val, x, y, prep)
    ok, why = close_to_reference(y, _reference(rowptr, col, val, x, A.shape), torch.float32)
    assert ok, why


@pytest.mark.gpu
def test_a_kernel_loaded_from_the_cubin_cache_is_correct(tmp_path, monkeypatch):
    from torch_sparserl import toolchain
    from torch_sparserl.toolchain import cubins, paths, trust

    monkeypatch.setenv("SPARSERL_CACHE_DIR", str(tmp_path / "cache"))
    paths.forget_checks()
    trust.forget_keys()
    A = make_pattern("empty rows in the middle")
    rowptr, col, val, x = _operands(A)
    first = load_kernel(spec(77))
    assert cubins.count()[0] == 1
    monkeypatch.setattr(toolchain.load, "_LOADED", {})  # as a new process: the module is loaded again
    kernel = load_kernel(spec(77))
    assert kernel is not first and kernel.compile_log == first.compile_log
    assert kernel.registers == first.registers and cubins.count()[0] == 1
    prep = prepare(kernel.plan, rowptr, col, A.shape, n=1)
    y = torch.full((A.shape[0],), float("nan"), device="cuda")
    kernel(rowptr, col, val, x, y, prep)
    ok, why = close_to_reference(y, _reference(rowptr, col, val, x, A.shape), torch.float32)
    assert ok, why
    paths.forget_checks()
    trust.forget_keys()


# Each row's sum is atomically added: y must be zero before the kernel (init=zero), and a matrix
# without nonzeros launches no block at all (grid=ceil(nnz/128) = 0), yet y is still zeroed.
ATOMIC_ROWS = """// sparserl: op=spmv dtype=f32 rows=natural split=none block=128 grid=ceil(nnz/128) init=zero
#define SR_TAG {tag}
extern "C" __global__ void sparserl_kernel(const int* __restrict__ rowptr, const int* __restrict__ col,
    const float* __restrict__ val, const float* __restrict__ x, float* __restrict__ y,
    const int* __restrict__ aux, float* __restrict__ work, int rows, int cols, int n, int nnz, int parts) {{
  for (int r = blockIdx.x * blockDim.x + threadIdx.x; r < rows; r += gridDim.x * blockDim.x) {{
    float s = 0.f;
    for (int k = rowptr[r]; k < rowptr[r + 1]; ++k) s += val[k] * x[col[k]];
    atomicAdd(&y[r], s);
  }}
}}
"""


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["nvrtc", "inline"])
@pytest.mark.parametrize("case", ["random", "no nonzeros"])
def test_the_launch_zeroes_the_output_of_init_zero_plans(backend, case, tmp_path, monkeypatch):
    monkeypatch.setenv("SPARSERL_CACHE_DIR", str(tmp_path))
    A = make_pattern("random") if case == "random" else sp.csr_matrix((300, 200), dtype=np.float32)
    rowptr, col, val, x = _operands(A)
    kernel = load_kernel(KernelSpec(ATOMIC_ROWS.format(tag=40 + len(backend)), family="test"), backend=backend)
    prep = prepare(kernel.plan, rowptr, col, A.shape, n=1)
    assert prep.init_zero and (prep.grid == 0) == (case == "no nonzeros")
    want = _reference(rowptr, col, val, x, A.shape)
    for _ in range(2):  # the second call adds onto the first's output unless it is zeroed again
        y = torch.full((A.shape[0],), float("nan"), device="cuda")
        kernel(rowptr, col, val, x, y, prep)
        ok, why = close_to_reference(y, want, torch.float32)
        assert ok, why
    y = torch.full((A.shape[0],), 7.0, device="cuda")
    kernel.bind(prep)(rowptr, col, val, x, y, torch.cuda.current_stream().cuda_stream, zeroed=True)
    assert close_to_reference(y - 7.0, want, torch.float32)[0]  # zeroed=True: the caller's y, not zeroed


@pytest.mark.gpu
def test_inline_batches_kernels_and_reloads_from_disk(tmp_path):
    specs = [spec(20), spec(21), spec(22)]
    start = time.perf_counter()
    kernels = inline.build(specs, directory=tmp_path)
    cold = time.perf_counter() - start
    start = time.perf_counter()
    again = inline.build(specs, directory=tmp_path)
    warm = time.perf_counter() - start
    assert set(kernels) == set(again) == {s.key for s in specs}
    assert warm < cold and warm < 1.0, (cold, warm)
    A = make_pattern("random")
    rowptr, col, val, x = _operands(A)
    want = _reference(rowptr, col, val, x, A.shape)
    for kernel in again.values():
        y = torch.full((A.shape[0],), float("nan"), device="cuda")
        kernel(rowptr, col, val, x, y, prepare(kernel.plan, rowptr, col, A.shape, n=1))
        assert close_to_reference(y, want, torch.float32)[0]


@pytest.mark.gpu
def test_launch_refuses_operands_that_do_not_match():
    A = make_pattern("random")
    rowptr, col, val, x = _operands(A)
    kernel = load_kernel(spec(30))
    prep = prepare(kernel.plan, rowptr, col, A.shape, n=1)
    y = torch.empty(A.shape[0], device="cuda")
    with pytest.raises(LaunchError, match="col must be torch.int32"):
        kernel(rowptr, col.long(), val, x, y, prep)
    with pytest.raises(LaunchError, match="x must have 45 elements for op=spmv \\(got 44\\)"):
        kernel(rowptr, col, val, x[:-1], y, prep)
    with pytest.raises(LaunchError, match="val must be torch.float32"):
        kernel(rowptr, col, val.half(), x, y, prep)
    with pytest.raises(LaunchError, match="operands must be CUDA tensors"):
        kernel(rowptr, col, val, x, y.cpu(), prep)


def test_inline_is_built_reads_the_completed_marker(tmp_path):
    """is_built: the library's .ok marker, written after a complete build, per sources and arch."""
    a, b = spec(3), spec(5)
    assert not inline.is_built([a], "sm_90", directory=tmp_path)
    assert not inline.is_built([], "sm_90", directory=tmp_path)
    name = inline.module_name([a], "sm_90")
    (tmp_path / name).mkdir()
    (tmp_path / name / f"{name}.so").write_bytes(b"")  # half-linked: no marker yet
    assert not inline.is_built([a], "sm_90", directory=tmp_path)
    (tmp_path / name / f"{name}.ok").write_text(a.key)  # a marker without the library's keyed digest
    assert not inline.is_built([a], "sm_90", directory=tmp_path)
    from torch_sparserl.toolchain import trust

    trust.write_marker(tmp_path / name / f"{name}.so", tmp_path / name / f"{name}.ok")
    assert inline.is_built([a], "sm_90", directory=tmp_path)
    assert inline.is_built([a, a], "sm_90", directory=tmp_path)
    assert not inline.is_built([a], "sm_80", directory=tmp_path)
    assert not inline.is_built([a, b], "sm_90", directory=tmp_path)
    (tmp_path / name / f"{name}.so").write_bytes(b"\x7fELF changed")  # changed since it was signed
    assert not inline.is_built([a], "sm_90", directory=tmp_path)
