"""tests/gpu_suite.py, the device's GPU run, on the CPU: it finds the stage folders, runs the ones
asked for as separate pytest processes, and reports one line per folder (no GPU: all skipped)."""

import subprocess
import sys

from helpers import TESTS


def test_the_gpu_suite_runs_each_folder_and_reports(tmp_path):
    sys.path.insert(0, str(TESTS))
    import gpu_suite

    assert {"jit", "ops", "compiler", "repo"} <= set(gpu_suite.stage_folders())
    assert "adversarial" not in gpu_suite.stage_folders()
    done = subprocess.run([sys.executable, str(TESTS / "gpu_suite.py"), "abi", "config", "--jobs", "2",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert {line.split()[0] for line in lines[:2]} == {"abi", "config"} and all(" ok " in line for line in lines[:2])
    assert lines[-1].startswith("2 of 2 folders passed")
    assert (tmp_path / "abi.txt").exists() and (tmp_path / "config.txt").exists()
    wrong = subprocess.run([sys.executable, str(TESTS / "gpu_suite.py"), "nosuch"], capture_output=True, text=True)
    assert wrong.returncode == 2 and "unknown folder(s) ['nosuch']" in wrong.stderr
