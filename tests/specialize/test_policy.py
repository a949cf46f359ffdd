"""The learned policy on the CPU: encoder, tokenizer, compact sources, checkpoints, the
shipped policy's candidates compiled with nvcc, and the runtime's choice of specializer."""

import copy
import math
import os
import re
import shutil

import numpy as np
import pytest
import torch

from torch_sparserl.abi import PlanError
from torch_sparserl.specialize import families
from torch_sparserl.specialize.policy import corpus
from torch_sparserl.specialize.policy.encoder import (N_FEATURES, PatternEncoder, PatternInput, collate, feature_vector,
                                                      sample_coordinates, sinusoidal)
from torch_sparserl.specialize.policy.model import KernelPolicy, Sample, build
from torch_sparserl.specialize.policy import model as model_module
from torch_sparserl.specialize.policy.propose import to_proposal
from torch_sparserl.specialize.policy.tokenizer import EOS, special_ids, train_tokenizer

HAS_NVCC = shutil.which("nvcc") is not None


# ------------------------------------------------------------------------ encoder


def test_sinusoidal_matches_the_formula():
    d = 16
    pos = torch.tensor([0, 1, 7, 12345, 3_000_000])
    pe = sinusoidal(pos, d)
    for a, i in enumerate(pos.tolist()):
        for j in range(d // 2):
            angle = i / 10000 ** (2 * j / d)
            assert pe[a, 2 * j].item() == pytest.approx(math.sin(angle), abs=1e-6)
            assert pe[a, 2 * j + 1].item() == pytest.approx(math.cos(angle), abs=1e-6)


def test_sinusoidal_refuses_odd_width():
    with pytest.raises(ValueError, match="even"):
        sinusoidal(torch.arange(3), 5)


def _random_csr(rows, cols, per_row, seed=0):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, 2 * per_row + 1, rows)
    rowptr = np.concatenate([[0], np.cumsum(lengths)])
    col = np.concatenate([np.sort(rng.choice(cols, size=l, replace=False)) for l in lengths]) if rowptr[-1] else np.zeros(0)
    return rowptr.astype(np.int64), col.astype(np.int64)


@pytest.mark.parametrize("samples", [8, 64, 1000])
def test_sampled_coordinates_are_nonzeros_in_row_major_order(samples):
    rowptr, col = _random_csr(50, 40, 5, seed=samples)
    rows, cols = sample_coordinates(rowptr, col, samples, seed=3)
    assert rows.shape == cols.shape == (samples,)
    nonzeros = {(r, c) for r in range(50) for c in col[rowptr[r]:rowptr[r + 1]]}
    assert all((r, c) in nonzeros for r, c in zip(rows.tolist(), cols.tolist()))
    order = rows * 100 + cols
    assert np.all(np.diff(order) >= 0)
    if samples <= rowptr[-1]:  # without replacement: distinct nonzeros
        assert len(set(zip(rows.tolist(), cols.tolist()))) == samples


def test_sampled_coordinates_of_an_empty_matrix():
    rows, cols = sample_coordinates(np.zeros(5, np.int64), np.zeros(0, np.int64), 4)
    assert rows.tolist() == cols.tolist() == [0, 0, 0, 0]


def test_feature_vector_names_bad_requests():
    f = {"rows": 10, "cols": 10, "nnz": 30}
    assert feature_vector(f, "spmm", "f32", 32).shape == (N_FEATURES,)
    with pytest.raises(ValueError, match="op expected"):
        feature_vector(f, "sddmm", "f32", 32)
    with pytest.raises(ValueError, match="dtype expected"):
        feature_vector(f, "spmm", "f64", 32)


@pytest.mark.parametrize("coords", ["sinusoidal", "raw"])
def test_encoder_gives_one_prefix_position_per_sample_plus_features(coords):
    rowptr, col = _random_csr(100, 80, 4)
    inputs = [PatternInput.from_pattern(rowptr, col, (100, 80), "spmm", "f32", 32, samples=16, seed=s)
              for s in range(3)]
    enc = PatternEncoder(hidden=24, pe_dim=8, coords=coords)
    out = enc(**collate(inputs))
    assert out.shape == (3, 17, 24)
    assert torch.isfinite(out).all()
    with pytest.raises(ValueError, match="coords expected"):
        PatternEncoder(hidden=8, coords="learned")


