"""Shared pieces of the training stages: dataclass arguments, JSONL metrics, resumable
checkpoints, time budgets, the training patterns."""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
import time
import typing
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


# ------------------------------------------------------------------------ arguments


def parse_args(cls, argv: list[str] | None = None, description: str | None = None):
    """An instance of the dataclass ``cls`` from ``--kebab-case`` options (defaults from ``cls``)."""
    parser = argparse.ArgumentParser(description=description or (cls.__doc__ or "").strip().splitlines()[0])
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        name = "--" + f.name.replace("_", "-")
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        origin = typing.get_origin(kind)
        if kind is bool:
            parser.add_argument(name, action=argparse.BooleanOptionalAction, default=default)
        elif origin in (list, tuple):
            inner = typing.get_args(kind)[0]
            parser.add_argument(name, type=inner, nargs="*", default=default)
        else:
            base = next((a for a in typing.get_args(kind) if a is not type(None)), kind) if origin else kind
            parser.add_argument(name, type=base, default=default,
                                required=f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
    ns = parser.parse_args(argv)
    return cls(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(cls)})


def pick_device(name: str = "auto") -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def set_seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


# ------------------------------------------------------------------------ metrics


class Metrics:
    """Appends one JSON object per line: ``{"step": s, "time_s": t, "<stage>/<name>": value, ...}``."""

    def __init__(self, path: Path, stage: str):
        self.path, self.stage = Path(path), stage
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.start = time.monotonic()

    def log(self, step: int, echo: bool = True, **values) -> dict:
        row = {"step": step, "time_s": round(time.monotonic() - self.start, 2)}
        row.update({f"{self.stage}/{k}": (round(v, 6) if isinstance(v, float) else v) for k, v in values.items()})
        with open(self.path, "a") as fh:
            fh.write(json.dumps(row) + "\n")
        if echo:
            print(" ".join(f"{k}={v}" for k, v in row.items()), flush=True)
        return row


def read_metrics(path: Path) -> list[dict]:
    if not Path(path).exists():
        return []
    return [json.loads(line) for line in open(path) if line.strip()]


# ------------------------------------------------------------------------ checkpoints


def save_checkpoint(folder: Path, policy, optimizer, step: int, extra: dict | None = None) -> None:
    """The policy (float32, loadable by ``KernelPolicy.load``) and the trainer state beside it."""
    folder = Path(folder)
    tmp = folder.with_name(folder.name + ".tmp")
    policy.save(tmp, meta={"step": step, **(extra or {})}, dtype=torch.float32)
    torch.save({"step": step, "optimizer": optimizer.state_dict(), "extra": extra or {},
                "rng": {"python": random.getstate(), "numpy": np.random.get_state(),
                        "torch": torch.get_rng_state()}}, tmp / "trainer.pt")
    if folder.exists():
        old = folder.with_name(folder.name + ".old")
        if old.exists():
            _rmtree(old)
        folder.rename(old)
        tmp.rename(folder)
        _rmtree(old)
    else:
        tmp.rename(folder)


