"""The C++ fast path's Python side on any machine: when it is built, what it refuses, and that
nothing changes where it is not loaded (CPU torch, or turned off). What it serves is tested on
the GPU (tests/test_fastpath_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from torch_sparserl.jit import fastpath
from torch_sparserl.jit import runtime as rt
from torch_sparserl.ops import FAST_OPS

from helpers import make_pattern, ref_spmm, to_parts


@pytest.mark.parametrize("value", ["0", "off", "false"])
def test_turned_off_by_the_environment(monkeypatch, value):
    monkeypatch.setenv("SPARSERL_FAST_PATH", value)
    assert fastpath.unavailable() == "turned off by SPARSERL_FAST_PATH"
    assert fastpath.ensure() is fastpath.loaded


@pytest.mark.skipif(torch.version.cuda is not None, reason="a CUDA torch can build it")
def test_without_cuda_it_is_never_built(monkeypatch):
    monkeypatch.delenv("SPARSERL_FAST_PATH", raising=False)
    assert fastpath.unavailable() == "this torch has no CUDA"
    assert fastpath.ensure(wait=True) is False and fastpath._builder is None
    assert fastpath.entries() == 0
    fastpath.forget()  # nothing to forget: no error


def test_the_library_is_named_by_its_source_and_torch(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARSERL_CACHE_DIR", str(tmp_path))
    path, done = fastpath.library()
    assert path.parent.parent == tmp_path / "build" and path.suffix == ".so" and done.suffix == ".ok"
    assert path.stem == fastpath._name() and torch.__version__ not in path.stem  # a hash
    assert not fastpath.is_built()
    monkeypatch.setattr(torch, "__version__", torch.__version__ + "+other")
    assert fastpath.library()[0] != path


def test_the_source_ships_with_the_package():
    text = fastpath.SOURCE.read_text()
    for op in fastpath.OPS:  # the C++ kernels are registered for each of the Python operators
        assert f'm.impl("{op}", &product<' in text
        assert any(t._name == f"sparserl_fast::{op}" for t in FAST_OPS.values())


def test_fast_ops_are_the_python_implementation_where_cxx_is_not_loaded(device):
    A = make_pattern("random", seed=11)
    crow, col, val = to_parts(A, torch.float32, torch.int64, device)
    X = torch.randn(A.shape[1], 8, device=device)
    for _ in range(2):
        got = torch.ops.sparserl_fast.spmm(crow, col, val, A.shape[1], X)
        want = ref_spmm(crow, col, val, A.shape[1], X)
        torch.testing.assert_close(got.double().cpu(), want, rtol=1e-5, atol=1e-5)
    if torch.device(device).type == "cpu":
        with pytest.raises(ValueError, match="sparserl.spmm"):
            torch.ops.sparserl_fast.spmm(crow, col, val, A.shape[1], X[:-1])


def test_runtime_stats_are_a_plain_dict_of_counters():
    runtime = rt.Runtime(rt.RuntimeSettings(mode="off"))
    try:
        stats = runtime.stats
        assert isinstance(stats, dict) and stats is runtime.stats
        assert stats["installed_calls"] == stats["fallback_calls"] == 0
        fastpath.fold(runtime)  # not the registry's owner: nothing to add
        assert runtime.stats["installed_calls"] == 0
    finally:
        runtime.close()


@pytest.mark.skipif(torch.version.cuda is not None, reason="a CUDA torch can build it")
def test_the_cli_says_why_it_is_not_there(capsys, monkeypatch):
    from torch_sparserl import cli

    monkeypatch.delenv("SPARSERL_FAST_PATH", raising=False)
    assert cli.main(["fastpath"]) == 1
    assert "C++ fast path: not available: this torch has no CUDA" in capsys.readouterr().out
    assert cli.main(["info"]) == 0
    assert "C++ fast path: not available" in capsys.readouterr().out
