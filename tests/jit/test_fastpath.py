"""The C++ fast path's Python side on any machine: when it is built, what it refuses, and that
nothing changes where it is not loaded (CPU torch, or turned off). What it serves is tested on
the GPU (tests/jit/test_fastpath_gpu.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import torch_sparserl as ts
from torch_sparserl import pattern as patterns
from torch_sparserl.jit import fastpath
from torch_sparserl.jit import runtime as rt
from torch_sparserl.ops import FAST_OPS, doors
from torch_sparserl.config import JitOptions

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


def test_the_sources_are_the_unit_and_every_part_it_includes():
    """fastpath.cpp includes each file of csrc/fastpath/ once, and sources() lists them all, the
    unit first: none is left out of the library's name, its build folder or the package data
    (test_setup.py)."""
    found = fastpath.sources()
    assert found[0] == fastpath.SOURCE and len(found) == len(set(found))
    assert sorted(found[1:]) == sorted((fastpath.CSRC / "fastpath").iterdir())
    text = "".join(source.read_text() for source in found)
    for op in fastpath.OPS:  # the C++ kernels are registered for each of the Python operators
        assert f'm.impl("{op}", &product<' in text
        assert any(t._name == f"sparserl_fast::{op}" for t in FAST_OPS.values())


@pytest.fixture
def csrc_copy(tmp_path, monkeypatch):
    """A copy of csrc/ that the fast path reads as its sources."""
    import shutil

    copy = tmp_path / "csrc"
    shutil.copytree(fastpath.CSRC, copy)
    monkeypatch.setattr(fastpath, "CSRC", copy)
    monkeypatch.setattr(fastpath, "SOURCE", copy / fastpath.SOURCE.name)
    return copy


def test_a_change_to_any_source_names_another_library(csrc_copy):
    """The library's name covers the unit and each part: an edit to any one builds a new library."""
    first = fastpath._name()
    sources = fastpath.sources()
    assert len(sources) > 1
    for source in sources:
        text = source.read_text()
        source.write_text(text + "// edited\n")
        assert fastpath._name() != first, source
        source.write_text(text)
    assert fastpath._name() == first


def test_a_missing_part_is_named(csrc_copy):
    (csrc_copy / "fastpath" / "staging.h").unlink()
    with pytest.raises(FileNotFoundError, match="staging.h"):
        fastpath._name()


def test_the_build_folder_holds_every_source_as_csrc_does(tmp_path, monkeypatch):
    """build() lays the unit and its parts out in the library's folder as under csrc/ (so that the
    unit's includes resolve there) and compiles the unit alone (torch's builder stubbed)."""
    from torch.utils import cpp_extension

    monkeypatch.setenv("SPARSERL_CACHE_DIR", str(tmp_path))
    seen = {}

    def load(name, sources, build_directory, **kwargs):
        folder = Path(build_directory)
        seen["sources"] = sources
        seen["files"] = {path.relative_to(folder).as_posix(): path.read_text() for path in folder.rglob("*")
                         if path.suffix in (".cpp", ".h")}
        (folder / f"{name}.so").write_bytes(b"a stand-in library")

    monkeypatch.setattr(cpp_extension, "load", load)
    path = fastpath.build()
    assert seen["sources"] == [str(path.parent / fastpath.SOURCE.name)]
    assert seen["files"] == {source.relative_to(fastpath.CSRC).as_posix(): source.read_text()
                             for source in fastpath.sources()}


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
    runtime = rt.Runtime(JitOptions(mode="off"))
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
    assert cli.main(["fastpath"]) == 2  # what this machine lacks, as bench says it
    assert "sparserl fastpath: needs a CUDA build of torch" in capsys.readouterr().err
    assert cli.main(["info"]) == 0
    assert "C++ fast path: not available" in capsys.readouterr().out


# ------------------------------------------------------------------ the eager door (its routing, CPU)


class _FakeServe:
    """Stands in for the library's serve(): records what it was asked, answers ``answer``."""

    def __init__(self, answer=None):
        self.asked, self.answer = [], answer

    def __call__(self, op, crow, col, val, ncols, X):
        self.asked.append(((*fastpath.OPS, "sddmm")[op], ncols, tuple(X.shape)))
        return self.answer(X) if callable(self.answer) else self.answer


