"""The runtime's decisions and every fallback path, with fake specializers and installers (CPU)."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch

from torch_sparserl import pattern as patterns
from torch_sparserl.evaluate.record import TransientFailure
from torch_sparserl.jit.cache import KernelCache
from torch_sparserl.jit.runtime import Installed, Runtime, SpecializationError
from torch_sparserl.config import JitOptions

from fakes import SOURCE, Fakes
from helpers import make_pattern, to_parts

def setup(tmp_path, mode="sync", strict=False, **fake_args):
    fakes = Fakes(**fake_args)
    runtime = Runtime(JitOptions(mode=mode, strict=strict, admit_age_s=0), cache=KernelCache(tmp_path),
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
    assert runtime.explain("spmm", entry, 8, torch.float32) == "installed: fake{'p': 1} (2.0x cuSPARSE)"


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


def test_the_stats_say_how_long_products_waited_for_decisions(tmp_path):
    class Sleep:  # the fake specializer's gate: at least 0.2 s, counted from the call itself
        @staticmethod
        def wait(timeout):
            time.sleep(0.2)

    sync, *parts = setup(tmp_path / "sync", gate=Sleep())
    call(sync, *parts[1:])
    assert sync.stats["jit_s"] >= 0.2 and sync.stats["background_s"] == 0.0

    gate = threading.Event()
    background, *parts = setup(tmp_path / "background", mode="background", gate=gate)
    call(background, *parts[1:])
    threading.Timer(0.2, gate.set).start()
    background.wait(10)
    assert background.stats["jit_s"] < 0.2 <= background.stats["background_s"]


def test_the_keys_of_one_pattern_share_its_features_and_sandbox(monkeypatch):
    from torch_sparserl.pattern import features as features_module
    from torch_sparserl.pattern.fingerprint import SpecializationKey
    from torch_sparserl.jit import specializers
    from torch_sparserl.jit.specializers import autotune_specializer

    computed, copied = [], []
    monkeypatch.setattr(features_module, "structural_features",
                        lambda rowptr, col, shape: computed.append(shape) or {"rows": shape[0]})
    real_copy = specializers.host_indices
    monkeypatch.setattr(specializers, "host_indices", lambda *a: copied.append(1) or real_copy(*a))
    specializer = autotune_specializer(JitOptions())
    A = make_pattern("cora (real)")
    crow, col, _ = to_parts(A, torch.float32, torch.int32, "cpu")

    def ask(pattern, n):
        key = SpecializationKey(pattern=pattern * 32, op="spmm", n=n, dtype="f32", arch="sm_90", policy="autotune")
        return specializer._problem(key, crow, col, A.shape[1])

    asked = []
    for n in (16, 128):
        matrix, known = ask("p", n)
        asked.append(known)
    assert computed == [A.shape] and matrix[2] == A.shape
    assert asked[0]["sandbox"] is asked[1]["sandbox"] and asked[1]["matrix_key"] == "p" * 32
    assert len(copied) == 1 and ask("p", 32)[0] is matrix  # one host copy for the pattern's keys
    ask("q", 16)
    assert len(copied) == 2  # another pattern: copied
    specializer.close()  # the worker stopped: the kept copy goes with it
    assert specializer._matrix is None
    ask("q", 16)
    assert len(copied) == 3
    specializer.close()


def test_a_new_process_finds_the_decision_on_disk(tmp_path):
    runtime, fakes, A, crow, col, val, X = setup(tmp_path)
    call(runtime, A, crow, col, val, X)
    second = Fakes()
    fresh = Runtime(JitOptions(mode="sync"), cache=KernelCache(tmp_path), specializer=second.specializer,
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
    with caplog.at_level(logging.WARNING, logger="torch_sparserl.jit.runtime"):
        assert call(runtime, A, crow, col, val, X) is None
        assert call(runtime, A, crow, col, val, X) is None
    assert "spmm n=8 f32 falls back to cuSPARSE: specialization failed: RuntimeError: every candidate crashed" in caplog.text
    assert caplog.text.count("falls back") == 1 and len(fakes.specialized) == 1  # decided once


def test_a_search_undecided_for_the_devices_state_runs_again_and_then_decides(tmp_path, caplog):
    runtime, fakes, A, crow, col, val, X = setup(tmp_path, transient=1)
    with caplog.at_level(logging.WARNING, logger="torch_sparserl.jit.runtime"):
        torch.testing.assert_close(call(runtime, A, crow, col, val, X), expected(A, crow, col, val, X))
    assert len(fakes.specialized) == 2 and runtime.stats["transient_retries"] == 1
    assert "failed for the device's state; this process's cached GPU memory is released" in caplog.text
    assert len(runtime.cache.entries()) == 1  # the decision, once reached


def test_a_search_undecided_twice_falls_back_and_caches_nothing(tmp_path):
    runtime, fakes, A, crow, col, val, X = setup(tmp_path, transient=5)
    assert call(runtime, A, crow, col, val, X) is None and call(runtime, A, crow, col, val, X) is None
    assert len(fakes.specialized) == 2 and runtime.cache.entries() == []
    entry = patterns.lookup(crow, col, A.shape[1])
    assert runtime.explain("spmm", entry, 8, torch.float32) == (
        "cuSPARSE: no candidate decided: 2 of 2 evaluations failed for the device's state (tried 2 times; "
        "nothing cached: a later process decides again)")
    later = Fakes()  # another process, the device free again: it searches and decides
    second = Runtime(JitOptions(mode="sync"), cache=KernelCache(tmp_path), specializer=later.specializer,
                     installer=later.installer, devices=("cpu",))
    torch.testing.assert_close(call(second, A, crow, col, val, X), expected(A, crow, col, val, X))
    assert len(later.specialized) == 1


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


def test_the_kernels_get_contiguous_aligned_operands(tmp_path):
    runtime, fakes, A, crow, col, val, X = setup(tmp_path)
    wide = torch.randn(A.shape[1], 16)[:, :8]  # non-contiguous view
    shifted = torch.randn(A.shape[1] * 8 + 1)[1:].view(A.shape[1], 8)  # contiguous, 4 bytes off alignment
    strided_val = torch.randn(val.numel() * 2)[::2]
    for X_in, val_in in ((wide, val), (shifted, val), (X, strided_val)):
        torch.testing.assert_close(call(runtime, A, crow, col, val_in, X_in), expected(A, crow, col, val_in, X_in))
    assert fakes.launched == [(True, 0, True)] * 3


def test_off_mode_and_other_devices_never_specialize(tmp_path):
    runtime, fakes, A, crow, col, val, X = setup(tmp_path)
    cuda_only = Runtime(JitOptions(mode="sync"), cache=KernelCache(tmp_path), specializer=fakes.specializer,
                        installer=fakes.installer)
    off = Runtime(JitOptions(mode="off"), cache=KernelCache(tmp_path), specializer=fakes.specializer,
                  installer=fakes.installer, devices=("cpu",))
    assert call(cuda_only, A, crow, col, val, X) is None and call(off, A, crow, col, val, X) is None
    assert call(runtime, A, crow, col, val.double(), X.double()) is None  # float64: no kernels
    assert fakes.specialized == []
    entry = patterns.lookup(crow, col, A.shape[1])
    assert runtime.explain("spmm", entry, 8, torch.float64).startswith("cuSPARSE: torch.float64 is not a kernel dtype")


def test_products_outside_the_kernel_abi_are_decided_without_specializing(tmp_path):
    runtime, fakes, A, crow, col, val, X = setup(tmp_path, strict=True)
    entry = patterns.lookup(crow, col, A.shape[1])
    assert runtime.call("spgemm", entry, crow, col, val, X) is None  # no kernel space: a decision
    assert runtime.call("spmm", entry, crow, col, val, X[:, :0]) is None  # N = 0
    assert runtime.explain("spmm", entry, 0, torch.float32) == "cuSPARSE: empty product"
    assert fakes.specialized == []


def test_states_belong_to_their_runtime(tmp_path):
    runtime, fakes, A, crow, col, val, X = setup(tmp_path)
    call(runtime, A, crow, col, val, X)
    other = Fakes(fail_specialize=True)
    second = Runtime(JitOptions(mode="sync"), cache=KernelCache(tmp_path / "other"),
                     specializer=other.specializer, installer=other.installer, devices=("cpu",))
    assert call(second, A, crow, col, val, X) is None  # not the first runtime's installed kernel
    entry = patterns.lookup(crow, col, A.shape[1])
    assert runtime.explain("spmm", entry, 8, torch.float32).startswith("installed")
    assert second.explain("spmm", entry, 8, torch.float32).startswith("cuSPARSE: specialization failed")


def test_prespecialize_decides_before_the_first_product(tmp_path):
    runtime, fakes, A, crow, col, val, X = setup(tmp_path)
    entry = patterns.lookup(crow, col, A.shape[1])
    state = runtime.prespecialize("spmm", entry, crow, col, 8, torch.float32)
    assert runtime.explain("spmm", entry, 8, torch.float32).startswith("installed") and state is not None
    call(runtime, A, crow, col, val, X)
    assert len(fakes.specialized) == 1 and runtime.stats["installed_calls"] == 1


def test_settings_from_the_environment():
    settings = JitOptions.from_env({"SPARSERL_JIT": "sync", "SPARSERL_JIT_BUDGET_S": "5",
                                         "SPARSERL_JIT_MARGIN": "1.2", "SPARSERL_JIT_STRICT": "yes"})
    assert settings == JitOptions(mode="sync", budget_s=5.0, margin=1.2, strict=True)
    assert JitOptions.from_env({}) == JitOptions()
    with pytest.raises(ValueError, match=r"SPARSERL_JIT_BUDGET_S: expected a number of seconds > 0 and <= 3600 \(got 'soon'\)"):
        JitOptions.from_env({"SPARSERL_JIT_BUDGET_S": "soon"})
    with pytest.raises(ValueError, match=r"SPARSERL_JIT_STRICT: expected a boolean .* \(got 'maybe'\)"):
        JitOptions.from_env({"SPARSERL_JIT_STRICT": "maybe"})
    with pytest.raises(ValueError, match=r"SPARSERL_JIT: expected one of \('background', 'sync', 'off'\)"):
        JitOptions.from_env({"SPARSERL_JIT": "eager"})


def test_configure_replaces_the_active_runtime_and_keeps_the_rest():
    from torch_sparserl.jit import runtime as rt

    before = rt.active()
    try:
        changed = rt.configure(mode="off", margin=1.5)
        assert rt.active() is changed and changed is not before
        assert changed.settings.mode == "off" and changed.settings.margin == 1.5
        assert changed.settings.budget_s == before.settings.budget_s
        with pytest.raises(TypeError, match=r"configure: unknown setting\(s\) \['colour'\]; expected some of"):
            rt.configure(colour="blue")
        assert rt.active() is changed  # refused before anything changed
    finally:
        rt.configure(before.settings)


@pytest.mark.parametrize("kwargs, message", [(dict(mode="eager"), "mode must be one of"),
                                             (dict(margin=0.9), "margin must be a number >= 1"),
                                             (dict(budget_s=0), "budget_s must be a number of seconds > 0")])
def test_settings_name_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        JitOptions(**kwargs)


# ------------------------------------------------------------------ the operators use the runtime


@pytest.fixture
def routed(tmp_path):
    """The operators' runtime replaced by one with fakes that serves the CPU."""
    from torch_sparserl.jit import runtime as rt

    fakes = Fakes()
    previous = rt.set_active(Runtime(JitOptions(mode="sync", strict=True), cache=KernelCache(tmp_path),
                                     specializer=fakes.specializer, installer=fakes.installer, devices=("cpu",)))
    yield fakes
    rt.set_active(previous)


