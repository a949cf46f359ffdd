"""The policy's plain-torch decoder against transformers' LlamaForCausalLM: same parameter
names, same logits, losses, gradients and cached decoding, on random weights and the shipped
checkpoint; and the runtime's paths that load the policy import neither transformers nor
torch._dynamo."""

import inspect
import subprocess
import sys

import pytest
import torch

from torch_sparserl.specialize.policy.decoder import Decoder, DecoderConfig, KVCache

transformers = pytest.importorskip("transformers")

CONFIG = DecoderConfig(vocab_size=97, hidden=64, layers=2, heads=4, intermediate=176, pad_token_id=1)


def _pair(seed=0, config=CONFIG):
    torch.manual_seed(seed)
    ours = Decoder(config).eval()
    with torch.no_grad():  # weights far from the initialisation, norms too
        for p in ours.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    cfg = transformers.LlamaConfig(vocab_size=config.vocab_size, hidden_size=config.hidden,
                                   intermediate_size=config.intermediate, num_hidden_layers=config.layers,
                                   num_attention_heads=config.heads, num_key_value_heads=config.heads,
                                   max_position_embeddings=1024, tie_word_embeddings=True,
                                   pad_token_id=config.pad_token_id, rms_norm_eps=config.eps)
    cfg._attn_implementation = "sdpa"
    theirs = transformers.LlamaForCausalLM(cfg).eval()
    theirs.load_state_dict(ours.state_dict(), strict=True)
    theirs.tie_weights()
    return ours, theirs


def test_parameter_names_are_transformers_llama_names():
    ours, theirs = _pair()
    assert set(ours.state_dict()) == set(theirs.state_dict())
    assert ours.lm_head.weight.data_ptr() == ours.model.embed_tokens.weight.data_ptr()