def _recorded(A, serve):
    """What recording a CUDA product leaves on the matrix: its door, with C++'s ``serve``."""
    door = doors.Door(A.shape[1])
    door.cpp = serve
    A.__dict__["_door"] = door


@pytest.fixture
def square():
    import scipy.sparse as sp

    M = sp.random(20, 20, density=0.2, format="csr", random_state=np.random.default_rng(0))
    A = ts.csr(M, dtype=torch.float64)
    return A, torch.from_numpy(M.toarray())


def test_each_eager_spelling_asks_the_door_for_its_own_product(monkeypatch, square):
    """A miss (None) runs the Python path; each spelling names its product, the transposes too
    (on a square matrix, spmm and spmm_transposed take operands of the same shape)."""
    A, dense = square
    fake = _FakeServe()
    _recorded(A, fake)
    X, x = torch.randn(20, 3, dtype=torch.float64), torch.randn(20, dtype=torch.float64)
    torch.testing.assert_close(A @ X, dense @ X)
    torch.testing.assert_close(A @ x, dense @ x)
    torch.testing.assert_close(X.t() @ A, X.t() @ dense)
    torch.testing.assert_close(x @ A, x @ dense)
    torch.testing.assert_close(torch.mm(A, X), dense @ X)
    torch.testing.assert_close(torch.mv(A, x), dense @ x)
    assert [op for op, _, _ in fake.asked] == ["spmm", "spmv", "spmm_transposed", "spmv_transposed", "spmm", "spmv"]
    assert all(ncols == 20 for _, ncols, _ in fake.asked)


def test_what_the_door_serves_is_the_result(monkeypatch, square):
    A, _ = square
    _recorded(A, _FakeServe(lambda X: torch.full((20, X.shape[1]), 7.0)))
    assert torch.equal(A @ torch.randn(20, 2, dtype=torch.float64), torch.full((20, 2), 7.0))
    assert torch.equal(torch.mm(A, torch.randn(20, 3, dtype=torch.float64)), torch.full((20, 3), 7.0))


def test_an_error_in_the_door_reaches_the_caller(monkeypatch, square):
    A, _ = square

    def failing(*args):
        raise RuntimeError("sparserl kernel launch: cudaLaunchKernel failed with cudaError 719")

    _recorded(A, failing)
    with pytest.raises(RuntimeError, match="cudaLaunchKernel failed"):
        A @ torch.randn(20, 2, dtype=torch.float64)


def test_the_door_is_not_asked_without_a_recording_or_under_a_tracer(monkeypatch, square):
    A, dense = square
    fake = _FakeServe()
    monkeypatch.setattr(fastpath, "serve", fake)
    X = torch.randn(20, 3, dtype=torch.float64)
    B = ts_detached(A)  # a new matrix: nothing recorded for it
    torch.testing.assert_close(B @ X, dense @ X)
    torch.testing.assert_close(B @ X, dense @ X)  # nor after a CPU product
    assert B.__dict__["_door"].cpp is None
    C = ts_detached(A)
    _recorded(C, fake)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    torch.testing.assert_close(C @ X, dense @ X)
    torch.testing.assert_close(torch.mm(C, X), dense @ X)
    assert fake.asked == []


def ts_detached(A):
    return ts.CSRMatrix(A.crow, A.col, A.val.detach(), tuple(A.shape))


def test_eager_autograd_asks_the_door_inside_its_node(monkeypatch, square):
    """A product autograd records asks the door from inside its node (grad mode is off there):
    the forward's spmm, the backward's sddmm (the values' gradient: ncols is X's rows) and
    spmm_transposed. The gradients are the Python path's."""
    A, dense = square
    fake = _FakeServe()
    monkeypatch.setattr(fastpath, "serve", fake)
    A.requires_grad = True  # the setter drops the matrix's own recording: its products go through autograd
    X = torch.randn(20, 3, dtype=torch.float64, requires_grad=True)
    (A @ X).sum().backward()
    torch.testing.assert_close(X.grad, dense.t() @ torch.ones(20, 3, dtype=torch.float64))
    assert [op for op, _, _ in fake.asked] == ["spmm", "sddmm", "spmm_transposed"]
    assert fake.asked[1] == ("sddmm", 20, (20, 3))