@pytest.mark.parametrize("name", ["random", "cora (real)"])
def test_every_product_of_the_operators_goes_through_the_runtime(routed, name):
    import torch_sparserl as ts

    M = make_pattern(name)
    A = ts.csr(M, dtype=torch.float32)
    dense = torch.from_numpy(M.toarray()).float()
    X = torch.randn(M.shape[1], 8, requires_grad=True)
    x = torch.randn(M.shape[1])
    G = torch.randn(5, M.shape[0])

    Y = A @ X
    torch.testing.assert_close(Y, dense @ X)
    torch.testing.assert_close(A @ x, dense @ x)
    torch.testing.assert_close(G @ A, G @ dense)  # Aᵀ Gᵀ on the transposed pattern, N = 5
    Y.sum().backward()  # grad X = Aᵀ @ 1: the transposed pattern again, N = 8
    torch.testing.assert_close(X.grad, dense.t() @ torch.ones(M.shape[0], 8))

    seen = {(key.op, key.n) for key in routed.specialized}
    assert seen == {("spmm", 8), ("spmv", 1), ("spmm", 5)}
    assert len(routed.launched) == 4
    if name == "random":  # A's pattern and its transpose, the transpose with N = 5 and N = 8
        assert len({key.pattern for key in routed.specialized}) == 2 and len(routed.specialized) == 4
    else:  # cora is symmetric: its transpose has the same fingerprint, so Aᵀ reuses A's N = 8 kernel
        assert len({key.pattern for key in routed.specialized}) == 1 and len(routed.specialized) == 3


