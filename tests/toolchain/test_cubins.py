"""The cubin cache: a build is kept once, signed, and loaded after; anything else in its folder
is refused, never handed to the driver (toolchain/cubins.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from torch_sparserl.toolchain import cubins, driver, nvrtc, paths, trust

ARCH = "sm_90"
OPTIONS = ["--gpu-architecture=sm_90", "-std=c++17"]
SOURCE = 'extern "C" __global__ void sparserl_kernel(float* y) { y[threadIdx.x] = 1.0f; }\n'


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A fresh private cache folder and key; NVRTC's version fixed so that no library is needed."""
    root = tmp_path / "cache"
    monkeypatch.setenv("SPARSERL_CACHE_DIR", str(root))
    monkeypatch.delenv("SPARSERL_CACHE_CUBINS", raising=False)
    monkeypatch.setattr(cubins, "nvrtc_version", lambda: "13.0")
    monkeypatch.setattr(cubins, "_warned", False)
    paths.forget_checks()
    trust.forget_keys()
    yield root
    paths.forget_checks()
    trust.forget_keys()


def _only_entry(root):
    (entry,) = [p for p in (root / cubins.FOLDER).iterdir() if not p.name.startswith(".")]
    return entry


def test_a_stored_build_is_found_with_its_log(cache):
    assert cubins.lookup(SOURCE, ARCH, OPTIONS) is None
    assert cubins.store(SOURCE, ARCH, OPTIONS, b"\x7fELF-cubin-bytes", "ptxas info: 10 registers")
    assert cubins.lookup(SOURCE, ARCH, OPTIONS) == (b"\x7fELF-cubin-bytes", "ptxas info: 10 registers")
    entry = _only_entry(cache)
    assert (os.stat(entry).st_mode & 0o777) == 0o600
    assert (os.stat(cache / cubins.FOLDER).st_mode & 0o777) == 0o700
    assert cubins.count() == (1, entry.stat().st_size)


@pytest.mark.parametrize("change", [
    {"source": SOURCE + "// another\n"}, {"arch": "sm_80"}, {"options": [*OPTIONS, "-lineinfo"]}])
def test_a_build_is_found_only_for_the_same_source_arch_and_options(cache, change):
    cubins.store(SOURCE, ARCH, OPTIONS, b"cubin", "")
    asked = {"source": SOURCE, "arch": ARCH, "options": OPTIONS, **change}
    assert cubins.lookup(asked["source"], asked["arch"], asked["options"]) is None


def test_another_nvrtc_version_misses(cache, monkeypatch):
    cubins.store(SOURCE, ARCH, OPTIONS, b"cubin", "")
    monkeypatch.setattr(cubins, "nvrtc_version", lambda: "13.1")
    assert cubins.lookup(SOURCE, ARCH, OPTIONS) is None


def _tampered(data: bytes) -> bytes:
    return data[:-80] + bytes([data[-80] ^ 1]) + data[-79:]


