"""The kernel cache's trust model: a private folder, signed entries, device code only, verified
libraries, locks that follow no symbolic link (issue 33, class 7)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

from torch_sparserl.abi import PlanError, check_source
from torch_sparserl.jit.cache import CacheEntry, KernelCache
from torch_sparserl.pattern.fingerprint import SpecializationKey
from torch_sparserl.toolchain import paths, trust

KEY = SpecializationKey(pattern="abc", op="spmm", n=32, dtype="f32", arch="sm_90", policy="autotune")
SOURCE = ('// sparserl: op=spmm dtype=f32 block=32 grid=1\n'
          'extern "C" __global__ void sparserl_kernel(const int* rowptr) {}\n')


@pytest.fixture
def private_cache(tmp_path, monkeypatch):
    """A fresh private cache folder (and key) of this test's own."""
    root = tmp_path / "cache"
    monkeypatch.setenv("SPARSERL_CACHE_DIR", str(root))
    paths.forget_checks()
    trust.forget_keys()
    yield root
    paths.forget_checks()
    trust.forget_keys()


def _entry(source=SOURCE):
    return CacheEntry(KEY, source, family="group_row", params={"lanes": 8}, reason="fastest")


def test_the_default_cache_folder_is_created_private(private_cache):
    KernelCache()
    assert (os.stat(private_cache).st_mode & 0o777) == 0o700
    key_file = private_cache / trust.KEY_NAME
    assert (os.stat(key_file).st_mode & 0o777) == 0o600 and len(key_file.read_bytes()) == trust.KEY_BYTES


@pytest.mark.parametrize("mode", [0o770, 0o757, 0o777])
def test_a_cache_folder_others_can_write_is_refused_with_a_message(private_cache, mode, caplog):
    private_cache.mkdir()
    os.chmod(private_cache, mode)
    with pytest.raises(paths.CacheDirError) as refused:
        paths.cache_dir()
    message = str(refused.value)
    assert str(private_cache) in message and "group or others can write" in message
    assert f"({mode:o})" in message and "expected a folder owned by uid" in message
    paths.forget_checks()
    caplog.clear()
    cache = KernelCache()  # the library's use: no disk cache, one warning
    assert not cache.disk and cache.get(KEY) is None
    cache.put(_entry())
    assert cache.get(KEY).family == "group_row"  # memory only
    assert not list(private_cache.iterdir())
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "refusing the kernel cache folder" in warnings[0].getMessage()


def test_a_symlinked_cache_folder_is_refused(private_cache, tmp_path):
    real = tmp_path / "elsewhere"
    real.mkdir(mode=0o700)
    private_cache.symlink_to(real)
    with pytest.raises(paths.CacheDirError, match="symbolic link"):
        paths.cache_dir()


def test_a_cache_folder_of_another_user_is_refused(private_cache, monkeypatch):
    private_cache.mkdir(mode=0o700)
    monkeypatch.setattr(os, "getuid", lambda: os.stat(private_cache).st_uid + 1)
    with pytest.raises(paths.CacheDirError, match="belongs to another user"):
        paths.cache_dir()


def test_a_forged_entry_is_rejected_and_removed(private_cache, caplog):
    cache = KernelCache()
    path = cache.put(_entry())
    document = json.loads(path.read_text())
    document["payload"]["params"] = {"lanes": 16}  # what a writer without the key can do
    import hashlib

    from torch_sparserl.jit.cache import _canonical

    document["hmac_sha256"] = hashlib.sha256(_canonical(document["payload"])).hexdigest()
    path.write_text(json.dumps(document))
    fresh = KernelCache()
    assert fresh.get(KEY) is None and not path.exists() and fresh.stats["rejected"] == 1
    assert "bad signature" in caplog.text