def test_a_matrix_keeps_its_installed_kernel_for_the_next_product(routed):
    import torch_sparserl as ts
    from torch_sparserl.jit import runtime as rt

    M = make_pattern("random")
    A = ts.csr(M, dtype=torch.float32)
    A = ts.CSRMatrix(A.crow, A.col, A.val, A.shape)  # on the caller's index tensors, which it may write
    X = torch.randn(M.shape[1], 8)
    dense = torch.from_numpy(M.toarray()).float()
    torch.testing.assert_close(A @ X, dense @ X)  # decided, installed, remembered on A
    assert (2, 8) in A.__dict__["_door"].hot
    lookups = patterns.stats()["lookups"]
    torch.testing.assert_close(A @ X, dense @ X)
    assert patterns.stats()["lookups"] == lookups  # served from A itself: no pattern lookup
    assert len(routed.launched) == 2

    with torch.no_grad():
        A.col[0] = (A.col[0] + 1) % M.shape[1]  # an in-place change of the pattern
    changed = torch.sparse_csr_tensor(A.crow, A.col, A.val, A.shape).to_dense()
    torch.testing.assert_close(A @ X, changed @ X)  # not the stale kernel: specialized again
    assert len(routed.specialized) == 2

    A @ X
    assert A.__dict__["_door"].hot
    B = ts.csr(M, dtype=torch.float32)
    B @ X
    B.requires_grad = True  # the setter forgets the kernels remembered for a matrix without gradient
    assert "_door" not in B.__dict__

    Xg = X.clone().requires_grad_()
    (A @ Xg).sum().backward()  # autograd: the operator, not the remembered launch
    torch.testing.assert_close(Xg.grad, changed.t() @ torch.ones(M.shape[0], 8))
    other = rt.Runtime(JitOptions(mode="off"), devices=("cpu",))
    previous = rt.set_active(other)
    try:
        launched = len(routed.launched)
        torch.testing.assert_close(A @ X, changed @ X)  # another runtime: the remembered kernel is not its own
        assert len(routed.launched) == launched
    finally:
        rt.set_active(previous)