def test_the_first_product_of_a_process_is_recorded_for_the_door(monkeypatch, square):
    """The product that creates the process's runtime is recorded too: the next call is C++'s."""
    A, dense = square
    recorded = []
    monkeypatch.setattr(rt, "_ACTIVE", None)
    monkeypatch.setattr(doors, "_recordable", lambda X: True)
    monkeypatch.setattr(fastpath, "record", lambda runtime, op, *args: recorded.append((runtime, op)))
    monkeypatch.setattr(fastpath, "serve", fake := _FakeServe())
    X = torch.randn(20, 3, dtype=torch.float64)
    torch.testing.assert_close(A @ X, dense @ X)
    created = rt.active_or_none()
    try:
        assert recorded == [(created, "spmm")] and created is not None
        assert A.__dict__["_door"].cpp is fake  # the next product asks C++ first
        torch.testing.assert_close(A @ X, dense @ X)
        assert fake.asked == [("spmm", 20, (20, 3))]
    finally:
        created.close()


def test_one_recording_serves_every_door(monkeypatch):
    """Recording for C++ happens in one place (ops.doors.record), whichever door served the
    call: the eager product, the implementation-only twins (spmm and SDDMM), eager autograd."""
    A = make_pattern("random", seed=12)
    crow, col, val = to_parts(A, torch.float64, torch.int64, "cpu")
    X, Y = torch.randn(A.shape[1], 3, dtype=torch.float64), torch.randn(A.shape[0], 3, dtype=torch.float64)
    recorded = []
    monkeypatch.setattr(doors, "_recordable", lambda X: True)
    monkeypatch.setattr(fastpath, "record", lambda runtime, op, c, k, v, ncols, X: recorded.append((op, ncols)))
    torch.ops.sparserl_direct.spmm(crow, col, val, A.shape[1], X)
    torch.ops.sparserl_fast.spmv_transposed(crow, col, val, A.shape[1], Y[:, 0])
    torch.ops.sparserl_direct.sddmm(crow, col, Y, X)
    ts.csr((crow, col, val), A.shape) @ X
    v = val.clone().requires_grad_()
    torch.ops.sparserl.spmm(crow, col, v, A.shape[1], X).sum().backward()  # eager autograd: its products
    assert recorded[:4] == [("spmm", A.shape[1]), ("spmv_transposed", A.shape[1]), ("sddmm", A.shape[1]),
                            ("spmm", A.shape[1])]
    assert sorted(recorded[4:]) == [("sddmm", A.shape[1])]  # the backward's values' gradient


def test_the_first_cuda_product_starts_the_library_once(monkeypatch, caplog):
    """start(): ensure() once per process (loaded now if built, else built in the background);
    a failure there is a warning, and the Python path serves on."""
    calls = []
    monkeypatch.setattr(fastpath, "_started", False)
    monkeypatch.setattr(fastpath, "loaded", False)
    monkeypatch.setattr(fastpath, "ensure", lambda: calls.append(1))
    fastpath.start()
    fastpath.start()
    assert calls == [1]

    def failing():
        raise OSError("no space left on device")

    monkeypatch.setattr(fastpath, "_started", False)
    monkeypatch.setattr(fastpath, "ensure", failing)
    with caplog.at_level("WARNING", logger="torch_sparserl.jit.fastpath"):
        fastpath.start()
    assert "could not be loaded: no space left on device" in caplog.text


class _OnCuda(torch.Tensor):
    """A CPU tensor that says it is on CUDA: enough for the checks of ops.products._transposed_once."""

    is_cuda = True


@pytest.fixture
def one_off(monkeypatch):
    """A validated CPU pattern, and a fake of the library's cusparse_once (Aᵀ @ G in float64)."""
    A = make_pattern("short and huge rows", seed=4)
    crow, col, val = to_parts(A, torch.float64, torch.int64, "cpu")
    entry = patterns.lookup(crow, col, A.shape[1])
    entry.validate("test", crow, col)
    calls = []

    def cusparse_once(c, k, v, ncols, G, transposed):
        assert transposed
        calls.append((c, k))
        return torch.from_numpy(A.T @ G.as_subclass(torch.Tensor).numpy())

    monkeypatch.setattr(fastpath, "cusparse_once", cusparse_once)
    G = torch.randn(A.shape[0], 3, dtype=torch.float64).as_subclass(_OnCuda)
    return A, entry, crow, col, val, G, calls


