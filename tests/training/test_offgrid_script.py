"""training/offgrid.py on the CPU: its options, its summary and table, and a smoke run at the
compile tier (nvcc) with the shipped policy."""

import json
import shutil
import sys

import pytest

from helpers import REPO  # noqa: E402
sys.path.insert(0, str(REPO))

from training import offgrid  # noqa: E402


@pytest.mark.parametrize("text", ["spmv:32:f32", "spmm:32", "spmm:x:f32", "spmm:32:f64", "sddmm:32:f32"])
def test_a_bad_request_names_the_option(text):
    with pytest.raises(SystemExit, match=f"--requests expects op:n:dtype items .* got '{text}'"):
        offgrid.parse_request(text)


@pytest.mark.parametrize("argv,match", [(["--tier", "tpu"], "--tier expects one of compile, gpu, got 'tpu'"),
                                        (["--k", "1"], "--k expects at least 2"),
                                        (["--matrices", "nope"], "cannot be loaded: nope")])
def test_bad_options_are_named(argv, match, tmp_path):
    with pytest.raises(SystemExit, match=match):
        offgrid.main(argv + ["--out", str(tmp_path / "o.json")])


def test_the_gpu_tier_says_it_needs_a_gpu(tmp_path, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="--tier gpu needs a CUDA GPU"):
        offgrid.main(["--tier", "gpu", "--out", str(tmp_path / "o.json")])


def _row(off, compiled=True, correct=None, speedup=None, spill=0, domain=True):
    row = {"key": f"{off}{compiled}{correct}{speedup}", "parsed": True, "in_domain": domain,
           "off_grid": off if domain else None, "refusal": None if domain else "source: outside the domain: x",
           "compiled": compiled and domain, "spill_bytes": spill, "error_kind": None}
    if correct is not None:
        row.update(correct=correct, speedup=speedup)
    return row


def test_the_summary_counts_off_grid_kernels_and_the_cells_they_win():
    cells = [
        {"op": "spmm", "n": 32, "dtype": "f32", "oracle": {"speedup": 2.0},
         "explore": [_row(False, correct=True, speedup=1.9), _row(True, correct=True, speedup=2.2),
                     _row(True, correct=False, speedup=None), _row(True, domain=False)]},
        {"op": "spmm", "n": 32, "dtype": "f32", "oracle": {"speedup": 1.0},
         "explore": [_row(False, correct=True, speedup=1.0), _row(True, correct=True, speedup=0.5, spill=8)]},
    ]
    m = offgrid.summarize(cells)["spmm n=32 f32"]["explore"]
    assert m["proposals"] == 6 and m["parsed"] == 6 and m["in_domain"] == 5 and m["off_grid"] == 3
    assert m["off_grid_compiled"] == 3 and m["off_grid_correct"] == 2 and m["off_grid_spilled"] == 1
    assert m["cells_off_grid_beats_oracle"] == 1
    assert m["best_off_grid_frac_oracle_mean"] == pytest.approx((2.2 / 2.0 + 0.5 / 1.0) / 2)
    doc = {"args": {"tier": "gpu"}, "command": "python training/offgrid.py --tier gpu", "commit": "abc",
           "created": "now", "env": {"host": "h", "gpu": "H100"}, "cells": cells, "summary": offgrid.summarize(cells)}
    table = offgrid.markdown(doc)
    assert "| spmm n=32 f32 | explore | 6 | 6 | 5 | 3 | 3 | 1 | 2 | 1 of 2 | 80.0% |" in table
    assert "1 × source: outside the domain: x" in table and "not measured" not in table


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_a_compile_tier_run_writes_its_result_and_table(tmp_path):
    out = tmp_path / "offgrid.json"
    assert offgrid.main(["--matrices", "cora", "--requests", "spmm:32:f32", "--k", "4", "--sample-k", "1",
                         "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    (cell,) = doc["cells"]
    assert [r["off_grid"] for r in cell["explore"]] == [False, True, True, True]
    assert all(r["parsed"] and r["in_domain"] and r["compiled"] for r in cell["explore"])
    assert doc["summary"]["all"]["explore"]["off_grid_compiled"] == 3
    table = out.with_suffix(".md").read_text()
    assert doc["command"] in table and "were not measured in this run" in table


def test_the_gpu_tier_screens_what_passed_the_gate_and_runs_the_oracle_in_the_same_box():
    """The GPU tier's path on the CPU, with the fake sandbox of tests/fakes.py for the device: each
    distinct gated kernel screened (median of three), the oracle tuned, the summary's comparison."""
    from types import SimpleNamespace

    from fakes import FakeSandbox
    from torch_sparserl.specialize.policy import load_default
    from training.common import Patterns

    class Box(FakeSandbox):  # the real sandbox's evaluate has a default timeout, as eval.py uses it
        def evaluate(self, spec, matrix_key, n, dtype, config, timeout_s=60.0):
            return super().evaluate(spec, matrix_key, n, dtype, config, timeout_s)

    box = Box(wrong_every=3)
    args = SimpleNamespace(k=4, seed=0, temperature=1.0, sample_k=0, sample_temperature=1.5, tier="gpu",
                           oracle_budget_s=5.0)
    cell = offgrid.measure_cell(load_default("cpu"), Patterns().get("cora"), "spmm", 32, "f32", args, box)
    beyond = [r for r in cell["explore"] if r["off_grid"]]
    assert len(beyond) == 3 and all("correct" in r and r["compiled"] for r in beyond)
    screened = {key for key, _ in box.calls}
    assert {r["key"] for r in cell["explore"]} <= screened  # every proposal passed the gate and was screened
    from training.eval import METRIC_SCREENS

    assert all(sum(key == r["key"] for key, _ in box.calls) >= METRIC_SCREENS for r in cell["explore"])
    assert cell["oracle"]["speedup"] > 0 and box.released == 1  # by the oracle's tune, after the screens
    m = offgrid.summarize([{"matrix": "cora", **cell}])["all"]["explore"]
    best = max([r["speedup"] for r in beyond if r["correct"]] or [0.0])
    assert m["cells_off_grid_beats_oracle"] == int(best > cell["oracle"]["speedup"])
    assert m["best_off_grid_frac_oracle_mean"] == pytest.approx(best / cell["oracle"]["speedup"])
