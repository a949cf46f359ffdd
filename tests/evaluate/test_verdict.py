"""The verdict on a candidate (torch_sparserl.evaluate.verdict) and the search both tuners share
(torch_sparserl.specialize.search), on the CPU with fixed evaluation records.

The first tests go through the entry points that existed before the verdict had a module of its
own (``tune``, ``policy_tune``, the specializer's decision, the class check): on the same
records they must reach the same decisions, with the same reasons. The others test the
verdict's and the search's functions one by one.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from torch_sparserl import pattern as patterns
from torch_sparserl.evaluate.record import ErrorKind, EvalRecord, TransientFailure
from torch_sparserl.jit.decisions import SpecializationError
from torch_sparserl.pattern.fingerprint import SpecializationKey
from torch_sparserl.specialize.autotune import FINAL_CONFIG, tune

from helpers import make_pattern, to_parts

KEY = SpecializationKey(pattern="abc", op="spmv", n=1, dtype="f32", arch="sm_90", policy="autotune")
SOURCE = "// the best candidate's source\n"


class ScriptedSandbox:
    """A sandbox whose records are written in advance, per candidate: candidates are numbered in
    the order they are first evaluated, and ``screen[i]`` / ``final[i]`` give candidate i's GPU
    µs in each stage (None: wrong; absent: 500 + i). cuSPARSE takes ``cusparse[i]`` µs (100)."""

    def __init__(self, screen: dict, final: dict, cusparse: dict | None = None):
        self.screen, self.final, self.cusparse = screen, final, cusparse or {}
        self.order: list[str] = []
        self.calls: list[tuple[int, str]] = []  # (candidate, "screen" | "final")
        self.matrices: dict = {}

    def set_matrix(self, key, rowptr, col, shape):
        self.matrices[key] = shape

    def has_matrix(self, key):
        return key in self.matrices

    def release(self):
        pass

    def evaluate(self, spec, matrix_key, n, dtype, config, timeout_s):
        if spec.key not in self.order:
            self.order.append(spec.key)
        i = self.order.index(spec.key)
        stage = "final" if config is FINAL_CONFIG else "screen"
        self.calls.append((i, stage))
        us = (self.final if stage == "final" else self.screen).get(i, 500.0 + i)
        record = EvalRecord(key=spec.key, family=spec.family, params=dict(spec.params), op="spmv", n=n, dtype=dtype,
                            compiled=True)
        if us is None:
            return record.fail(ErrorKind.WRONG, f"scripted: candidate {i} is wrong in its {stage}")
        record.correct, record.runtime_us = True, us
        record.cusparse_us = self.cusparse.get(i, 100.0) if stage == "final" else None
        return record


def cora():
    from torch_sparserl.data.datasets import load_matrix

    return load_matrix("cora")


# ======================================================================= the same decisions as before

# candidate 1 screens fastest but fails its final validation; 0 is next, 2 validates fastest
SCREEN = {0: 50.0, 1: 40.0, 2: 60.0}
FINAL = {0: 55.0, 1: None, 2: 45.0}


@pytest.mark.parametrize("top_k, best, finals", [
    (1, None, [1]),         # the one finalist fails: no kernel
    (2, 0, [1, 0]),         # the next one is validated and kept
    (3, 2, [1, 0, 2]),      # the fastest validated, not the fastest screened
])
def test_tune_validates_its_top_k_fastest_and_keeps_the_fastest_final(top_k, best, finals):
    box = ScriptedSandbox(SCREEN, FINAL, cusparse={0: 90.0, 2: 80.0})
    result = tune(cora(), op="spmv", sandbox=box, top_k=top_k, budget_s=1e9)
    assert [i for i, stage in box.calls if stage == "final"] == finals
    assert (result.best.key if result.best else None) == (box.order[best] if best is not None else None)
    assert result.best is None or (result.best.timing["stage"] == "final" and result.best_spec.key == result.best.key)
    passed = [box.cusparse.get(i, 100.0) for i in finals if FINAL.get(i, 1.0) is not None]
    assert result.cusparse_us == (min(passed) if passed else None)  # a wrong final times no cuSPARSE
    assert len(result.table) == result.screened + len(finals)


class RankingPolicy:
    """A policy for ``strategy="rank"`` that likes the space's kernels in the order the space
    lists them: its K proposals are the space's first K kernels."""

    class config:  # noqa: N801 - read as policy.config.samples
        samples = 8

    def completion_ids(self, texts):
        return [[i] for i in range(len(texts))]

    def score_ids(self, inp, op, dtype, n, ids):
        return [-float(i[0]) for i in ids]


