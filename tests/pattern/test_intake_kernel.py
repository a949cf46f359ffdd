"""The fused intake of CUDA indices (CPU tests): the kernel source builds, the pinned slots' pool,
and the whole path (copy, check, repair, verdict, poison, the named error) with the kernel's
contract played on CPU memory by a model of it, so that every state can be stepped through.

:func:`device_check.copy_checked` launches one kernel where it is built; the model here does at
launch what the stream orders before any later work (the copies, the check, the repair, the bad
word products read) and leaves the verdict's arrival in pinned host memory to the test, as a GPU
leaves it to its progress. What only a GPU shows (the real kernel's results, no synchronization,
graph replays) is ``test_intake_kernel_gpu.py``'s.
"""

from __future__ import annotations

import ctypes
import logging
import shutil
import subprocess
import threading

import numpy as np
import pytest
import torch

import torch_sparserl as ts
from torch_sparserl import pattern as patterns
from torch_sparserl.dtypes import assert_close_to_reference
from torch_sparserl.pattern import device_check
from torch_sparserl.pattern.validation import check_csr_values
from torch_sparserl.toolchain import CompileError, intake

from helpers import make_pattern, ref_spmm, to_parts

_CTYPES = {torch.int32: ctypes.c_int32, torch.int64: ctypes.c_int64}


def _memory(address: int, n: int, ctype) -> np.ndarray:
    """``n`` elements of ``ctype`` at ``address``, as a NumPy array sharing the memory."""
    return np.ctypeslib.as_array((ctype * max(n, 1)).from_address(address))[:n]


class KernelModel:
    """The fused kernel's contract (``toolchain/intake.py``'s ``SOURCE``), on CPU memory: at launch,
    what the stream orders before later work (the copies, the five checks' bits, the repair, the
    result words, the work words left zero); the host slot's bits and done marker when the test
    says (:meth:`deliver`)."""

    geometry = (256, 4, 1024)  # what a launcher hands the C++ library's intake (device_check.intake)

    def __init__(self):
        self.launches = 0
        self.undelivered: list[tuple[int, int]] = []  # (host slot address, bits)

    def function(self, dtype):
        """A stand-in for the kernel's CUfunction address, per index dtype."""
        return {torch.int32: 32, torch.int64: 64}.get(dtype)

    def __call__(self, dtype, crow_src, col_src, crow_dst, col_dst, rows, nnz, ncols, copy, work, result, host,
                 stream) -> bool:
        self.launches += 1
        ctype = _CTYPES[dtype]
        source_crow, source_col = _memory(crow_src, rows + 1, ctype), _memory(col_src, nnz, ctype)
        words = _memory(work, 2, ctypes.c_int32)
        assert not words.any(), "the work words must be zero at every launch"
        bits = (int(source_crow[0] != 0) | int(source_crow[rows] != nnz) << 1
                | int(bool((source_crow[1:] < source_crow[:-1]).any())) << 2
                | int(bool((source_col < 0).any())) << 3 | int(bool((source_col >= ncols).any())) << 4)
        crow_out, col_out = _memory(crow_dst, rows + 1, ctype), _memory(col_dst, nnz, ctype)
        if copy:
            crow_out[:], col_out[:] = source_crow, source_col
        if bits:
            crow_out[:rows], crow_out[rows], col_out[:] = 0, nnz, 0
        _memory(result, 2, ctypes.c_int32)[:] = (int(bits != 0), bits)
        if host:
            self.undelivered.append((host, bits))
        return True

    def deliver(self) -> None:
        """The device ran everything queued: every host slot gets its bits, then its marker."""
        for host, bits in self.undelivered:
            _memory(host, 2, ctypes.c_int32)[:] = (bits, 1)
        self.undelivered.clear()