def test_an_unsigned_entry_of_the_old_format_is_rejected(private_cache, caplog):
    cache = KernelCache()
    path = cache.put(_entry())
    payload = json.loads(path.read_text())["payload"]
    import hashlib

    from torch_sparserl.jit.cache import _canonical

    path.write_text(json.dumps({"format": 1, "sha256": hashlib.sha256(_canonical(payload)).hexdigest(),
                                "payload": payload}))
    assert KernelCache().get(KEY) is None and not path.exists()
    assert "format 1, expected 2" in caplog.text


def test_an_entry_signed_with_another_key_is_rejected(private_cache):
    path = KernelCache().put(_entry())
    (private_cache / trust.KEY_NAME).unlink()  # another user's (or machine's) key signed it
    trust.forget_keys()
    assert KernelCache().get(KEY) is None and not path.exists()


HOSTILE = {
    "constructor attribute": '__attribute__((constructor)) static void pwn() {}',
    "host function": 'int pwn() { return 0; }',
    "extern C host function": 'extern "C" int pwn() { return 0; }',
    "static initializer": 'static int pwned = 1;',
    "global constructor": 'struct Pwn { Pwn() {} } pwn;',
    "asm": '__device__ void f() { asm("trap;"); }',
    "host header": '#include <cstdlib>',
    "__host__": '__host__ __device__ int f() { return 0; }',
    "pragma": '#pragma GCC diagnostic ignored "-Wall"',
    "macro hiding the qualifier": '#define HIDE(x)\nHIDE(__device__) int pwn() { return 0; }',
    "conditional qualifier": '#if 0\n__device__\n#endif\nint pwn() { return 0; }',
    "redefined qualifier": '#define __device__\n__device__ int pwn() { return 0; }',
    "digraph include": '%:include <cstdlib>',
    "line splice": '// \\\nint pwn() { return 0; }',
    "C++ attribute": '[[gnu::constructor]] int pwn() { return 0; }',
    "line comment ended by a lone CR": '// note\rint pwn() { return 0; }',
    "line comment ended by CR LF": '// note\r\nint pwn() { return 0; }',
    "form feed": '__device__ int f() {\f return 0; }',
    "NUL": '__device__ int f() { return 0; }\x00int pwn() { return 0; }',
    "Unicode line separator": '// note\u2028int pwn() { return 0; }',
}


@pytest.mark.parametrize("code", HOSTILE.values(), ids=HOSTILE.keys())
def test_an_entry_with_host_code_is_rejected_even_when_signed(private_cache, code, caplog):
    hostile = SOURCE + code + "\n"
    with pytest.raises(PlanError, match="not device code only|not allowed"):
        check_source(hostile)
    path = KernelCache().put(_entry(hostile))  # signed with the user's own key
    fresh = KernelCache()
    assert fresh.get(KEY) is None and not path.exists()
    assert "fails the ABI check" in caplog.text


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_nvcc_ends_a_line_comment_at_a_lone_carriage_return(tmp_path):
    """Why a lone CR is refused: the compiler reads the code after it as code, where a scan that
    ends lines at \\n alone would read it as the rest of a comment."""
    source = tmp_path / "k.cu"
    source.write_bytes(b"// note\rint pwn() { return 0; }\n")
    done = subprocess.run(["nvcc", "-E", str(source)], capture_output=True, timeout=120)
    assert done.returncode == 0 and b"int pwn" in done.stdout


def test_every_shipped_family_renders_device_code_only():
    from torch_sparserl.specialize import families

    checked = 0
    for op in families.OPS:
        for dtype in families.DTYPE_CODES:
            for n in ((1,) if op == "spmv" else (1, 8, 32, 64, 128)):
                for family, params in families.space(op, dtype, n):
                    for compact in (False, True):
                        check_source(families.render(family, params, op=op, dtype=dtype, n=n,
                                                     compact=compact).source)
                        checked += 1
                    if family in families.EPILOGUE_FAMILIES and op == "spmm":
                        check_source(families.render(family, {**params, "epilogue": "scale+bias+relu"},
                                                     op=op, dtype=dtype, n=n).source)
    assert checked > 500
    assert set(f'"{name}"' for name in families.HEADERS) <= __import__("torch_sparserl.abi").abi.DEVICE_INCLUDES


