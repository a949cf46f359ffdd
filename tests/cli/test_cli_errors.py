"""Every bad invocation of the CLI is one line on stderr, ``sparserl COMMAND: ...``, and exit
status 2: no traceback (issue 33, class 9). Bad matrices and files, numbers out of range, bad
folders, unknown families, broken cache folders; ``SPARSERL_DEBUG=1`` still shows tracebacks."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import scipy.sparse as sp
import torch

from torch_sparserl import cli
from torch_sparserl.cli import main


@pytest.fixture(autouse=True)
def _no_debug(monkeypatch):
    monkeypatch.delenv("SPARSERL_DEBUG", raising=False)  # it would turn every line into a traceback


def _run(argv, capsys):
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def _assert_one_line(code, err, command):
    assert "Traceback" not in err, err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(" ".join(["sparserl", command]).strip() + ":"), err
    assert code == 2, (code, err)


@pytest.fixture(scope="module")
def bad(tmp_path_factory):
    """Files that are not usable matrices, by name."""
    d = tmp_path_factory.mktemp("bad")
    (d / "random.npz").write_bytes(np.random.default_rng(0).bytes(1000))
    (d / "empty.npz").write_bytes(b"")
    sp.save_npz(d / "zero.npz", sp.csr_matrix((0, 0)))
    sp.save_npz(d / "no_rows.npz", sp.csr_matrix((0, 5)))
    sp.save_npz(d / "no_nonzeros.npz", sp.csr_matrix((5, 5)))
    np.savez(d / "not_a_matrix.npz", a=np.arange(3))
    np.save(d / "array.npy", np.eye(2))
    os.replace(d / "array.npy", d / "array.npz")  # a .npy under a .npz name
    np.savez(d / "column_out_of_range.npz", indptr=np.array([0, 1]), indices=np.array([7]), data=np.array([1.0]),
             shape=np.array([1, 1]))
    np.savez(d / "bad_indptr.npz", indptr=np.array([0, 5]), indices=np.array([0]), data=np.array([1.0]),
             shape=np.array([1, 1]))
    np.savez(d / "negative_shape.npz", indptr=np.array([0]), indices=np.array([], dtype=np.int64),
             data=np.array([]), shape=np.array([-1, -1]))
    np.savez(d / "complex.npz", indptr=np.array([0, 1]), indices=np.array([0]), data=np.array([1j]),
             shape=np.array([1, 1]))
    np.savez(d / "strings.npz", indptr=np.array([0, 1]), indices=np.array([0]), data=np.array(["x"]),
             shape=np.array([1, 1]))
    (d / "garbage.mtx").write_text("hello\n")
    # 60-odd bytes whose header promises 10**12 entries, or 10**12 rows: SciPy would allocate them first
    (d / "promises_too_much.mtx").write_text("%%MatrixMarket matrix coordinate real general\n"
                                             "1000000 1000000 1000000000000\n1 1 1.0\n")
    (d / "too_many_rows.mtx").write_text("%%MatrixMarket matrix coordinate real general\n"
                                         "1000000000000 1000000000000 1\n1 1 1.0\n")
    np.savez(d / "fractional_indices.npz", indptr=np.array([0, 1, 2]), indices=np.array([0.7, 1.2]),
             data=np.array([1.0, 2.0]), shape=np.array([2, 2]))
    (d / "matrix.txt").write_text("1 2 3\n")
    (d / "folder.npz").mkdir()
    os.mkfifo(d / "fifo.npz")  # reading it would wait forever
    os.symlink("/dev/zero", d / "zeros.npz")  # reading it would never end
    (d / "a_file").write_text("not a folder\n")
    sp.save_npz(d / "not_square.npz", sp.random(30, 50, density=0.1, format="csr", random_state=0))
    return d


BAD_MATRICES = ["random.npz", "empty.npz", "zero.npz", "no_rows.npz", "no_nonzeros.npz", "not_a_matrix.npz",
                "array.npz", "column_out_of_range.npz", "bad_indptr.npz", "negative_shape.npz", "complex.npz",
                "strings.npz", "garbage.mtx", "promises_too_much.mtx", "too_many_rows.mtx",
                "fractional_indices.npz", "matrix.txt", "folder.npz", "fifo.npz", "zeros.npz",
                "no-such-file.npz", "no-such-shipped-matrix"]
MATRIX_COMMANDS = {"demo": ["demo", "--device", "cpu", "--matrix"], "tune": ["tune"], "bench": ["bench"],
                   "explain": ["explain"]}


@pytest.mark.parametrize("name", BAD_MATRICES)
@pytest.mark.parametrize("command", list(MATRIX_COMMANDS))
def test_a_bad_matrix_is_one_line(bad, capsys, command, name):
    code, out, err = _run(MATRIX_COMMANDS[command] + [str(bad / name) if "." in name else name], capsys)
    _assert_one_line(code, err, command)
    assert "matrix" in err and (name in err or "shipped" in err), err


def test_bench_checks_every_matrix_before_any_work(bad, capsys):
    code, out, err = _run(["bench", "cora", str(bad / "random.npz")], capsys)
    _assert_one_line(code, err, "bench")
    assert "random.npz" in err and "not a .npz archive" in err and out == ""


@pytest.mark.parametrize("value", ["-5", "0", "10**12", "1000000000000", "65537", "1.5", "abc", ""])
@pytest.mark.parametrize("command", ["demo", "tune cora", "bench cora", "explain cora"])
def test_n_out_of_range_is_one_line(capsys, command, value):
    code, out, err = _run(command.split() + ["--n", value], capsys)
    _assert_one_line(code, err, command.split()[0])
    assert f"--n: expected a positive integer up to {cli.MAX_N} (got {value!r})" in err


@pytest.mark.parametrize("value", ["-1", "0", "nan", "inf", "soon"])
@pytest.mark.parametrize("command", ["demo", "tune cora", "bench cora"])
def test_a_bad_budget_is_one_line(capsys, command, value):
    code, out, err = _run(command.split() + ["--budget-s", value], capsys)
    _assert_one_line(code, err, command.split()[0])
    assert f"--budget-s: expected a positive number of seconds (got {value!r})" in err


@pytest.mark.parametrize("value", ["nosuch", "meta", "cuda:99", "cpu:x"])
def test_a_bad_device_is_one_line(capsys, value):
    code, out, err = _run(["demo", "--device", value], capsys)
    _assert_one_line(code, err, "demo")
    assert "--device: expected" in err and repr(value) in err


def test_a_missing_gpu_is_one_line(capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    code, out, err = _run(["demo", "--device", "cuda"], capsys)
    _assert_one_line(code, err, "demo")
    code, out, err = _run(["bench", "cora"], capsys)
    _assert_one_line(code, err, "bench")
    assert "needs a CUDA GPU" in err


def test_demo_refuses_a_non_square_matrix_before_any_output(bad, capsys):
    code, out, err = _run(["demo", "--device", "cpu", "--matrix", str(bad / "not_square.npz")], capsys)
    _assert_one_line(code, err, "demo")
    assert "expected a square matrix" in err and "(got 30 x 50 in" in err and out == "", (out, err)


def test_tune_without_nvcc_says_so_before_any_work(monkeypatch, capsys):
    """The compile tier needs nvcc: without one, one line saying what is missing and how to get
    it, exit 2, instead of 0/30 candidates compiled and exit 1."""
    from torch_sparserl.evaluate import compile_tier
    from torch_sparserl.toolchain import nvcc

    def compile_only(spec, *args, **kwargs):
        raise AssertionError("compiled a candidate without nvcc")

    monkeypatch.setattr(nvcc, "nvcc_path", lambda: None)
    monkeypatch.setattr(compile_tier, "compile_only", compile_only)
    code, out, err = _run(["tune", "cora", "--compile-only"], capsys)
    _assert_one_line(code, err, "tune")
    assert "needs nvcc" in err and "install the CUDA toolkit" in err and "CUDA_HOME" in err and out == "", err


def test_fastpath_without_a_cuda_torch_is_status_2_like_bench(capsys):
    if torch.version.cuda is not None:
        pytest.skip("this torch has CUDA")
    code, out, err = _run(["fastpath"], capsys)
    _assert_one_line(code, err, "fastpath")
    assert "needs a CUDA build of torch" in err and "this torch has no CUDA" in err, err


@pytest.mark.parametrize("families, expected", [
    ("nosuchfamily", "expected comma-separated names among"),
    ("group_row,nosuchfamily", "(got 'nosuchfamily')"),
    ("group_row,", "(got '')"),
    ("", "(got '')"),
    ("vector_row", "expected families that serve spmm"),  # an SpMV family
])
def test_an_unknown_family_is_refused(capsys, families, expected):
    code, out, err = _run(["tune", "cora", "--families", families], capsys)
    _assert_one_line(code, err, "tune")
    assert "--families" in err and expected in err, err


@pytest.mark.parametrize("argv, command", [
    (["explain", "cora", "--dir", "{file}"], "explain"),
    (["cache", "list", "--dir", "{file}"], "cache"),
    (["cache", "info", "abc", "--dir", "{file}"], "cache"),
    (["cache", "clear", "--dir", "{file}"], "cache"),
    (["cache", "list", "--dir", "{file}/below"], "cache"),
    (["explain", "cora", "--dir", "{file}/below"], "explain"),
    (["bench", "cora", "--json", "{folder}"], "bench"),
    (["bench", "cora", "--json", "{folder}/no/such/folder/out.json"], "bench"),
])
def test_a_bad_folder_or_output_is_one_line(bad, capsys, argv, command):
    argv = [a.format(file=bad / "a_file", folder=bad) for a in argv]
    code, out, err = _run(argv, capsys)
    _assert_one_line(code, err, command)
    assert "expected" in err, err


@pytest.mark.parametrize("argv, command", [
    ([], ""), (["nosuchcommand"], ""), (["tune"], "tune"), (["tune", "cora", "--op", "sddmm"], "tune"),
    (["tune", "cora", "--dtype", "f64"], "tune"), (["bench", "cora", "--dtype", "f64"], "bench"),
    (["bench"], "bench"), (["explain", "cora", "--op", "spmv2"], "explain"), (["cache"], "cache"),
    (["cache", "purge"], "cache"), (["info", "extra"], ""), (["demo", "--no-such-flag"], ""),
])
def test_usage_errors_are_one_line(capsys, argv, command):
    code, out, err = _run(argv, capsys)
    _assert_one_line(code, err, command)


def test_cache_info_without_a_single_match_is_one_line(tmp_path, capsys):
    code, out, err = _run(["cache", "info", "zzzz", "--dir", str(tmp_path)], capsys)
    _assert_one_line(code, err, "cache")
    assert "expected one entry starting with 'zzzz', found 0" in err


# ---------------------------------------------------------------- broken cache folders
def _entry(root, name="0" * 64):
    kernels = root / "kernels"
    kernels.mkdir(parents=True, exist_ok=True)
    return kernels / f"{name}.json"


def _cache_file(tmp_path):
    (tmp_path / "cache").write_text("a file where the folder should be\n")
    return tmp_path / "cache"


def _kernels_file(tmp_path):
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "kernels").write_text("a file where the folder should be\n")
    return tmp_path / "cache"


def _fifo_entry(tmp_path):
    os.mkfifo(_entry(tmp_path / "cache"))
    return tmp_path / "cache"


def _dev_zero_entry(tmp_path):
    os.symlink("/dev/zero", _entry(tmp_path / "cache"))
    return tmp_path / "cache"


def _folder_entry(tmp_path):
    _entry(tmp_path / "cache").mkdir()
    return tmp_path / "cache"


BROKEN = {"cache folder is a file": _cache_file, "kernels folder is a file": _kernels_file,
          "FIFO entry": _fifo_entry, "/dev/zero entry": _dev_zero_entry, "folder entry": _folder_entry}


@pytest.mark.parametrize("argv", [["cache", "list"], ["cache", "info", "0000"], ["explain", "cora"]],
                         ids=" ".join)
@pytest.mark.parametrize("broken", list(BROKEN))
def test_a_broken_cache_folder_is_one_line(tmp_path, monkeypatch, capsys, broken, argv):
    monkeypatch.setenv("SPARSERL_CACHE_DIR", str(BROKEN[broken](tmp_path)))
    code, out, err = _run(argv, capsys)
    _assert_one_line(code, err, argv[0])
    assert "expected" in err, err


@pytest.mark.parametrize("content", ["{not json", "[" * 100000 + "]" * 100000], ids=["corrupt", "nested"])
def test_a_read_only_cache_with_a_corrupt_entry_is_listed(tmp_path, monkeypatch, capsys, content):
    """An entry that is a file but no entry (corrupt, or JSON nested too deeply to read) is
    listed as unreadable; the runtime and explain take it for a miss."""
    entry = _entry(tmp_path / "cache")
    entry.write_text(content)
    entry.parent.chmod(0o555)
    monkeypatch.setenv("SPARSERL_CACHE_DIR", str(tmp_path / "cache"))
    try:
        code, out, err = _run(["cache", "list"], capsys)
        assert code == 0 and "Traceback" not in err and "unreadable" in out, (out, err)
        code, out, err = _run(["explain", "cora"], capsys)
        assert code == 0 and "Traceback" not in err and "no decision in" in out, (out, err)
        code, out, err = _run(["cache", "info", "0000"], capsys)
        _assert_one_line(code, err, "cache")
        assert "expected JSON" in err
    finally:
        entry.parent.chmod(0o755)


def test_cache_clear_removes_a_fifo_entry(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SPARSERL_CACHE_DIR", str(_fifo_entry(tmp_path)))
    code, out, err = _run(["cache", "clear"], capsys)
    assert code == 0 and "removed 1 entries" in out, (out, err)


# ---------------------------------------------------------------- bugs and the real process
def test_a_bug_is_one_line_with_status_1_and_its_traceback_under_sparserl_debug(monkeypatch, capsys):
    def broken(args):
        raise AttributeError("a bug")

    from torch_sparserl.cli import info as info_command

    monkeypatch.setattr(info_command, "info", broken)
    code, out, err = _run(["info"], capsys)
    assert code == 1 and err.splitlines() == [
        "sparserl info: internal error, AttributeError: a bug (SPARSERL_DEBUG=1 shows its traceback)"]
    monkeypatch.setenv("SPARSERL_DEBUG", "1")
    with pytest.raises(AttributeError, match="a bug"):
        main(["info"])
    with pytest.raises(cli.CommandError, match="expected families that serve spmm"):  # an expected one too
        main(["tune", "cora", "--families", "vector_row"])


@pytest.mark.slow
def test_the_installed_command_prints_one_line(bad):
    env = {k: v for k, v in os.environ.items() if k != "SPARSERL_DEBUG"}
    for argv, command in [(["tune", "cora", "--n", "-5"], "tune"),
                          (["demo", "--device", "cpu", "--matrix", str(bad / "random.npz")], "demo"),
                          (["tune", "cora", "--families", "nosuchfamily"], "tune")]:
        done = subprocess.run([sys.executable, "-m", "torch_sparserl", *argv], capture_output=True, text=True,
                              timeout=300, env=env)
        assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
        assert done.stderr.startswith(f"sparserl {command}:") and len(done.stderr.splitlines()) == 1, done.stderr
    done = subprocess.run([sys.executable, "-m", "torch_sparserl", "demo", "--device", "cpu", "--matrix",
                           str(bad / "random.npz")], capture_output=True, text=True, timeout=300,
                          env={**env, "SPARSERL_DEBUG": "1"})
    assert done.returncode != 0 and "Traceback" in done.stderr and "not a .npz archive" in done.stderr


def test_the_help_names_sparserl_debug(capsys):
    """The top-level help is plain text (no reST markup) and its epilog documents the exit statuses."""
    code, out, err = _run(["--help"], capsys)
    assert code == 0 and "SPARSERL_DEBUG=1" in out
    assert "``" not in out and ":mod:" not in out, out
    epilog = " ".join(out.split())  # argparse wraps it
    assert "Exit status: 0 done; 1 a check failed" in epilog
    assert "2 a bad invocation, or a command that needs what this machine lacks (a CUDA GPU" in epilog


# ---------------------------------------------------------------- the cache commands (issue 50)
def _signed_entries(folder, count=3):
    """``count`` real entries, signed, in the cache folder ``folder``."""
    from torch_sparserl.jit.cache import CacheEntry, KernelCache
    from torch_sparserl.pattern.fingerprint import SpecializationKey

    source = ('// sparserl: op=spmm dtype=f32 block=32 grid=1\n'
              'extern "C" __global__ void sparserl_kernel(const int* rowptr) {}\n')
    cache = KernelCache(folder)
    return cache, [cache.put(CacheEntry(SpecializationKey(pattern=f"p{i}", op="spmm", n=32, dtype="f32",
                                                          arch="sm_90", policy="autotune"), source, reason="fastest"))
                   for i in range(count)]


@pytest.mark.parametrize("value", ["1e308", "inf", "-inf", "nan", "-1", "1048577", "1e999", "lots"])
def test_a_bad_prune_limit_is_one_line(tmp_path, capsys, value):
    code, out, err = _run(["cache", "prune", f"--max-mb={value}", "--dir", str(tmp_path)], capsys)
    _assert_one_line(code, err, "cache")
    assert f"--max-mb: expected a number of megabytes >= 0 and <= 1048576 (got {value!r})" in err


def test_cache_info_without_a_key_says_what_to_pass(tmp_path, capsys):
    code, out, err = _run(["cache", "info", "--dir", str(tmp_path)], capsys)
    _assert_one_line(code, err, "cache")
    assert "expected the KEY of an entry" in err and "sparserl cache list" in err and "None" not in err


@pytest.mark.parametrize("argv, expected", [
    (["cache", "list", "abc"], "list: expected no KEY (only `cache info KEY` takes one) (got 'abc')"),
    (["cache", "clear", "abc"], "clear: expected no KEY"),
    (["cache", "clear", "--max-mb", "3"], "clear: expected no --max-mb (only `cache prune` takes it) (got 3)"),
])
def test_a_cache_argument_the_action_does_not_take_is_refused(tmp_path, capsys, argv, expected):
    code, out, err = _run(argv + ["--dir", str(tmp_path)], capsys)
    _assert_one_line(code, err, "cache")
    assert expected in err


def test_cache_info_refuses_a_symlinked_entry_as_the_cache_does(tmp_path, capsys):
    cache, (path, *_) = _signed_entries(tmp_path / "kernels", 1)
    elsewhere = tmp_path / "elsewhere.json"
    path.rename(elsewhere)
    path.symlink_to(elsewhere)
    assert cache.listing()[0][1] is None  # the library's own reading refuses it
    code, out, err = _run(["cache", "info", path.stem[:8], "--dir", str(tmp_path / "kernels")], capsys)
    _assert_one_line(code, err, "cache")
    assert "a symbolic link, which the cache refuses to read" in err and out == "", (out, err)
    code, out, err = _run(["cache", "info", path.stem[:8], "--dir", str(tmp_path / "kernels")], capsys)
    assert path.is_symlink() and elsewhere.exists()  # info reads; it removes nothing


def _vanishing(monkeypatch, cache_class, how_many=1):
    """The next listings of any cache's entries lose an entry just after they are listed, as when
    another process's prune removes it then."""
    real = cache_class.entries
    left = [how_many]

    def entries(self):
        found = real(self)
        if left[0] and found:
            left[0] -= 1
            os.unlink(found[0])
        return found

    monkeypatch.setattr(cache_class, "entries", entries)


