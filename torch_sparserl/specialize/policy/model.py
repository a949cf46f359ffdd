"""The kernel policy: a small causal LM (Llama architecture, from a config) reading the matrix
encoder's prefix embeddings and writing a compact ABI kernel source.

Sequence layout (training and sampling alike)::

    [encoder prefix: samples + 1 positions] <bos> request tokens | completion tokens <eos>

The request is the start of the plan line (``// sparserl: op=spmm dtype=f32 n=32``), stated by
the caller; the policy writes the rest: the plan, the family and its parameters, the kernel.
A checkpoint is a folder with ``config.json`` (this module's :class:`PolicyConfig` plus
metadata), ``model.safetensors`` (float16 weights, the tied LM head left out) and
``tokenizer.json``: loaded by building the model from the config. The model is
:mod:`.decoder`'s plain-torch Llama, which names its parameters as ``transformers``' Llama
does and computes the same (tested against it), so loading neither imports ``transformers``
nor depends on its version.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from .corpus import prompt_text
from .encoder import PatternEncoder, PatternInput, collate
from .tokenizer import EOS, BOS, PAD, load_tokenizer, special_ids

CONFIG_FILE, WEIGHTS_FILE, TOKENIZER_FILE = "config.json", "model.safetensors", "tokenizer.json"
# The float32 logits one scoring pass may hold, (batch, length, vocabulary): the batch is as
# many completions of about the same length as fit. On a GPU a pass costs its launches, so a
# request's kernel space (tens of kernels) goes in a few; the budget keeps the pass's memory
# (the logits and their logsumexp's temporaries, about 3x this) small beside the user's job.
SCORE_LOGIT_BYTES = {"cuda": 128 << 20, "cpu": 64 << 20}
COMPLETION_MEMO = 4096  # tokenized completion texts a policy keeps (the kernel space has hundreds)
_MEMO_LOCK = threading.Lock()  # of every policy's memo (module-level: a policy stays copyable)


def score_batches(lengths: list[int], logit_bytes: int, vocab: int, rows: int | None = None) -> list[list[int]]:
    """Indices of completions grouped for scoring: shortest first, each group as many as keep
    ``group size x its longest length x vocab`` float32 logits within ``logit_bytes`` (and at
    most ``rows``), at least one."""
    groups, current = [], []
    for i in sorted(range(len(lengths)), key=lengths.__getitem__):
        full = rows is not None and len(current) == rows
        if current and (full or (len(current) + 1) * lengths[i] * vocab * 4 > logit_bytes):
            groups.append(current)
            current = []
        current.append(i)
    if current:
        groups.append(current)
    return groups


@dataclass
class PolicyConfig:
    vocab_size: int = 8192
    hidden: int = 256
    layers: int = 4
    heads: int = 8
    intermediate: int = 704
    max_positions: int = 1024
    samples: int = 128          # sampled nonzeros: prefix positions
    pe_dim: int = 64            # sinusoidal width per coordinate (row and column each)
    coords: str = "sinusoidal"  # or "raw" (the ablation)
    max_new_tokens: int = 640   # longest completion sampled (nnz_split spmm: up to ~500 tokens)


def _decoder(config: PolicyConfig, ids: dict[str, int]):
    from .decoder import Decoder, DecoderConfig

    return Decoder(DecoderConfig(vocab_size=config.vocab_size, hidden=config.hidden, layers=config.layers,
                                 heads=config.heads, intermediate=config.intermediate, pad_token_id=ids[PAD],
                                 eps=1e-5))


@dataclass
class Sample:
    """One sampled completion: its text, its token ids and their log-probabilities."""

    text: str
    tokens: list[int]
    logprob: float
    finished: bool
    token_logprobs: list[float] = field(default_factory=list)


def read_config(folder: str | Path) -> tuple[PolicyConfig, dict]:
    """A checkpoint's model configuration and the whole ``config.json`` (no weights read)."""
    path = Path(folder) / CONFIG_FILE
    info = json.loads(path.read_text())
    if info.get("format") != "torch_sparserl.policy/1":
        raise ValueError(f"policy: {path} is not a torch_sparserl policy checkpoint (format {info.get('format')!r})")
    known = {f.name for f in dataclasses.fields(PolicyConfig)}
    return PolicyConfig(**{k: v for k, v in info["config"].items() if k in known}), info