def test_prewarm_starts_the_specializer_once_before_any_key():
    from torch_sparserl.jit import runtime as rt

    calls = []

    class Warmable:
        def __call__(self, key, crow, col, ncols):
            raise AssertionError("no key was asked for")

        def prewarm(self, device):
            calls.append(device)

    runtime = rt.Runtime(JitOptions(mode="sync"), specializer=Warmable(), devices=("cpu",))
    seconds = runtime.prewarm("cpu")
    assert calls == [torch.device("cpu")] and seconds is not None and seconds >= 0
    runtime.prewarm("cpu", background=True)
    runtime.wait(10)
    assert len(calls) == 2
    off = rt.Runtime(JitOptions(mode="off"), specializer=Warmable(), devices=("cpu",))
    assert off.prewarm("cpu") is None and len(calls) == 2

    class Failing(Warmable):
        def prewarm(self, device):
            raise RuntimeError("no GPU here")

    assert rt.Runtime(JitOptions(mode="sync"), specializer=Failing(), devices=("cpu",)).prewarm("cpu") is None


def test_decisions_name_what_serves_the_matrix_and_its_transpose(tmp_path):
    runtime, fakes, A, crow, col, val, X = setup(tmp_path)
    assert runtime.decisions(crow, col, A.shape[1]) == {}
    call(runtime, A, crow, col, val, X)
    entry_t, crow_t, col_t, perm = patterns.lookup(crow, col, A.shape[1]).transpose(crow, col)
    G = torch.randn(A.shape[0], 4)
    runtime.call("spmm", entry_t, crow_t, col_t, val[perm], G)
    assert runtime.decisions(crow, col, A.shape[1]) == {
        "A spmm n=8 float32": "installed: fake{'p': 1} (2.0x cuSPARSE)",
        "At spmm n=4 float32": "installed: fake{'p': 1} (2.0x cuSPARSE)"}
    other = Runtime(JitOptions(mode="sync"), cache=KernelCache(tmp_path), specializer=fakes.specializer,
                    installer=fakes.installer, devices=("cpu",))
    assert other.decisions(crow, col, A.shape[1]) == {}  # another runtime's states are not its own


def test_background_mode_decides_off_the_callers_thread(tmp_path, monkeypatch):
    """In background mode a call only records that the decision is pending: the fingerprint,
    the cache lookup and the install (a cache hit too) run in the background thread."""
    from torch_sparserl.pattern import fingerprint as fingerprints

    threads = []
    real = fingerprints.pattern_hash
    monkeypatch.setattr(fingerprints, "pattern_hash",
                        lambda *a: threads.append(threading.current_thread()) or real(*a))
    runtime, fakes, A, crow, col, val, X = setup(tmp_path)  # sync: decides and caches the key
    call(runtime, A, crow, col, val, X)
    assert threads == [threading.main_thread()]

    second = Fakes()
    background = Runtime(JitOptions(mode="background", admit_age_s=0), cache=KernelCache(tmp_path),
                         specializer=second.specializer, installer=second.installer, devices=("cpu",))
    crow2, col2 = crow.clone(), col.clone()  # a new pattern entry: fingerprinted again
    assert call(background, A, crow2, col2, val, X) is None  # served by the fallback meanwhile
    background.wait(10)
    assert len(threads) == 2 and threads[1] is not threading.main_thread()
    assert second.specialized == [] and len(second.installed) == 1  # found in the cache, installed there
    torch.testing.assert_close(call(background, A, crow2, col2, val, X), expected(A, crow2, col2, val, X))
    assert background.stats["jit_s"] < 0.1
    background.close()


class _ClosingSpecializer:
    """A specializer with a worker to stop: counts the stops."""

    def __init__(self, fakes):
        self.fakes, self.closed = fakes, 0

    def __call__(self, key, crow, col, ncols):
        return self.fakes.specializer(key, crow, col, ncols)

    def close(self):
        self.closed += 1


def _idle_runtime(tmp_path, idle_s):
    fakes = Fakes()
    specializer = _ClosingSpecializer(fakes)
    runtime = Runtime(JitOptions(mode="sync", idle_s=idle_s), cache=KernelCache(tmp_path),
                      specializer=specializer, installer=fakes.installer, devices=("cpu",))
    A = make_pattern("cora (real)")
    crow, col, val = to_parts(A, torch.float32, torch.int64, "cpu")
    return runtime, specializer, A, crow, col, val


def test_an_idle_worker_is_stopped_and_a_busy_one_kept(tmp_path):
    runtime, specializer, A, crow, col, val = _idle_runtime(tmp_path, idle_s=1.0)
    try:
        call(runtime, A, crow, col, val, torch.randn(A.shape[1], 4))
        time.sleep(0.6)
        call(runtime, A, crow, col, val, torch.randn(A.shape[1], 8))  # another key: the idle clock restarts
        time.sleep(0.5)
        assert specializer.closed == 0  # 1.1 s since the first, 0.5 s since the last
        deadline = time.monotonic() + 5
        while specializer.closed == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert specializer.closed == 1 and runtime.stats["worker_stops"] == 1
        time.sleep(1.2)
        assert specializer.closed == 1  # once per idle spell
        call(runtime, A, crow, col, val, torch.randn(A.shape[1], 16))  # the worker would start again
        assert len(specializer.fakes.specialized) == 3
    finally:
        runtime.close()