@pytest.mark.parametrize("argv", [["cache", "list"], ["explain", "cora"]], ids=" ".join)
def test_an_entry_removed_while_listing_is_left_out(tmp_path, monkeypatch, capsys, argv):
    from torch_sparserl.jit.cache import KernelCache

    cache, paths = _signed_entries(tmp_path, 3)
    _vanishing(monkeypatch, KernelCache)
    code, out, err = _run(argv + ["--dir", str(tmp_path)], capsys)
    assert code == 0 and err == "", (out, err)
    if argv[0] == "cache":
        assert out.startswith("2 entries in") and sum(path.stem in out for path in paths) == 2, out


def test_cache_info_of_an_entry_removed_meanwhile_is_one_line(tmp_path, monkeypatch, capsys):
    from torch_sparserl.jit.cache import KernelCache

    cache, (path,) = _signed_entries(tmp_path, 1)
    _vanishing(monkeypatch, KernelCache)
    code, out, err = _run(["cache", "info", path.stem[:8], "--dir", str(tmp_path)], capsys)
    _assert_one_line(code, err, "cache")
    assert "removed meanwhile" in err


def _read_only(monkeypatch, folder):
    """``folder`` read-only: its files cannot be removed (chmod does not stop root, so removal
    itself is refused, as a read-only mount refuses it)."""
    real = os.unlink

    def unlink(path, *args, **kwargs):
        if str(path).startswith(str(folder)):
            raise PermissionError(13, "Permission denied", str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(os, "unlink", unlink)
    return real


@pytest.mark.parametrize("argv", [["cache", "clear"], ["cache", "prune", "--max-mb", "0"]], ids=" ".join)
def test_a_read_only_cache_says_why_nothing_was_removed(tmp_path, monkeypatch, capsys, argv):
    cache, paths = _signed_entries(tmp_path, 3)
    _read_only(monkeypatch, tmp_path)
    code, out, err = _run(argv + ["--dir", str(tmp_path)], capsys)
    _assert_one_line(code, err, "cache")
    assert "3 could not be removed (Permission denied" in err, err
    assert err.rstrip().endswith("; 0 removed" if argv[1] == "clear" else "MB kept (limit 0 MB)"), err
    assert all(path.exists() for path in paths)


def test_cache_clear_says_which_built_kernels_it_could_not_remove(tmp_path, monkeypatch, capsys):
    from torch_sparserl.toolchain import cubins, paths, trust

    monkeypatch.setenv("SPARSERL_CACHE_DIR", str(tmp_path / "cache"))
    paths.forget_checks()
    trust.forget_keys()
    try:
        _signed_entries(tmp_path / "cache" / "kernels", 1)
        built = tmp_path / "cache" / cubins.FOLDER / f"{'a' * 64}.cubin"
        built.parent.mkdir(mode=0o700)
        built.write_bytes(b"cubin")
        writable = _read_only(monkeypatch, built.parent)
        code, out, err = _run(["cache", "clear"], capsys)
        _assert_one_line(code, err, "cache")
        assert "removed 1 entries" in out and "1 could not be removed" in err and "0 built kernels removed" in err
        assert built.exists()
        monkeypatch.setattr(os, "unlink", writable)
        code, out, err = _run(["cache", "clear"], capsys)
        assert code == 0 and "removed 1 built kernels" in out and not built.exists(), (out, err)
    finally:
        paths.forget_checks()
        trust.forget_keys()


def test_every_command_and_option_has_a_help_text():
    """Each command: a line in the command list and a description in its own --help; each of its
    options and arguments: a help text."""
    import argparse

    parser = cli._parser()
    commands = next(action for action in parser._actions if isinstance(action, argparse._SubParsersAction))
    listed = {choice.dest: choice.help for choice in commands._choices_actions}
    assert set(listed) == set(commands.choices) and len(listed) >= 7
    for name, command in commands.choices.items():
        assert listed[name] and command.description, name
        for action in command._actions:
            assert action.help, (name, action.option_strings or action.dest)


@pytest.mark.parametrize("command", [["tune", "cora"], ["bench", "cora"]])
@pytest.mark.parametrize("given, meant", [("float32", "float32"), ("f32", "float32"), ("float16", "float16"),
                                          ("f16", "float16"), ("bfloat16", "bfloat16"), ("bf16", "bfloat16")])
def test_dtype_has_one_documented_spelling_and_takes_both(command, given, meant):
    """tune took f32, bench float32: both take both, and document float32."""
    parser = cli._parser()
    assert parser.parse_args(command + ["--dtype", given]).dtype == meant
    assert parser.parse_args(command).dtype == "float32"


def test_tune_hands_the_abi_its_dtype_name(monkeypatch, capsys):
    from torch_sparserl.specialize import autotune
    from torch_sparserl.toolchain import nvcc

    asked = []
    monkeypatch.setattr(nvcc, "nvcc_path", lambda: "nvcc")
    monkeypatch.setattr(autotune, "candidates", lambda op, n, dtype, *rest: asked.append(dtype) or [])
    for given in ("bfloat16", "bf16"):
        code, out, err = _run(["tune", "cora", "--compile-only", "--dtype", given], capsys)
        assert code == 0 and "0/0 candidates compile cleanly" in out, (out, err)
    assert asked == ["bf16", "bf16"]
