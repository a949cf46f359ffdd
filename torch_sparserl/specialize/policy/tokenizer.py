"""The policy's tokenizer: byte-level BPE trained on the kernel corpus (``tokenizers``).

Words are whole lines (a split after each newline, then byte-level), so merges may span
spaces: a line the families write often becomes one token, and a kernel is a few hundred
tokens rather than a few thousand. Byte-level means any text encodes, so a policy can write
anything and the compiler judges it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
SPECIALS = (PAD, BOS, EOS)


def _require():
    try:
        import tokenizers  # noqa: F401
    except ImportError as exc:  # pragma: no cover - a dependency of the package
        raise ImportError("torch_sparserl.specialize.policy needs the 'tokenizers' package (pip install tokenizers)") from exc


def train_tokenizer(texts: Iterable[str], vocab_size: int = 4096, min_frequency: int = 2):
    """A byte-level BPE over ``texts`` with the special tokens <pad>, <bos>, <eos> first."""
    _require()
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"\n"), behavior="merged_with_previous"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                  special_tokens=list(SPECIALS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False, max_token_length=256)
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def load_tokenizer(path: str | Path):
    _require()
    from tokenizers import Tokenizer

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"policy: tokenizer file {path} is missing")
    return Tokenizer.from_file(str(path))


def special_ids(tok) -> dict[str, int]:
    ids = {name: tok.token_to_id(name) for name in SPECIALS}
    missing = [k for k, v in ids.items() if v is None]
    if missing:
        raise ValueError(f"policy: the tokenizer lacks the special tokens {missing}")
    return ids
