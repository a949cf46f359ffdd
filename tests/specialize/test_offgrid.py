"""Kernels beyond the grid on the CPU: the families' domain, the gate a written kernel passes
(the family line, the plan line and the macros against the template), the off-grid neighbours,
the policy's ``explore`` strategy, and nvcc building a sample of off-grid kernels."""

import shutil

import pytest

from torch_sparserl.abi import PlanError, check_source
from torch_sparserl.specialize import families as F
from torch_sparserl.specialize import offgrid as O
from torch_sparserl.specialize.policy.encoder import PatternInput

HAS_NVCC = shutil.which("nvcc") is not None
REQUESTS = [("spmv", "f32", 1), ("spmm", "f32", 32), ("spmm", "f32", 128), ("spmm", "bf16", 128),
            ("spmm", "f16", 64), ("sddmm", "f32", 64)]


def _source(family, params, op, dtype, n):
    return F.render(family, params, op=op, dtype=dtype, n=n, compact=True).source


def _with_family_line(source, line):
    lines = source.split("\n")
    i = next(i for i, text in enumerate(lines) if text.startswith("// family:"))
    return "\n".join(lines[:i] + [line] + lines[i + 1:])


# ------------------------------------------------------------------------ the domain


@pytest.mark.parametrize("op,dtype,n", REQUESTS)
def test_the_grid_lies_inside_the_domain(op, dtype, n):
    points = F.space(op, dtype, n, None, opt_in=F.OPT_IN_FAMILIES if op == "spmm" else ())
    assert points
    for family, params in points:
        assert F.valid(family, params, op=op, dtype=dtype, n=n) is None


def test_every_family_documents_every_parameter_its_template_takes():
    for name, fam in F.FAMILIES.items():
        taken = set()
        for op in fam.ops:
            n = 1 if op == "spmv" else 32
            taken |= {k for k, _ in F.render(name, {}, op=op, dtype="f32", n=n).params}
        assert set(F.domain(name).params) == taken, name
    with pytest.raises(ValueError, match=r"domain: unknown family 'tiles'"):
        F.domain("tiles")


OFF_GRID = [
    ("vector_row", {"lanes": 4, "block": 96, "unroll": 3}, "spmv", "f32", 1),
    ("vector_row", {"lanes": 32, "block": 1024, "unroll": 8, "rows": "sorted_desc"}, "spmv", "f32", 1),
    ("nnz_split", {"chunk": 96, "block": 320}, "spmv", "f32", 1),
    ("nnz_split", {"lanes": 16, "vec": 2, "chunk": 48, "block": 192, "unroll": 3}, "spmm", "f32", 32),
    ("merge_path", {"items": 24, "block": 384}, "spmv", "f32", 1),
    ("sell", {"c": 64, "sigma": 512, "block": 128, "unroll": 5}, "spmv", "f32", 1),
    ("binned", {"edges": (3, 48, 768, 6000), "lanes": (1, 4, 32, 32, 160), "block": 160, "unroll": 3},
     "spmv", "f32", 1),
    ("rowchunks", {"lanes": 8, "seg": 768, "block": 448, "unroll": 6}, "spmv", "f32", 1),
    ("rowchunks", {"lanes": 16, "vec": 8, "seg": 48, "block": 128, "unroll": 3}, "spmm", "bf16", 128),
    ("group_row", {"lanes": 32, "vec": 2, "block": 160, "unroll": 3}, "spmm", "f32", 32),
    ("group_row", {"lanes": 4, "vec": 8, "block": 512, "unroll": 1}, "spmm", "f16", 64),
    ("warp_row_staged", {"lanes": 16, "vec": 2, "block": 96, "stage": "smem"}, "spmm", "f32", 32),
    ("tc_tiles", {"window": 32, "j": 2, "ksplit": 2, "block": 96}, "spmm", "f32", 64),
    ("group_row", {"lanes": 8, "vec": 4, "block": 192, "unroll": 5}, "sddmm", "f32", 64),
]


@pytest.mark.parametrize("family,params,op,dtype,n", OFF_GRID)
def test_an_off_grid_kernel_is_inside_the_domain_and_passes_the_gate(family, params, op, dtype, n):
    """Values the grid never lists render through the template, pass the domain gate, and are
    device-only ABI sources (the check every candidate passes before a compiler sees it)."""
    assert F.valid(family, params, op=op, dtype=dtype, n=n) is None
    key = O.canonical(family, params, op=op, dtype=dtype, n=n)
    assert key not in O.grid_keys(op, dtype, n, None)
    compact = _source(family, params, op, dtype, n)
    declared, got = O.check_declared(compact, op=op, dtype=dtype, n=n)
    assert declared == family and all(got[k] == v for k, v in params.items())
    full = F.expand_headers(compact)
    plan = check_source(full)
    assert plan.op == op and plan.block == params.get("block", 256)