def _host_pool(chunk_slots: int = 8, max_chunks: int = 4, fence=None) -> device_check.SlotPool:
    """A pool on ordinary host memory (a GPU's is pinned, and the device's work words on it)."""

    def allocate(words):
        host, work = np.zeros(words, np.int32), np.zeros(words, np.int32)
        return host, host.ctypes.data, work.ctypes.data, (host, work), fence

    return device_check.SlotPool(allocate, chunk_slots=chunk_slots, max_chunks=max_chunks)


@pytest.fixture
def fused(monkeypatch):
    """CPU indices served the fused way: the kernel's model as the launcher, a host pool."""
    kernel = KernelModel()
    pool = _host_pool()
    kernel.pool = pool
    monkeypatch.setattr(device_check, "defers", lambda crow, col: crow.shape[0] > 1)
    monkeypatch.setattr(device_check, "_fusable", lambda crow, col: kernel if crow.dtype in _CTYPES
                        and crow.dtype == col.dtype else None)
    monkeypatch.setattr(device_check, "_pool", lambda index, provider: pool)
    monkeypatch.setattr(device_check, "_raw_stream", lambda index: 7)
    kernel.waited = []
    monkeypatch.setattr(device_check, "_wait_stream", lambda stream, device: kernel.waited.append(stream)
                        or kernel.deliver())
    torch_way = []
    real_init = device_check.DeviceCheck.__init__
    monkeypatch.setattr(device_check.DeviceCheck, "__init__",
                        lambda self, *a, **k: torch_way.append(a[0]) or real_init(self, *a, **k))
    kernel.torch_way = torch_way
    return kernel


def _matrix(seed, index_dtype=torch.int64):
    M = make_pattern("random", seed=seed)
    return M, to_parts(M, torch.float64, index_dtype, "cpu")


# ---- the kernel's source ---------------------------------------------------------------------------------


