"""The host costs the install's verdict weighs (torch_sparserl.jit.endtoend), and the runtime's
install gate on them, with given costs (CPU); the verdict's arithmetic is tested in
tests/evaluate/test_verdict.py. The costs' measurement runs on the device: tests/jit/test_fastpath_gpu.py."""

from __future__ import annotations

import pytest
import torch

from torch_sparserl import pattern as patterns
from torch_sparserl.evaluate import verdict
from torch_sparserl.jit import endtoend
from torch_sparserl.jit.cache import CacheEntry, KernelCache
from torch_sparserl.jit.decisions import Fallback, Installed
from torch_sparserl.jit.runtime import Runtime
from torch_sparserl.config import JitOptions

from helpers import make_pattern, to_parts


def record(kernel_gpu_us, cusparse_gpu_us, launches):
    return {"runtime_us": kernel_gpu_us, "cusparse_us": cusparse_gpu_us, "timing": {"launches": launches}}


def test_without_the_cxx_library_no_costs_are_measured(monkeypatch):
    from torch_sparserl.jit import fastpath

    monkeypatch.setattr(fastpath, "loaded", False)
    assert endtoend.host_costs(torch.device("cuda", 0)) is None
    assert endtoend.host_costs(torch.device("cpu")) is None


@pytest.mark.parametrize("launches, installed", [(3, False), (1, True)])
def test_the_runtime_installs_only_what_wins_end_to_end(tmp_path, monkeypatch, launches, installed):
    """The runtime asks the gate before it installs a kernel its specializer chose on GPU time;
    a refused kernel is a decided fallback whose reason gives the numbers."""
    monkeypatch.setattr(endtoend, "host_costs", lambda device: verdict.HostCosts(
        door_us=1.0, alloc_us=1.0, launch_us=3.0, cusparse_us={"spmm": 6.0}))
    built = []
    source = ('// sparserl: op=spmm dtype=f32 block=32 grid=1\n'
              'extern "C" __global__ void sparserl_kernel(const int* rowptr) {}\n')

    def specializer(key, crow, col, ncols):
        return CacheEntry(key, source, family="rowchunks", params={}, reason="1.67x cuSPARSE",
                          record=record(3.0, 5.0, launches))

    def installer(entry, crow, col, ncols):
        built.append(entry.key)
        return lambda crow, col, val, X: torch.sparse_csr_tensor(crow, col, val, (crow.numel() - 1, ncols)).to_dense() @ X

    runtime = Runtime(JitOptions(mode="sync"), cache=KernelCache(tmp_path), specializer=specializer,
                      installer=installer, devices=("cpu",))
    try:
        A = make_pattern("random")
        crow, col, val = to_parts(A, torch.float32, torch.int64, "cpu")
        X = torch.randn(A.shape[1], 8, dtype=torch.float32)
        entry = patterns.lookup(crow, col, A.shape[1])
        got = runtime.call("spmm", entry, crow, col, val, X)  # None: cuSPARSE serves it
        assert (got is not None) == installed
        if installed:
            torch.testing.assert_close(got, torch.sparse_csr_tensor(crow, col, val, A.shape).to_dense() @ X)
        state = runtime.state("spmm", entry, 8, torch.float32)
        if installed:
            assert isinstance(state, Installed) and built
        else:
            assert isinstance(state, Fallback) and state.decided and not built
            assert "under the 1.05x margin end to end" in state.reason and "3 launches" in state.reason
    finally:
        runtime.close()


def test_a_failed_measurement_is_a_warning_and_the_gpu_time_decision_stands(monkeypatch, caplog):
    """Where the costs cannot be measured (here: no CUDA), the runtime warns once and installs on
    GPU time; the device is not measured again."""
    from torch_sparserl.jit import fastpath

    if torch.cuda.is_available():
        pytest.skip("measures for real on a GPU (tests/jit/test_fastpath_gpu.py)")
    monkeypatch.setattr(fastpath, "loaded", True)
    monkeypatch.setattr(endtoend, "_COSTS", {})
    with caplog.at_level("WARNING", logger="torch_sparserl.jit.endtoend"):
        assert endtoend.host_costs(torch.device("cuda", 0)) is None
        assert endtoend.host_costs(torch.device("cuda", 0)) is None
    assert caplog.text.count("host costs could not be measured") == 1
    assert verdict.end_to_end(record(3.0, 5.0, 9), "spmv", torch.float32, 1.05,
                              lambda: endtoend.host_costs(torch.device("cuda", 0))) == (True, "")