def test_a_policy_sample_with_host_code_is_a_plan_failure():
    from torch_sparserl.abi import KernelSpec
    from torch_sparserl.evaluate.compile_tier import compile_only
    from torch_sparserl.evaluate.record import ErrorKind

    record = compile_only(KernelSpec(SOURCE + "int pwn() { return 0; }\n"))
    assert record.error_kind == ErrorKind.PLAN and "device code" in record.log


# ------------------------------------------------------------------ libraries

def _planted(folder, name):
    folder.mkdir(parents=True)
    library = folder / f"{name}.so"
    library.write_bytes(b"\x7fELF planted")
    (folder / f"{name}.ok").write_text(name)  # the marker of the old format: no keyed digest
    return library


def test_a_planted_kernel_library_is_rebuilt_not_loaded(private_cache, tmp_path, monkeypatch):
    from torch_sparserl.specialize import families
    from torch_sparserl.toolchain import inline

    spec = families.render("group_row", {}, op="spmm", dtype="f32", n=32)
    name, folder, library, done = inline._paths([spec], "sm_90", tmp_path)
    _planted(folder, name)
    loaded, built = [], []

    def fake_compile(**kwargs):  # torch's builder: writes the library it was asked for
        built.append(kwargs["name"])
        assert not library.exists(), "the planted library must be gone before a rebuild"
        library.write_bytes(b"\x7fELF built here")

    import torch.utils.cpp_extension as cpp

    monkeypatch.setattr(cpp, "load", fake_compile)
    monkeypatch.setattr(inline, "_load", lambda path: loaded.append(open(path, "rb").read()) or object())
    monkeypatch.setattr(inline, "_bind", lambda lib, spec: spec.key)
    assert not inline.is_built([spec], "sm_90", directory=tmp_path)
    assert inline.build([spec], "sm_90", directory=tmp_path) == {spec.key: spec.key}
    assert built == [name] and loaded == [b"\x7fELF built here"]
    assert inline.is_built([spec], "sm_90", directory=tmp_path)
    inline.build([spec], "sm_90", directory=tmp_path)  # verified now: loaded without a build
    assert built == [name] and loaded == [b"\x7fELF built here"] * 2


def test_a_planted_fast_path_library_is_not_loaded(private_cache, monkeypatch):
    from torch_sparserl.jit import fastpath

    library, done = fastpath.library()
    _planted(library.parent, library.stem)
    opened = []
    monkeypatch.setattr(fastpath, "_load_library",
                        lambda name, path: opened.append(name) or type("Module", (), {"serve": print, "intake": len}))
    monkeypatch.setattr(fastpath, "loaded", False)
    monkeypatch.setattr(fastpath, "serve", None)
    monkeypatch.setattr(fastpath.device_check, "_DOOR", None)
    assert not fastpath.is_built() and fastpath._load() is False and opened == []
    trust.write_marker(library, done)  # what a build by this user records
    assert fastpath.is_built()
    monkeypatch.setattr(fastpath.torch.ops, "sparserl_fastpath", type("Ops", (), {"bind_counters": print}),
                        raising=False)
    assert fastpath._load() is True and opened == [library.stem] and fastpath.serve is print
    assert fastpath.device_check._DOOR is len  # ts.csr's door into the library


# ------------------------------------------------------------------ locks

@pytest.mark.parametrize("which", ["cache", "build"])
def test_a_symlinked_lock_is_not_followed_nor_its_target_truncated(tmp_path, which):
    from torch_sparserl.toolchain import inline

    target = tmp_path / "precious"
    target.write_text("keep me")
    folder = tmp_path / "folder"
    folder.mkdir()
    if which == "cache":
        cache = KernelCache(folder)
        cache.lock_path(KEY).symlink_to(target)
        assert cache.get_or_create(KEY, lambda key: _entry()).family == "group_row"  # memory only, no raise
    else:
        (folder / inline.LOCK_NAME).symlink_to(target)
        with pytest.raises(OSError):
            with inline.exclusive(folder):
                pass
    assert target.read_text() == "keep me"