def test_a_patterns_first_transposed_product_skips_the_transpose(one_off):
    from torch_sparserl.ops import products as ops

    A, entry, crow, col, val, G, calls = one_off
    avoided = patterns.stats()["transposes_avoided"]
    out = ops._transposed_once(entry, crow, col, val, A.shape[1], G)
    torch.testing.assert_close(out, torch.from_numpy(A.T @ G.as_subclass(torch.Tensor).numpy()))
    assert calls == [entry.indices(crow, col)] and not entry.has_transpose
    assert patterns.stats()["transposes_avoided"] == avoided + 1
    # the second is not a one-off: the caller computes the transpose (and may specialize it)
    assert ops._transposed_once(entry, crow, col, val, A.shape[1], G) is None and len(calls) == 1


def test_the_transpose_is_computed_where_the_shortcut_does_not_apply(one_off, monkeypatch):
    from torch_sparserl.ops import products as ops

    A, entry, crow, col, val, G, calls = one_off
    with monkeypatch.context() as m:
        m.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)  # cuSPARSE's transpose may vary
        assert ops._transposed_once(entry, crow, col, val, A.shape[1], G) is None
    entry.transposed_products = 0
    assert ops._transposed_once(entry, crow, col, val, A.shape[1], G.as_subclass(torch.Tensor)) is None  # CPU
    entry.transpose(crow, col)
    assert ops._transposed_once(entry, crow, col, val, A.shape[1], G) is None  # computed already
    monkeypatch.setattr(fastpath, "cusparse_once", None)  # the library not loaded
    entry.transposed_products = 0
    assert ops._transposed_once(entry, crow, col, val, A.shape[1], G) is None
    assert calls == []


def test_cuda_products_cusparse_serves_are_called_from_cxx(monkeypatch):
    """ops.common._vendor: a CUDA product with no kernel calls cuSPARSE through the library in one
    call; what the library declines, and everything where it is not loaded, goes through torch."""
    from torch_sparserl.ops import common as ops

    A = make_pattern("random", seed=5)
    crow, col, val = to_parts(A, torch.float64, torch.int64, "cpu")
    entry = patterns.lookup(crow, col, A.shape[1])
    entry.validate("test", crow, col)
    X = torch.randn(A.shape[1], 4, dtype=torch.float64)
    want = torch.from_numpy(A @ X.numpy())
    calls, answer = [], {"out": None}

    def cusparse_once(c, k, v, ncols, Xc, transposed):
        calls.append((ncols, transposed))
        return answer["out"]

    monkeypatch.setattr(fastpath, "cusparse_once", cusparse_once)
    answer["out"] = sentinel = torch.empty(0)
    assert ops._vendor("spmm", entry, crow, col, val, X.as_subclass(_OnCuda)) is sentinel
    assert calls == [(A.shape[1], False)]
    answer["out"] = None  # declined: torch's path
    torch.testing.assert_close(ops._vendor("spmm", entry, crow, col, val, X.as_subclass(_OnCuda))
                               .as_subclass(torch.Tensor), want)
    assert len(calls) == 2
    torch.testing.assert_close(ops._vendor("spmm", entry, crow, col, val, X), want)  # CPU: not asked
    with monkeypatch.context() as m:  # Dynamo tracing: the library's ops have no fake kernels
        m.setattr(torch.compiler, "is_compiling", lambda: True)
        answer["out"] = sentinel
        assert ops._vendor("spmm", entry, crow, col, val, X.as_subclass(_OnCuda)) is not sentinel
    monkeypatch.setattr(fastpath, "cusparse_once", None)  # not loaded
    torch.testing.assert_close(ops._vendor("spmm", entry, crow, col, val, X.as_subclass(_OnCuda))
                               .as_subclass(torch.Tensor), want)
    assert len(calls) == 2


