"""The exhaustive autotuner's search logic, with a fake sandbox (CPU); the GPU run is in
tests/specialize/test_autotune_gpu.py."""

from __future__ import annotations


import pytest

import torch_sparserl as ts
from torch_sparserl.evaluate.record import ErrorKind, EvalRecord
from torch_sparserl.pattern.features import structural_features
from torch_sparserl.specialize.autotune import FINAL_CONFIG, SCREEN_CONFIG, candidates, tune

from fakes import FakeSandbox


@pytest.fixture(scope="module")
def cora():
    return ts.load_matrix("cora")


@pytest.mark.parametrize("op, n", [("spmv", 1), ("spmm", 32), ("spmm", 7)])
def test_space_renders_distinct_parseable_candidates(cora, op, n):
    features = structural_features(cora.indptr, cora.indices, cora.shape)
    specs = candidates(op, n, "f32", features)
    assert len(specs) >= 10
    assert len({s.key for s in specs}) == len(specs)
    for spec in specs:
        assert spec.plan.op == op and spec.plan.n in (None, n) and spec.family


def test_tune_returns_the_fastest_correct_finalist(cora):
    box = FakeSandbox()
    result = tune(cora, op="spmm", n=32, sandbox=box, top_k=3, budget_s=1e9)
    screens = [c for c in box.calls if c[1] is SCREEN_CONFIG]
    finals = [c for c in box.calls if c[1] is FINAL_CONFIG]
    assert len(screens) == result.candidates == result.screened and len(finals) == 3
    correct = [r for r in result.table if r.timing["stage"] == "screen" and r.ok]
    fastest = sorted(correct, key=lambda r: r.runtime_us)[:3]
    assert {c[0] for c in finals} == {r.key for r in fastest}
    assert result.best.key == fastest[0].key and result.best.timing["stage"] == "final"
    assert result.best_spec.key == result.best.key
    assert result.speedup == pytest.approx(500.0 / result.best.runtime_us)
    assert "best" in result.summary()


def test_a_known_pattern_is_not_sent_or_measured_again(cora, monkeypatch):
    import torch_sparserl.specialize.search as search

    box = FakeSandbox()
    first = tune(cora, op="spmm", n=32, sandbox=box, top_k=1, budget_s=1e9)
    monkeypatch.setattr(search, "structural_features", lambda *a: pytest.fail("features computed again"))
    again = tune(cora, op="spmm", n=64, sandbox=box, top_k=1, budget_s=1e9, features=first.features,
                 matrix_key=next(iter(box.matrices)))
    assert box.sent == 1 and box.released == 2 and again.features == first.features and again.best is not None


def test_tune_stops_screening_when_the_budget_is_spent(cora):
    box = FakeSandbox(wrong_every=0)  # the one candidate screened is correct, whatever the sources' hashes
    result = tune(cora, op="spmv", sandbox=box, budget_s=0.0, top_k=2)
    assert result.budget_exhausted and result.screened == 1 < result.candidates
    assert result.best is not None  # what was screened still gets its final evaluation


def test_tune_reports_no_kernel_when_nothing_is_correct(cora, monkeypatch):
    box = FakeSandbox()
    monkeypatch.setattr(box, "evaluate", lambda spec, *a: EvalRecord(key=spec.key, compiled=False).fail(
        ErrorKind.COMPILE, "fake"))
    result = tune(cora, op="spmv", sandbox=box)
    assert result.best is None and "no correct candidate" in result.summary()


def test_tune_restricts_to_named_families(cora):
    box = FakeSandbox()
    result = tune(cora, op="spmv", sandbox=box, families=["vector_row"])
    assert result.candidates and {r.family for r in result.table} == {"vector_row"}


@pytest.mark.parametrize("kwargs, message", [
    (dict(op="spgemm"), "op must be 'spmm', 'spmv' or 'sddmm'"),
    (dict(op="spmv", n=4), "op='spmv' has n=1"),
    (dict(op="spmm", n=0), "n must be >= 1"),
    (dict(op="spmm", n=4, dtype="f64"), "expected f32, f16, bf16"),
])
def test_tune_names_bad_arguments(cora, kwargs, message):
    with pytest.raises(ValueError, match=message):
        tune(cora, sandbox=FakeSandbox(), **kwargs)


def test_tune_names_a_matrix_it_cannot_read():
    with pytest.raises(TypeError, match="expected a SciPy sparse matrix"):
        tune([[1, 0], [0, 1]], op="spmv", sandbox=FakeSandbox())


def test_a_scaled_budget_screens_every_candidate_up_to_its_cap(cora, monkeypatch):
    """max_budget_s: the screening budget becomes what every candidate takes at the first one's
    pace (a quarter more), from budget_s up to the cap; without it, budget_s stays fixed."""
    import torch_sparserl.specialize.autotune as autotune

    clock = [0.0]
    monkeypatch.setattr(autotune.time, "monotonic", lambda: clock[0])

    class Paced(FakeSandbox):
        def evaluate(self, *args):
            clock[0] += 2.0  # two seconds per evaluation
            return super().evaluate(*args)

    fixed = tune(cora, op="spmv", sandbox=Paced(wrong_every=0), budget_s=5.0, top_k=1)
    assert fixed.budget_exhausted and fixed.screened == 3 and fixed.budget_s == 5.0
    scaled = tune(cora, op="spmv", sandbox=Paced(wrong_every=0), budget_s=5.0, top_k=1, max_budget_s=1e6)
    assert not scaled.budget_exhausted and scaled.screened == scaled.candidates
    assert scaled.budget_s == pytest.approx(1.25 * 2.0 * scaled.candidates)
    capped = tune(cora, op="spmv", sandbox=Paced(wrong_every=0), budget_s=5.0, top_k=1, max_budget_s=11.0)
    assert capped.budget_exhausted and capped.screened == 6 and capped.budget_s == 11.0


def test_the_candidates_are_compiled_a_chunk_at_a_time_before_their_screens(cora):
    """A sandbox that can prebuild gets each chunk of PREBUILD_CHUNK candidates, in the
    screening order, before the first of them is screened, and no candidate twice."""
    import torch_sparserl.specialize.autotune as autotune

    class Prebuilding(FakeSandbox):
        def __init__(self):
            super().__init__(wrong_every=0)
            self.events = []

        def prebuild(self, specs, workers=4):
            self.events.append(("build", [s.key for s in specs], workers))
            return {}

        def evaluate(self, spec, *args):
            self.events.append(("screen", spec.key))
            return super().evaluate(spec, *args)

    box = Prebuilding()
    result = tune(cora, op="spmm", n=32, sandbox=box, top_k=1)
    chunk = autotune.PREBUILD_CHUNK
    builds = [e for e in box.events if e[0] == "build"]
    built = [k for e in builds for k in e[1]]
    screens = [e[1] for e in box.events if e[0] == "screen"][:result.screened]
    assert built == screens and len(builds) == -(-result.candidates // chunk) > 1
    assert all(e[2] == chunk and 0 < len(e[1]) <= chunk for e in builds)
    screen_at = [i for i, e in enumerate(box.events) if e[0] == "screen"][:result.screened]
    for j, at in enumerate(screen_at):  # each screen comes after its chunk's build
        assert box.events.index(builds[j // chunk]) < at