class KernelPolicy(nn.Module):
    def __init__(self, config: PolicyConfig, tokenizer):
        super().__init__()
        self.config = config
        self.tokenizer = tokenizer
        self.ids = special_ids(tokenizer)
        if tokenizer.get_vocab_size() > config.vocab_size:
            raise ValueError(f"policy: the tokenizer has {tokenizer.get_vocab_size()} tokens, "
                             f"more than vocab_size={config.vocab_size}")
        self.lm = _decoder(config, self.ids)
        self.encoder = PatternEncoder(config.hidden, config.pe_dim, config.coords)
        self.meta: dict = {}
        # completion text -> its ids with <eos>: the kernel space's texts come back for every
        # pattern of a request, so each is tokenized once (the most recent COMPLETION_MEMO kept)
        self._completion_memo: collections.OrderedDict[str, tuple[int, ...]] = collections.OrderedDict()

    # ------------------------------------------------------------------ text <-> ids
    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def request_ids(self, op: str, dtype: str, n: int) -> list[int]:
        return [self.ids[BOS]] + self.encode(prompt_text(op, dtype, n))

    @property
    def device(self) -> torch.device:
        return self.lm.model.embed_tokens.weight.device

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    # ------------------------------------------------------------------ forward passes
    def prefix(self, inputs: list[PatternInput]) -> torch.Tensor:
        batch = {k: v.to(self.device) for k, v in collate(inputs).items()}
        return self.encoder(**batch)

    def lm_loss(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Plain next-token loss over padded ``ids`` (pretraining: no prefix)."""
        labels = ids.masked_fill(mask == 0, -100)
        return self.lm(input_ids=ids, attention_mask=mask, labels=labels).loss

    def _sequences(self, inputs: list[PatternInput], requests: list[list[int]], completions: list[list[int]]):
        """inputs_embeds, attention mask, and the (batch, position) of every completion token."""
        prefix = self.prefix(inputs)
        b, p, h = prefix.shape
        lengths = [len(r) + len(c) for r, c in zip(requests, completions)]
        t = max(lengths)
        tok = torch.full((b, t), self.ids[PAD], dtype=torch.long)
        mask = torch.zeros((b, p + t), dtype=torch.long)
        mask[:, :p] = 1
        for i, (r, c) in enumerate(zip(requests, completions)):
            tok[i, :len(r) + len(c)] = torch.tensor(r + c)
            mask[i, p:p + len(r) + len(c)] = 1
        tok, mask = tok.to(self.device), mask.to(self.device)
        embeds = torch.cat([prefix, self.lm.model.embed_tokens(tok)], dim=1)
        return embeds, mask, tok, p

    def completion_logprobs(self, inputs: list[PatternInput], requests: list[list[int]],
                            completions: list[list[int]], temperature: float = 1.0) -> list[torch.Tensor]:
        """Per-token log-probabilities of each completion (with gradient) under the policy
        at ``temperature`` (softmax of logits / temperature)."""
        embeds, mask, tok, p = self._sequences(inputs, requests, completions)
        logits = self.lm(inputs_embeds=embeds, attention_mask=mask).logits.float() / temperature
        logp = torch.log_softmax(logits, dim=-1)
        out = []
        for i, (r, c) in enumerate(zip(requests, completions)):
            # the token at sequence position p + j is predicted by the logits at p + j - 1
            pos = torch.arange(p + len(r) - 1, p + len(r) + len(c) - 1, device=logits.device)
            out.append(logp[i, pos, tok[i, len(r):len(r) + len(c)]])
        return out

    def sft_loss(self, inputs: list[PatternInput], requests: list[list[int]],
                 completions: list[list[int]]) -> torch.Tensor:
        """Mean negative log-likelihood per completion token."""
        lps = self.completion_logprobs(inputs, requests, completions)
        return -torch.cat(lps).mean()

    # ------------------------------------------------------------------ sampling
    @torch.no_grad()
    def sample(self, inp: PatternInput, op: str, dtype: str, n: int, k: int = 4, *,
               temperature: float = 1.0, greedy_first: bool = True, max_new_tokens: int | None = None,
               generator: torch.Generator | None = None) -> list[Sample]:
        """``k`` completions for one request, batched; the first greedy when ``greedy_first``."""
        if k < 1:
            raise ValueError(f"policy.sample: k must be >= 1 (got {k})")
        max_new = max_new_tokens or self.config.max_new_tokens
        request = self.request_ids(op, dtype, n)
        prefix = self.prefix([inp]).expand(k, -1, -1)
        req = torch.tensor(request, device=self.device).unsqueeze(0).expand(k, -1)
        embeds = torch.cat([prefix, self.lm.model.embed_tokens(req)], dim=1)
        out = self.lm(inputs_embeds=embeds, use_cache=True)
        cache, logits = out.past_key_values, out.logits[:, -1].float()
        eos = self.ids[EOS]
        tokens = [[] for _ in range(k)]
        lps = [[] for _ in range(k)]
        done = torch.zeros(k, dtype=torch.bool, device=self.device)
        for _ in range(max_new):
            logp = torch.log_softmax(logits, dim=-1)
            if temperature > 0:
                probs = torch.softmax(logits / temperature, dim=-1)
                nxt = torch.multinomial(probs, 1, generator=generator).squeeze(1)
            else:
                nxt = logp.argmax(-1)
            if greedy_first:
                nxt[0] = logp[0].argmax()
            nxt = torch.where(done, torch.full_like(nxt, eos), nxt)
            chosen = logp.gather(1, nxt.unsqueeze(1)).squeeze(1)
            for i in range(k):
                if not done[i]:
                    tokens[i].append(int(nxt[i]))
                    lps[i].append(float(chosen[i]))
            done |= nxt == eos
            if bool(done.all()):
                break
            out = self.lm(input_ids=nxt.unsqueeze(1), past_key_values=cache, use_cache=True)
            cache, logits = out.past_key_values, out.logits[:, -1].float()
        samples = []
        for i in range(k):
            toks = tokens[i]
            finished = bool(toks) and toks[-1] == eos
            body = toks[:-1] if finished else toks
            samples.append(Sample(text=self.decode(body), tokens=toks, logprob=float(sum(lps[i])),
                                  finished=finished, token_logprobs=lps[i]))
        return samples

    def completion_ids(self, completions: list[str]) -> list[list[int]]:
        """Each completion's token ids, ``<eos>`` appended: what :meth:`score_ids` scores
        (texts seen before are not tokenized again)."""
        eos = self.ids[EOS]
        memo = self._completion_memo
        with _MEMO_LOCK:
            missing = [t for t in dict.fromkeys(completions) if t not in memo]
            for text, encoding in zip(missing, self.tokenizer.encode_batch(missing) if missing else ()):
                memo[text] = (*encoding.ids, eos)
            out = []
            for text in completions:
                memo.move_to_end(text)
                out.append(list(memo[text]))
            while len(memo) > COMPLETION_MEMO:
                memo.popitem(last=False)
        return out

    def score(self, inp: PatternInput, op: str, dtype: str, n: int, completions: list[str], *,
              batch: int | None = None) -> list[float]:
        """The log-probability of writing each completion (and then ``<eos>``) for this pattern."""
        return self.score_ids(inp, op, dtype, n, self.completion_ids(completions), batch=batch)

    @torch.no_grad()
    def score_ids(self, inp: PatternInput, op: str, dtype: str, n: int, ids: list[list[int]], *,
                  batch: int | None = None) -> list[float]:
        """:meth:`score` of completions given as token ids (:meth:`completion_ids`).

        The pattern prefix and the request are run once; the completions are run after that
        cached state in groups of about equal length (:func:`score_batches`: at most ``batch``
        each, and no more float32 logits than :data:`SCORE_LOGIT_BYTES` for the policy's
        device), right-padded (causal attention keeps padding out of every real token's view, so
        no mask is needed). The scores come back in the order of ``ids``."""
        if batch is not None and batch < 1:
            raise ValueError(f"policy.score: batch must be >= 1 (got {batch})")
        if not ids:
            return []
        budget = SCORE_LOGIT_BYTES["cuda" if self.device.type == "cuda" else "cpu"]
        groups = score_batches([len(row) for row in ids], budget, self.config.vocab_size, batch)
        request = self.request_ids(op, dtype, n)
        prefix = self.prefix([inp])
        req = torch.tensor(request, device=self.device).unsqueeze(0)
        first = self.lm(inputs_embeds=torch.cat([prefix, self.lm.model.embed_tokens(req)], dim=1), use_cache=True)
        first_logp = torch.log_softmax(first.logits[0, -1].float(), dim=-1)
        pad = self.ids[PAD]
        scores = []
        for group in groups:
            rows = [ids[i] for i in group]
            b, t = len(rows), max(map(len, rows))
            tok = torch.full((b, t), pad, dtype=torch.long)
            for i, row in enumerate(rows):
                tok[i, :len(row)] = torch.tensor(row)
            tok = tok.to(self.device)
            cache = first.past_key_values.copy()
            cache.keys = [k.expand(b, -1, -1, -1) for k in cache.keys]
            cache.values = [v.expand(b, -1, -1, -1) for v in cache.values]
            # token j is predicted by the logits at j - 1; token 0 by the request's last position.
            # Gathered minus logsumexp: no second (batch, length, vocab) tensor besides the logits.
            picked = first_logp[tok[:, :1]]
            if t > 1:
                logits = self.lm(input_ids=tok[:, :-1], past_key_values=cache, use_cache=True).logits.float()
                later = logits.gather(2, tok[:, 1:].unsqueeze(2)).squeeze(2) - torch.logsumexp(logits, dim=-1)
                picked = torch.cat([picked, later], dim=1)
            valid = torch.arange(t, device=self.device)[None, :] < torch.tensor([len(r) for r in rows],
                                                                                device=self.device)[:, None]
            scores.append((picked * valid).sum(1))
        values = torch.cat(scores).tolist()  # one wait for the device, not one per group
        out = [0.0] * len(ids)
        for i, value in zip((i for group in groups for i in group), values):
            out[i] = value
        return out

    # ------------------------------------------------------------------ speculative sampling
    def _draft_index(self) -> dict:
        """Token trigrams of the kernel corpus -> (document, position): the draft source."""
        index = getattr(self, "_ngram_index", None)
        if index is None:
            from .corpus import completion_text, kernel_documents

            docs, index = [], {}
            # one batch: the tokenizer encodes it on every core (the first sample waits for this)
            texts = [completion_text(text, op, dtype, n) for op, dtype, n, _, _, text in kernel_documents()]
            for encoding in self.tokenizer.encode_batch(texts):
                ids = encoding.ids + [self.ids[EOS]]
                d = len(docs)
                docs.append(ids)
                for i in range(len(ids) - 3):
                    index.setdefault(tuple(ids[i:i + 3]), (d, i + 3))
            self._ngram_docs, self._ngram_index = docs, index
            index = self._ngram_index
        return index

    def _draft(self, context: list[int], length: int) -> list[int]:
        index = self._draft_index()
        hit = index.get(tuple(context[-3:])) if len(context) >= 3 else None
        if hit is None:
            return []
        doc, pos = hit
        return self._ngram_docs[doc][pos:pos + length]

    @torch.no_grad()
    def sample_speculative(self, inp: PatternInput, op: str, dtype: str, n: int, k: int = 4, *,
                           temperature: float = 1.0, greedy_first: bool = True, max_new_tokens: int | None = None,
                           generator: torch.Generator | None = None, draft_len: int = 64) -> list[Sample]:
        """The same distribution as :meth:`sample`, in far fewer forward passes.

        Prompt-lookup speculative decoding: a draft continuation is read from an earlier row
        that wrote the same tokens so far, else from the kernel corpus where the last three
        tokens occur there, and the model scores the whole draft in one pass. The draft never
        depends on the current row's own random draws, so acceptance stays exact. A draft token
        d is kept with probability p(d) (greedy rows: when it is the argmax); at the first rejection a token is drawn from p with d removed, renormalised
        -- exact speculative sampling for a point-mass draft -- so the samples follow the
        policy's distribution and greedy rows equal greedy decoding.
        """
        if k < 1:
            raise ValueError(f"policy.sample: k must be >= 1 (got {k})")
        max_new = max_new_tokens or self.config.max_new_tokens
        request = self.request_ids(op, dtype, n)
        prefix = self.prefix([inp])
        req = torch.tensor(request, device=self.device).unsqueeze(0)
        embeds = torch.cat([prefix, self.lm.model.embed_tokens(req)], dim=1)
        first = self.lm(inputs_embeds=embeds, use_cache=True)
        eos = self.ids[EOS]
        samples = []
        for row in range(k):
            greedy = temperature <= 0 or (greedy_first and row == 0)
            cache = first.past_key_values if row == k - 1 else first.past_key_values.copy()  # each row extends its own
            base = embeds.shape[1]
            dist = first.logits[0, -1].float()
            tokens, lps = [], []

            def verify(logits: torch.Tensor, draft: list[int]) -> tuple[list[int], int, list[float]]:
                """One pass's verdict on a draft, with a few host transfers in all (not per
                token): the accepted draft tokens, then the correction at the first rejection
                or a bonus token after a fully accepted draft; how many were accepted; and the
                log-probabilities of all of them. ``logits``: ``(len(draft) + 1, vocab)``."""
                n_draft = len(draft)
                logp = torch.log_softmax(logits, dim=-1)
                drafted = torch.tensor(draft, dtype=torch.long, device=logits.device)
                if greedy:
                    best = logits.argmax(-1)
                    agree = (best[:n_draft] == drafted).tolist()
                    n_acc = agree.index(False) if False in agree else n_draft
                    nxt = int(best[n_acc])
                else:
                    probs = torch.softmax(logits / temperature, dim=-1)
                    u = torch.rand(n_draft, generator=generator, device=probs.device) if generator is not None \
                        else torch.rand(n_draft, device=probs.device)
                    keep = (u < probs[torch.arange(n_draft, device=probs.device), drafted]).tolist()
                    n_acc = keep.index(False) if False in keep else n_draft
                    p = probs[n_acc]
                    if n_acc < n_draft:  # at a rejection: p with the drafted token removed, renormalised
                        p = p.clone()
                        p[draft[n_acc]] = 0
                        p = p / p.sum()
                    nxt = int(torch.multinomial(p, 1, generator=generator))
                chosen = draft[:n_acc] + [nxt]
                picked = logp[torch.arange(len(chosen), device=logp.device),
                              torch.tensor(chosen, dtype=torch.long, device=logp.device)]
                return chosen, n_acc, picked.tolist()

            (t,), _, (lp,) = verify(dist[None], [])
            tokens.append(t)
            lps.append(lp)
            while tokens[-1] != eos and len(tokens) < max_new:
                # An earlier row that wrote the same tokens so far is the best draft, all of its
                # remainder (a confident policy writes one kernel K times: then a row costs one
                # pass); else up to draft_len tokens from the corpus.
                draft = next((s.tokens[len(tokens):max_new] for s in samples
                              if len(s.tokens) > len(tokens) and s.tokens[:len(tokens)] == tokens), None)
                if not draft:
                    draft = self._draft(request + tokens, min(draft_len, max_new - len(tokens)))
                inp_ids = torch.tensor([[tokens[-1], *draft]], device=self.device)
                out = self.lm(input_ids=inp_ids, past_key_values=cache, use_cache=True)
                cache, logits = out.past_key_values, out.logits[0].float()
                chosen, n_acc, chosen_lps = verify(logits, draft)
                accepted = 0  # accepted draft tokens after which the row goes on
                for j, (t, lp) in enumerate(zip(chosen, chosen_lps)):
                    tokens.append(t)
                    lps.append(lp)
                    if t == eos or len(tokens) >= max_new:
                        break
                    accepted += j < n_acc
                # keep in the cache what was fed and accepted; the last token is fed next round
                base += 1 + accepted
                if accepted < len(draft):
                    cache.crop(base)
            finished = tokens[-1] == eos
            body = tokens[:-1] if finished else tokens
            samples.append(Sample(text=self.decode(body), tokens=tokens, logprob=float(sum(lps)),
                                  finished=finished, token_logprobs=lps))
        return samples

    # ------------------------------------------------------------------ checkpoints
    def save(self, folder: str | Path, meta: dict | None = None, dtype: torch.dtype = torch.float16) -> Path:
        from safetensors.torch import save_file

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().to("cpu", dtype if v.is_floating_point() else v.dtype).contiguous()
                 for k, v in self.state_dict().items() if k != "lm.lm_head.weight"}
        save_file(state, str(folder / WEIGHTS_FILE))
        self.tokenizer.save(str(folder / TOKENIZER_FILE))
        info = {"format": "torch_sparserl.policy/1", "config": dataclasses.asdict(self.config),
                "meta": {**self.meta, **(meta or {})}}
        (folder / CONFIG_FILE).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
        return folder

    @classmethod
    def load(cls, folder: str | Path, device: str | torch.device = "cpu") -> "KernelPolicy":
        from safetensors.torch import load_file

        folder = Path(folder)
        for name in (CONFIG_FILE, WEIGHTS_FILE, TOKENIZER_FILE):
            if not (folder / name).exists():
                raise FileNotFoundError(f"policy: checkpoint {folder} lacks {name}")
        config, info = read_config(folder)
        policy = cls(config, load_tokenizer(folder / TOKENIZER_FILE))
        state = {k: v.float() if v.is_floating_point() else v for k, v in load_file(str(folder / WEIGHTS_FILE)).items()}
        missing, unexpected = policy.load_state_dict(state, strict=False)
        missing = [k for k in missing if k != "lm.lm_head.weight"]
        if missing or unexpected:
            raise ValueError(f"policy: checkpoint {folder} does not match the model "
                             f"(missing {missing[:5]}, unexpected {unexpected[:5]})")
        policy.lm.tie_weights()
        policy.meta = info.get("meta", {})
        return policy.to(device).eval()


def build(tokenizer, **overrides) -> KernelPolicy:
    """A freshly initialised policy sized for ``tokenizer``."""
    config = PolicyConfig(**overrides)
    if tokenizer.get_vocab_size() != config.vocab_size:
        config = dataclasses.replace(config, vocab_size=max(tokenizer.get_vocab_size(), 1))
    return KernelPolicy(config, tokenizer)


def perplexity(loss: float) -> float:
    return math.exp(min(loss, 50.0))