def test_ts_csr_stages_host_arrays_through_the_library_where_it_can(monkeypatch):
    """construct._staged: host CSR arrays bound for CUDA go through the library's stage_csr
    (copy and check in one pass) when it is loaded; values whose copy autograd records stay in
    Python; a decline (a failed check among them) returns None, and the Python path names it;
    metadata is checked before the library is asked."""
    from torch_sparserl.tensor import construct

    crow, col, val = torch.tensor([0, 1, 2]), torch.tensor([0, 2]), torch.ones(2)
    monkeypatch.setattr(fastpath, "stage_csr", None)
    assert construct._staged("op", crow, col, val, (2, 3), "cuda") is None  # not loaded
    calls, answer = [], {}

    def stage(c, k, v, nrows, ncols, device):
        calls.append((v is not None, ncols, device.type))
        return answer["out"]

    monkeypatch.setattr(fastpath, "stage_csr", stage)
    answer["out"] = staged = [crow.clone(), col.clone(), val.clone()]
    got = construct._staged("op", crow, col, val, (2, 3), "cuda")
    assert [t is s for t, s in zip(got, staged)] == [True] * 3 and calls == [(True, 3, "cuda")]
    answer["out"] = staged[:2]
    got = construct._staged("op", crow, col, val.clone().requires_grad_(), (2, 3), "cuda")
    assert len(got) == 2 and calls[-1] == (False, 3, "cuda")  # autograd's copy of the values stays in Python
    answer["out"] = []
    assert construct._staged("op", crow, col, val, (2, 3), "cuda") is None  # declined
    answer["out"] = staged[:2]
    assert construct._staged("op", crow, col, val, (2, 3), "cuda") is None  # values asked for, not given
    with pytest.raises(ValueError, match=r"crow must have nrows \+ 1 = 4 elements"):
        construct._staged("torch_sparserl.csr", crow, col, val, (3, 3), "cuda")
    assert len(calls) == 4


def test_ts_csr_takes_the_short_path_for_host_triples_bound_for_cuda(monkeypatch):
    """construct._staged_matrix: ts.csr of a host (crow, col, val) triple bound for CUDA is one
    call of the library's stage_csr (with the shape's rows and columns) and a pattern registered
    as validated; what needs a conversion, autograd or inference mode, what is not bound for
    CUDA, and what the library declines go the general path."""

    crow, col, val = torch.tensor([0, 1, 2], dtype=torch.int32), torch.tensor([0, 2], dtype=torch.int32), torch.ones(2)
    calls, answer = [], {}

    def stage(c, k, v, nrows, ncols, device, young_ns=0):
        calls.append((c is crow, k is col, v is val, nrows, ncols, str(device)))
        answer["young_ns"] = young_ns
        return answer["out"]

    monkeypatch.setattr(fastpath, "stage_csr", stage)
    answer["out"] = [crow.clone(), col.clone(), val.clone()]
    A = ts.csr((crow, col, val), (np.int64(2), 3), device="cuda")
    assert calls == [(True, True, True, 2, 3, "cuda")] and tuple(A.shape) == (2, 3)
    assert answer["young_ns"] == fastpath.young_ns(rt.active())  # young for the active runtime's admission age
    # C++ serves a young matrix: its eager products try the C++ door first
    assert "_door" not in A.__dict__  # the tests' runtime is off: not young in C++
    monkeypatch.setattr(fastpath, "_owner", fastpath._owner)  # young_ns makes its runtime the owner: restored
    young = rt.Runtime(JitOptions(mode="background", admit_age_s=0.1))
    previous = rt.set_active(young)
    try:  # background mode: C++ serves it while young, and its eager products try the C++ door first
        A = ts.csr((crow, col, val), (2, 3), device="cuda")
        assert answer["young_ns"] == 100_000_000 and A.__dict__["_door"].ncols == 3
        assert A.__dict__["_door"].cpp is fastpath.serve
    finally:
        rt.set_active(previous)
        young.close()
    calls.pop()
    assert [A._crow, A._col, A.val] == answer["out"] and patterns.validated(A._crow, A._col, 3) is not None
    no_gpu = (RuntimeError, AssertionError)  # the general path's .to("cuda") on this CPU-only torch
    for kwargs, parts in (({"dtype": torch.float64}, (crow, col, val)), ({"index_dtype": torch.int64}, (crow, col, val)),
                          ({}, (crow, col, val.clone().requires_grad_())), ({}, (crow.numpy(), col, val))):
        with pytest.raises(no_gpu):
            ts.csr(parts, (2, 3), device="cuda", **kwargs)
    with torch.inference_mode(), pytest.raises(no_gpu):
        ts.csr((crow, col, val), (2, 3), device="cuda")
    assert ts.csr((crow, col, val), (2, 3), device="cpu").crow is not crow  # not bound for CUDA: the general path
    assert len(calls) == 1
    answer["out"] = []  # declined: the general path copies, checks and names what is wrong
    with pytest.raises(ValueError, match=r"col must be < ncols"):
        ts.csr((crow, torch.tensor([0, 3], dtype=torch.int32), val), (2, 3), device="cuda")
    assert len(calls) == 2


