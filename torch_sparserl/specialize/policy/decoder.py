"""The policy's language model: a Llama-architecture decoder in plain torch.

It computes what ``transformers``' ``LlamaForCausalLM`` computes for the configurations the
policy uses (rotary positions with base 10000, RMSNorm, SiLU-gated MLP, multi-head attention
through ``scaled_dot_product_attention``, tied input and output embeddings) and names its
parameters the same way, so a checkpoint is the same file for both; ``tests/specialize/test_policy_decoder.py``
compares logits, losses, gradients and cached decoding with ``transformers``' model.

It exists because the policy is loaded on the runtime's critical path: the sandbox's worker
loads it before the first kernel of a first run can be decided, while the training loop runs
on cuSPARSE. Importing ``transformers``' Llama (which imports ``torch._dynamo``, sympy and,
where installed, scikit-learn) takes seconds; this module imports only torch.

Only what the policy calls is here: a forward over token ids or embeddings, an optional padding
mask (right padding: positions are counted from the start, as ``transformers`` does), the
next-token loss over labels (-100 ignored), and a key/value cache that decoding extends and
crops.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

IGNORE_INDEX = -100
ROPE_BASE = 10000.0


@dataclass
class DecoderConfig:
    vocab_size: int
    hidden: int
    layers: int
    heads: int
    intermediate: int
    pad_token_id: int
    eps: float = 1e-5


@dataclass
class DecoderOutput:
    logits: torch.Tensor
    loss: torch.Tensor | None = None
    past_key_values: "KVCache | None" = None


class KVCache:
    """Keys and values of the positions seen so far, per layer: ``(batch, heads, length, head_dim)``."""

    def __init__(self, layers: int):
        self.keys: list[torch.Tensor | None] = [None] * layers
        self.values: list[torch.Tensor | None] = [None] * layers

    def get_seq_length(self) -> int:
        return 0 if self.keys[0] is None else int(self.keys[0].shape[2])

    def update(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.keys[layer] is not None:
            key = torch.cat([self.keys[layer], key], dim=2)
            value = torch.cat([self.values[layer], value], dim=2)
        self.keys[layer], self.values[layer] = key, value
        return key, value

    def copy(self) -> "KVCache":
        """A cache that extends and crops independently of this one. No tensor is copied: the
        cache never writes into a tensor it holds (``update`` concatenates, ``crop`` slices)."""
        other = KVCache(len(self.keys))
        other.keys, other.values = list(self.keys), list(self.values)
        return other

    def crop(self, length: int) -> None:
        """Keep the first ``length`` positions (speculative decoding drops rejected drafts)."""
        if length < 0:
            raise ValueError(f"KVCache.crop: expected a length >= 0 (got {length})")
        for i, (k, v) in enumerate(zip(self.keys, self.values)):
            if k is not None:
                self.keys[i], self.values[i] = k[:, :, :length], v[:, :, :length]


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(self, config: DecoderConfig):
        super().__init__()
        self.heads, self.head_dim = config.heads, config.hidden // config.heads
        self.q_proj = nn.Linear(config.hidden, config.hidden, bias=False)
        self.k_proj = nn.Linear(config.hidden, config.hidden, bias=False)
        self.v_proj = nn.Linear(config.hidden, config.hidden, bias=False)
        self.o_proj = nn.Linear(config.hidden, config.hidden, bias=False)

    def forward(self, x, cos, sin, mask, layer: int, cache: KVCache | None):
        b, t, _ = x.shape
        q, k, v = (proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        if cache is not None:
            k, v = cache.update(layer, k, v)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None and t > 1,
                                             scale=self.head_dim ** -0.5)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, config: DecoderConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden, config.intermediate, bias=False)
        self.up_proj = nn.Linear(config.hidden, config.intermediate, bias=False)
        self.down_proj = nn.Linear(config.intermediate, config.hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, config: DecoderConfig):
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden, config.eps)
        self.post_attention_layernorm = RMSNorm(config.hidden, config.eps)

    def forward(self, x, cos, sin, mask, layer, cache):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, layer, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Model(nn.Module):
    """The decoder stack (``LlamaModel``'s parameter names)."""

    def __init__(self, config: DecoderConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden, padding_idx=config.pad_token_id)
        self.layers = nn.ModuleList(Layer(config) for _ in range(config.layers))
        self.norm = RMSNorm(config.hidden, config.eps)
        head_dim = config.hidden // config.heads
        inv_freq = 1.0 / (ROPE_BASE ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)


class Decoder(nn.Module):
    """A causal LM: ``Decoder(config)(input_ids=...)`` or ``(inputs_embeds=...)`` gives logits
    (and the loss over ``labels``, and the extended cache with ``use_cache``)."""

    def __init__(self, config: DecoderConfig):
        super().__init__()
        self.config = config
        self.model = Model(config)
        self.lm_head = nn.Linear(config.hidden, config.vocab_size, bias=False)
        self.reset_parameters()
        self.tie_weights()

    def reset_parameters(self, std: float = 0.02) -> None:
        """``transformers``' initialisation: N(0, 0.02) weights, the padding embedding zero, norms one."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=std)
            if isinstance(module, nn.Embedding) and module.padding_idx is not None:
                with torch.no_grad():
                    module.weight[module.padding_idx].zero_()
            if isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)

    def tie_weights(self) -> None:
        self.lm_head.weight = self.model.embed_tokens.weight

    def _mask(self, attention_mask, b: int, t: int, past: int, device) -> torch.Tensor | None:
        """None where causal attention needs no explicit mask (no padding; no past, or one new
        position), else a boolean ``(batch, 1, t, past + t)`` mask: causal and not padding."""
        if attention_mask is not None and bool(attention_mask.all()):
            attention_mask = None
        if attention_mask is None and (past == 0 or t == 1):
            return None
        total = past + t
        query = torch.arange(past, total, device=device)
        allowed = torch.arange(total, device=device)[None, :] <= query[:, None]
        allowed = allowed[None, None].expand(b, 1, t, total)
        if attention_mask is not None:
            if attention_mask.shape != (b, total):
                raise ValueError(f"Decoder: expected an attention mask of shape {(b, total)} "
                                 f"(got {tuple(attention_mask.shape)})")
            allowed = allowed & attention_mask.bool()[:, None, None, :]
        return allowed

    def forward(self, input_ids: torch.Tensor | None = None, inputs_embeds: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                past_key_values: KVCache | None = None, use_cache: bool = False) -> DecoderOutput:
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("Decoder: pass exactly one of input_ids and inputs_embeds")
        x = self.model.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        b, t, _ = x.shape
        cache = past_key_values if past_key_values is not None else (KVCache(len(self.model.layers)) if use_cache
                                                                     else None)
        past = cache.get_seq_length() if cache is not None else 0
        positions = torch.arange(past, past + t, device=x.device, dtype=torch.float)
        freqs = positions[:, None] * self.model.inv_freq.to(device=x.device, dtype=torch.float)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)[None]
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        mask = self._mask(attention_mask, b, t, past, x.device)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, mask, i, cache)
        logits = self.lm_head(self.model.norm(x))
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                                   ignore_index=IGNORE_INDEX)
        return DecoderOutput(logits=logits, loss=loss, past_key_values=cache if use_cache else None)
