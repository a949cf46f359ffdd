"""The command line and the shipped matrices."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

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


def test_load_refuses_what_it_cannot_hold_or_would_truncate(tmp_path):
    """A .mtx header promising more entries than the file holds, or a matrix too large for memory,
    is refused before SciPy allocates it; fractional indices in a .npz are refused, not truncated."""
    import numpy as np

    banner = "%%MatrixMarket matrix coordinate real general\n"
    (tmp_path / "entries.mtx").write_text(banner + "1000000 1000000 1000000000000\n1 1 1.0\n")
    with pytest.raises(ValueError, match=r"entries.mtx.*promising 1000000000000 entries .* which hold at most"):
        ts.load_matrix(tmp_path / "entries.mtx")
    (tmp_path / "rows.mtx").write_text(banner + "1000000000000 1000000000000 1\n1 1 1.0\n")
    with pytest.raises(ValueError, match=r"rows.mtx.*GiB in memory; this machine has"):
        ts.load_matrix(tmp_path / "rows.mtx")
    (tmp_path / "array.mtx").write_text("%%MatrixMarket matrix array real general\n100000 100000\n1\n")
    with pytest.raises(ValueError, match="promising 10000000000 entries"):
        ts.load_matrix(tmp_path / "array.mtx")
    # the tightest honest file still loads: entries of four bytes, the last one without its line end
    (tmp_path / "tight.mtx").write_text("%%MatrixMarket matrix coordinate pattern general\n2 2 2\n1 1\n2 2")
    assert (ts.load_matrix(tmp_path / "tight.mtx") != sp.eye(2)).nnz == 0
    for name, fractional, shown in [("indices", [0.7, 1.0], 0.7), ("indptr", [0, 1.5, 2], 1.5), ("shape", [2.5, 2], 2.5)]:
        arrays = {"indptr": [0, 1, 2], "indices": [0, 1], "data": [1.0, 2.0], "shape": [2, 2], name: fractional}
        np.savez(tmp_path / "fractional.npz", **{key: np.array(value) for key, value in arrays.items()})
        with pytest.raises(ValueError, match=f"non-integer '{name}': float64, e.g. {shown}"):
            ts.load_matrix(tmp_path / "fractional.npz")
    coo = sp.coo_matrix(np.eye(2))  # SciPy's own save_npz layout, its coordinates made fractional
    np.savez(tmp_path / "scipy.npz", row=coo.row + 0.5, col=coo.col, data=coo.data, shape=np.array(coo.shape),
             format=np.array(b"coo"))
    with pytest.raises(ValueError, match="non-integer 'row'"):
        ts.load_matrix(tmp_path / "scipy.npz")


def test_info():
    out = subprocess.run([sys.executable, "-m", "torch_sparserl", "info"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "sparserl::spmm" in out.stdout and "cora" in out.stdout
    assert "JIT runtime (from the environment): mode=" in out.stdout and "admit_calls=" in out.stdout
    assert "kernel cache: " in out.stdout


@pytest.mark.slow
def test_demo_runs_on_cpu():
    """And says what starts before each slow step (on stderr, here merged with stdout in the
    order the lines were written)."""
    out = subprocess.run([sys.executable, "-m", "torch_sparserl", "demo", "--device", "cpu", "--n", "16"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=900)
    assert out.returncode == 0, out.stdout
    assert "all checks passed" in out.stdout and "0 graph breaks" in out.stdout
    assert ("check    compiled GCN against the same model run without compiling (float32 tolerance): output ok, "
            "lin1.weight's gradient ok") in out.stdout
    lines = out.stdout.splitlines()

    def first(start):
        return next(i for i, line in enumerate(lines) if line.startswith(start))

    assert first("rank     the policy writes its likeliest kernels") < first("rank     the policy's")
    assert first("compile  torch.compile of a 2-layer GCN") < first("compile  2-layer GCN")
    if shutil.which("nvcc"):
        assert first("compile  4 kernels with nvcc") < first("compile  1/4 ") < first("compile  4/4 ")


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_tune_without_a_gpu_runs_the_compile_tier(capsys):
    from torch_sparserl.cli import main

    assert main(["tune", "cora", "--op", "spmv", "--families", "vector_row", "--compile-only"]) == 0
    out, err = capsys.readouterr()
    assert "compiling the" in out and "candidates compile cleanly" in out and "vector_row(" in out
    total = int(re.search(r"result   \d+/(\d+) candidates", out).group(1))
    # what starts (on stderr), then a numbered line per candidate (on stdout) as each is done
    assert f"compile  {total} candidates with nvcc, " in err and "under a second each" in err, err
    numbered = [line.split()[1] for line in out.splitlines() if line.startswith("compile  ")]
    assert [n.strip() for n in numbered] == [f"{i}/{total}" for i in range(1, total + 1)], out


def test_progress_reports_lines_when_stderr_is_not_a_terminal(capsys):
    """The GPU screening's progress, in a log: a line at most every every_s seconds, and the last."""
    from torch_sparserl.cli import _progress

    report = _progress("screening", every_s=3600)
    for done in range(1, 31):
        report(done, 30)
    out, err = capsys.readouterr()
    assert out == "" and err.splitlines()[-1].startswith("screening 30/30, ") and len(err.splitlines()) == 1, err
    report = _progress("screening", every_s=0)
    for done in range(1, 4):
        report(done, 3)
    assert [line.split(",")[0] for line in capsys.readouterr().err.splitlines()] == [
        "screening 1/3", "screening 2/3", "screening 3/3"]