def test_a_transposed_product_served_without_the_transpose_is_not_recorded(one_off):
    """C++ serves transposed products with the transpose: recording one that was served without
    it would compute it after all. The next call computes it, and is recorded."""
    A, entry, crow, col, val, G, _ = one_off
    fastpath.record(object(), "spmm_transposed", crow, col, val, A.shape[1], G)  # returns before the runtime
    assert not entry.has_transpose


def test_young_patterns_are_left_to_cpp_where_the_runtime_leaves_them_to_cusparse(monkeypatch):
    """fastpath.young_ns: a staged pattern is young in C++ for the runtime's admission age in
    background mode, deciding on CUDA, with class kernels off; else 0 (the runtime sees every
    call). Asking makes the runtime the registry's owner, so that C++'s counts fold into it."""
    forgotten = []
    monkeypatch.setattr(fastpath, "_owner", None)
    monkeypatch.setattr(fastpath, "loaded", False)
    real = fastpath._forget_locked
    monkeypatch.setattr(fastpath, "_forget_locked", lambda: forgotten.append(1) or real())
    runtime = rt.Runtime(JitOptions(mode="background", admit_age_s=0.25))
    try:
        assert fastpath.young_ns(runtime) == 250_000_000 and fastpath._owner is runtime and forgotten == [1]
        assert fastpath.young_ns(runtime) == 250_000_000 and forgotten == [1]  # already the owner
        for settings, devices in (({"mode": "sync"}, ("cuda",)), ({"admit_age_s": 0}, ("cuda",)),
                                  ({"class_after": 16}, ("cuda",)), ({}, ("cpu",))):
            other = rt.Runtime(JitOptions(mode="background", admit_age_s=0.25).replace("test", **settings),
                               devices=devices)
            assert fastpath.young_ns(other) == 0 and fastpath._owner is runtime, settings
            other.close()
        fastpath.COUNTS[:] = torch.tensor([0, 5, 3])  # as C++ counts: 5 cuSPARSE calls, 3 of them young
        stats = runtime.stats
        assert stats["fallback_calls"] == 5 and stats["young_calls"] == 3
    finally:
        fastpath.COUNTS.zero_()
        fastpath._taken[:] = [0, 0, 0]
        runtime.close()


# ------------------------------------------------------------------ record: what C++ is told (CPU, library faked)

INSTALL_ARGS = ("crow", "col", "ncols", "op", "n", "dtype", "nnz", "x_rows", "rows", "rowptr", "colidx", "perm",
                "launcher", "geometry", "aux", "ints", "init_zero", "work_numel", "cols", "function", "work_once")
"""The arguments of ``sparserl_fastpath::install`` (csrc/fastpath/library.h), in order."""

FAST = dict(launcher=1234, function=0, grid=7, block=128, smem=96, aux=None, ints=(11, 12, 13, 14, 15),
            init_zero=True, work_numel=0, work_once=False, copies=None)
"""What an installed kernel's launch tells the fast path (install._bind_spec's ``launch.fast``)."""


class _FakeRegistry:
    """Stands in for the library's registry ops: records each install (by argument name) and forget."""

    def __init__(self):
        self.installs, self.forgets = [], 0

    def install(self, *args):
        assert len(args) == len(INSTALL_ARGS)
        self.installs.append(dict(zip(INSTALL_ARGS, args)))

    def forget(self):
        self.forgets += 1


@pytest.fixture
def registry(monkeypatch):
    """The library 'loaded' with a fake registry, no owner yet, no CUDA graph being captured."""
    fake = _FakeRegistry()
    monkeypatch.setattr(fastpath.torch.ops, "sparserl_fastpath", fake, raising=False)
    monkeypatch.setattr(fastpath, "loaded", True)
    monkeypatch.setattr(fastpath, "_owner", None)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    yield fake
    monkeypatch.setattr(fastpath, "_owner", None)