@pytest.mark.parametrize("finalists, best, finals", [
    (1, 0, [1, 0]),         # the one finalist fails: the next one takes its turn
    (2, 0, [1, 0]),
    (3, 2, [1, 0, 2]),
])
def test_policy_tune_validates_until_one_passes_and_keeps_the_fastest_final(finalists, best, finals):
    from torch_sparserl.specialize.policy.propose import policy_tune

    box = ScriptedSandbox(SCREEN, FINAL)
    result, proposals, records = policy_tune(cora(), op="spmv", policy=RankingPolicy(), k=3, sandbox=box,
                                             finalists=finalists)
    assert [i for i, stage in box.calls if stage == "screen"] == [0, 1, 2]  # the proposals' order
    assert [i for i, stage in box.calls if stage == "final"] == finals
    assert result.best.key == box.order[best] == result.best_spec.key
    assert [r.key for r in records] == [p.spec.key for p in proposals] == box.order
    assert result.screened == 3 and [r.timing["stage"] for r in result.table[:3]] == ["screen"] * 3


def test_policy_tune_validates_a_single_distinct_kernel_without_screening_it():
    from torch_sparserl.specialize.policy.propose import policy_tune

    box = ScriptedSandbox({}, {0: 30.0})
    result, proposals, records = policy_tune(cora(), op="spmv", policy=RankingPolicy(), k=1, sandbox=box)
    assert box.calls == [(0, "final")] and result.best is records[0] and result.table == [records[0]]
    assert result.screened == 1 and records[0].timing["stage"] == "final" and result.best_spec is proposals[0].spec


def _record(family, *, speedup=None, kind=None, log=""):
    record = EvalRecord(key=family, family=family, params={"lanes": 4}, compiled=True)
    if kind is not None:
        return record.fail(kind, log)
    record.correct, record.runtime_us, record.cusparse_us = True, 10.0, 10.0 * speedup
    return record


class _Result:
    """What a specializer's decision reads of a tuning result."""

    def __init__(self, best, *table):
        self.best, self.table = best, list(table)
        self.best_spec = type("Spec", (), {"source": SOURCE})() if best is not None else None


@pytest.mark.parametrize("margin, records, source, family, reason", [
    (1.05, [_record("a", speedup=1.5), _record("b", speedup=1.2)], SOURCE, "a", "1.50x cuSPARSE (S)"),
    (1.05, [_record("a", speedup=1.05)], SOURCE, "a", "1.05x cuSPARSE (S)"),  # the margin itself serves
    (1.05, [_record("a", speedup=0.9)], None, "a",
     "the best candidate, a, is 0.90x cuSPARSE, under the 1.05x margin (S)"),
    (2.0, [_record("a", speedup=1.5)], None, "a", "the best candidate, a, is 1.50x cuSPARSE, under the 2.0x margin (S)"),
    (1.05, [_record("c", kind=ErrorKind.WRONG), _record("d", kind=ErrorKind.TIMEOUT),
            _record("e", kind=ErrorKind.WRONG)], None, "", "no correct candidate (S; failed: timeout 1, wrong 2)"),
    (1.05, [], None, "", "no correct candidate (S; none evaluated)"),
])
def test_the_specializer_decides_as_the_verdict_says(margin, records, source, family, reason):
    from torch_sparserl.config import JitOptions
    from torch_sparserl.jit.specializers import autotune_specializer

    best = records[0] if records and records[0].ok else None
    entry = autotune_specializer(JitOptions(margin=margin))._entry(KEY, _Result(best, *records), "S", "candidate")
    assert (entry.spec_source, entry.family, entry.reason) == (source, family, reason)
    assert entry.record == (best.to_dict() if best is not None else None)