# ------------------------------------------------------------------------ compact sources, tokenizer


@pytest.mark.parametrize("op,dtype,n", [("spmv", "f32", 1), ("spmv", "bf16", 1), ("spmm", "f32", 32),
                                        ("spmm", "f16", 128)])
def test_every_compact_source_expands_to_the_full_rendering(op, dtype, n):
    for family, params in families.space(op, dtype, n):
        compact = families.render(family, params, op=op, dtype=dtype, n=n, compact=True)
        full = families.render(family, params, op=op, dtype=dtype, n=n)
        assert "#include \"sparserl/prelude.cuh\"" in compact.source
        assert families.expand_headers(compact.source) == full.source


def test_unknown_abi_header_is_a_plan_error():
    with pytest.raises(PlanError, match="unknown ABI header"):
        families.expand_headers('#include "sparserl/nothing.cuh"\n')


def test_completion_text_needs_the_request():
    src = families.render("group_row", None, op="spmm", dtype="f32", n=32, compact=True).source
    assert corpus.request("spmm", "f32", 32) + corpus.completion_text(src, "spmm", "f32", 32) == src
    with pytest.raises(ValueError, match="does not start with"):
        corpus.completion_text(src, "spmm", "f32", 64)


@pytest.fixture(scope="module")
def small_tokenizer():
    docs = corpus.kernel_documents(ns_spmm=(32,), dtypes=("f32",))
    return train_tokenizer(corpus.iter_texts(docs, [], per_family=8), vocab_size=2000), docs


def test_tokenizer_round_trips_and_compresses_kernels(small_tokenizer):
    tok, docs = small_tokenizer
    assert set(special_ids(tok)) == {"<pad>", "<bos>", "<eos>"}
    for doc in docs[::7]:
        ids = tok.encode(doc[-1]).ids
        assert tok.decode(ids) == doc[-1]
        assert len(ids) < len(doc[-1]) / 4  # whole lines merge: far fewer tokens than bytes
    odd = "__global__ void weird(){ /* ünïcode */ }\n"
    assert tok.decode(tok.encode(odd).ids) == odd  # byte level: any text encodes


# ------------------------------------------------------------------------ model, checkpoints


def test_checkpoint_round_trip_gives_the_same_greedy_samples(tmp_path, small_tokenizer):
    tok, _ = small_tokenizer
    torch.manual_seed(0)
    policy = build(tok, hidden=32, layers=1, heads=2, intermediate=64, samples=8, pe_dim=8)
    rowptr, col = _random_csr(60, 60, 3)
    inp = PatternInput.from_pattern(rowptr, col, (60, 60), "spmv", "f32", 1, samples=8)
    before = policy.sample(inp, "spmv", "f32", 1, k=2, temperature=0.0, max_new_tokens=12)
    policy.save(tmp_path / "ck", dtype=torch.float32)
    loaded = KernelPolicy.load(tmp_path / "ck")
    after = loaded.sample(inp, "spmv", "f32", 1, k=2, temperature=0.0, max_new_tokens=12)
    assert [s.tokens for s in before] == [s.tokens for s in after]
    assert loaded.lm.lm_head.weight.data_ptr() == loaded.lm.model.embed_tokens.weight.data_ptr()


def test_sft_loss_only_counts_completion_tokens(small_tokenizer):
    tok, _ = small_tokenizer
    torch.manual_seed(0)
    policy = build(tok, hidden=32, layers=1, heads=2, intermediate=64, samples=4, pe_dim=8)
    rowptr, col = _random_csr(30, 30, 2)
    inp = PatternInput.from_pattern(rowptr, col, (30, 30), "spmm", "f32", 32, samples=4)
    req = policy.request_ids("spmm", "f32", 32)
    comp = [5, 6, 7, special_ids(tok)[EOS]]
    lps = policy.completion_logprobs([inp, inp], [req, req], [comp, comp[:2]])
    assert [lp.shape[0] for lp in lps] == [4, 2]
    assert torch.allclose(lps[0][:2], lps[1], atol=1e-5)  # right padding does not leak


