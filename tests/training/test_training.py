"""A smoke run of every training stage at a tiny budget (CPU): pretrain -> SFT -> RL -> eval.

The RL and eval stages run at the compile tier (nvcc, no GPU); the full stages run on the
device (training/README.md)."""

import json
import shutil
import sys

import pytest

from helpers import REPO  # noqa: E402
sys.path.insert(0, str(REPO))

from training import data  # noqa: E402
from training.common import parse_args, read_metrics  # noqa: E402

TINY = ["--hidden", "32", "--layers", "1", "--heads", "2", "--intermediate", "64", "--vocab-size", "700"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return tmp_path_factory.mktemp("runs")


def test_split_keeps_validation_matrices_out_of_training():
    assert not set(data.VAL_MATRICES) & set(data.TRAIN_MATRICES)
    labels = data.load_labels(split="train")
    assert labels, "no training labels: training/labels/*-tables.jsonl is missing"
    assert not {lab.matrix for lab in labels} & set(data.VAL_MATRICES)
    val = data.load_labels(split="val")
    assert {lab.matrix for lab in val} <= set(data.VAL_MATRICES)
    for lab in labels[:50]:
        assert lab.speedup > 0 and lab.family in __import__("torch_sparserl.specialize.families").specialize.families.FAMILIES


def test_the_held_out_generated_matrices_were_never_trained_on_and_load():
    """Issue 53's evaluation: the real validation matrices and the held-out generated ones, at
    least 8 matrices that no stage read, none a spec the training grid draws, none in any label
    table; with SpMV and four SpMM widths, over 60 cells per dtype."""
    import re

    from training.common import Patterns

    heldout = set(data.HELDOUT_SYNTHETIC)
    assert len(data.EVAL_MATRICES) >= 8 and len(data.EVAL_MATRICES) * len(data.EVAL_NS) >= 60
    assert not heldout & set(data.TRAIN_MATRICES) and not heldout & set(data.VAL_MATRICES)
    trained_specs = set(data.synthetic_specs())
    assert not set(data.HELDOUT_SYNTHETIC.values()) & trained_specs
    slugs = {re.sub(r"[^A-Za-z0-9_.-]+", "-", spec.replace("=", "")).strip("-") for spec in trained_specs}
    assert not heldout & slugs
    everything = {lab.matrix for lab in data.load_labels(split="all")}
    assert not heldout & everything and not set(data.VAL_MATRICES) & {
        lab.matrix for lab in data.load_labels(split="train")}
    assert all(data.in_split(name, "val") and not data.in_split(name, "train") for name in heldout)
    assert not any(data.is_synthetic(name) for name in heldout)
    patterns = Patterns()
    assert all(patterns.available(name) for name in heldout)
    rowptr, col, shape, _ = patterns.get("heldout-stencil-300")
    assert shape == (90000, 90000) and rowptr[-1] == len(col)


def test_synthetic_specs_are_deterministic_and_valid():
    from torch_sparserl.data import synthetic

    specs = data.synthetic_specs(14, seed=3)
    assert specs == data.synthetic_specs(14, seed=3) and len(set(specs)) == 14
    for spec in specs:
        synthetic.parse_spec(spec)


def test_load_labels_names_a_bad_split():
    with pytest.raises(ValueError, match="split expected"):
        data.load_labels(split="test")


def test_dataclass_arguments():
    from training.rl import RLArgs

    args = parse_args(RLArgs, ["--steps", "3", "--compile-only", "--labels", "a", "b"])
    assert args.steps == 3 and args.compile_only is True and args.labels == ["a", "b"]
    assert parse_args(RLArgs, []).compile_only is False


def test_pretrain_smoke_and_resume(runs):
    from training import pretrain

    out = runs / "pretrain"
    argv = ["--out", str(out), "--steps", "2", "--batch", "2", "--seq-len", "64", "--cuda-bytes", "50000",
            "--log-every", "1", *TINY]
    assert pretrain.main(argv) == 0
    assert pretrain.main([*argv[:2], "--steps", "3", *argv[4:]]) == 0  # resumes at step 2
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all("pretrain/loss" in r for r in rows)
    assert (out / "policy" / "trainer.pt").exists()


def test_sft_smoke(runs):
    from training import sft

    out = runs / "sft"
    assert sft.main(["--init", str(runs / "pretrain" / "policy"), "--out", str(out), "--steps", "2", "--batch", "2",
                     "--log-every", "1", "--dev-every-steps", "2", "--max-examples", "6", "--resamples", "2"]) == 0
    rows = read_metrics(out / "metrics.jsonl")
    assert rows[-1]["step"] == 2 and "sft/loss" in rows[-1]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_rl_smoke_at_the_compile_tier(runs):
    from training import rl

    out = runs / "rl"
    assert rl.main(["--init", str(runs / "sft" / "policy"), "--out", str(out), "--steps", "1", "--prompts", "2",
                    "--group", "2", "--compile-only", "--max-cells", "3"]) == 0
    row = read_metrics(out / "metrics.jsonl")[-1]
    assert row["rl/reward_mean"] >= -0.5 and 0 <= row["rl/compile_rate"] <= 1
    # off-grid kernels in every group (RL beyond the grid): one of each group of 3, counted
    explored = runs / "rl-explore"
    assert rl.main(["--init", str(runs / "sft" / "policy"), "--out", str(explored), "--steps", "1", "--prompts", "2",
                    "--group", "3", "--explore", "1", "--compile-only", "--max-cells", "3"]) == 0
    row = read_metrics(explored / "metrics.jsonl")[-1]
    assert row["rl/off_grid"] == 2 and 0 <= row["rl/off_grid_correct"] <= 2 and row["rl/beats_oracle"] == 0
    with pytest.raises(ValueError, match=r"--explore must be from 0 to group - 1 = 2 \(got 3\)"):
        rl.main(["--init", str(runs / "sft" / "policy"), "--out", str(explored), "--group", "3", "--explore", "3"])


def test_the_reward_against_the_grid_oracle():
    from torch_sparserl.evaluate.record import EvalRecord
    from torch_sparserl.evaluate.reward import reward

    fast = EvalRecord(key="k", family="f", compiled=True, correct=True, runtime_us=10.0, cusparse_us=30.0)
    assert reward(fast) == pytest.approx(3.0)  # 1 + (3x - 1) against cuSPARSE
    assert reward(fast, baseline=2.0) == pytest.approx(1.5)  # 1.5x the oracle's speed
    assert reward(fast, baseline=3.0) == pytest.approx(1.0)  # as fast as the oracle
    with pytest.raises(ValueError, match="baseline must be a speedup > 0"):
        reward(fast, baseline=0.0)


def test_rl_advantages_leave_out_samples_the_device_could_not_evaluate():
    import numpy as np
    from training.rl import group_advantages

    rewards = np.array([1.0, 0.0, 2.0, 0.0, 3.0, 3.0, 3.0, 3.0, 1.0, 0.0, 0.0, 0.0])
    valid = np.array([1, 1, 1, 0, 1, 1, 1, 1, 1, 0, 0, 0], dtype=bool)
    adv = group_advantages(rewards, valid, 4)
    z = 1 / np.std([1.0, 0.0, 2.0])
    np.testing.assert_allclose(adv[:4], [0.0, -z, z, 0.0], rtol=1e-5)  # the fourth: no reward, no advantage
    assert not adv[4:].any()  # equal rewards, and a single valid sample: no signal


def test_rl_rewarder_evaluates_again_what_failed_for_the_devices_state():
    from types import SimpleNamespace

    import numpy as np
    from torch_sparserl.evaluate.record import ErrorKind, EvalRecord
    from training.rl import Rewarder

    class Box:  # the first evaluation finds the device full, the second runs
        def __init__(self):
            self.calls = 0

        def set_matrix(self, *args):
            pass

        def evaluate(self, spec, matrix, n, dtype, config):
            self.calls += 1
            record = EvalRecord(key=spec.key, compiled=True)
            if self.calls == 1:
                return record.fail(ErrorKind.DEVICE_MEMORY, "OutOfMemoryError: CUDA out of memory")
            record.correct, record.runtime_us, record.cusparse_us = True, 1.0, 2.0
            return record

    patterns = SimpleNamespace(get=lambda m: (np.array([0, 1]), np.array([0]), (1, 1), None))
    rewarder = Rewarder(patterns, compile_only=False)
    rewarder.box = Box()
    cell = SimpleNamespace(cell="c", matrix="m", n=8, dtype="f32")
    proposal = SimpleNamespace(spec=SimpleNamespace(key="k"), error=None, family="f")
    assert rewarder.record(cell, proposal).error_kind is ErrorKind.DEVICE_MEMORY
    assert rewarder.record(cell, proposal).correct and rewarder.box.calls == 2
    assert rewarder.record(cell, proposal).correct and rewarder.box.calls == 2  # a verdict: kept


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_eval_smoke_at_the_compile_tier(runs):
    from training import eval as evaluate

    out = runs / "eval.json"
    assert evaluate.main(["--policies", str(runs / "sft" / "policy"), "--names", "tiny", "--matrices", "cora",
                          "--ns", "32", "--k", "2", "--compile-only", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["summary"]["tiny"]["all"]["samples"] == 2
    assert len(doc["cells"][0]["policies"]["tiny"]["samples"]) == 2


def test_learning_curve_plot(runs, tmp_path):
    from training import plots

    svg = plots.learning_curves([runs / "pretrain" / "metrics.jsonl"], tmp_path / "c.svg")
    text = svg.read_text()
    assert text.startswith("<svg") and "pretrain/loss" in text