def _recording_runtime(tmp_path, *, kernel: bool = True, install_fails: bool = False, strict: bool = False):
    """A CPU runtime whose decisions are a kernel with ``FAST`` (``kernel``), or cuSPARSE;
    ``install_fails``: the kernel's install raises (an undecided fallback)."""
    from types import SimpleNamespace

    from torch_sparserl.jit.cache import CacheEntry, KernelCache

    source = ('// sparserl: op=spmm dtype=f32 block=32 grid=1\n'
              'extern "C" __global__ void sparserl_kernel(const int* rowptr) {}\n') if kernel else None

    def specializer(key, crow, col, ncols):
        return CacheEntry(key, source, family="fake", reason="chosen by the test")

    def installer(entry, crow, col, ncols):
        if install_fails:
            raise OSError("the build failed")
        rows = crow.numel() - 1

        def launch(crow, col, val, X):
            return torch.sparse_csr_tensor(crow, col, val, (rows, ncols)).to_dense() @ X

        launch.fast = SimpleNamespace(**FAST)
        return launch

    return rt.Runtime(JitOptions(mode="sync", strict=strict), cache=KernelCache(tmp_path),
                      specializer=specializer, installer=installer, devices=("cpu",))


def _validated(dtype=torch.float32, seed=21):
    """A validated pattern (as the operators leave it), its parts and an X of width 8."""
    A = make_pattern("random", seed=seed)
    crow, col, val = to_parts(A, dtype, torch.int64, "cpu")
    entry = patterns.lookup(crow, col, A.shape[1])
    entry.validate("test", crow, col)
    return A, entry, crow, col, val, torch.randn(A.shape[1], 8, dtype=dtype)


def _decided(runtime, op="spmm", dtype=torch.float32, seed=21):
    """:func:`_validated`, with its ``op`` product decided by ``runtime`` (one call)."""
    A, entry, crow, col, val, X = _validated(dtype, seed)
    runtime.call(op, entry, crow, col, val, X)
    return A, entry, crow, col, val, X


def test_record_hands_cpp_the_installed_kernels_launch_once(tmp_path, registry):
    runtime = _recording_runtime(tmp_path)
    try:
        A, entry, crow, col, val, X = _decided(runtime)
        assert isinstance(runtime.state("spmm", entry, 8, torch.float32), rt.Installed)
        fastpath.record(runtime, "spmm", crow, col, val, A.shape[1], X)
        (got,) = registry.installs
        rowptr, colidx = entry.indices(crow, col)
        assert got["crow"] is crow and got["col"] is col and got["op"] == fastpath.OPS.index("spmm")
        assert (got["ncols"], got["n"], got["dtype"], got["nnz"], got["x_rows"], got["rows"], got["cols"]) == \
            (A.shape[1], 8, torch.float32, A.nnz, A.shape[1], A.shape[0], A.shape[1])
        # the pattern's validated copy, never the caller's tensors (which C++ only watches)
        assert got["rowptr"] is rowptr and got["colidx"] is colidx and got["perm"] is None
        assert (got["launcher"], got["geometry"], got["ints"], got["init_zero"], got["work_numel"], got["function"],
                got["work_once"]) == (1234, [7, 128, 96], [11, 12, 13, 14, 15], True, 0, 0, False)
        assert fastpath._owner is runtime
        fastpath.record(runtime, "spmm", crow, col, val, A.shape[1], X)  # handed over already
        assert len(registry.installs) == 1
    finally:
        runtime.close()


def test_record_hands_cpp_cusparse_where_the_runtime_decided_it(tmp_path, registry):
    """A decided fallback is recorded as cuSPARSE (no launcher), for half precision too (C++ runs
    cuSPARSE with float32 sums); not for an SDDMM (C++ serves only its kernels)."""
    runtime = _recording_runtime(tmp_path, kernel=False)
    try:
        A, entry, crow, col, val, X = _decided(runtime)
        state = runtime.state("spmm", entry, 8, torch.float32)
        assert isinstance(state, rt.Fallback) and state.decided
        fastpath.record(runtime, "spmm", crow, col, val, A.shape[1], X)
        (got,) = registry.installs
        assert (got["launcher"], got["function"], got["geometry"], got["ints"]) == (0, 0, [0, 0, 0], [0] * 5)
        A, entry, crow, col, val, X = _decided(runtime, dtype=torch.float16, seed=22)
        fastpath.record(runtime, "spmm", crow, col, val, A.shape[1], X)
        assert len(registry.installs) == 2 and registry.installs[1]["launcher"] == 0
        A, entry, crow, col, _, X = _validated(seed=23)
        Y = torch.randn(A.shape[0], 8)
        runtime.call("sddmm", entry, crow, col, Y, X)
        assert isinstance(runtime.state("sddmm", entry, 8, torch.float32), rt.Fallback)
        fastpath.record(runtime, "sddmm", crow, col, Y, A.shape[1], X)
        assert len(registry.installs) == 2
    finally:
        runtime.close()


