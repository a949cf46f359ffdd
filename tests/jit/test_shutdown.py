"""A process that exits while the runtime specializes in the background exits silently and
leaves no half-written cache entry (issue 33, class 8)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from torch_sparserl.config import JitOptions

from helpers import REPO

SCRIPT = textwrap.dedent('''
    import sys, time, warnings
    warnings.simplefilter("ignore")
    from concurrent.futures import ThreadPoolExecutor
    import torch
    from torch_sparserl import pattern as patterns
    from torch_sparserl.config import JitOptions
    from torch_sparserl.jit import runtime as rt
    from torch_sparserl.jit.cache import CacheEntry, KernelCache

    SOURCE = ('// sparserl: op=spmm dtype=f32 block=32 grid=1\\n'
              'extern "C" __global__ void sparserl_kernel(const int* rowptr) {}\\n')
    KEEPER = ThreadPoolExecutor(max_workers=1)  # what pattern.run_kept's pool does on CUDA

    class Specializer:  # slow enough that exit finds searches queued and one under way
        policy_id = "autotune"
        def __call__(self, key, crow, col, ncols):
            time.sleep(0.3)
            return CacheEntry(key, SOURCE, family="fake", params={}, reason="2.0x cuSPARSE")
        def prebuild(self, entry, arch):  # the library's build, after an interim install
            time.sleep(0.2)
        def close(self):
            pass

    def installer(entry, crow, col, ncols):
        rows = crow.numel() - 1
        launch = lambda crow, col, val, X: torch.sparse_csr_tensor(crow, col, val, (rows, ncols)).to_dense() @ X
        return KEEPER.submit(lambda: launch).result()

    runtime = rt.Runtime(JitOptions(mode="background", admit_age_s=0), cache=KernelCache(sys.argv[1]),
                         specializer=Specializer(), installer=installer, interim_installer=installer,
                         devices=("cpu",))
    rt.set_active(runtime)
    kept = []
    for seed in range(4):
        torch.manual_seed(seed)
        S = (torch.rand(40, 40) < 0.1).float().to_sparse_csr()
        crow, col, val = S.crow_indices(), S.col_indices(), S.values()
        kept.append(S)
        for width in (4, 8, 16):
            assert runtime.call("spmm", patterns.lookup(crow, col, 40), crow, col, val, torch.randn(40, width)) is None
    time.sleep(float(sys.argv[2]))
''')


@pytest.mark.parametrize("linger_s", [0.0, 0.45, 1.0])
def test_exit_while_specializing_is_silent_and_leaves_no_partial_entry(tmp_path, linger_s, monkeypatch):
    script = tmp_path / "exit_now.py"
    script.write_text(SCRIPT)
    cache = tmp_path / "kernels"
    env = {**os.environ, "PYTHONPATH": str(REPO), "SPARSERL_CACHE_DIR":
           str(tmp_path / "private")}
    done = subprocess.run([sys.executable, str(script), str(cache), str(linger_s)], capture_output=True, text=True,
                          timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    names = sorted(p.name for p in cache.iterdir())
    assert not [n for n in names if n.startswith(".tmp-")]  # no write left half done
    entries = [n for n in names if n.endswith(".json")]
    from torch_sparserl.jit.cache import KernelCache
    from torch_sparserl.toolchain import paths, trust

    monkeypatch.setenv("SPARSERL_CACHE_DIR", str(tmp_path / "private"))  # the child's key
    paths.forget_checks()
    trust.forget_keys()
    try:
        listing = KernelCache(cache).listing()
        assert len(listing) == len(entries) and all(entry is not None for _, entry, _ in listing)  # whole, signed
    finally:
        paths.forget_checks()
        trust.forget_keys()


def test_work_submitted_after_exit_began_is_dropped(tmp_path):
    from torch_sparserl.jit import runtime as rt
    from torch_sparserl.jit.cache import KernelCache

    runtime = rt.Runtime(JitOptions(mode="background", admit_age_s=0), cache=KernelCache(tmp_path),
                         specializer=lambda *a: None, devices=("cpu",))
    runtime._stop_for_exit()
    future = runtime._in_background(lambda: 1 / 0)
    assert future.cancelled() and not runtime.busy
    runtime.wait(5)  # no error, no wait