def test_a_negative_answer_while_the_device_had_no_memory_decides_nothing():
    from torch_sparserl.config import JitOptions
    from torch_sparserl.jit.specializers import autotune_specializer

    decide = autotune_specializer(JitOptions(margin=1.05))._entry
    oom = _record("b", kind=ErrorKind.DEVICE_MEMORY, log="OutOfMemoryError: out of memory\nmore")
    slow = _record("a", speedup=0.9)
    with pytest.raises(TransientFailure, match=r"^no policy kernel decided: 1 of 2 evaluations failed for the "
                                               r"device's state at the time \(device_memory: OutOfMemoryError: out of memory; S\)$"):
        decide(KEY, _Result(slow, slow, oom), "S", "policy kernel")
    assert decide(KEY, _Result(_record("a", speedup=1.5), oom), "S", "candidate").spec_source == SOURCE


def _class_operands():
    A = make_pattern("random")
    crow, col, val = to_parts(A, torch.float32, torch.int32, "cpu")
    return patterns.lookup(crow, col, A.shape[1]), crow, col


def _product(crow, col, val, X, y):
    """The product a correct class kernel writes into ``y``."""
    A = torch.sparse_csr_tensor(crow.long(), col.long(), val, (crow.numel() - 1, X.shape[0]))
    y.copy_((A.to_dense().double() @ X.double()).to(y.dtype))
    return y


@pytest.mark.parametrize("how, message", [
    ("correct", None),
    ("wrong", r"^the class kernel differs from the float64 reference on a pattern of \d+ rows and \d+ nonzeros: "),
    ("unwritten row", r"^the class kernel differs from the float64 reference on a pattern of \d+ rows"),
    ("declines", r"^the class kernel declined a pattern of \d+ rows and \d+ nonzeros$"),
])
def test_a_class_kernel_is_checked_against_float64_before_it_serves(how, message):
    from torch_sparserl.jit import classes

    pattern, crow, col = _class_operands()

    def launch(crow, col, val, X, y):
        if how == "declines":
            return None
        _product(crow, col, val, X, y)
        if how == "wrong":
            y[0] += 1.0
        elif how == "unwritten row":
            y[3] = float("nan")  # as left by the NaN fill: never written
        return y

    if message is None:
        classes.check(launch, pattern, crow, col, "spmm", 8, torch.float32)
    else:
        with pytest.raises(SpecializationError, match=message):
            classes.check(launch, pattern, crow, col, "spmm", 8, torch.float32)


# ======================================================================= the verdict, rule by rule

def test_a_record_is_worth_its_gpu_time_only_when_correct_and_timed():
    from torch_sparserl.evaluate import verdict

    fast, slow = _record("fast", speedup=3.0), _record("slow", speedup=1.0)
    slow.runtime_us = 20.0
    untimed = _record("untimed", speedup=1.0)
    untimed.runtime_us = None
    wrong = _record("wrong", kind=ErrorKind.WRONG)
    wrong.runtime_us = 1.0  # timed, but wrong: worth nothing
    assert verdict.runtime_us(fast) == 10.0 and verdict.runtime_us(slow) == 20.0
    assert math.isinf(verdict.runtime_us(untimed)) and math.isinf(verdict.runtime_us(wrong))
    pairs = [(slow, "s"), (wrong, "w"), (fast, "f"), (untimed, "u")]
    assert verdict.ranked(pairs) == [(fast, "f"), (slow, "s")]
    assert verdict.better(fast, None) and verdict.better(fast, slow) and not verdict.better(slow, fast)
    assert not verdict.better(wrong, None) and not verdict.better(untimed, slow) and not verdict.better(fast, fast)


