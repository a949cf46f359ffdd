"""The runtime's decisions and every fallback path, with fake specializers and installers (CPU)."""

from __future__ import annotations

import logging
import threading

import pytest
import torch

from torch_sparserl import pattern as patterns
from torch_sparserl.cache import CacheEntry, KernelCache
from torch_sparserl.runtime import Runtime, RuntimeSettings, SpecializationError

from helpers import make_pattern, to_parts

SOURCE = "// sparserl: op=spmm dtype=f32 block=32 grid=1\n"


class Fakes:
    def __init__(self, entry_source=SOURCE, fail_specialize=False, fail_install=False, gate=None):
        self.specialized, self.installed = [], []
        self.entry_source, self.fail_specialize, self.fail_install, self.gate = (
            entry_source, fail_specialize, fail_install, gate)

    def specializer(self, key, crow, col, ncols):
        if self.gate is not None:
            self.gate.wait(10)
        self.specialized.append(key)
        if self.fail_specialize:
            raise RuntimeError("every candidate crashed")
        return CacheEntry(key, self.entry_source, family="fake", params={"p": 1},
                          reason="2.0x cuSPARSE" if self.entry_source else "none beat cuSPARSE")

    def installer(self, entry, crow, col, ncols):
        self.installed.append(entry.key)
        if self.fail_install:
            raise OSError("the build failed")
        rows = crow.numel() - 1

        def launch(val, X):
            return torch.sparse_csr_tensor(crow, col, val, (rows, ncols)).to_dense() @ X

        return launch


def setup(tmp_path, mode="sync", strict=False, **fake_args):
    fakes = Fakes(**fake_args)
    runtime = Runtime(RuntimeSettings(mode=mode, strict=strict), cache=KernelCache(tmp_path),
                      specializer=fakes.specializer, installer=fakes.installer, devices=("cpu",))
    A = make_pattern("cora (real)")
    crow, col, val = to_parts(A, torch.float32, torch.int64, "cpu")
    X = torch.randn(A.shape[1], 8)
    return runtime, fakes, A, crow, col, val, X


def call(runtime, A, crow, col, val, X):
    entry = patterns.lookup(crow, col, A.shape[1])
    return runtime.call("spmm", entry, crow, col, val, X)


def expected(A, crow, col, val, X):
    return torch.sparse_csr_tensor(crow, col, val, A.shape).to_dense() @ X


def test_sync_mode_specializes_once_and_reuses(tmp_path):
    runtime, fakes, A, crow, col, val, X = setup(tmp_path)
    for _ in range(3):
        torch.testing.assert_close(call(runtime, A, crow, col, val, X), expected(A, crow, col, val, X))
    assert len(fakes.specialized) == 1 and len(fakes.installed) == 1
    assert runtime.stats["installed_calls"] == 3
    entry = patterns.lookup(crow, col, A.shape[1])
    assert runtime.explain("spmm", entry, 8, torch.float32) == "installed: fake{'p': 1}"


def test_background_mode_serves_cusparse_until_the_kernel_is_ready(tmp_path):
    gate = threading.Event()
    runtime, fakes, A, crow, col, val, X = setup(tmp_path, mode="background", gate=gate)
    assert call(runtime, A, crow, col, val, X) is None  # first call: cuSPARSE
    entry = patterns.lookup(crow, col, A.shape[1])
    assert runtime.explain("spmm", entry, 8, torch.float32) == "specializing in the background"
    gate.set()
    runtime.wait(10)
    torch.testing.assert_close(call(runtime, A, crow, col, val, X), expected(A, crow, col, val, X))
    assert len(fakes.specialized) == 1


def test_a_new_process_finds_the_decision_on_disk(tmp_path):
    runtime, fakes, A, crow, col, val, X = setup(tmp_path)
    call(runtime, A, crow, col, val, X)
    second = Fakes()
    fresh = Runtime(RuntimeSettings(mode="sync"), cache=KernelCache(tmp_path), specializer=second.specializer,
                    installer=second.installer, devices=("cpu",))
    crow2, col2 = crow.clone(), col.clone()  # new tensors, same pattern: same fingerprint
    torch.testing.assert_close(call(fresh, A, crow2, col2, val, X), expected(A, crow, col, val, X))
    assert second.specialized == [] and len(second.installed) == 1


