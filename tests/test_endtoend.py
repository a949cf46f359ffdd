"""The install gate that weighs host costs with GPU time (torch_sparserl.jit.endtoend), with
given costs (CPU). The costs' measurement runs on the device: tests/test_fastpath_gpu.py."""

from __future__ import annotations

import pytest
import torch

from torch_sparserl import pattern as patterns
from torch_sparserl.jit import endtoend
from torch_sparserl.jit.cache import CacheEntry, KernelCache
from torch_sparserl.jit.decisions import Fallback, Installed
from torch_sparserl.jit.runtime import Runtime, RuntimeSettings

from helpers import make_pattern, to_parts

COSTS = endtoend.HostCosts(door_us=1.0, alloc_us=1.0, launch_us=2.0, cusparse_us={"spmv": 6.0, "spmm": 9.0})


def record(kernel_gpu_us, cusparse_gpu_us, launches):
    return {"runtime_us": kernel_gpu_us, "cusparse_us": cusparse_gpu_us, "timing": {"launches": launches}}


def test_a_call_is_weighed_alone_and_in_a_stream():
    found = endtoend.verdict(record(4.0, 6.0, 2), "spmv", COSTS)
    # kernel: 1 + 1 + 2 * 2 = 6 us of host; cuSPARSE: 1 + 6 = 7
    assert found.kernel_host_us == pytest.approx(6.0) and found.cusparse_host_us == pytest.approx(7.0)
    assert found.alone == pytest.approx((7 + 6) / (6 + 4))
    assert found.streamed == pytest.approx(7 / 6)
    assert found.speedup == pytest.approx(7 / 6)
    assert "2 launches" in found.describe() and "1.17x" in found.describe()


def test_a_gpu_win_that_loses_per_call_is_refused():
    """1.67x on the GPU, but three launches of a host-bound call cost more than cuSPARSE's call."""
    costs = endtoend.HostCosts(door_us=1.0, alloc_us=1.0, launch_us=3.0, cusparse_us={"spmv": 6.0})
    found = endtoend.verdict(record(3.0, 5.0, 3), "spmv", costs)
    assert found.alone == pytest.approx((7 + 5) / (11 + 3)) and found.speedup < 1.0


def test_large_products_keep_their_gpu_win():
    found = endtoend.verdict(record(100.0, 180.0, 2), "spmm_transposed", COSTS)  # spmm's costs
    assert found.cusparse_host_us == pytest.approx(10.0)
    assert found.streamed == pytest.approx(1.8) and found.alone == pytest.approx(190 / 106)


@pytest.mark.parametrize("case", ["no costs", "no launches", "not served by C++", "half", "no record"])
def test_the_gpu_time_decision_stands_where_nothing_can_be_weighed(monkeypatch, case):
    monkeypatch.setattr(endtoend, "host_costs", lambda device: None if case == "no costs" else COSTS)
    losing = record(3.0, 5.0, 9)
    if case == "no launches":
        losing["timing"] = {}
    op = "sddmm" if case == "not served by C++" else "spmv"
    dtype = torch.float16 if case == "half" else torch.float32
    assert endtoend.gate(None if case == "no record" else losing, op, dtype, torch.device("cpu"), 1.05) == (True, "")


def test_the_margin_applies_end_to_end(monkeypatch):
    monkeypatch.setattr(endtoend, "host_costs", lambda device: COSTS)
    allowed, why = endtoend.gate(record(4.0, 6.0, 2), "spmv", torch.float32, torch.device("cpu"), 1.05)
    assert allowed and "1.17x" in why
    allowed, _ = endtoend.gate(record(4.0, 6.0, 2), "spmv", torch.float32, torch.device("cpu"), 1.2)
    assert not allowed


def test_without_the_cxx_library_no_costs_are_measured(monkeypatch):
    from torch_sparserl.jit import fastpath

    monkeypatch.setattr(fastpath, "loaded", False)
    assert endtoend.host_costs(torch.device("cuda", 0)) is None
    assert endtoend.host_costs(torch.device("cpu")) is None


@pytest.mark.parametrize("launches, installed", [(3, False), (1, True)])
def test_the_runtime_installs_only_what_wins_end_to_end(tmp_path, monkeypatch, launches, installed):
    """The runtime asks the gate before it installs a kernel its specializer chose on GPU time;
    a refused kernel is a decided fallback whose reason gives the numbers."""
    monkeypatch.setattr(endtoend, "host_costs", lambda device: endtoend.HostCosts(
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

    runtime = Runtime(RuntimeSettings(mode="sync"), cache=KernelCache(tmp_path), specializer=specializer,
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
        pytest.skip("measures for real on a GPU (tests/test_fastpath_gpu.py)")
    monkeypatch.setattr(fastpath, "loaded", True)
    monkeypatch.setattr(endtoend, "_COSTS", {})
    with caplog.at_level("WARNING", logger="torch_sparserl.jit.endtoend"):
        assert endtoend.host_costs(torch.device("cuda", 0)) is None
        assert endtoend.host_costs(torch.device("cuda", 0)) is None
    assert caplog.text.count("host costs could not be measured") == 1
    assert endtoend.gate(record(3.0, 5.0, 9), "spmv", torch.float32, torch.device("cuda", 0), 1.05) == (True, "")