def test_scoring_completions_equals_their_summed_token_logprobs(small_tokenizer):
    """score() runs the prefix once and the completions after its cache, batched and padded;
    completion_logprobs() runs each whole sequence with a mask. They must agree, and the
    batch size must not change a score."""
    tok, _ = small_tokenizer
    torch.manual_seed(0)
    policy = build(tok, hidden=32, layers=2, heads=2, intermediate=64, samples=8, pe_dim=8)
    rowptr, col = _random_csr(50, 40, 3)
    inp = PatternInput.from_pattern(rowptr, col, (50, 40), "spmm", "f32", 32, samples=8)
    texts = [corpus.completion_text(corpus.render_compact(f, p, "spmm", "f32", 32), "spmm", "f32", 32)
             for f, p in families.space("spmm", "f32", 32)[:5]] + ["", " x"]
    eos = special_ids(tok)[EOS]
    req = policy.request_ids("spmm", "f32", 32)
    with torch.no_grad():
        expected = [float(lp.sum()) for lp in policy.completion_logprobs(
            [inp] * len(texts), [req] * len(texts), [policy.encode(t) + [eos] for t in texts])]
    for batch in (1, 3, 16, None):
        assert policy.score(inp, "spmm", "f32", 32, texts, batch=batch) == pytest.approx(expected, abs=1e-3)
    budget = model_module.SCORE_LOGIT_BYTES
    try:  # a budget that holds one completion per pass
        model_module.SCORE_LOGIT_BYTES = {"cuda": 1, "cpu": 1}
        assert policy.score(inp, "spmm", "f32", 32, texts) == pytest.approx(expected, abs=1e-3)
    finally:
        model_module.SCORE_LOGIT_BYTES = budget
    assert policy.score(inp, "spmm", "f32", 32, []) == []
    with pytest.raises(ValueError, match="batch must be >= 1"):
        policy.score(inp, "spmm", "f32", 32, texts, batch=0)


def test_completion_ids_tokenize_each_text_once_and_stay_bounded(small_tokenizer, monkeypatch):
    tok, _ = small_tokenizer
    policy = build(tok, hidden=32, layers=2, heads=2, intermediate=64, samples=8, pe_dim=8)
    eos = special_ids(tok)[EOS]
    texts = [corpus.completion_text(corpus.render_compact(f, p, "spmm", "f32", 32), "spmm", "f32", 32)
             for f, p in families.space("spmm", "f32", 32)[:4]]
    expected = [tok.encode(t).ids + [eos] for t in texts]
    assert policy.completion_ids(texts + texts[:1]) == expected + expected[:1]

    class Counting:  # the tokenizer, its batches recorded
        def __init__(self, inner):
            self.inner, self.batches = inner, []

        def encode_batch(self, batch):
            self.batches.append(list(batch))
            return self.inner.encode_batch(batch)

        def __getattr__(self, name):
            return getattr(self.inner, name)

    policy.tokenizer = counting = Counting(policy.tokenizer)
    first = policy.completion_ids(texts)
    first[0].append(-1)  # a caller's list is its own
    assert policy.completion_ids(texts) == expected and counting.batches == []
    monkeypatch.setattr(model_module, "COMPLETION_MEMO", 2)
    assert policy.completion_ids(texts[:3] + ["", " x"]) == expected[:3] + [[eos], tok.encode(" x").ids + [eos]]
    assert list(policy._completion_memo) == ["", " x"] and counting.batches == [["", " x"]]
    policy.tokenizer = counting.inner
    assert copy.deepcopy(policy).completion_ids([" x"]) == [tok.encode(" x").ids + [eos]]  # still copyable


def test_score_batches_group_by_length_within_the_logit_budget():
    lengths = [300, 5, 120, 7, 300, 60, 1]
    vocab = 100
    for budget, rows in ((10**9, None), (300 * vocab * 4 * 2, None), (1, None), (10**9, 2)):
        groups = model_module.score_batches(lengths, budget, vocab, rows)
        flat = [i for g in groups for i in g]
        assert sorted(flat) == list(range(len(lengths)))  # each once
        assert [lengths[i] for i in flat] == sorted(lengths)  # shortest first
        for g in groups:
            assert len(g) == 1 or len(g) * max(lengths[i] for i in g) * vocab * 4 <= budget
            assert rows is None or len(g) <= rows
    assert model_module.score_batches(lengths, 10**9, vocab) == [[6, 1, 3, 5, 2, 0, 4]]
    assert len(model_module.score_batches(lengths, 1, vocab)) == len(lengths)
    assert model_module.score_batches([], 1, vocab) == []