def test_the_kernel_source_compiles_for_sm_90_with_nvcc(tmp_path):
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc is not installed")
    source = tmp_path / "intake.cu"
    source.write_text(intake.SOURCE)
    cubin = tmp_path / "intake.cubin"
    done = subprocess.run(["nvcc", "-cubin", "-arch=sm_90", "-o", str(cubin), str(source)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    image = cubin.read_bytes()
    assert all(name.encode() in image for name in intake.KERNELS.values())


def test_the_kernel_source_compiles_with_nvrtc_where_it_loads():
    from torch_sparserl.toolchain import nvrtc

    try:
        cubin, _, _ = nvrtc.compile(intake.SOURCE, "sm_90")
    except CompileError as error:
        if "not found" in str(error):
            pytest.skip(f"NVRTC does not load here: {error}")
        raise
    assert all(name.encode() in cubin for name in intake.KERNELS.values())


def test_the_grid_covers_the_longer_array_with_a_bounded_number_of_blocks():
    assert intake.grid(1, 0) == 1
    for rows, nnz in ((10, 0), (1000, 5000), (100_000, 1_000_000), (5, 10**9)):
        blocks = intake.grid(rows, nnz)
        assert 1 <= blocks <= intake.MAX_GRID
        assert blocks == intake.MAX_GRID or blocks * intake.BLOCK * intake.PER_THREAD >= max(rows + 1, nnz)


# ---- the pool of pinned slots ----------------------------------------------------------------------------


class _Check:
    """What the pool keeps of a check: its slot, its bits."""
    _slot = _pool = _bits = None


def _mark(pool, check, bits):
    """The kernel of ``check`` ran: its slot holds its bits and the done marker."""
    host, _, _, _ = pool._chunks[check._slot // pool.chunk_slots]
    i = check._slot % pool.chunk_slots
    host[2 * i], host[2 * i + 1] = bits, 1


def test_a_slot_is_reused_only_after_its_marker_was_seen():
    pool = _host_pool(chunk_slots=4, max_chunks=1)
    checks = [_Check() for _ in range(4)]
    addresses = [pool.acquire(c) for c in checks]
    assert len({a for a, _ in addresses}) == 4 and len({w for _, w in addresses}) == 4
    assert pool.acquire(_Check()) is None  # full, nothing done: the torch way serves
    assert pool.take(checks[1]) is None and pool.out == 4  # not run yet: the slot stays out
    _mark(pool, checks[1], 0b10100)
    assert pool.take(checks[1]) == 0b10100 and checks[1]._slot is None and pool.out == 3
    assert pool.take(checks[1]) == 0b10100  # read again: the bits it kept
    again = _Check()
    assert pool.acquire(again) == addresses[1]  # the slot whose marker was seen, its words zeroed
    assert pool.take(again) is None


def test_a_check_dropped_before_its_verdict_leaves_its_slot_out_until_the_marker_shows():
    pool = _host_pool(chunk_slots=4, max_chunks=1)
    kept, dropped = _Check(), _Check()
    pool.acquire(kept)
    pool.acquire(dropped)
    slot = dropped._slot
    _mark(pool, dropped, 0)
    del dropped  # its verdict never read
    pool.acquire(_Check()), pool.acquire(_Check())  # the pool is full now
    _mark(pool, kept, 0b1000)
    reused = _Check()
    assert pool.acquire(reused) is not None and reused._slot in (slot, kept._slot or slot)
    assert pool.take(kept) == 0b1000  # reclaimed too, its bits handed over, not lost
    assert pool.out == 3


def test_the_pool_grows_a_chunk_when_little_can_be_reclaimed_and_stops_at_its_bound():
    pool = _host_pool(chunk_slots=4, max_chunks=3)
    checks = [_Check() for _ in range(12)]
    assert all(pool.acquire(c) is not None for c in checks) and pool.slots == 12
    assert pool.acquire(_Check()) is None
    for c in checks[:2]:
        _mark(pool, c, 0)
    last = _Check()
    assert pool.acquire(last) is not None and pool.slots == 12  # reclaimed at the bound
    assert [pool.take(c) for c in checks[:2]] == [0, 0] and pool.out == 11


def test_launches_wait_for_the_zeroing_of_a_new_chunk_until_it_is_known_done():
    answers = [False, False, True]
    asked = []
    pool = _host_pool(chunk_slots=8, max_chunks=1, fence=lambda: asked.append(1) or answers[len(asked) - 1])
    for _ in range(5):
        pool.acquire(_Check())
    assert len(asked) == 3  # asked (the launch ordered after the zeroing) until it said done, then never


def test_a_refused_launch_gives_its_slot_back():
    pool = _host_pool(chunk_slots=2, max_chunks=1)
    check = _Check()
    pool.acquire(check)
    pool.take_back(check)
    assert pool.out == 0 and check._slot is None and pool.acquire(_Check()) is not None


def test_the_pool_is_safe_between_threads():
    pool = _host_pool(chunk_slots=64, max_chunks=64)

    def work():
        for _ in range(200):
            check = _Check()
            if pool.acquire(check) is not None:
                _mark(pool, check, 3)
                assert pool.take(check) == 3

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert pool.out == 0


# ---- the fused path, the kernel played by its model -----------------------------------------------------


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_good_indices_are_copied_and_checked_by_one_launch(fused, index_dtype):
    M, (crow, col, val) = _matrix(seed=21, index_dtype=index_dtype)
    A = ts.csr((crow, col, val), M.shape)
    assert fused.launches == 1 and fused.torch_way == []  # one launch, no torch check
    assert A._crow is not crow and A._col is not col and A._crow.dtype == index_dtype
    assert torch.equal(A._crow, crow) and torch.equal(A._col, col)
    assert patterns.owned(A._crow) and patterns.owned(A._col)
    entry = patterns.validated(A._crow, A._col, M.shape[1])
    assert entry is not None and entry.check is not None and not entry.settle()  # no verdict yet
    X = torch.randn(M.shape[1], 5, dtype=torch.float64)
    assert_close_to_reference(A @ X, ref_spmm(crow, col, val, M.shape[1], X))  # served meanwhile, right
    fused.deliver()
    assert entry.settle() and entry.check is None and fused.pool.out == 0  # the slot went back
    assert_close_to_reference(A @ X, ref_spmm(crow, col, val, M.shape[1], X))


_FAILURES = {  # the five checks, in device_check._CHECKS' order
    "crow[0]": lambda crow, col, n: crow.__setitem__(0, 1),
    "crow[-1]": lambda crow, col, n: crow.__setitem__(-1, crow[-1] - 1),
    "decreasing": lambda crow, col, n: crow.__setitem__(5, crow[4] - 1),
    "col negative": lambda crow, col, n: col.__setitem__(3, -2),
    "col too large": lambda crow, col, n: col.__setitem__(7, n + 3),
}


@pytest.mark.parametrize("served", ["python", "library"])  # the fused kernel launched from Python, or by the C++ door
@pytest.mark.parametrize("case", list(_FAILURES))
def test_each_failure_gives_nan_then_the_error_the_torch_way_gives(fused, monkeypatch, case, served):
    door = _registered_door(fused, monkeypatch) if served == "library" else None
    M, (crow, col, val) = _matrix(seed=22)
    n = M.shape[1]
    crow, col = crow.clone(), col.clone()
    _FAILURES[case](crow, col, n)
    with pytest.raises(ValueError) as expected:  # the named entry, as the host's check names it
        check_csr_values("torch_sparserl.csr", crow, col, n)
    A = ts.csr((crow, col, val), M.shape)  # no error yet
    assert fused.launches == 1 and fused.torch_way == [] and (door is None or len(door.calls) == 1)
    assert A._crow[:-1].eq(0).all() and int(A._crow[-1]) == M.nnz and A._col.eq(0).all()  # repaired
    X = torch.randn(n, 4, dtype=torch.float64)
    assert (A @ X).isnan().all()
    fused.deliver()
    for _ in range(2):  # at this and every later use
        with pytest.raises(ValueError) as raised:
            A @ X
        assert str(raised.value) == str(expected.value)


def test_a_failure_without_the_callers_tensors_names_the_check_and_the_matrix(fused):
    M, (crow, col, val) = _matrix(seed=23)
    col = col.clone()
    col[0] = M.shape[1]
    crow_bad = crow.clone()
    crow_bad[0] = int(crow[1]) + 1  # and so above crow[1]
    A = ts.csr((crow_bad, col, val), M.shape)
    col[0] = 0  # the caller's tensor changed meanwhile
    fused.deliver()
    with pytest.raises(ValueError) as raised:
        A @ torch.randn(M.shape[1], 2, dtype=torch.float64)
    assert str(raised.value) == (
        f"torch_sparserl.csr: crow[0] must be 0; crow must be non-decreasing; col must be < ncols = {M.shape[1]} "
        f"(the indices of a {M.shape[0]} x {M.shape[1]} matrix with {M.nnz} nonzeros on cpu, checked there after "
        "the call returned)")


def test_an_operator_on_a_callers_tensors_copies_and_checks_them_in_one_launch(fused):
    M, (crow, col, val) = _matrix(seed=24)
    col = col.clone()
    col[-1] = M.shape[1] + 9
    X = torch.randn(M.shape[1], 3, dtype=torch.float64)
    assert torch.ops.sparserl.spmm(crow, col, val, M.shape[1], X).isnan().all()
    assert fused.launches == 1 and fused.torch_way == [] and int(col[-1]) == M.shape[1] + 9
    fused.deliver()
    with pytest.raises(ValueError, match=rf"^sparserl\.spmm: col must be < ncols = {M.shape[1]} \(got col\[{M.nnz - 1}\]"):
        torch.ops.sparserl.spmm(crow, col, val, M.shape[1], X)


def test_what_must_wait_for_the_verdict_waits_on_the_kernels_stream(fused):
    M, (crow, col, val) = _matrix(seed=25)
    col = col.clone()
    col[1] = -1
    A = ts.csr((crow, col, val), M.shape)
    with pytest.raises(ValueError, match=r"col must be >= 0"):
        A.to_dense()  # reads the indices on the host: waits for the verdict
    assert fused.waited == [7]


def test_settling_before_a_capture_reads_every_fused_verdict(fused):
    M, (crow, col, val) = _matrix(seed=26)
    good = ts.csr((crow, col, val), M.shape)
    patterns.settle_pending()
    assert fused.waited == [7] and patterns.lookup(good._crow, good._col, M.shape[1]).check is None


@pytest.mark.parametrize("bad", [False, True])
def test_a_fused_check_inside_a_graph_has_no_slot_and_poisons_all(fused, bad):
    crow, col = torch.tensor([0, 1, 3]), torch.tensor([0, 5 if bad else 2, 1])
    own_crow, own_col, check = device_check.in_graph("sparserl.spmm", crow, col, 3)
    assert fused.launches == 1 and fused.undelivered == [] and fused.pool.out == 0  # no host slot
    assert col.tolist() == [0, 5 if bad else 2, 1]
    assert (own_crow.tolist(), own_col.tolist()) == (([0, 0, 3], [0, 0, 0]) if bad else ([0, 1, 3], [0, 2, 1]))
    assert check._scratch.tolist()[2:] == [0, 0]  # the work words, zero for the next replay
    assert check.verdict() is None
    with pytest.raises(RuntimeError, match="checked inside a CUDA graph"):
        check.verdict(block=True)
    out = check.poison(torch.ones(2, 4))
    assert out.isnan().all() if bad else out.eq(1).all()


def test_a_library_tensor_is_checked_in_place_by_the_kernel(fused):
    crow, col = torch.tensor([0, 2, 3]), torch.tensor([1, 0, 4])
    crow_out, col_out, check = device_check.copy_checked("sparserl.spmm", crow, col, 3, copy=False)
    assert crow_out is crow and col_out is col and fused.launches == 1
    assert crow.tolist() == [0, 0, 3] and col.tolist() == [0, 0, 0]  # repaired where they lie
    fused.deliver()
    assert check.verdict() is False
    with pytest.raises(ValueError, match=r"^sparserl\.spmm: col must be < ncols = 3 \(the indices of a 2 x 3"):
        check.raise_failure()


def test_a_full_pool_or_a_refused_launch_falls_back_to_the_torch_way(fused, monkeypatch):
    M, (crow, col, val) = _matrix(seed=27)
    monkeypatch.setattr(device_check, "_pool", lambda index, provider: _host_pool(chunk_slots=1, max_chunks=0))
    A = ts.csr((crow, col, val), M.shape)
    assert fused.launches == 0 and fused.torch_way == ["torch_sparserl.csr"]
    assert torch.equal(A._col, col)
    monkeypatch.setattr(device_check, "_pool", lambda index, provider: fused.pool)
    monkeypatch.setattr(device_check, "_fusable", lambda crow, col: lambda *args: False)
    ts.csr((crow, col, val), M.shape)
    assert fused.torch_way == ["torch_sparserl.csr"] * 2 and fused.pool.out == 0


# ---- the choice and the build ----------------------------------------------------------------------------


def test_the_toolchain_registers_the_kernel_and_cpu_indices_take_the_torch_way():
    assert device_check._FUSED is intake.PROVIDER
    crow, col = torch.tensor([0, 1, 2]), torch.tensor([0, 1])
    assert device_check._fusable(crow, col) is None
    crow_out, col_out, check = device_check.copy_checked("sparserl.spmm", crow, col, 2)
    assert check._scratch is None and check.verdict() is True and torch.equal(col_out, col) and col_out is not col


class _Gate:
    """A compiler the test lets finish."""

    def __init__(self, fail=False):
        self.go, self.fail, self.calls = threading.Event(), fail, []

    def __call__(self, source, arch):
        self.calls.append(arch)
        self.go.wait(10)
        if self.fail:
            raise CompileError("NVRTC: the test's failure")
        return b"not a cubin"


def _built(provider, index=0):
    for _ in range(1000):
        if not isinstance(provider._builds.get(index), threading.Thread):
            return
        threading.Event().wait(0.01)
    raise AssertionError("the build never finished")


def test_the_build_runs_in_the_background_and_a_failed_load_leaves_the_torch_way(monkeypatch, caplog):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (9, 0))
    gate = _Gate()
    provider = intake.Provider(compile_fn=gate)
    assert provider.launcher(0) is None  # returns at once, the compile under way
    assert provider.launcher(0) is None
    gate.go.set()
    _built(provider)
    assert gate.calls == ["sm_90"]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert provider.launcher(0) is None and 0 not in provider._launchers  # never loaded during a capture
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    with caplog.at_level(logging.WARNING, logger="torch_sparserl.toolchain.intake"):
        assert provider.launcher(0) is None  # no GPU here: the load fails, once
    assert "could not be loaded" in caplog.text and provider._launchers == {0: None}
    assert provider.launcher(0) is None and gate.calls == ["sm_90"]


def test_a_failed_build_leaves_the_torch_way_for_good(monkeypatch, caplog):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (9, 0))
    gate = _Gate(fail=True)
    gate.go.set()
    provider = intake.Provider(compile_fn=gate)
    with caplog.at_level(logging.WARNING, logger="torch_sparserl.toolchain.intake"):
        assert provider.launcher(0) is None
        _built(provider)
        assert provider.launcher(0) is None and provider.launcher(0) is None
    assert "could not be built" in caplog.text and gate.calls == ["sm_90"]


def test_copies_made_under_inference_mode_are_ordinary_tensors(fused):
    M, (crow, col, val) = _matrix(seed=28)
    with torch.inference_mode():
        A = ts.csr((crow, col, val), M.shape)
    assert fused.launches == 1 and not A._crow.is_inference() and not A._col.is_inference()
    fused.deliver()
    X = torch.randn(M.shape[1], 2, dtype=torch.float64)
    assert_close_to_reference(A @ X, ref_spmm(crow, col, val, M.shape[1], X))


# ---- the C++ library's intake door, played by its contract ---------------------------------------------


class DoorModel:
    """``csrc/fastpath/intake.h``'s ``intake()`` on CPU memory: what it declines (a few of its
    metadata checks, enough to show that a decline reaches the Python path), then the library's
    copies and result words allocated and the kernel (its model) launched with them."""

    def __init__(self, kernel: KernelModel):
        self.kernel = kernel
        self.calls: list[tuple] = []

    def __call__(self, crow, col, val, nrows, ncols, function, host, work, block, per_thread, max_grid):
        self.calls.append((function, (block, per_thread, max_grid), val))
        if (crow.dim() != 1 or crow.shape[0] != nrows + 1 or nrows < 1 or col.dtype != crow.dtype
                or (val is not None and (val.shape != col.shape or not val.is_floating_point()))):
            return None
        crow_copy, col_copy = torch.empty_like(crow), torch.empty_like(col)
        result = torch.empty(2, dtype=torch.int32)
        self.kernel(crow.dtype, crow.data_ptr(), col.data_ptr(), crow_copy.data_ptr(), col_copy.data_ptr(), nrows,
                    col.shape[0], ncols, True, work, result.data_ptr(), host, 9)
        return crow_copy, col_copy, result, 9


def _registered_door(kernel: KernelModel, monkeypatch) -> DoorModel:
    model = DoorModel(kernel)
    monkeypatch.setattr(device_check, "_DOOR", model)
    return model


@pytest.fixture
def door(fused, monkeypatch):
    """The fused fixture with the C++ library's door registered (its model)."""
    return _registered_door(fused, monkeypatch)


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_a_cuda_triple_is_taken_in_by_one_call_of_the_library(door, index_dtype):
    M, (crow, col, val) = _matrix(seed=41, index_dtype=index_dtype)
    A = ts.csr((crow, col, val), M.shape)
    assert len(door.calls) == 1 and door.kernel.launches == 1 and door.kernel.torch_way == []
    function, geometry, checked = door.calls[0]
    assert function == door.kernel.function(index_dtype) and geometry == door.kernel.geometry and checked is val
    assert A._crow is not crow and A._col is not col and A._crow.dtype == index_dtype and A.val is val
    assert torch.equal(A._crow, crow) and torch.equal(A._col, col)
    assert patterns.owned(A._crow) and patterns.owned(A._col)
    entry = patterns.validated(A._crow, A._col, M.shape[1])
    assert entry is not None and entry.check is not None and not entry.settle()  # no verdict yet
    X = torch.randn(M.shape[1], 3, dtype=torch.float64)
    assert_close_to_reference(A @ X, ref_spmm(crow, col, val, M.shape[1], X))
    door.kernel.deliver()
    assert entry.settle() and entry.check is None and door.kernel.pool.out == 0


@pytest.mark.parametrize("case", ["short crow", "short val", "integer val"])
def test_what_the_library_declines_takes_the_python_path_and_its_slot_back(door, case):
    M, (crow, col, val) = _matrix(seed=43)
    n = M.shape[1]
    if case == "short crow":
        crow = crow[:-1]
    elif case == "short val":
        val = val[:-1]
    else:
        val = torch.ones(M.nnz, dtype=torch.int64)
    if case == "integer val":  # the Python path converts the values (to the default dtype) and goes on
        A = ts.csr((crow, col, val), M.shape)
        assert A.val.dtype == torch.get_default_dtype() and len(door.calls) == 1
        door.kernel.deliver()
        assert A.to_dense().eq(torch.from_numpy((M != 0).toarray()).to(A.val.dtype)).all()
    else:
        with pytest.raises(ValueError) as via_door:
            ts.csr((crow, col, val), M.shape)
        assert len(door.calls) == 1
        device_check._DOOR = None  # the Python path alone names the same error (monkeypatch restores it)
        with pytest.raises(ValueError) as alone:
            ts.csr((crow, col, val), M.shape)
        assert str(via_door.value) == str(alone.value)
    assert door.kernel.pool.out == 0  # the declined call's slot went back: no verdict will come to it


def test_conversions_and_tensors_the_library_owns_skip_the_door(door):
    M, (crow, col, val) = _matrix(seed=44)
    A = ts.csr((crow, col, val), M.shape, dtype=torch.float32)  # a conversion: the Python path
    assert door.calls == [] and A.val.dtype == torch.float32
    B = ts.csr((A._crow, A._col, A.val), M.shape)  # the library's own indices: nothing to copy
    assert door.calls == []
    door.kernel.deliver()
    X = torch.randn(M.shape[1], 2, dtype=torch.float32)
    assert_close_to_reference(B @ X, ref_spmm(crow, col, val.float(), M.shape[1], X), torch.float32)


def test_without_the_library_the_fused_kernel_serves_from_python(fused):
    M, (crow, col, val) = _matrix(seed=45)
    assert device_check._DOOR is None or not device_check._DOOR  # nothing registered on a CPU machine
    A = ts.csr((crow, col, val), M.shape)
    assert fused.launches == 1 and fused.torch_way == []
    fused.deliver()
    assert torch.equal(A._crow, crow) and torch.equal(A._col, col)


def test_a_torch_csr_tensor_is_taken_in_by_the_library_too(door):
    M, (crow, col, val) = _matrix(seed=46)
    A = ts.csr(torch.sparse_csr_tensor(crow, col, val, M.shape))
    assert len(door.calls) == 1 and door.kernel.launches == 1
    door.kernel.deliver()
    assert torch.equal(A._crow, crow) and torch.equal(A._col, col)
    X = torch.randn(M.shape[1], 2, dtype=torch.float64)
    assert_close_to_reference(A @ X, ref_spmm(crow, col, val, M.shape[1], X))
    leaf = val.clone().requires_grad_()
    B = ts.csr(torch.sparse_csr_tensor(crow, col, leaf, M.shape))  # its values' gradient flows back
    (B @ X).sum().backward()
    assert leaf.grad is not None and len(door.calls) == 2
