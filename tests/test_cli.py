"""The command line and the shipped matrices."""

import shutil
import subprocess
import sys

import pytest
import scipy.sparse as sp

import torch_sparserl as ts


def test_shipped_matrices_load():
    names = ts.list_matrices()
    assert {"cora", "citeseer"} <= set(names)
    A = ts.load_matrix("cora")
    assert isinstance(A, sp.csr_matrix) and A.shape == (2708, 2708) and A.nnz == 10556


def test_load_mtx_and_errors(tmp_path):
    import scipy.io
    A = ts.load_matrix("citeseer")
    scipy.io.mmwrite(tmp_path / "a.mtx", A)
    assert (ts.load_matrix(tmp_path / "a.mtx") != A).nnz == 0
    with pytest.raises(FileNotFoundError, match="no shipped matrix of that name"):
        ts.load_matrix("no-such-matrix")


def test_info():
    out = subprocess.run([sys.executable, "-m", "torch_sparserl", "info"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "sparserl::spmm" in out.stdout and "cora" in out.stdout
    assert "JIT runtime (from the environment): mode=" in out.stdout and "admit_calls=" in out.stdout
    assert "kernel cache: " in out.stdout


@pytest.mark.slow
def test_demo_runs_on_cpu():
    out = subprocess.run([sys.executable, "-m", "torch_sparserl", "demo", "--device", "cpu", "--n", "16"],
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "all checks passed" in out.stdout and "0 graph breaks" in out.stdout


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_tune_without_a_gpu_runs_the_compile_tier(capsys):
    from torch_sparserl.cli import main

    assert main(["tune", "cora", "--op", "spmv", "--families", "vector_row", "--compile-only"]) == 0
    out = capsys.readouterr().out
    assert "compiling the" in out and "candidates compile cleanly" in out and "vector_row(" in out


def test_cache_commands(tmp_path, capsys):
    from torch_sparserl.cli import main
    from torch_sparserl.jit.cache import CacheEntry, KernelCache
    from torch_sparserl.pattern.fingerprint import SpecializationKey

    key = SpecializationKey(pattern="feed", op="spmm", n=32, dtype="f32", arch="sm_90", policy="autotune")
    KernelCache(tmp_path).put(CacheEntry(key, None, reason="none beat cuSPARSE"))
    assert main(["cache", "list", "--dir", str(tmp_path)]) == 0
    listed = capsys.readouterr().out
    assert "1 entries" in listed and "MB of at most 256 MB)" in listed
    assert main(["cache", "info", key.digest()[:8], "--dir", str(tmp_path)]) == 0
    assert '"reason": "none beat cuSPARSE"' in capsys.readouterr().out
    assert main(["cache", "info", "zzzz", "--dir", str(tmp_path)]) == 2
    assert "expected one entry starting with 'zzzz', found 0" in capsys.readouterr().err
    assert main(["cache", "clear", "--dir", str(tmp_path)]) == 0
    assert "removed 1 entries" in capsys.readouterr().out


def test_explain_reads_the_decisions_for_a_matrix(tmp_path, capsys):
    import numpy as np
    import torch

    from torch_sparserl.cli import main
    from torch_sparserl.jit.cache import CacheEntry, KernelCache
    from torch_sparserl.pattern.fingerprint import SpecializationKey, pattern_hash

    M = ts.load_matrix("rajat01")
    crow = torch.from_numpy(M.indptr.astype(np.int32))
    col = torch.from_numpy(M.indices.astype(np.int32))
    key = SpecializationKey(pattern=pattern_hash(crow, col, M.shape[1]), op="spmm", n=32, dtype="f32",
                            arch="sm_90", policy="autotune")
    other = SpecializationKey(pattern="feed", op="spmm", n=32, dtype="f32", arch="sm_90", policy="autotune")
    cache = KernelCache(tmp_path)
    cache.put(CacheEntry(key, "// sparserl: ...", family="group_row", params={"lanes": 8},
                         record={"runtime_us": 10.0, "cusparse_us": 21.0}, reason="2.10x cuSPARSE"))
    cache.put(CacheEntry(other, None, reason="none beat cuSPARSE"))
    assert main(["explain", "rajat01", "--dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "spmm n=32 f32 int32 indices, sm_90" in out and "kernel group_row{'lanes': 8} because 2.10x cuSPARSE" in out
    assert "measured 10.0 us vs cuSPARSE 21.0 us" in out and "none beat" not in out
    assert main(["explain", "rajat01", "--transposed", "--dir", str(tmp_path)]) == 0
    assert "no decision in" in capsys.readouterr().out  # rajat01 is not symmetric


def test_bench_says_it_needs_a_gpu(capsys):
    import torch

    from torch_sparserl.cli import main

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert main(["bench", "cora"]) == 2
    assert "sparserl bench: needs a CUDA GPU" in capsys.readouterr().err