def test_loading_a_broken_checkpoint_names_the_problem(tmp_path):
    with pytest.raises(FileNotFoundError, match="lacks config.json"):
        KernelPolicy.load(tmp_path)
    (tmp_path / "config.json").write_text('{"format": "other"}')
    (tmp_path / "model.safetensors").write_bytes(b"")
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(ValueError, match="not a torch_sparserl policy checkpoint"):
        KernelPolicy.load(tmp_path)


def test_a_proposal_that_cannot_become_a_source_is_a_plan_failure():
    text = ' rows=natural split=none block=256 grid=ceil(rows/8)\n#include "sparserl/bogus.cuh"\n'
    p = to_proposal(Sample(text, [1, 2], 0.0, True), "spmv", "f32", 1)
    assert p.error and "unknown ABI header" in p.error
    unfinished = to_proposal(Sample(" rows=natural", [1], 0.0, False), "spmv", "f32", 1)
    assert "did not end" in unfinished.error


# ------------------------------------------------------------------------ the shipped checkpoint


@pytest.fixture(scope="module")
def shipped():
    from torch_sparserl.specialize.policy import CHECKPOINT_DIR, load_default

    if not (CHECKPOINT_DIR / "model.safetensors").exists():
        pytest.fail(f"the shipped policy checkpoint is missing from {CHECKPOINT_DIR}")
    return load_default("cpu")


def test_shipped_checkpoint_fits_in_the_package(shipped):
    from torch_sparserl.specialize.policy import CHECKPOINT_DIR

    size = sum(f.stat().st_size for f in CHECKPOINT_DIR.iterdir() if f.is_file())
    assert size <= 16 * 2**20
    assert (CHECKPOINT_DIR / "MODEL_CARD.md").exists()
    assert 1e6 < shipped.num_parameters() < 2e7


@pytest.mark.skipif(not HAS_NVCC, reason="nvcc not installed")
@pytest.mark.parametrize("strategy", ["rank", "sample"])
@pytest.mark.parametrize("op,n", [("spmv", 1), ("spmm", 32), ("spmm", 128)])
def test_shipped_policy_writes_kernels_that_parse_and_compile(shipped, op, n, strategy):
    """The policy encodes a shipped matrix and proposes K=4 kernels on the CPU; each parses
    and compiles for sm_90 with nvcc."""
    from torch_sparserl.data.datasets import load_matrix
    from torch_sparserl.evaluate.compile_tier import compile_only
    from torch_sparserl.specialize.policy.propose import propose

    A = load_matrix("cora")
    props = propose(shipped, A.indptr, A.indices, A.shape, op=op, n=n, dtype="f32", k=4, seed=1, strategy=strategy)
    assert len(props) == 4
    built = {}
    for p in props:
        assert p.error is None, p.error
        assert p.spec.plan.op == op and p.spec.plan.n == n
        assert p.spec.family in families.FAMILIES
        if p.spec.key not in built:
            built[p.spec.key] = compile_only(p.spec)
        assert built[p.spec.key].compiled, built[p.spec.key].log[-2000:]