def test_an_in_place_change_of_the_pattern_specializes_again(tmp_path):
    runtime, fakes, A, crow, col, val, X = setup(tmp_path)
    call(runtime, A, crow, col, val, X)
    col[0] = (col[0] + 1) % A.shape[1]
    call(runtime, A, crow, col, val, X)
    assert len(fakes.specialized) == 2 and fakes.specialized[0].pattern != fakes.specialized[1].pattern


def test_failed_specialization_falls_back_loudly(tmp_path, caplog):
    runtime, fakes, A, crow, col, val, X = setup(tmp_path, fail_specialize=True)
    with caplog.at_level(logging.WARNING, logger="torch_sparserl.runtime"):
        assert call(runtime, A, crow, col, val, X) is None
        assert call(runtime, A, crow, col, val, X) is None
    assert "spmm n=8 f32 falls back to cuSPARSE: specialization failed: RuntimeError: every candidate crashed" in caplog.text
    assert caplog.text.count("falls back") == 1 and len(fakes.specialized) == 1  # decided once


def test_failed_install_falls_back(tmp_path, caplog):
    runtime, fakes, A, crow, col, val, X = setup(tmp_path, fail_install=True)
    assert call(runtime, A, crow, col, val, X) is None
    assert "installing fake failed: the build failed" in caplog.text


@pytest.mark.parametrize("failure", [dict(fail_specialize=True), dict(fail_install=True)])
def test_strict_raises_instead_of_falling_back(tmp_path, failure):
    runtime, fakes, A, crow, col, val, X = setup(tmp_path, strict=True, **failure)
    with pytest.raises(SpecializationError, match="sparserl runtime: spmm n=8 f32: (specialization|installing)"):
        call(runtime, A, crow, col, val, X)


def test_no_kernel_faster_than_cusparse_is_a_decision_not_a_failure(tmp_path):
    runtime, fakes, A, crow, col, val, X = setup(tmp_path, strict=True, entry_source=None)
    assert call(runtime, A, crow, col, val, X) is None  # strict does not raise for a decision
    entry = patterns.lookup(crow, col, A.shape[1])
    assert runtime.explain("spmm", entry, 8, torch.float32) == "cuSPARSE: no kernel: none beat cuSPARSE"
    assert fakes.installed == []


def test_operands_the_kernels_cannot_take_fall_back_per_call(tmp_path):
    runtime, fakes, A, crow, col, val, X = setup(tmp_path)
    wide = torch.randn(A.shape[1], 16)[:, :8]  # non-contiguous view
    assert call(runtime, A, crow, col, val, wide) is None
    assert call(runtime, A, crow, col, val, X) is not None
    assert call(runtime, A, crow, col, val, torch.randn(A.shape[1], 16)[:, :8]) is None


def test_off_mode_and_other_devices_never_specialize(tmp_path):
    runtime, fakes, A, crow, col, val, X = setup(tmp_path)
    cuda_only = Runtime(RuntimeSettings(mode="sync"), cache=KernelCache(tmp_path), specializer=fakes.specializer,
                        installer=fakes.installer)
    off = Runtime(RuntimeSettings(mode="off"), cache=KernelCache(tmp_path), specializer=fakes.specializer,
                  installer=fakes.installer, devices=("cpu",))
    assert call(cuda_only, A, crow, col, val, X) is None and call(off, A, crow, col, val, X) is None
    assert call(runtime, A, crow, col, val.double(), X.double()) is None  # float64: no kernels
    assert fakes.specialized == []


@pytest.mark.parametrize("kwargs, message", [(dict(mode="eager"), "mode must be one of"),
                                             (dict(margin=0.9), "margin must be >= 1.0"),
                                             (dict(budget_s=0), "budget_s must be > 0")])
def test_settings_name_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RuntimeSettings(**kwargs)