def test_bench_says_what_starts_before_each_matrix(monkeypatch, capsys):
    """On a GPU each matrix's specialization takes up to the budget: a line on stderr says so first."""
    import torch

    from torch_sparserl.cli import main, measure
    from torch_sparserl.jit import runtime as rt

    errs, outs = [], []

    def product(M, op, n, dtype, *, runtime):
        captured = capsys.readouterr()  # what was written when the work began
        errs.append(captured.err)
        outs.append(captured.out)
        return {"cold_s": 1.0, "hot_us": 10.0, "torch_sparse_us": 20.0, "speedup": 2.0, "correct": True,
                "decision": "a kernel"}

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(rt, "configure", lambda **settings: None)
    monkeypatch.setattr(measure, "product", product)
    assert main(["bench", "cora", "citeseer", "--budget-s", "7"]) == 0
    assert errs == [
        "bench    cora: specializing spmm (within the 7 s budget), then timing it\n",
        "bench    citeseer: specializing spmm (within the 7 s budget), then timing it\n"]
    out = "".join(outs) + capsys.readouterr().out
    assert out.startswith("cora ") and "\nciteseer " in out and "2.00x" in out, out


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


@pytest.mark.parametrize("gpu", [False, True])
def test_explain_suggests_only_what_runs_on_this_machine(tmp_path, monkeypatch, capsys, gpu):
    import torch

    from torch_sparserl.cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
    assert main(["explain", "cora", "--dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "no decision in" in out
    if gpu:
        assert "(or run `sparserl bench cora` now)" in out, out
    else:
        assert "run `sparserl bench" not in out and "this machine has none" in out and "needs one" in out, out


def test_bench_says_it_needs_a_gpu(capsys):
    import torch

    from torch_sparserl.cli import main

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert main(["bench", "cora"]) == 2
    assert "sparserl bench: needs a CUDA GPU" in capsys.readouterr().err


# What pip writes for the [project.scripts] entry (the launcher in a venv's bin/).
_LAUNCHER = """import re
import sys
from torch_sparserl.cli import main
if __name__ == '__main__':
    sys.argv[0] = re.sub(r'(-script\\.pyw|\\.exe)?$', '', sys.argv[0])
    sys.exit(main())
"""


def _imports(command: list[str], tmp_path) -> tuple[subprocess.CompletedProcess, set[str]]:
    """Run ``command`` (after ``python -X importtime``) on the package under test; its result and
    the modules it imported."""
    root = str(Path(ts.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-X", "importtime", *command], capture_output=True, text=True,
                          timeout=120, env=env, cwd=tmp_path)
    imported = {line.rsplit("|", 1)[1].strip() for line in done.stderr.splitlines()
                if line.startswith("import time:") and "|" in line}
    assert imported, done.stderr  # -X importtime wrote its table
    return done, imported


def test_help_and_usage_errors_answer_without_importing_torch(tmp_path):
    """``--help`` of the command and of every subcommand, and an argument error, import neither
    torch nor SciPy (seconds on some hosts), through ``python -m`` and the installed launcher."""
    (tmp_path / "sparserl").write_text(_LAUNCHER)
    done, imported = _imports(["-m", "torch_sparserl", "--help"], tmp_path)
    assert done.returncode == 0 and "usage: sparserl" in done.stdout, done.stderr[-2000:]
    assert not {"torch", "scipy"} & imported
    commands = re.search(r"\{([a-z,]+)\}", done.stdout).group(1).split(",")
    assert {"demo", "tune", "bench", "cache"} <= set(commands)
    runs = [(["-m", "torch_sparserl", name, "--help"], 0) for name in commands] + [
        (["-mtorch_sparserl.__main__", "--help"], 0), ([str(tmp_path / "sparserl"), "--help"], 0),
        ([str(tmp_path / "sparserl"), "tune", "--help"], 0), (["-m", "torch_sparserl", "tune"], 2),
        (["-m", "torch_sparserl", "demo", "--no-such-flag"], 2), (["-m", "torch_sparserl", "tune", "cora", "--n", "-5"], 2),
        ([str(tmp_path / "sparserl"), "nosuchcommand"], 2)]
    for command, code in runs:
        done, imported = _imports(command, tmp_path)
        assert done.returncode == code, (command, done.stderr[-2000:])
        assert not {"torch", "scipy"} & imported, (command, sorted({"torch", "scipy"} & imported))


def test_the_command_registers_the_operators_once_its_arguments_parse(tmp_path):
    """Deferred at import in the command, the operators are there when a subcommand runs; and a
    plain ``import torch_sparserl`` still registers them at once."""
    done, imported = _imports(["-m", "torch_sparserl", "info"], tmp_path)
    assert done.returncode == 0 and "sparserl::spmm" in done.stdout, done.stderr[-2000:]
    done, imported = _imports(["-c", "import torch, torch_sparserl; print(torch.ops.sparserl.spmm.default)"],
                              tmp_path)
    assert done.returncode == 0 and "sparserl.spmm.default" in done.stdout, done.stderr[-2000:]


@pytest.mark.gpu
@pytest.mark.slow
def test_demo_times_the_fast_path_with_a_fresh_cache(tmp_path):
    """With an empty cache folder the demo builds the C++ fast path before it times A @ X (it
    used to time the Python path while the library built, without saying so), and says which
    path served the timed calls."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    env = {**os.environ, "SPARSERL_CACHE_DIR": str(tmp_path / "cache")}
    env.pop("SPARSERL_FAST_PATH", None)
    out = subprocess.run([sys.executable, "-m", "torch_sparserl", "demo", "--n", "32"], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, timeout=900, env=env)
    assert out.returncode == 0, out.stdout
    lines = out.stdout.splitlines()
    timed = next(i for i, line in enumerate(lines) if line.startswith("time     A @ X "))
    assert lines[timed].endswith("A @ X served by the C++ fast path"), out.stdout
    built = [i for i, line in enumerate(lines) if line.startswith("fastpath ")]  # absent if loaded already
    assert all(i < timed for i in built) and (not built or "loaded from" in lines[built[-1]]), out.stdout


def test_the_warm_start_script_names_only_what_it_binds():
    """measure._WARM_SCRIPT runs in a child process on the GPU machine, where a name it does not
    import fails only there: every name it reads is bound in it (an import, an assignment, a
    function, a loop or an argument) or a builtin."""
    import ast
    import builtins

    from torch_sparserl.cli import measure

    tree = ast.parse(measure._WARM_SCRIPT)
    bound = set(dir(builtins))
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            bound |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            bound.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.Lambda)):
            bound |= {a.arg for a in node.args.args + node.args.kwonlyargs} | (
                {node.name} if isinstance(node, ast.FunctionDef) else set())
    read = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)}
    assert read <= bound, sorted(read - bound)