@pytest.mark.parametrize("strategy", ["rank", "sample"])
def test_the_policy_in_a_sandbox_worker_proposes_what_it_proposes_here(shipped, strategy):
    """The runtime runs the policy in the sandbox's worker (SandboxedPolicy): same seed, same
    proposals as in this process, and this process never loads it for that."""
    from torch_sparserl.data.datasets import load_matrix
    from torch_sparserl.evaluate.sandbox import Sandbox
    from torch_sparserl.specialize.policy import CHECKPOINT_DIR
    from torch_sparserl.specialize.policy.propose import SandboxedPolicy, propose

    A = load_matrix("cora")
    here = propose(shipped, A.indptr, A.indices, A.shape, op="spmm", n=32, k=4, seed=3, strategy=strategy)
    with Sandbox(init=None, matrix_loader=None, health_check=None) as box:  # a CPU worker
        remote = SandboxedPolicy(box, CHECKPOINT_DIR)
        assert remote.config == shipped.config and remote.load() == {"device": "cpu"}
        there = propose(remote, A.indptr, A.indices, A.shape, op="spmm", n=32, k=4, seed=3, strategy=strategy)
        worker = box.worker_pid
        assert worker is not None and worker != os.getpid()
    assert [p.compact for p in there] == [p.compact for p in here]
    assert [p.sample.tokens for p in there] == [p.sample.tokens for p in here]
    assert [p.sample.logprob for p in there] == pytest.approx([p.sample.logprob for p in here], abs=1e-4)


def test_ranking_proposes_the_likeliest_distinct_kernels_of_the_space(shipped):
    """strategy="rank": K distinct kernels of the autotuner's space for the pattern, in the
    order of the policy's log-probability of writing them, and none left out scores higher."""
    from torch_sparserl.data.datasets import load_matrix
    from torch_sparserl.pattern.features import structural_features
    from torch_sparserl.specialize.policy.propose import propose

    A = load_matrix("citeseer")
    feats = structural_features(A.indptr, A.indices, A.shape)
    props = propose(shipped, A.indptr, A.indices, A.shape, op="spmm", n=64, k=3, seed=0, features=feats)
    space = families.space("spmm", "f32", 64, feats)
    texts = {corpus.render_compact(f, p, "spmm", "f32", 64): (f, p) for f, p in space}
    assert len(props) == 3 and len({p.spec.key for p in props}) == 3
    assert all(p.compact in texts and p.error is None and p.sample.finished for p in props)
    logps = [p.sample.logprob for p in props]
    assert logps == sorted(logps, reverse=True)
    inp = PatternInput.from_pattern(A.indptr, A.indices, A.shape, "spmm", "f32", 64, shipped.config.samples,
                                    features=feats)
    rest = [corpus.completion_text(t, "spmm", "f32", 64) for t in texts if t not in {p.compact for p in props}]
    assert max(shipped.score(inp, "spmm", "f32", 64, rest)) <= logps[-1] + 1e-4
    # a space smaller than K gives the whole space
    assert len(propose(shipped, A.indptr, A.indices, A.shape, op="spmm", n=64, k=len(texts) + 5,
                       features=feats)) == len(texts)


@pytest.mark.parametrize("kwargs,match", [(dict(strategy="beam"), r"strategy must be one of \('rank', 'sample', 'explore'\)"),
                                          (dict(k=0), "k must be >= 1")])
def test_propose_names_bad_arguments(shipped, kwargs, match):
    from torch_sparserl.specialize.policy.propose import propose

    rowptr, col = _random_csr(20, 20, 2)
    with pytest.raises(ValueError, match=match):
        propose(shipped, rowptr, col, (20, 20), op="spmm", n=32, **kwargs)



def test_a_sandboxed_policy_that_cannot_load_says_why(tmp_path):
    from torch_sparserl.evaluate.sandbox import Sandbox
    from torch_sparserl.specialize.policy import CHECKPOINT_DIR
    from torch_sparserl.specialize.policy.propose import SandboxedPolicy

    shutil.copy(CHECKPOINT_DIR / "config.json", tmp_path)  # a configuration, no weights
    with Sandbox(init=None, matrix_loader=None, health_check=None) as box:
        with pytest.raises(RuntimeError, match=r"policy: load_task in the sandbox's worker failed \(error\): "
                                               r"FileNotFoundError: policy: checkpoint .* lacks model.safetensors"):
            SandboxedPolicy(box, tmp_path).load()


def test_a_sandboxed_policy_without_device_memory_is_a_transient_failure():
    from torch_sparserl.evaluate.record import TransientFailure
    from torch_sparserl.evaluate.sandbox import TaskOutcome
    from torch_sparserl.specialize.policy import CHECKPOINT_DIR
    from torch_sparserl.specialize.policy.propose import SandboxedPolicy

    class Busy:  # a worker whose device another process fills
        def run(self, task, args, timeout_s=None):
            return TaskOutcome(status="error", error="OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB")

    with pytest.raises(TransientFailure, match=r"policy: load_task .* failed \(error\): OutOfMemoryError"):
        SandboxedPolicy(Busy(), CHECKPOINT_DIR).load()


