"""The device-only scanner's comment stripper and tokenizer (abi/device_scan.py) against the
straightforward implementations they replaced: the same output, the same errors, on every
family source and on random strings made of the characters that matter."""

from __future__ import annotations

import random
import re

import pytest

import torch_sparserl as ts
from torch_sparserl.abi import PlanError, check_source
from torch_sparserl.abi.device_scan import _strip_comments, _tokens
from torch_sparserl.pattern.features import structural_features
from torch_sparserl.specialize.autotune import candidates


def strip_reference(text: str) -> str:
    out, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            i = n if j < 0 else j
            out.append(" ")
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            if j < 0:
                raise PlanError("source: unterminated /* comment")
            out.append(" " + "\n" * text.count("\n", i, j))
            i = j + 2
        elif c in "\"'":
            j = i + 1
            while j < n and text[j] != c and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            out.append(text[i:j + 1])
            i = j + 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


TOKEN = re.compile(r"""
    (?P<ws>\s+)
  | (?P<name>[A-Za-z_][A-Za-z0-9_]*)
  | (?P<number>\.?[0-9](?:[eEpP][+-]|[A-Za-z0-9_.'])*)
  | (?P<char>'(?:[^'\\\n]|\\[^\n])+')
  | (?P<string>"(?:[^"\\\n]|\\[^\n])*")
  | (?P<digraph><%|%>|<:|:>|%:)
  | (?P<punct>::|->|\+\+|--|<<=|>>=|<<|>>|<=|>=|==|!=|&&|\|\||[-+*/%&|^!~=<>?:;,.(){}\[\]])
  | (?P<other>.)""", re.X | re.S)


def tokens_reference(text: str, where: str) -> list[str]:
    tokens = []
    for m in TOKEN.finditer(text):
        kind, value = m.lastgroup, m.group()
        if kind == "ws":
            continue
        if kind in ("digraph", "other"):
            raise PlanError(f"source: {where}: {value!r} is not allowed in a kernel")
        tokens.append(value)
    return tokens


def outcome(fn, *args):
    try:
        return "ok", fn(*args)
    except PlanError as exc:
        return "error", str(exc)


@pytest.fixture(scope="module")
def sources():
    m = ts.load_matrix("cora")
    features = structural_features(m.indptr, m.indices, m.shape)
    return [s.source for op, n in (("spmv", 1), ("spmm", 32), ("spmm", 256)) for s in candidates(op, n, "f32", features)]


def test_family_sources_strip_and_tokenize_as_before(sources):
    for source in sources:
        stripped = strip_reference(source)
        assert _strip_comments(source) == stripped
        for line in stripped.split("\n"):
            assert outcome(_tokens, line, "code") == outcome(tokens_reference, line, "code")
        check_source(source)


STRIP_PIECES = ["/", "*", '"', "'", "\\", "\n", "a", " ", "/*", "*/", "//"]
TOKEN_PIECES = ["a", "_1", "0", ".5", "1e+", "'", '"', "\\", " ", "\t", "<", ":", "%", ">", "<:", "%:", "::",
                "-", ">>=", "|", "&", "@", "$", "#", "`", ".", "x'y", "\n", "é"]


@pytest.mark.parametrize("seed", range(4))
def test_random_strings_strip_as_before(seed):
    rng = random.Random(seed)
    for _ in range(20000):
        text = "".join(rng.choice(STRIP_PIECES) for _ in range(rng.randint(0, 16)))
        assert outcome(_strip_comments, text) == outcome(strip_reference, text), repr(text)


@pytest.mark.parametrize("seed", range(4))
def test_random_strings_tokenize_as_before(seed):
    rng = random.Random(seed)
    for _ in range(20000):
        text = "".join(rng.choice(TOKEN_PIECES) for _ in range(rng.randint(0, 12)))
        assert outcome(_tokens, text, "code") == outcome(tokens_reference, text, "code"), repr(text)


@pytest.mark.parametrize("text, error", [
    ("int x; /* open", "unterminated /\\* comment"),
    ("a <% b", "'<%' is not allowed"),
    ("a @ b", "'@' is not allowed"),
])
def test_named_errors(text, error):
    fn = _strip_comments if "/*" in text else (lambda t: _tokens(t, "code"))
    with pytest.raises(PlanError, match=error):
        fn(text)