# each constraint of the domain, violated: (family, params, op, dtype, n, words the refusal names)
OUTSIDE = [
    ("vector_row", {"lanes": 3}, "spmv", "f32", 1, ("'lanes'", "(1, 2, 4, 8, 16, 32)", "3")),
    ("vector_row", {"lanes": 64}, "spmv", "f32", 1, ("'lanes'", "64")),
    ("vector_row", {"block": 100}, "spmv", "f32", 1, ("'block'", "a multiple of 32 in 64..1024", "100")),
    ("vector_row", {"block": 32}, "spmv", "f32", 1, ("'block'", "a multiple of 32 in 64..1024", "32")),
    ("vector_row", {"block": 1056}, "spmv", "f32", 1, ("'block'", "64..1024", "1056")),
    ("vector_row", {"unroll": 0}, "spmv", "f32", 1, ("'unroll'", "an integer in 1..8", "0")),
    ("vector_row", {"unroll": 9}, "spmv", "f32", 1, ("'unroll'", "an integer in 1..8", "9")),
    ("vector_row", {"rows": "binned"}, "spmv", "f32", 1, ("'rows'", "'binned'")),
    ("vector_row", {"warps": 2}, "spmv", "f32", 1, ("unknown parameter", "'warps'")),
    ("group_row", {"vec": 4}, "spmm", "f32", 6, ("'vec'", "a divisor of n=6")),
    ("group_row", {"vec": 8}, "spmm", "f32", 32, ("'vec'", "(1, 2, 4)", "8")),
    ("group_row", {"epilogue": "relu"}, "sddmm", "f32", 32, ("'epilogue'", "'none' for op=sddmm")),
    ("group_row", {"lanes": 1, "vec": 1}, "sddmm", "f32", 256, ("'lanes'", "op=sddmm", "32 registers")),
    ("nnz_split", {"chunk": 100}, "spmv", "f32", 1, ("'chunk'", "a multiple of 32", "100")),
    ("nnz_split", {"chunk": 0}, "spmm", "f32", 32, ("'chunk'", "0")),
    ("nnz_split", {}, "spmv", "f16", 1, ("'dtype'", "f32 for op=spmv", "atomics")),
    ("merge_path", {"items": 4097}, "spmv", "f32", 1, ("'items'", "1..4096", "4097")),
    ("merge_path", {}, "spmv", "bf16", 1, ("'dtype'", "f32")),
    ("sell", {"c": 24, "sigma": 48}, "spmv", "f32", 1, ("'c'", "24")),
    ("sell", {"c": 32, "sigma": 48}, "spmv", "f32", 1, ("'sigma'", "multiple of c=32", "48")),
    ("binned", {"edges": (32, 4)}, "spmv", "f32", 1, ("'edges'", "strictly increasing")),
    ("binned", {"edges": (4, 32), "lanes": (1, 2)}, "spmv", "f32", 1, ("'lanes'", "3 lane counts")),
    ("binned", {"edges": (4,), "lanes": (1, 512)}, "spmv", "f32", 1, ("'lanes'", "block=256", "512")),
    ("rowchunks", {"seg": 0}, "spmv", "f32", 1, ("'seg'", "0")),
    ("warp_row_staged", {"lanes": 4}, "spmm", "f32", 32, ("'lanes'", "(8, 16, 32)", "4")),
    ("warp_row_staged", {"stage": "regs"}, "spmm", "f32", 32, ("'stage'", "'regs'")),
    ("tc_tiles", {"window": 32, "j": 4, "block": 1024}, "spmm", "f32", 64,
     ("'block'", "at most 96 threads", "shared memory")),
    ("tc_tiles", {"ksplit": 2}, "spmm", "f16", 64, ("'ksplit'", "1 for dtype=f16")),
    ("tc_tiles", {"math": "tf32"}, "spmm", "bf16", 64, ("'math'", "'ieee' for dtype=bf16")),
    ("tc_tiles", {"j": 2}, "spmm", "f32", 48, ("'j'", "multiple of 16*j = 32")),
    ("tc_tiles", {}, "spmv", "f32", 1, ("'op'", "['spmm']")),
]