def test_libraries_loaded_one_after_another_keep_their_own_symbols(tmp_path):
    """Each verified library is loaded from a memory file of its own that stays open: dlopen
    knows a library by its path, so a reused /proc/self/fd/N would hand back the first
    library, without the second's symbols (seen on the H100: 'undefined symbol')."""
    import ctypes
    import shutil
    import subprocess

    from torch_sparserl.toolchain.inline import load_verified

    if shutil.which("gcc") is None:
        pytest.skip("needs gcc to build two shared libraries")
    loaded = []
    for i in range(3):
        source = tmp_path / f"lib{i}.c"
        source.write_text(f"int sparserl_test_{i}(void) {{ return {i + 40}; }}\n")
        library = tmp_path / f"lib{i}.so"
        subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(library), str(source)], check=True)
        lib = load_verified(library, library.read_bytes(), lambda path: ctypes.CDLL(path))
        loaded.append((i, lib))
    for i, lib in loaded:
        assert getattr(lib, f"sparserl_test_{i}")() == i + 40


@pytest.mark.skipif(not hasattr(os, "memfd_create") or not os.path.isdir("/proc/self/fd"),
                    reason="memory files (memfd_create, /proc/self/fd) are Linux-only")
def test_a_library_is_loaded_from_a_sealed_memory_file(tmp_path, monkeypatch):
    """The verified bytes are the bytes dlopen maps: the memory file they are copied to refuses
    any write, growth, shrinking or new seal afterwards."""
    import errno
    import fcntl

    data = os.urandom(4096)
    loaded = []
    monkeypatch.setattr(trust, "_LOADED_FDS", loaded)  # closed below, not kept for the process
    path, _ = trust.loadable_path(tmp_path / "libx.so", data)
    assert path.startswith("/proc/self/fd/") and len(loaded) == 1
    fd = loaded[0]
    try:
        assert path == f"/proc/self/fd/{fd}"
        want = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL
        assert fcntl.fcntl(fd, fcntl.F_GET_SEALS) & want == want
        with open(path, "rb") as handle:
            assert handle.read() == data

        def write_through_the_path():
            other = os.open(path, os.O_WRONLY)
            try:
                os.pwrite(other, b"planted", 0)
            finally:
                os.close(other)

        attempts = {
            "write": lambda: os.pwrite(fd, b"planted", 0),
            "write through the path": write_through_the_path,
            "grow": lambda: os.ftruncate(fd, len(data) + 4096),
            "shrink": lambda: os.ftruncate(fd, 16),
            "change the seals": lambda: fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE),
        }
        for what, attempt in attempts.items():
            with pytest.raises(PermissionError) as caught:
                attempt()
            assert caught.value.errno == errno.EPERM, what
        assert os.fstat(fd).st_size == len(data)
        with open(path, "rb") as handle:
            assert handle.read() == data
    finally:
        os.close(fd)


def test_a_platform_without_seals_still_gets_the_verified_bytes(tmp_path, monkeypatch):
    """Where ``fcntl`` has no seals, the library is still loaded from a path holding exactly the verified bytes."""
    import fcntl

    monkeypatch.delattr(fcntl, "F_ADD_SEALS", raising=False)
    data = os.urandom(1024)
    loaded = []
    monkeypatch.setattr(trust, "_LOADED_FDS", loaded)
    library = tmp_path / "libx.so"
    library.write_bytes(data)
    path, _ = trust.loadable_path(library, data)
    try:
        with open(path, "rb") as handle:
            assert handle.read() == data
    finally:
        for fd in loaded:
            os.close(fd)