def test_idle_zero_keeps_the_worker(tmp_path):
    runtime, specializer, A, crow, col, val = _idle_runtime(tmp_path, idle_s=0)
    try:
        call(runtime, A, crow, col, val, torch.randn(A.shape[1], 4))
        time.sleep(0.2)
        assert specializer.closed == 0 and runtime._idle_timer is None
    finally:
        runtime.close()
    with pytest.raises(ValueError, match="idle_s must be a number of seconds >= 0"):
        JitOptions(idle_s=-1)
    assert JitOptions.from_env({"SPARSERL_JIT_IDLE_S": "2.5"}).idle_s == 2.5


def test_the_longest_idle_time_arms_the_worker_s_timer_and_longer_is_refused(tmp_path, monkeypatch):
    """A timer of 1e10 s was accepted and raised OverflowError in a thread after each
    specialization; the range stops at a day, which a timer takes."""
    from torch_sparserl import config

    failures = []
    monkeypatch.setattr(threading, "excepthook", lambda args: failures.append(args.exc_value))
    runtime, specializer, A, crow, col, val = _idle_runtime(tmp_path, idle_s=config.MAX_JIT_IDLE_S)
    try:
        call(runtime, A, crow, col, val, torch.randn(A.shape[1], 4))
        time.sleep(0.2)
        assert runtime._idle_timer is not None and runtime._idle_timer.is_alive() and not failures
    finally:
        runtime.close()
    for idle_s in (1e10, float("inf"), float("nan")):
        with pytest.raises(ValueError, match=r"idle_s must be a number of seconds >= 0 and <= 86400"):
            JitOptions(idle_s=idle_s)
        with pytest.raises(ValueError, match=r"SPARSERL_JIT_IDLE_S: expected a number of seconds >= 0 and <= 86400"):
            JitOptions.from_env({"SPARSERL_JIT_IDLE_S": str(idle_s)})


