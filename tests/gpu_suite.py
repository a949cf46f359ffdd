"""Run the GPU tests on the device: ``pytest -m gpu`` on every stage's folder, several at once.

The suite's folders mirror the package's stages (``tests/<stage>/``); a GPU run takes each folder
as one pytest process, up to ``--jobs`` at a time (the largest folders first, so that they do not
finish last), writes each folder's output to ``--out`` and prints one line per folder, then the
totals. Exit status: 0 when every folder passed, 1 otherwise.

    python tests/gpu_suite.py                      # every folder, 3 at a time
    python tests/gpu_suite.py jit ops --jobs 2     # some folders
    python tests/gpu_suite.py --out $OUT/gpu       # keep each folder's output
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

TESTS = Path(__file__).resolve().parent
SHARED = {"adversarial", "__pycache__"}  # folders of shared modules, no tests of a stage


def stage_folders() -> list[str]:
    """The suite's stage folders, by name."""
    return sorted(p.name for p in TESTS.iterdir() if p.is_dir() and p.name not in SHARED
                  and any(p.glob("test_*.py")))


def _size(folder: str) -> int:
    return sum(f.stat().st_size for f in (TESTS / folder).glob("test_*.py"))


def run(folder: str, out: Path, timeout_s: float) -> tuple[str, int, str, float]:
    """``pytest -m gpu`` on one folder: (folder, exit status, its summary line, seconds)."""
    started = time.perf_counter()
    log = out / f"{folder}.txt"
    with log.open("w") as sink:
        try:
            status = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider",
                                     str(TESTS / folder)], stdout=sink, stderr=subprocess.STDOUT,
                                    timeout=timeout_s, cwd=TESTS.parent).returncode
        except subprocess.TimeoutExpired:
            status = 124
    lines = log.read_text().splitlines()
    summary = next((line.strip("= ") for line in reversed(lines)
                    if re.search(r"\d+ (passed|failed|error|deselected|skipped)", line)), "no summary")
    if status == 124:
        summary = f"timed out after {timeout_s:.0f} s ({summary})"
    return folder, status, summary, time.perf_counter() - started


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folders", nargs="*", help=f"stage folders (default: all of {', '.join(stage_folders())})")
    parser.add_argument("--jobs", type=int, default=3, help="folders run at once (default 3)")
    parser.add_argument("--out", help="a folder for each folder's output (default: a temporary one)")
    parser.add_argument("--timeout-s", type=float, default=1800.0, help="per folder (default 1800)")
    args = parser.parse_args(argv)
    known = stage_folders()
    folders = args.folders or known
    unknown = sorted(set(folders) - set(known))
    if unknown:
        parser.error(f"unknown folder(s) {unknown}; expected some of {known}")
    if args.jobs < 1:
        parser.error(f"--jobs must be >= 1 (got {args.jobs})")
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="sparserl-gpu-"))
    out.mkdir(parents=True, exist_ok=True)
    order = sorted(folders, key=_size, reverse=True)
    failed = 0
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        for folder, status, summary, seconds in pool.map(lambda f: run(f, out, args.timeout_s), order):
            failed += status not in (0, 5)  # 5: nothing selected (a folder without GPU tests)
            print(f"{folder:<14} {'ok  ' if status in (0, 5) else 'FAIL'} {seconds:6.0f} s  {summary}", flush=True)
    print(f"{len(folders) - failed} of {len(folders)} folders passed; output in {out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
