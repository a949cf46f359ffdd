"""The command line and the shipped matrices."""

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


@pytest.mark.slow
def test_demo_runs_on_cpu():
    out = subprocess.run([sys.executable, "-m", "torch_sparserl", "demo", "--device", "cpu", "--n", "16"],
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "all checks passed" in out.stdout and "0 graph breaks" in out.stdout