def test_a_background_decision_whose_cache_cannot_be_made_falls_back(tmp_path, monkeypatch, caplog):
    """The cache is made on the first decision, reading its settings then: one refused there
    (SPARSERL_CACHE_MAX_MB set after the runtime was) is a fallback that says why, not a
    decision left "specializing in the background" for good."""
    fakes = Fakes()
    runtime = Runtime(JitOptions(mode="background", admit_age_s=0), specializer=fakes.specializer,
                      installer=fakes.installer, devices=("cpu",))
    monkeypatch.setenv("SPARSERL_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("SPARSERL_CACHE_MAX_MB", "1e308")
    A = make_pattern("cora (real)")
    crow, col, val = to_parts(A, torch.float32, torch.int64, "cpu")
    X = torch.randn(A.shape[1], 8)
    try:
        assert call(runtime, A, crow, col, val, X) is None  # cuSPARSE meanwhile
        runtime.wait(10)
        entry = patterns.lookup(crow, col, A.shape[1])
        said = runtime.explain("spmm", entry, 8, torch.float32)
        assert said.startswith("cuSPARSE: decision failed: ValueError: SPARSERL_CACHE_MAX_MB: expected"), said
        assert "SPARSERL_CACHE_MAX_MB" in caplog.text and fakes.specialized == []
    finally:
        runtime.close()


@pytest.mark.parametrize("fails", [False, True])
def test_the_specializers_prebuild_runs_before_the_install_and_may_fail(tmp_path, fails):
    """A specializer with ``prebuild`` (the real ones: the library built in the sandbox's
    worker) gets the entry and the key's architecture before the installer runs; when it fails
    the installer builds and installs as before, and products stay correct."""
    fakes = Fakes()
    order = []

    class Specializer:
        def __call__(self, key, crow, col, ncols):
            return fakes.specializer(key, crow, col, ncols)

        def prebuild(self, entry, arch):
            order.append(("prebuild", entry.family, arch))
            if fails:
                raise RuntimeError("the worker's build failed")

    def installer(entry, crow, col, ncols):
        order.append(("install", entry.family))
        return fakes.installer(entry, crow, col, ncols)

    runtime = Runtime(JitOptions(mode="sync"), cache=KernelCache(tmp_path), specializer=Specializer(),
                      installer=installer, devices=("cpu",))
    A = make_pattern("cora (real)")
    crow, col, val = to_parts(A, torch.float32, torch.int64, "cpu")
    X = torch.randn(A.shape[1], 8)
    for _ in range(2):
        torch.testing.assert_close(call(runtime, A, crow, col, val, X), expected(A, crow, col, val, X))
    assert order == [("prebuild", "fake", "cpu"), ("install", "fake")]
    assert runtime.stats["installs"] == 1 and runtime.stats["installed_calls"] == 2


class _BuildingSpecializer:
    """A specializer whose ``prebuild`` (the library's build in the sandbox's worker) waits
    for ``gate``; ``building`` is set when it starts."""

    def __init__(self, fakes, fail=False):
        self.fakes, self.fail = fakes, fail
        self.building, self.gate = threading.Event(), threading.Event()

    def __call__(self, key, crow, col, ncols):
        return self.fakes.specializer(key, crow, col, ncols)

    def prebuild(self, entry, arch):
        self.building.set()
        assert self.gate.wait(10)
        if self.fail:
            raise RuntimeError("the worker's build failed")


def _until(condition, timeout=10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.005)
    return condition()


def _interim_runtime(tmp_path, mode="background", fail_interim=False, fail_prebuild=False, fail_install=False):
    fakes = Fakes(fail_install=fail_install)
    specializer = _BuildingSpecializer(fakes, fail=fail_prebuild)
    interim = []

    def interim_installer(entry, crow, col, ncols):
        interim.append(entry.key)
        if fail_interim:
            raise OSError("NVRTC is not there")
        rows = crow.numel() - 1
        return lambda crow, col, val, X: torch.sparse_csr_tensor(crow, col, val, (rows, ncols)).to_dense() @ X

    runtime = Runtime(JitOptions(mode=mode, admit_age_s=0), cache=KernelCache(tmp_path), specializer=specializer,
                      installer=fakes.installer, interim_installer=interim_installer, devices=("cpu",))
    A = make_pattern("cora (real)")
    crow, col, val = to_parts(A, torch.float32, torch.int64, "cpu")
    return runtime, specializer, interim, A, crow, col, val


def test_the_interim_build_serves_while_the_library_is_built(tmp_path):
    """In background mode the entry's kernel is installed from the interim installer (the NVRTC
    build) before the library's build starts, serves the products meanwhile, and is replaced by
    the installer's kernel once the library is built."""
    runtime, specializer, interim, A, crow, col, val = _interim_runtime(tmp_path)
    try:
        X = torch.randn(A.shape[1], 8)
        assert call(runtime, A, crow, col, val, X) is None  # pending: cuSPARSE serves
        assert specializer.building.wait(10)  # the interim is installed beside the library's build
        assert _until(lambda: runtime.stats["interim_installs"] == 1)
        entry = patterns.lookup(crow, col, A.shape[1])
        state = runtime.state("spmm", entry, 8, torch.float32)
        assert len(interim) == 1 and runtime.stats["interim_installs"] == 1
        assert runtime.explain("spmm", entry, 8, torch.float32) == (
            "installed: fake{'p': 1} (2.0x cuSPARSE; its NVRTC build until the library is built)")
        torch.testing.assert_close(call(runtime, A, crow, col, val, X), expected(A, crow, col, val, X))
        assert runtime.busy  # decided, with the library still being built
        specializer.gate.set()
        runtime.wait(10)
        assert not runtime.busy
        final = runtime.state("spmm", entry, 8, torch.float32)
        assert final.launch is not state.launch
        assert runtime.explain("spmm", entry, 8, torch.float32) == "installed: fake{'p': 1} (2.0x cuSPARSE)"
        torch.testing.assert_close(call(runtime, A, crow, col, val, X), expected(A, crow, col, val, X))
        assert runtime.stats["installs"] == 1 and runtime.stats["installed_calls"] == 2
    finally:
        specializer.gate.set()
        runtime.close()


def test_the_library_install_is_handed_the_interim_launch(tmp_path, monkeypatch):
    """The default installer gets the interim NVRTC build's launch (``like``), whose plan data
    and index copies the library's kernel reuses (``_bind_spec``) instead of preparing them on
    the host again; an installer of the caller's is called as before."""
    from torch_sparserl.jit import decide
    from torch_sparserl.jit import runtime as rt

    fakes, handed = Fakes(), []

    def inline(entry, crow, col, ncols, *, like=None):
        handed.append(like)
        return fakes.installer(entry, crow, col, ncols)

    monkeypatch.setattr(rt, "inline_installer", inline)  # the default installer
    monkeypatch.setattr(decide, "inline_installer", inline)  # which the library's install recognizes
    specializer = _BuildingSpecializer(fakes)
    runtime = Runtime(JitOptions(mode="background", admit_age_s=0), cache=KernelCache(tmp_path),
                      specializer=specializer, interim_installer=fakes.installer, devices=("cpu",))
    try:
        A = make_pattern("cora (real)")
        crow, col, val = to_parts(A, torch.float32, torch.int64, "cpu")
        X = torch.randn(A.shape[1], 8)
        assert call(runtime, A, crow, col, val, X) is None
        assert _until(lambda: runtime.stats["interim_installs"] == 1)
        entry = patterns.lookup(crow, col, A.shape[1])
        interim = runtime.state("spmm", entry, 8, torch.float32).launch
        specializer.gate.set()
        runtime.wait(10)
        assert handed == [interim] and runtime.state("spmm", entry, 8, torch.float32).launch is not interim
        torch.testing.assert_close(call(runtime, A, crow, col, val, X), expected(A, crow, col, val, X))
    finally:
        specializer.gate.set()
        runtime.close()


def test_the_next_decision_does_not_wait_for_a_library_build(tmp_path):
    """The library's build after an interim install runs in a thread of its own: while it is
    held, the transpose's product (a symmetric pattern: the same key, from the cache) is decided
    and served from its own interim build. (A key the specializer must search waits for the
    worker, which the build holds.)"""
    runtime, specializer, interim, A, crow, col, val = _interim_runtime(tmp_path)
    try:
        entry = patterns.lookup(crow, col, A.shape[1])
        assert call(runtime, A, crow, col, val, torch.randn(A.shape[1], 8)) is None
        assert specializer.building.wait(10)  # the first key's library build, held
        entry_t, crow_t, col_t, perm = entry.transpose(crow, col)
        X = torch.randn(A.shape[0], 8)

        def transposed():
            return runtime.call("spmm", entry_t, crow_t, col_t, val[perm], X)

        assert transposed() is None
        assert _until(lambda: runtime.state("spmm", entry_t, 8, torch.float32).__class__.__name__ == "Installed")
        assert not specializer.gate.is_set() and runtime.busy and len(interim) == 2
        torch.testing.assert_close(transposed(), expected(A, crow, col, val, torch.eye(A.shape[0])).T @ X)
        specializer.gate.set()
        runtime.wait(10)
        for pattern in (entry, entry_t):
            assert runtime.explain("spmm", pattern, 8, torch.float32) == "installed: fake{'p': 1} (2.0x cuSPARSE)"
        assert runtime.stats["installs"] == 2 and runtime.stats["interim_installs"] == 2 and not runtime.busy
        assert len(specializer.fakes.specialized) == 1  # the transpose's decision came from the cache
    finally:
        specializer.gate.set()
        runtime.close()


@pytest.mark.parametrize("fails", ["interim", "prebuild", "install"])
def test_a_failed_interim_or_library_build_loses_nothing(tmp_path, fails):
    """No interim kernel (NVRTC missing): the products wait on cuSPARSE for the library's, as
    before. A failed worker build after an interim: the installer builds the library here. A
    failed install of the library: the interim kernel serves on."""
    runtime, specializer, interim, A, crow, col, val = _interim_runtime(
        tmp_path, fail_interim=fails == "interim", fail_prebuild=fails == "prebuild", fail_install=fails == "install")
    try:
        X = torch.randn(A.shape[1], 8)
        assert call(runtime, A, crow, col, val, X) is None
        assert specializer.building.wait(10)
        assert _until(lambda: interim and (fails == "interim" or runtime.stats["interim_installs"] == 1))
        entry = patterns.lookup(crow, col, A.shape[1])
        interim_state = runtime.state("spmm", entry, 8, torch.float32)
        assert (interim_state.__class__.__name__ == "Pending") == (fails == "interim")
        specializer.gate.set()
        runtime.wait(10)
        assert runtime.explain("spmm", entry, 8, torch.float32) == "installed: fake{'p': 1} (2.0x cuSPARSE" + (
            "; its NVRTC build until the library is built)" if fails == "install" else ")")
        torch.testing.assert_close(call(runtime, A, crow, col, val, X), expected(A, crow, col, val, X))
        assert runtime.stats["interim_installs"] == (0 if fails == "interim" else 1)
        assert runtime.stats["installs"] == (0 if fails == "install" else 1) and len(interim) == 1
        assert runtime.stats["fallbacks"] == 0
    finally:
        specializer.gate.set()
        runtime.close()


def test_no_interim_build_in_sync_mode_or_for_a_custom_installer(tmp_path):
    """Sync mode waits for the library anyway; a custom installer has no NVRTC twin unless one
    is given; the default installer's twin is the NVRTC installer."""
    from torch_sparserl.jit import runtime as rt

    runtime, specializer, interim, A, crow, col, val = _interim_runtime(tmp_path, mode="sync")
    specializer.gate.set()
    try:
        X = torch.randn(A.shape[1], 8)
        torch.testing.assert_close(call(runtime, A, crow, col, val, X), expected(A, crow, col, val, X))
        assert interim == [] and runtime.stats["interim_installs"] == 0
    finally:
        runtime.close()
    assert Runtime(devices=("cpu",)).interim_installer is rt.nvrtc_installer
    assert Runtime(installer=Fakes().installer, devices=("cpu",)).interim_installer is None


def _tuned(*records):
    from torch_sparserl.specialize.autotune import TuneResult

    correct = [r for r in records if r.correct]
    best = max(correct, key=lambda r: r.speedup) if correct else None
    return TuneResult(op="spmm", n=8, dtype="f32", features={}, best=best, best_spec=SimpleSpec() if best else None,
                      table=list(records))


class SimpleSpec:
    source = SOURCE


def _record(family, *, speedup=None, kind=None, log=""):
    from torch_sparserl.evaluate import EvalRecord

    record = EvalRecord(key=family, family=family, compiled=True)
    if kind is not None:
        return record.fail(kind, log)
    record.correct, record.runtime_us, record.cusparse_us = True, 10.0, 10.0 * speedup
    return record


def test_a_negative_answer_reached_while_the_device_had_no_memory_is_no_decision():
    from torch_sparserl.evaluate import ErrorKind
    from torch_sparserl.jit.specializers import autotune_specializer
    from torch_sparserl.pattern.fingerprint import SpecializationKey

    key = SpecializationKey(pattern="abc", op="spmm", n=8, dtype="f32", arch="sm_90", policy="autotune")
    decide = autotune_specializer(JitOptions())._entry
    oom = _record("b", kind=ErrorKind.DEVICE_MEMORY, log="OutOfMemoryError: CUDA out of memory. Tried to allocate 4 GiB")
    with pytest.raises(TransientFailure, match=r"no candidate decided: 1 of 1 evaluations failed for the device's state "
                                               r"at the time \(device_memory: OutOfMemoryError: CUDA out of memory"):
        decide(key, _tuned(oom), "1 searched", "candidate")
    with pytest.raises(TransientFailure, match="1 of 2 evaluations"):  # the one measured is under the margin
        decide(key, _tuned(_record("a", speedup=0.9), oom), "2 searched", "candidate")
    entry = decide(key, _tuned(_record("a", speedup=1.5), oom), "2 searched", "candidate")
    assert entry.spec_source == SOURCE and entry.family == "a"  # a kernel that beats cuSPARSE is a decision
    wrong = _record("c", kind=ErrorKind.WRONG, log="trial 0: max error 1.0")
    hang = _record("d", kind=ErrorKind.TIMEOUT, log="no answer in 60 s")
    entry = decide(key, _tuned(wrong, hang, wrong), "3 searched", "candidate")
    assert entry.spec_source is None  # a verdict: cached, and it says what the candidates did
    assert entry.reason == "no correct candidate (3 searched; failed: timeout 1, wrong 2)"


def test_one_cpu_thread_narrows_only_the_calling_thread():
    """The install's host work runs on one core; the training thread keeps its CPU threads."""
    from torch_sparserl.jit.install import one_cpu_thread

    if "OpenMP" not in torch.__config__.parallel_info():
        pytest.skip("torch's intra-op thread count is per thread only under OpenMP")
    main = torch.get_num_threads()
    if main == 1:
        pytest.skip("one CPU thread already")
    inside, leave, seen = threading.Event(), threading.Event(), {}

    def background():
        with one_cpu_thread():
            seen["inside"] = torch.get_num_threads()
            seen["sum"] = float(torch.arange(1 << 20, dtype=torch.float64).sum())  # a parallel operator
            inside.set()
            leave.wait(10)
        seen["after"] = torch.get_num_threads()

    thread = threading.Thread(target=background)
    thread.start()
    assert inside.wait(10)
    assert torch.get_num_threads() == main  # the caller's thread meanwhile
    leave.set()
    thread.join(10)
    assert seen == {"inside": 1, "sum": float((1 << 20) * ((1 << 20) - 1) // 2), "after": main}
    assert torch.get_num_threads() == main


def test_the_runtime_module_keeps_the_hot_path_and_its_parts_live_apart():
    """jit/runtime.py holds the hot path and the process's runtime; admission and the decision
    flow, class kernels, fused epilogues and the background work are parts of Runtime, each in
    a module of its own, and the names callers take from runtime.py are still there."""
    from torch_sparserl.jit import classes, decide, fused, workers
    from torch_sparserl.jit import runtime as rt

    homes = {rt: ("call", "launch", "_launch_class", "state", "decision", "decisions", "describe", "close"),
             decide: ("prespecialize", "young", "_resolve", "_decide", "_specialize", "_install", "_fallback"),
             classes: ("_class_state", "_decide_class", "classes"),
             fused: ("call_fused", "fusable", "_resolve_fused", "_install_fused"),
             workers: ("prewarm", "wait", "_in_background", "_arm_idle_stop", "_stop_for_exit", "_prebuild")}
    for module, names in homes.items():
        for name in names:
            assert getattr(rt.Runtime, name).__module__ == module.__name__, name
    for name in ("Runtime", "JitOptions", "active", "active_or_none", "set_active", "configure", "Installed",
                 "Fallback", "Pending", "SpecializationError", "OPS", "settings_policy_id"):
        assert hasattr(rt, name), name


def test_no_decision_starts_while_a_cuda_graph_is_captured(tmp_path, monkeypatch):
    """A product first asked for inside a capture is served by the vendor and leaves no trace: no
    Fallback for good, nothing queued; the next call outside the capture decides it."""
    from torch_sparserl.jit import decide

    for mode in ("sync", "background"):
        runtime, fakes, A, crow, col, val, X = setup(tmp_path / mode, mode=mode, strict=True)
        entry = patterns.lookup(crow, col, A.shape[1])
        monkeypatch.setattr(decide, "capturing", lambda t: True)
        assert call(runtime, A, crow, col, val, X) is None
        assert runtime.state("spmm", entry, 8, torch.float32) is None and fakes.specialized == []
        monkeypatch.undo()
        call(runtime, A, crow, col, val, X)
        runtime.wait(10)
        torch.testing.assert_close(call(runtime, A, crow, col, val, X), expected(A, crow, col, val, X))
        assert isinstance(runtime.state("spmm", entry, 8, torch.float32), Installed) and len(fakes.specialized) == 1
        runtime.close()


def test_the_epoch_moves_when_a_decision_lands_or_the_runtime_is_replaced_or_closed(tmp_path):
    from torch_sparserl.jit import runtime as rt

    gate = threading.Event()
    runtime, fakes, A, crow, col, val, X = setup(tmp_path, mode="background", gate=gate)
    call(runtime, A, crow, col, val, X)  # Pending: nothing a copy repeats changed yet
    assert runtime.epoch == 0 and not runtime.closed
    gate.set()
    runtime.wait(10)
    landed = runtime.epoch
    assert landed > 0
    previous = rt.set_active(runtime)
    other = Runtime(JitOptions(mode="off"), devices=("cpu",))
    rt.set_active(other)
    assert runtime.epoch > landed
    rt.set_active(previous)
    other.close()
    replaced = runtime.epoch
    runtime.close()
    assert runtime.closed and runtime.epoch > replaced
