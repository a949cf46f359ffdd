#!/usr/bin/env python3
"""Pack training runs for transport or shipping: each policy in float16 (about 11 MB) with
its stage's metrics, one ``.tar.gz`` per run; the trainer state (optimizer) is left out.

    python training/export.py training/runs/sft training/runs/rl --out $OUT
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tarfile
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def export(run: Path, out: Path) -> Path:
    from torch_sparserl.specialize.policy.model import KernelPolicy

    run = Path(run)
    with tempfile.TemporaryDirectory() as tmp:
        stage = Path(tmp) / run.name
        stage.mkdir()
        if (run / "policy").exists():
            KernelPolicy.load(run / "policy").save(stage / "policy")
        for extra in run.glob("*.jsonl"):
            shutil.copy(extra, stage / extra.name)
        target = Path(out) / f"{run.name}.tar.gz"
        with tarfile.open(target, "w:gz") as tar:
            tar.add(stage, arcname=run.name)
    return target


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for run in args.runs:
        if run.exists():
            print(export(run, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