@pytest.mark.parametrize("name,op,n", [("cora", "spmm", 32), ("rajat01", "spmv", 1)])
def test_speculative_greedy_decoding_equals_plain_greedy_decoding(shipped, name, op, n):
    from torch_sparserl.data.datasets import load_matrix

    A = load_matrix(name)
    inp = PatternInput.from_pattern(A.indptr, A.indices, A.shape, op, "f32", n, shipped.config.samples)
    plain = shipped.sample(inp, op, "f32", n, k=1, temperature=0.0)[0]
    fast = shipped.sample_speculative(inp, op, "f32", n, k=1, temperature=0.0)[0]
    assert fast.tokens == plain.tokens and fast.finished
    assert fast.logprob == pytest.approx(plain.logprob, abs=1e-3)


def test_speculative_sampling_keeps_the_policy_distribution(small_tokenizer):
    """With a fixed draft, the drafted token's frequency at the second position equals its
    frequency under plain sampling (within sampling error), and so do the others'."""
    from collections import Counter

    tok, _ = small_tokenizer
    rowptr, col = _random_csr(20, 20, 2)
    inp = PatternInput.from_pattern(rowptr, col, (20, 20), "spmv", "f32", 1, samples=4)
    kw = dict(k=600, temperature=1.0, greedy_first=False, max_new_tokens=2)
    # a tiny random policy whose second token is peaky but not deterministic; which seed gives
    # one depends on the tokenizer, itself trained on the shipped kernels' text
    for seed in range(1, 21):
        torch.manual_seed(seed)
        policy = build(tok, hidden=16, layers=1, heads=2, intermediate=32, samples=4, pe_dim=4)
        with torch.no_grad():
            policy.lm.model.embed_tokens.weight.mul_(30.0)
        a = policy.sample(inp, "spmv", "f32", 1, generator=torch.Generator().manual_seed(0), **kw)
        second = Counter(s.tokens[1] for s in a if len(s.tokens) > 1)
        drafted = second.most_common(1)[0][0]
        if 0.1 < second[drafted] / 600 < 0.95:
            break
    policy._draft = lambda context, length: [drafted][:length]
    b = policy.sample_speculative(inp, "spmv", "f32", 1, generator=torch.Generator().manual_seed(1), **kw)
    other = Counter(s.tokens[1] for s in b if len(s.tokens) > 1)
    assert 0.1 < second[drafted] / 600 < 0.95  # the test means something
    for token in {drafted, *dict(second.most_common(3))}:
        assert abs(second[token] - other[token]) / 600 < 0.07, (token, second[token], other[token])


# ------------------------------------------------------------------------ the runtime's specializer


def test_runtime_uses_the_learned_policy_by_default():
    from torch_sparserl.jit.runtime import Runtime
    from torch_sparserl.config import JitOptions
    from torch_sparserl.jit.specializers import autotune_specializer, learned_specializer

    rt = Runtime(JitOptions(mode="sync"))
    try:
        assert isinstance(rt.specializer, learned_specializer)
        assert re.fullmatch(r"learned:[0-9a-f]{12}/rank", rt.policy_id), rt.policy_id
    finally:
        rt.close()
    rt = Runtime(JitOptions(mode="sync", policy="autotune"))
    try:
        assert type(rt.specializer) is autotune_specializer and rt.policy_id == "autotune"
    finally:
        rt.close()


def test_a_custom_specializer_shares_the_default_cache_key():
    """A process whose specializer does not name its policy (a warm start that only reads the
    cache) must compute the same key as one with the learned specializer."""
    from torch_sparserl.jit.runtime import Runtime
    from torch_sparserl.config import JitOptions

    default = Runtime(JitOptions(mode="sync"))
    custom = Runtime(JitOptions(mode="sync"), specializer=lambda *a: None)
    try:
        assert custom.policy_id == default.policy_id
    finally:
        default.close()
        custom.close()