@pytest.mark.parametrize("how", ["flipped byte", "truncated", "other key", "empty", "other entry", "garbage"])
def test_a_changed_or_planted_entry_is_refused_and_removed(cache, how, caplog):
    cubins.store(SOURCE, ARCH, OPTIONS, b"cubin-bytes" * 10, "log")
    entry = _only_entry(cache)
    data = entry.read_bytes()
    if how == "flipped byte":
        data = _tampered(data)
    elif how == "truncated":
        data = data[:len(data) // 2]
    elif how == "other key":  # signed, but not with this user's key
        name = entry.name
        data = cubins._encode(name, b"planted", "log", b"k" * trust.KEY_BYTES)
    elif how == "empty":
        data = b""
    elif how == "other entry":  # a genuine entry of another source, under this name
        cubins.store(SOURCE + "//x\n", ARCH, OPTIONS, b"other", "log")
        other = [p for p in (cache / cubins.FOLDER).iterdir() if p != entry][0]
        data = other.read_bytes()
    else:
        data = os.urandom(300)
    entry.write_bytes(data)
    assert cubins.lookup(SOURCE, ARCH, OPTIONS) is None
    assert not entry.exists()
    assert any("refusing" in r.getMessage() and entry.name in r.getMessage() for r in caplog.records)


def test_a_symbolic_link_or_a_readable_entry_is_refused(cache, tmp_path):
    cubins.store(SOURCE, ARCH, OPTIONS, b"cubin", "log")
    entry = _only_entry(cache)
    os.chmod(entry, 0o644)
    assert cubins.lookup(SOURCE, ARCH, OPTIONS) is None
    cubins.store(SOURCE, ARCH, OPTIONS, b"cubin", "log")
    real = tmp_path / "elsewhere.cubin"
    os.replace(entry, real)
    os.symlink(real, entry)
    assert cubins.lookup(SOURCE, ARCH, OPTIONS) is None
    assert not os.path.lexists(entry) and real.exists()


def test_a_fifo_in_place_of_an_entry_does_not_block(cache):
    cubins.store(SOURCE, ARCH, OPTIONS, b"cubin", "log")
    entry = _only_entry(cache)
    entry.unlink()
    os.mkfifo(entry, 0o600)
    assert cubins.lookup(SOURCE, ARCH, OPTIONS) is None


def test_no_cache_without_a_private_folder_or_when_switched_off(cache, monkeypatch):
    monkeypatch.setenv("SPARSERL_CACHE_CUBINS", "0")
    assert not cubins.store(SOURCE, ARCH, OPTIONS, b"cubin", "")
    assert cubins.lookup(SOURCE, ARCH, OPTIONS) is None
    assert not (cache / cubins.FOLDER).exists()
    monkeypatch.delenv("SPARSERL_CACHE_CUBINS")
    cache.mkdir(mode=0o700)
    os.chmod(cache, 0o777)  # others could plant a cubin: no disk cache at all
    paths.forget_checks()
    assert not cubins.store(SOURCE, ARCH, OPTIONS, b"cubin", "")
    assert cubins.lookup(SOURCE, ARCH, OPTIONS) is None
    assert not (cache / cubins.FOLDER).exists()


def test_a_cubin_folder_others_can_write_is_not_used(cache):
    cubins.store(SOURCE, ARCH, OPTIONS, b"cubin", "")
    os.chmod(cache / cubins.FOLDER, 0o777)
    assert cubins.lookup(SOURCE, ARCH, OPTIONS) is None
    assert not cubins.store(SOURCE + "//2\n", ARCH, OPTIONS, b"cubin", "")


def test_the_least_recently_used_entries_go_past_the_cap(cache, monkeypatch):
    monkeypatch.setattr(cubins, "MAX_ENTRIES", 8)
    sources = [SOURCE + f"// {i}\n" for i in range(8)]
    for i, source in enumerate(sources):
        cubins.store(source, ARCH, OPTIONS, b"cubin", "")
        os.utime(cache / cubins.FOLDER / cubins.entry_name(source, ARCH, OPTIONS), (1000 + i, 1000 + i))
    assert cubins.lookup(sources[0], ARCH, OPTIONS) is not None  # a hit makes it the most recent
    cubins.store(SOURCE + "// new\n", ARCH, OPTIONS, b"cubin", "")  # the ninth: down to 6
    assert cubins.count()[0] == 6
    kept = [s for s in sources if cubins.lookup(s, ARCH, OPTIONS) is not None]
    assert kept == [sources[0], *sources[4:]]


def test_compile_reads_the_cache_and_compiles_once(cache, monkeypatch):
    calls = []

    def fake_compile(source, arch, name="kernel.cu"):
        calls.append(source)
        return b"cubin:" + source.encode(), "ptxas info: 0 bytes spill"

    monkeypatch.setattr(driver, "nvrtc_compile", fake_compile)
    monkeypatch.setattr(driver, "include_dirs", lambda: ("/cuda/include",))
    first = nvrtc.compile(SOURCE, ARCH)
    second = nvrtc.compile(SOURCE, ARCH)
    assert calls == [SOURCE]
    assert first[:2] == second[:2] == (b"cubin:" + SOURCE.encode(), "ptxas info: 0 bytes spill")
    monkeypatch.setenv("SPARSERL_CACHE_CUBINS", "off")
    nvrtc.compile(SOURCE, ARCH)
    assert calls == [SOURCE, SOURCE]


def test_a_failed_build_is_not_kept(cache, monkeypatch):
    from torch_sparserl.toolchain.errors import CompileError

    def failing(source, arch, name="kernel.cu"):
        raise CompileError("NVRTC: compilation failed (6)", log="error: expected a ;")

    monkeypatch.setattr(driver, "nvrtc_compile", failing)
    for _ in range(2):
        with pytest.raises(CompileError):
            nvrtc.compile(SOURCE, ARCH)
    assert cubins.count() == (0, 0)


def _has_nvrtc() -> bool:
    try:
        driver.nvrtc()
        return True
    except Exception:  # noqa: BLE001
        return False


# NVRTC compiles without a GPU: the test runs wherever libnvrtc loads (torch's, a CUDA
# toolkit's, the nvidia-cuda-nvrtc wheel's), GPU or not
@pytest.mark.skipif(not _has_nvrtc(), reason="needs libnvrtc (torch's, a CUDA toolkit's or nvidia-cuda-nvrtc's)")
def test_a_real_build_is_loaded_from_the_cache_byte_for_byte(cache, monkeypatch):
    monkeypatch.undo()  # NVRTC's real version, and the fixture's folder again
    monkeypatch.setenv("SPARSERL_CACHE_DIR", str(cache))
    paths.forget_checks()
    trust.forget_keys()
    cubin, log, _ = nvrtc.compile(SOURCE, ARCH)
    again = nvrtc.compile(SOURCE, ARCH)
    assert again[:2] == (cubin, log) and cubin[:4] == b"\x7fELF"
    assert cubins.count()[0] == 1


def test_cache_clear_on_the_command_line_removes_the_cubins(cache):
    cubins.store(SOURCE, ARCH, OPTIONS, b"cubin", "")
    env = {**os.environ, "SPARSERL_CACHE_DIR": str(cache)}
    out = subprocess.run([sys.executable, "-m", "torch_sparserl", "cache", "clear"], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "removed 1 built kernels" in out.stdout
    assert cubins.count() == (0, 0)


def test_a_new_key_refuses_every_entry_with_one_warning(cache, caplog):
    sources = [SOURCE + f"// {i}\n" for i in range(3)]
    for source in sources:
        cubins.store(source, ARCH, OPTIONS, b"cubin", "")
    (cache / trust.KEY_NAME).unlink()
    trust.forget_keys()
    caplog.set_level("DEBUG", logger="torch_sparserl.toolchain.cubins")
    assert all(cubins.lookup(s, ARCH, OPTIONS) is None for s in sources)
    refusals = [r for r in caplog.records if "refusing" in r.getMessage()]
    assert [r.levelname for r in refusals] == ["WARNING", "DEBUG", "DEBUG"]
    assert cubins.count() == (0, 0)