def test_logits_and_loss_equal_transformers_with_right_padding():
    ours, theirs = _pair(1)
    ids = torch.randint(0, CONFIG.vocab_size, (3, 11))
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    mask[2, 4:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    a = ours(input_ids=ids, attention_mask=mask, labels=labels)
    b = theirs(input_ids=ids, attention_mask=mask, labels=labels)
    keep = mask.bool()
    torch.testing.assert_close(a.logits[keep], b.logits[keep], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(a.loss, b.loss, rtol=1e-5, atol=1e-6)


def test_embeddings_in_and_gradients_equal_transformers():
    ours, theirs = _pair(2)
    ours.train(), theirs.train()
    embeds = torch.randn(2, 9, CONFIG.hidden)
    ids = torch.randint(0, CONFIG.vocab_size, (2, 9))
    ours(inputs_embeds=embeds, labels=ids).loss.backward()
    theirs(inputs_embeds=embeds, labels=ids).loss.backward()
    grads = dict(theirs.named_parameters())
    for name, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, rtol=1e-4, atol=1e-6, msg=name)


def test_cached_decoding_equals_the_full_forward_and_crop_forgets():
    ours, theirs = _pair(3)
    ids = torch.randint(0, CONFIG.vocab_size, (2, 14))
    full = theirs(input_ids=ids).logits
    with torch.no_grad():
        out = ours(input_ids=ids[:, :6], use_cache=True)
        cache = out.past_key_values
        assert isinstance(cache, KVCache) and cache.get_seq_length() == 6
        step = ours(input_ids=ids[:, 6:7], past_key_values=cache, use_cache=True)  # one position
        torch.testing.assert_close(step.logits[:, 0], full[:, 6], rtol=1e-5, atol=1e-5)
        copy = cache.copy()
        draft = ours(input_ids=ids[:, 7:12], past_key_values=cache, use_cache=True)  # several at once
        torch.testing.assert_close(draft.logits, full[:, 7:12], rtol=1e-5, atol=1e-5)
        assert cache.get_seq_length() == 12 and copy.get_seq_length() == 7
        cache.crop(9)  # drafts 9..11 rejected: decode them again
        again = ours(input_ids=ids[:, 9:14], past_key_values=cache, use_cache=True)
        torch.testing.assert_close(again.logits, full[:, 9:14], rtol=1e-5, atol=1e-5)
        other = ours(input_ids=ids[:, 7:8], past_key_values=copy, use_cache=True)  # the copy is unchanged
        torch.testing.assert_close(other.logits[:, 0], full[:, 7], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="crop"):
        cache.crop(-1)


def test_decoder_names_bad_calls():
    ours, _ = _pair()
    with pytest.raises(ValueError, match="exactly one"):
        ours()
    with pytest.raises(ValueError, match="attention mask of shape"):
        ours(input_ids=torch.zeros(2, 5, dtype=torch.long), attention_mask=torch.zeros(2, 4, dtype=torch.long))


@pytest.fixture(scope="module")
def shipped():
    from torch_sparserl.specialize.policy import CHECKPOINT_DIR
    from torch_sparserl.specialize.policy.model import KernelPolicy

    return KernelPolicy.load(CHECKPOINT_DIR, "cpu")


class _TransformersCache:
    """transformers' cache behind :class:`KVCache`'s interface (its crop() takes a negative count)."""

    def __init__(self, inner):
        self.inner = inner

    def get_seq_length(self):
        return self.inner.get_seq_length()

    def crop(self, length):
        if length < self.inner.get_seq_length():
            self.inner.crop(length - self.inner.get_seq_length())

    def copy(self):
        import copy

        return _TransformersCache(copy.deepcopy(self.inner))


class _TransformersLM(torch.nn.Module):
    def __init__(self, llama):
        super().__init__()
        self.llama, self.model = llama, llama.model

    # transformers 5.24 renamed the cache argument and output field ``past_key_values`` to ``cache``
    # (the old name warns, to be removed in 5.40); the device's 5.17 knows only the old one.
    CACHE = "cache" if "cache" in inspect.signature(transformers.LlamaForCausalLM.forward).parameters \
        else "past_key_values"

    def forward(self, past_key_values=None, **kwargs):
        from torch_sparserl.specialize.policy.decoder import DecoderOutput

        inner = past_key_values.inner if past_key_values is not None else None
        out = self.llama(**{self.CACHE: inner}, **kwargs)
        returned = out.get(self.CACHE)
        return DecoderOutput(logits=out.logits,
                             past_key_values=_TransformersCache(returned) if returned is not None else None)


def test_shipped_policy_samples_what_transformers_llama_samples(shipped):
    """The same greedy and seeded samples when the shipped weights run in transformers' Llama."""
    import copy

    import numpy as np

    from torch_sparserl.specialize.policy.encoder import PatternInput

    c = shipped.config
    cfg = transformers.LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.hidden, intermediate_size=c.intermediate,
                                   num_hidden_layers=c.layers, num_attention_heads=c.heads,
                                   num_key_value_heads=c.heads, max_position_embeddings=c.max_positions,
                                   tie_word_embeddings=True, pad_token_id=shipped.lm.config.pad_token_id,
                                   rms_norm_eps=1e-5)
    cfg._attn_implementation = "sdpa"
    llama = transformers.LlamaForCausalLM(cfg).eval()
    llama.load_state_dict(shipped.lm.state_dict())
    llama.tie_weights()
    twin = copy.copy(shipped)  # the same encoder and tokenizer, transformers' LM
    twin._modules = dict(shipped._modules, lm=_TransformersLM(llama))
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 9, 300)
    rowptr = np.concatenate([[0], np.cumsum(lengths)])
    col = np.concatenate([np.sort(rng.choice(300, size=n, replace=False)) for n in lengths])
    inp = PatternInput.from_pattern(rowptr, col, (300, 300), "spmm", "f32", 64, c.samples, seed=0)
    ours = shipped.sample_speculative(inp, "spmm", "f32", 64, k=3, temperature=1.0,
                                      generator=torch.Generator().manual_seed(5))
    theirs = twin.sample_speculative(inp, "spmm", "f32", 64, k=3, temperature=1.0,
                                     generator=torch.Generator().manual_seed(5))
    assert [s.tokens for s in ours] == [s.tokens for s in theirs]
    for a, b in zip(ours, theirs):
        assert a.logprob == pytest.approx(b.logprob, rel=1e-4, abs=1e-3)


def test_the_workers_imports_leave_out_transformers_and_dynamo():
    """What the sandbox's worker imports to evaluate candidates and load the policy: the
    package, the harness, the builder and the policy, in a fresh interpreter."""
    code = ("import sys, torch_sparserl.evaluate.harness, torch_sparserl.toolchain.inline, torch_sparserl.specialize.policy.propose; "
            "from torch_sparserl.specialize.policy import load_default; load_default('cpu'); "
            "print(sorted(m for m in ('transformers', 'torch._dynamo', 'sympy') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"