def test_runtime_without_a_checkpoint_falls_back_to_the_autotuner(tmp_path, caplog):
    from torch_sparserl.config import JitOptions
    from torch_sparserl.jit.specializers import learned_specializer

    spec = learned_specializer(JitOptions(), checkpoint=tmp_path)
    assert spec.unavailable and spec.policy_id == "autotune"
    assert "autotuner specializes instead" in caplog.text


@pytest.mark.parametrize("changes,match", [({"policy": "oracle"}, "policy must be one of"),
                                           ({"k": 0}, r"k must be a whole number >= 1 and <= 64 \(got 0\)"),
                                           ({"k": True}, r"k must be a whole number >= 1 and <= 64 \(got True\)")])
def test_runtime_settings_name_bad_policy_options(changes, match):
    from torch_sparserl.config import JitOptions

    with pytest.raises(ValueError, match=match):
        JitOptions(**changes)


def test_runtime_settings_read_the_policy_from_the_environment():
    from torch_sparserl.config import JitOptions

    s = JitOptions.from_env({"SPARSERL_JIT_POLICY": "autotune", "SPARSERL_JIT_K": "8"})
    assert s.policy == "autotune" and s.k == 8


def test_the_worker_samples_where_the_switch_says(monkeypatch):
    from torch_sparserl.specialize.policy.propose import worker_policy_device

    monkeypatch.delenv("SPARSERL_POLICY_DEVICE", raising=False)
    assert worker_policy_device() == ("cuda" if torch.cuda.is_available() else "cpu")
    monkeypatch.setenv("SPARSERL_POLICY_DEVICE", " CPU ")
    assert worker_policy_device() == "cpu"
    monkeypatch.setenv("SPARSERL_POLICY_DEVICE", "cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert worker_policy_device() == "cpu"  # no GPU: the host, whatever the switch asks
    monkeypatch.setenv("SPARSERL_POLICY_DEVICE", "tpu")
    with pytest.raises(ValueError, match=r"SPARSERL_POLICY_DEVICE: expected one of \('cuda', 'cpu'\) \(got 'tpu'\)"):
        worker_policy_device()


@pytest.mark.parametrize("strategy", ["rank", "sample"])
def test_policy_tune_builds_screens_and_validates_the_distinct_proposals(shipped, strategy):
    """policy_tune on the CPU with a fake sandbox (candidates timed by a hash of their source):
    the distinct runnable proposals are compiled together first, each is screened once, the
    fastest screened one is the one validated, and every stage's seconds are recorded."""
    from fakes import FakeSandbox

    from torch_sparserl.data.datasets import load_matrix
    from torch_sparserl.specialize.autotune import FINAL_CONFIG, SCREEN_CONFIG
    from torch_sparserl.specialize.policy.propose import policy_tune

    class Box(FakeSandbox):
        def prebuild(self, specs, workers=4):
            self.prebuilt = [s.key for s in specs]
            return {}

    box = Box(wrong_every=0)
    A = load_matrix("cora")
    result, proposals, records = policy_tune(A, op="spmm", n=32, policy=shipped, k=4, sandbox=box, strategy=strategy)
    distinct = list(dict.fromkeys(p.spec.key for p in proposals))
    assert len(proposals) == len(records) == 4 and result.candidates == 4
    screens = [key for key, config in box.calls if config is SCREEN_CONFIG]
    finals = [key for key, config in box.calls if config is FINAL_CONFIG]
    if len(distinct) > 1:
        assert box.prebuilt == distinct and sorted(screens) == sorted(distinct)
        fastest = min((r for r in records), key=lambda r: r.runtime_us)
        assert finals == [fastest.key]
    else:  # one kernel proposed K times: validated directly, nothing to build together or screen
        assert not hasattr(box, "prebuilt") and screens == [] and finals == distinct
    if strategy == "rank":
        assert len(distinct) == 4
    assert result.best is not None and result.best.key == finals[0] and result.best_spec.key == finals[0]
    stages = result.table[0].timing
    assert all(stages[name] >= 0 for name in ("problem_s", "generate_s", "prebuild_s"))
    assert box.released == 1  # the caller's sandbox keeps its worker, the problem's inputs go