def test_judge_gives_the_record_whether_it_serves_and_why():
    from torch_sparserl.evaluate import verdict

    best = _record("a", speedup=1.5)
    assert verdict.judge(best, [best], 1.05, "3 screened", "candidate") == \
        verdict.Verdict(best, True, "1.50x cuSPARSE (3 screened)")
    assert verdict.judge(best, [best], 1.6, "3 screened", "candidate") == \
        verdict.Verdict(best, False, "the best candidate, a, is 1.50x cuSPARSE, under the 1.6x margin (3 screened)")
    assert verdict.judge(None, [], 1.05, "0 screened", "policy kernel") == \
        verdict.Verdict(None, False, "no correct policy kernel (0 screened; none evaluated)")


def _costs(**changes):
    from torch_sparserl.evaluate.verdict import HostCosts

    fields = dict(door_us=1.0, alloc_us=1.0, launch_us=2.0, cusparse_us={"spmv": 6.0, "spmm": 9.0})
    return HostCosts(**{**fields, **changes})


def timed(kernel_gpu_us, cusparse_gpu_us, launches):
    return {"runtime_us": kernel_gpu_us, "cusparse_us": cusparse_gpu_us, "timing": {"launches": launches}}


def test_a_call_is_weighed_alone_and_in_a_stream():
    from torch_sparserl.evaluate import verdict

    found = verdict.per_call(timed(4.0, 6.0, 2), "spmv", _costs())
    # kernel: 1 + 1 + 2 * 2 = 6 us of host; cuSPARSE: 1 + 6 = 7
    assert found.kernel_host_us == pytest.approx(6.0) and found.cusparse_host_us == pytest.approx(7.0)
    assert found.alone == pytest.approx((7 + 6) / (6 + 4))
    assert found.streamed == pytest.approx(7 / 6)
    assert found.speedup == pytest.approx(7 / 6)
    assert "2 launches" in found.describe() and "1.17x" in found.describe()


def test_a_gpu_win_that_loses_per_call_is_refused():
    """1.67x on the GPU, but three launches of a host-bound call cost more than cuSPARSE's call."""
    from torch_sparserl.evaluate import verdict

    found = verdict.per_call(timed(3.0, 5.0, 3), "spmv", _costs(launch_us=3.0, cusparse_us={"spmv": 6.0}))
    assert found.alone == pytest.approx((7 + 5) / (11 + 3)) and found.speedup < 1.0
    allowed, why = verdict.end_to_end(timed(3.0, 5.0, 3), "spmv", torch.float32, 1.05,
                                      lambda: _costs(launch_us=3.0, cusparse_us={"spmv": 6.0}))
    assert not allowed and "3 launches" in why


def test_large_products_keep_their_gpu_win():
    from torch_sparserl.evaluate import verdict

    found = verdict.per_call(timed(100.0, 180.0, 2), "spmm_transposed", _costs())  # spmm's costs
    assert found.cusparse_host_us == pytest.approx(10.0)
    assert found.streamed == pytest.approx(1.8) and found.alone == pytest.approx(190 / 106)


@pytest.mark.parametrize("case", ["no costs", "no launches", "not served by C++", "half", "no record"])
def test_the_gpu_time_decision_stands_where_nothing_can_be_weighed(case):
    from torch_sparserl.evaluate import verdict

    asked = []

    def costs():
        asked.append(1)
        return None if case == "no costs" else _costs()

    losing = timed(3.0, 5.0, 9)
    if case == "no launches":
        losing["timing"] = {}
    op = "sddmm" if case == "not served by C++" else "spmv"
    dtype = torch.float16 if case == "half" else torch.float32
    assert verdict.end_to_end(None if case == "no record" else losing, op, dtype, 1.05, costs) == (True, "")
    assert asked == ([] if case == "half" else [1])  # the half types are not gated: nothing is measured