@pytest.mark.parametrize("family,params,op,dtype,n,words", OUTSIDE)
def test_a_kernel_outside_the_domain_is_refused_naming_the_parameter_and_the_constraint(family, params, op, dtype,
                                                                                          n, words):
    why = F.valid(family, params, op=op, dtype=dtype, n=n)
    assert why is not None and why.startswith(f"family {family}: ")
    for word in words:
        assert word in why, (word, why)
    # the same parameters declared on a kernel's family line: refused before any compiler
    base = _source(family, {}, *(("spmv", "f32", 1) if "spmv" in F.FAMILIES[family].ops else ("spmm", "f32", 64)))
    line = f"// family: {family}(" + ",".join(f"{k}={v}".replace(" ", "") for k, v in params.items()) + ")"
    with pytest.raises(PlanError, match="outside the domain") as info:
        O.check_declared(_with_family_line(base, line), op=op, dtype=dtype, n=n)
    assert all(word in str(info.value) for word in words)


@pytest.mark.parametrize("edit,match", [
    (lambda s: s.replace("#define SR_UNROLL 2", "#define SR_UNROLL 3"), r"#define SR_UNROLL is '3' where .* give '2'"),
    (lambda s: s.replace("#define SR_LANES 8\n", ""), r"#define SR_LANES is 'missing' where .* give '8'"),
    (lambda s: s.replace("#define SR_VEC 4", "#define SR_VEC 4\n#define SR_EXTRA 1"),
     r"#define SR_EXTRA is '1' where .* give 'no such macro'"),
    (lambda s: s.replace("block=256 grid=ceil(rows/32)", "block=512 grid=ceil(rows/64)"),
     r"the plan line .*block=512.* is not the one family group_row renders"),
    (lambda s: _with_family_line(s, "// nothing here"), r"no '// family: name\(param=value,...\)' line"),
    (lambda s: _with_family_line(s, "// family: group_row(lanes=8,lanes=4)"), "names parameter 'lanes' twice"),
    (lambda s: _with_family_line(s, "// family: group_row(lanes=eight!)"), r"parameter 'lanes' expected an integer"),
    (lambda s: _with_family_line(s, "// family: group_row(lanes)"), r"expected name=value items, got 'lanes'"),
    (lambda s: _with_family_line(s, "// family: grp_row(lanes=8)"), r"unknown family 'grp_row'"),
])
def test_a_kernel_whose_text_disagrees_with_its_family_line_is_refused(edit, match):
    good = _source("group_row", {"lanes": 8, "vec": 4, "unroll": 2}, "spmm", "f32", 32)
    O.check_declared(good, op="spmm", dtype="f32", n=32)
    bad = edit(good)
    assert bad != good
    with pytest.raises(PlanError, match=match):
        O.check_declared(bad, op="spmm", dtype="f32", n=32)


def test_the_family_line_reads_integers_tuples_and_words():
    family, params = O.parse_family_line(_source("binned", {"edges": (4,), "lanes": (2, 256)}, "spmv", "f32", 1))
    assert family == "binned" and params == {"block": 256, "edges": (4,), "lanes": (2, 256), "unroll": 2}
    _, params = O.parse_family_line(_source("group_row", {"epilogue": "bias+relu"}, "spmm", "f32", 32))
    assert params["epilogue"] == "bias+relu" and params["rows"] == "natural"


# ------------------------------------------------------------------------ neighbours


@pytest.mark.parametrize("op,dtype,n", REQUESTS)
def test_off_grid_neighbours_are_in_the_domain_outside_the_grid_and_device_only(op, dtype, n):
    anchors = F.space(op, dtype, n, None)[:2] + [p for p in F.space(op, dtype, n, None) if p[0] == "rowchunks"][:1]
    found = O.off_grid(anchors, op=op, dtype=dtype, n=n)
    assert len(found) >= 10
    grid = O.grid_keys(op, dtype, n, None)
    keys = [O.canonical(f, p, op=op, dtype=dtype, n=n) for f, p in found]
    assert len(set(keys)) == len(keys) and not set(keys) & grid
    for family, params in found[::7]:
        assert F.valid(family, params, op=op, dtype=dtype, n=n) is None
        compact = _source(family, params, op, dtype, n)
        O.check_declared(compact, op=op, dtype=dtype, n=n)
        check_source(F.expand_headers(compact))  # the device-only scan, the plan, the kernel's name