def test_record_waits_for_a_decision_and_never_records_under_capture(tmp_path, registry, monkeypatch):
    runtime = _recording_runtime(tmp_path)
    try:
        A, _, crow, col, val, X = _validated(seed=24)
        fastpath.record(runtime, "spmm", crow, col, val, A.shape[1], X)  # not asked to decide yet
        assert registry.installs == []
        A, entry, crow, col, val, X = _decided(runtime, seed=25)
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
        fastpath.record(runtime, "spmm", crow, col, val, A.shape[1], X)
        assert registry.installs == [] and not runtime.decision("spmm", entry, 8, torch.float32).fast
    finally:
        runtime.close()


@pytest.mark.parametrize("strict", [False, True])
def test_record_of_an_undecided_fallback_follows_strict(tmp_path, registry, strict):
    """A failed install (a fallback, not decided): cuSPARSE for C++ unless strict, where the
    next call must reach Python again, which raises."""
    runtime = _recording_runtime(tmp_path, install_fails=True, strict=strict)
    try:
        A, entry, crow, col, val, X = _validated(seed=26)
        if strict:
            with pytest.raises(rt.SpecializationError, match="the build failed"):
                runtime.call("spmm", entry, crow, col, val, X)
        else:
            runtime.call("spmm", entry, crow, col, val, X)
        state = runtime.state("spmm", entry, 8, torch.float32)
        assert isinstance(state, rt.Fallback) and not state.decided
        fastpath.record(runtime, "spmm", crow, col, val, A.shape[1], X)
        assert [got["launcher"] for got in registry.installs] == ([] if strict else [0])
    finally:
        runtime.close()


def test_record_of_a_transposed_product_hands_over_the_transpose(tmp_path, registry):
    """Aᵀ @ G: C++ serves it with the transposed pattern's indices and the values' permutation,
    as the runtime decided the product on the transposed pattern."""
    runtime = _recording_runtime(tmp_path)
    try:
        A, entry, crow, col, val, _ = _validated(seed=27)
        pattern_t, crow_t, col_t, perm = entry.transpose(crow, col)
        G = torch.randn(A.shape[0], 8)
        runtime.call("spmm", pattern_t, crow_t, col_t, entry.transposed_values(val, perm), G)
        fastpath.record(runtime, "spmm_transposed", crow, col, val, A.shape[1], G)
        (got,) = registry.installs
        assert got["op"] == fastpath.OPS.index("spmm_transposed") and got["launcher"] == 1234
        assert got["rowptr"] is crow_t and got["colidx"] is col_t and got["perm"] is perm
        assert (got["rows"], got["cols"], got["x_rows"]) == (A.shape[1], A.shape[0], A.shape[0])
    finally:
        runtime.close()


def test_record_for_another_runtime_empties_the_registry_first(tmp_path, registry):
    """The registry holds one runtime's decisions: recording another's forgets them (a new epoch)."""
    first, second = _recording_runtime(tmp_path / "first"), _recording_runtime(tmp_path / "second")
    try:
        A, entry, crow, col, val, X = _decided(first, seed=28)
        fastpath.record(first, "spmm", crow, col, val, A.shape[1], X)
        forgets, epoch = registry.forgets, fastpath._epoch
        second.call("spmm", entry, crow, col, val, X)
        fastpath.record(second, "spmm", crow, col, val, A.shape[1], X)
        assert registry.forgets == forgets + 1 and fastpath._epoch == epoch + 1 and fastpath._owner is second
        assert len(registry.installs) == 2
    finally:
        first.close()
        second.close()