def test_the_margin_applies_end_to_end():
    from torch_sparserl.evaluate import verdict

    allowed, why = verdict.end_to_end(timed(4.0, 6.0, 2), "spmv", torch.float32, 1.05, _costs)
    assert allowed and "1.17x" in why
    allowed, _ = verdict.end_to_end(timed(4.0, 6.0, 2), "spmv", torch.float32, 1.2, _costs)
    assert not allowed


def test_the_launch_check_names_what_differs():
    from torch_sparserl.evaluate import verdict

    pattern, crow, col = _class_operands()
    bias_seen = []

    def fused(val, X, bias, scale):
        bias_seen.append(bias is not None and scale is not None)
        A = torch.sparse_csr_tensor(crow.long(), col.long(), val.double(), (pattern.nrows, pattern.ncols))
        return ((A.to_dense() @ X.double()) * scale.double()[:, None] + bias.double()).relu().float()

    assert verdict.launch_check(fused, pattern, crow, col, op="spmm", n=4, dtype=torch.float32, seed=1,
                                epilogue="scale_bias_relu") is None and bias_seen == [True]
    why = verdict.launch_check(lambda val, X, bias, scale: torch.zeros(pattern.nrows, 4), pattern, crow, col,
                               op="spmm", n=4, dtype=torch.float32, seed=1)
    assert why.startswith(f"differs from the float64 reference on a pattern of {pattern.nrows} rows and "
                          f"{pattern.nnz} nonzeros: ")
    assert verdict.launch_check(lambda *a: None, pattern, crow, col, op="spmv", n=1, dtype=torch.float32,
                                seed=1) == f"declined a pattern of {pattern.nrows} rows and {pattern.nnz} nonzeros"


# ======================================================================= one search for both tuners

def test_both_tuners_run_the_one_screen_and_validation(monkeypatch):
    """tune and policy_tune screen and validate through the same functions, which see the
    same records the sandbox gave."""
    from torch_sparserl.specialize import search
    from torch_sparserl.specialize.policy.propose import policy_tune

    seen = []
    real_screen, real_validate = search.screen, search.validate
    monkeypatch.setattr(search, "screen", lambda *a, **kw: seen.append("screen") or real_screen(*a, **kw))
    monkeypatch.setattr(search, "validate", lambda *a, **kw: seen.append("validate") or real_validate(*a, **kw))
    tune(cora(), op="spmv", sandbox=ScriptedSandbox(SCREEN, FINAL), top_k=2, budget_s=1e9)
    assert seen == ["screen", "validate"]
    policy_tune(cora(), op="spmv", policy=RankingPolicy(), k=3, sandbox=ScriptedSandbox(SCREEN, FINAL))
    assert seen == ["screen", "validate"] * 2


def test_validate_takes_records_already_final_and_keeps_cusparses_fastest():
    from torch_sparserl.specialize import search

    class Spec:
        def __init__(self, key):
            self.key, self.family, self.params = key, key, ()

    box = ScriptedSandbox({}, {1: 20.0}, cusparse={1: 95.0})
    box.order = ["a", "b"]
    problem = search.Problem(box, np.zeros(1, np.int32), np.zeros(0, np.int32), (0, 0), {}, "m", 1, "f32", 1.0)
    done = _record("a", speedup=9.0)  # 10 us, cuSPARSE 90 us: already validated
    done.timing["stage"] = "final"
    screened = [(done, Spec("a")), (_record("b", speedup=1.0), Spec("b"))]

    class Result:
        table, cusparse_us, best, best_spec = [], None, None, None

    result = Result()
    search.validate(problem, screened, FINAL_CONFIG, result, finalists=2, done={"a": done})
    assert box.calls == [(1, "final")] and result.table[0].runtime_us == 20.0  # only b was evaluated
    assert result.best is done and result.best_spec.key == "a" and result.cusparse_us == 90.0  # done's