def test_neighbours_move_each_parameter_within_its_domain():
    moved = O.neighbours("vector_row", {"lanes": 8, "block": 256, "unroll": 2}, op="spmv", dtype="f32", n=1,
                         pairs=False)
    changes = {(k, p[k]) for p in moved for k in p if p[k] != {"lanes": 8, "block": 256, "unroll": 2,
                                                                "rows": "natural"}[k]}
    assert changes == {("lanes", 4), ("lanes", 16), ("block", 128), ("block", 512), ("block", 192),
                       ("block", 320), ("unroll", 1), ("unroll", 3), ("unroll", 4), ("rows", "sorted_desc")}
    edge = O.neighbours("vector_row", {"lanes": 32, "block": 1024, "unroll": 8}, op="spmv", dtype="f32", n=1,
                        pairs=False)
    assert all(p["lanes"] <= 32 and p["block"] <= 1024 and p["unroll"] <= 8 for p in edge)
    binned = O.neighbours("binned", {}, op="spmv", dtype="f32", n=1)
    assert any(len(p["edges"]) == 4 and len(p["lanes"]) == 5 for p in binned)
    assert all(F.valid("binned", p, op="spmv", dtype="f32", n=1) is None for p in binned)


# ------------------------------------------------------------------------ the policy


@pytest.fixture(scope="module")
def shipped():
    from torch_sparserl.specialize.policy import load_default

    return load_default("cpu")


@pytest.fixture(scope="module")
def citeseer():
    from torch_sparserl.data.datasets import load_matrix
    from torch_sparserl.pattern.features import structural_features

    A = load_matrix("citeseer")
    return A, structural_features(A.indptr, A.indices, A.shape)


def test_the_default_proposals_are_the_ones_before_exploring_existed(shipped, citeseer):
    """The space, the ranked proposals and the sampled ones for a fixed seed are those the code
    gave before the domain was widened and ``explore`` added (keys recorded at c856fc4)."""
    import hashlib
    import json

    from torch_sparserl.specialize.policy.propose import propose

    A, feats = citeseer
    space = F.space("spmm", "f32", 64, feats)
    assert hashlib.sha256(json.dumps(space, sort_keys=True, default=list).encode()).hexdigest()[:16] == \
        "961c75d75780338f"
    spmv = F.space("spmv", "f32", 1, None)
    assert hashlib.sha256(json.dumps(spmv, sort_keys=True, default=list).encode()).hexdigest()[:16] == \
        "082852f9bdde9ba3"
    ranked = propose(shipped, A.indptr, A.indices, A.shape, op="spmm", n=64, k=4, seed=0, features=feats)
    assert [p.spec.key for p in ranked] == ["350064506af5c80bb77d", "c5e1cd09b5d3bf940b53",
                                            "93f0fd597691fcbcbe89", "03c632741549f453f0a7"]
    assert not any(p.off_grid for p in ranked)
    sampled = propose(shipped, A.indptr, A.indices, A.shape, op="spmv", n=1, k=3, seed=5, features=feats,
                      strategy="sample")
    assert [p.spec.key for p in sampled] == ["f9fe1e3dfdff1abd3418"] * 3


def test_explore_proposes_the_first_choice_then_off_grid_kernels_inside_the_domain(shipped, citeseer):
    from torch_sparserl.specialize.policy.propose import propose

    A, feats = citeseer
    props = propose(shipped, A.indptr, A.indices, A.shape, op="spmm", n=32, dtype="f32", k=6, features=feats,
                    strategy="explore", seed=0, temperature=1.0)
    ranked = propose(shipped, A.indptr, A.indices, A.shape, op="spmm", n=32, k=1, features=feats)[0]
    assert props[0].spec.key == ranked.spec.key and not props[0].off_grid
    assert [p.off_grid for p in props] == [False] + [True] * 5
    grid = O.grid_keys("spmm", "f32", 32, feats)
    assert len({p.spec.key for p in props}) == 6
    for p in props:
        assert p.error is None and p.sample.finished
        family, params = O.check_declared(p.compact, op="spmm", dtype="f32", n=32)
        assert family == p.spec.family
        assert (O.canonical(family, params, op="spmm", dtype="f32", n=32) in grid) == (not p.off_grid)
        check_source(p.spec.source)
    # the policy's scores are those of the texts written out
    inp = PatternInput.from_pattern(A.indptr, A.indices, A.shape, "spmm", "f32", 32, shipped.config.samples,
                                    features=feats)
    assert shipped.score(inp, "spmm", "f32", 32, [props[1].sample.text]) == \
        pytest.approx([props[1].sample.logprob], abs=1e-3)


def _pool(logps):
    from torch_sparserl.specialize.policy.model import Sample

    return [Sample(text=str(i), tokens=[], logprob=v, finished=True) for i, v in enumerate(logps)]