def _rmtree(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


def load_trainer(folder: Path, optimizer) -> dict:
    state = torch.load(Path(folder) / "trainer.pt", map_location="cpu", weights_only=False)
    optimizer.load_state_dict(state["optimizer"])
    random.setstate(state["rng"]["python"])
    np.random.set_state(state["rng"]["numpy"])
    torch.set_rng_state(state["rng"]["torch"])
    return state


@dataclasses.dataclass
class Stage:
    """What every stage sets up: device, output folder, checkpoint folder, metrics, budget."""

    device: torch.device
    out: Path
    ckpt: Path
    metrics: "Metrics"
    budget: "Budget"

    @property
    def resuming(self) -> bool:
        return (self.ckpt / "trainer.pt").exists()

    def finish(self, name: str, policy, optimizer, step: int, steps: int, meta: dict) -> int:
        """Save the last checkpoint and report; 0 when all ``steps`` ran, 3 when the budget
        stopped the chunk (run again to resume)."""
        save_checkpoint(self.ckpt, policy, optimizer, step, meta)
        done = step >= steps
        print(f"{name}: step {step}/{steps} in {self.budget.elapsed():.0f} s -> {self.ckpt}"
              f"{'' if done else ' (time budget spent: run again to resume)'}", flush=True)
        return 0 if done else 3


def start_stage(args, name: str) -> Stage:
    """Seed, pick the device and open the stage's metrics under ``args.out``."""
    set_seed(args.seed)
    out = Path(args.out)
    return Stage(pick_device(args.device), out, out / "policy", Metrics(out / "metrics.jsonl", name),
                 Budget(args.max_time_s))


class Budget:
    """Wall-clock budget of one chunk: stages save and exit when it is spent."""

    def __init__(self, max_time_s: float):
        self.max_time_s, self.start = max_time_s, time.monotonic()

    def spent(self) -> bool:
        return self.max_time_s > 0 and time.monotonic() - self.start > self.max_time_s

    def elapsed(self) -> float:
        return time.monotonic() - self.start


def cosine_lr(step: int, total: int, base: float, warmup: int = 50) -> float:
    if step < warmup:
        return base * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return base * (0.1 + 0.9 * 0.5 * (1 + np.cos(np.pi * progress)))


# ------------------------------------------------------------------------ patterns


class Patterns:
    """Loads training/validation matrices by name (real ones from the package, ../shared or
    ./shared; synthetic ones from their spec), caching their CSR arrays and features."""

    def __init__(self):
        self._cache: dict[str, tuple] = {}
        self._specs = None

    def _spec_names(self) -> dict[str, str]:
        if self._specs is None:
            import re

            sys.path.insert(0, str(REPO / "benchmarks"))
            import bench_kernels
            from training.data import HELDOUT_SYNTHETIC, synthetic_specs

            names = dict(bench_kernels.SYNTHETIC)
            names.update(bench_kernels.SMALL_SYNTHETIC)
            names.update(HELDOUT_SYNTHETIC)
            for spec in synthetic_specs():
                names[re.sub(r"[^A-Za-z0-9_.-]+", "-", spec.replace("=", "")).strip("-")] = spec
            self._specs = names
        return self._specs

    def available(self, name: str) -> bool:
        """Whether :meth:`get` can load the matrix (real ones need ../shared or ./shared)."""
        if name in self._cache or name in self._spec_names():
            return True
        try:
            _real_path(name)
            return True
        except FileNotFoundError:
            return False

    def keep_available(self, items: list, what: str) -> list:
        """``items`` (with a ``.matrix``) whose matrix loads; says how many were dropped."""
        kept = [it for it in items if self.available(it.matrix)]
        if len(kept) < len(items):
            missing = sorted({it.matrix for it in items} - {it.matrix for it in kept})
            print(f"{what}: {len(items) - len(kept)} of {len(items)} left out: matrices not found "
                  f"({', '.join(missing[:6])}{'...' if len(missing) > 6 else ''}; real ones come from "
                  f"../shared/matrices or ./shared/matrices)", flush=True)
        return kept

    def get(self, name: str):
        """(rowptr int64, col int64, shape, features) of one matrix."""
        if name not in self._cache:
            from torch_sparserl.data import synthetic
            from torch_sparserl.pattern.features import structural_features

            spec = self._spec_names().get(name)
            if spec is not None:
                m = synthetic.make(spec)
            else:
                m = _load_real(name)
            m = m.tocsr()
            rowptr, col = np.asarray(m.indptr, np.int64), np.asarray(m.indices, np.int64)
            self._cache[name] = (rowptr, col, tuple(m.shape), structural_features(rowptr, col, m.shape))
        return self._cache[name]


def _load_real(name: str):
    from torch_sparserl.data.datasets import load_matrix

    return load_matrix(_real_path(name))


def _real_path(name: str):
    from torch_sparserl.data.datasets import list_matrices

    if name in list_matrices():
        return name
    for folder in (REPO.parent / "shared" / "matrices", REPO / "shared" / "matrices"):
        path = folder / f"{name}.npz"
        if path.exists():
            return path
    raise FileNotFoundError(f"training: matrix {name!r} is neither shipped, in ../shared/matrices, "
                            f"in ./shared/matrices, nor a known synthetic pattern")
