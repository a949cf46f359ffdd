"""training/offgrid.py at the GPU tier: off-grid kernels screened with cuSPARSE beside them and
the grid oracle run in the same process."""

import json
import sys

from helpers import REPO  # noqa: E402
sys.path.insert(0, str(REPO))

from training import offgrid  # noqa: E402


def test_the_gpu_tier_times_off_grid_kernels_against_the_oracle(tmp_path):
    out = tmp_path / "offgrid.json"
    assert offgrid.main(["--tier", "gpu", "--matrices", "cora", "--requests", "spmm:32:f32", "spmv:1:f32",
                         "--k", "4", "--sample-k", "0", "--oracle-budget-s", "60", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert len(doc["cells"]) == 2
    for cell in doc["cells"]:
        assert cell["oracle"]["speedup"] > 0
        beyond = [r for r in cell["explore"] if r["off_grid"]]
        assert len(beyond) == 3
        for r in beyond:
            assert r["compiled"] and r["correct"] is not None
            assert not r["correct"] or r["speedup"] > 0
    m = doc["summary"]["all"]["explore"]
    assert m["off_grid"] == 6 and "cells_off_grid_beats_oracle" in m
    assert "cells beating the oracle" in out.with_suffix(".md").read_text()