def test_explore_draws_by_the_policys_scores_without_replacement():
    from torch_sparserl.specialize.policy.propose import draw

    pool = _pool([-1.0, -3.0, -2.0, -40.0, -2.5])
    assert [s.text for s in draw(pool, 3, 0.0, seed=0)] == ["0", "2", "4"]
    assert [s.text for s in draw(pool, 9, 1.0, seed=0)] == ["0", "2", "4", "1", "3"]
    once = [s.text for s in draw(pool, 3, 1.0, seed=7)]
    assert once == [s.text for s in draw(pool, 3, 1.0, seed=7)] and len(set(once)) == 3
    # at temperature 1 the first draw follows softmax(logprob): "0" with e^-1/(e^-1+e^-2+e^-2.5+e^-3) = 58%
    firsts = [draw(pool, 1, 1.0, seed=s)[0].text for s in range(2000)]
    assert firsts.count("0") / 2000 == pytest.approx(0.579, abs=0.04) and "3" not in firsts
    # very hot: about uniform, the -40 one included
    hot = [draw(pool, 1, 1e6, seed=s)[0].text for s in range(2000)]
    assert hot.count("3") / 2000 == pytest.approx(0.2, abs=0.04)


def test_an_explored_text_outside_the_domain_is_a_plan_failure_never_built():
    from torch_sparserl.specialize.policy import corpus
    from torch_sparserl.specialize.policy.model import Sample
    from torch_sparserl.specialize.policy.propose import to_proposal

    text = corpus.completion_text(_source("vector_row", {"unroll": 8}, "spmv", "f32", 1), "spmv", "f32", 1)
    bad = text.replace("unroll=8", "unroll=9").replace("#define SR_UNROLL 8", "#define SR_UNROLL 9")
    sample = Sample(text=bad, tokens=[], logprob=0.0, finished=True)
    assert to_proposal(sample, "spmv", "f32", 1).error is None  # the default path leaves it to the compiler
    refused = to_proposal(sample, "spmv", "f32", 1, check_domain=True)
    assert "outside the domain" in refused.error and "'unroll'" in refused.error and "1..8" in refused.error


@pytest.mark.parametrize("kwargs,match", [
    (dict(strategy="explore", k=1), r"strategy='explore' needs k >= 2"),
    (dict(strategy="explore", temperature=-1.0), r"strategy='explore' needs a finite temperature >= 0 \(got -1.0\)"),
    (dict(strategy="explore", temperature=float("nan")), r"strategy='explore' needs a finite temperature >= 0"),
])
def test_explore_names_bad_arguments(shipped, kwargs, match):
    from torch_sparserl.specialize.policy.propose import propose

    with pytest.raises(ValueError, match=match):
        propose(shipped, [0, 1, 2], [0, 1], (2, 2), op="spmm", n=32, **kwargs)


# ------------------------------------------------------------------------ the compile tier


@pytest.mark.skipif(not HAS_NVCC, reason="nvcc not installed")
@pytest.mark.parametrize("index", [0, 2, 6, 9, 11])
def test_nvcc_builds_off_grid_kernels(index):
    """A sample of off-grid kernels (every family's, each an off-grid value) compiles for sm_90."""
    from torch_sparserl.evaluate.compile_tier import compile_only

    family, params, op, dtype, n = OFF_GRID[index]
    spec = F.render(family, params, op=op, dtype=dtype, n=n)
    record = compile_only(spec)
    assert record.compiled, record.log[-2000:]


@pytest.mark.slow  # a sandbox worker loads the policy and scores the neighbours again (20-60 s on a shared CPU)
def test_the_policy_in_a_sandbox_worker_explores_what_it_explores_here(shipped):
    from torch_sparserl.data.datasets import load_matrix
    from torch_sparserl.evaluate.sandbox import Sandbox
    from torch_sparserl.specialize.policy import CHECKPOINT_DIR
    from torch_sparserl.specialize.policy.propose import SandboxedPolicy, propose

    A = load_matrix("cora")
    kwargs = dict(op="spmv", n=1, k=4, seed=3, temperature=2.0, strategy="explore")
    here = propose(shipped, A.indptr, A.indices, A.shape, **kwargs)
    with Sandbox(init=None, matrix_loader=None, health_check=None) as box:  # a CPU worker
        there = propose(SandboxedPolicy(box, CHECKPOINT_DIR), A.indptr, A.indices, A.shape, **kwargs)
    assert [p.compact for p in there] == [p.compact for p in here]
    assert [p.off_grid for p in there] == [p.off_grid for p in here] == [False, True, True, True]
    assert all(p.error is None for p in there)
