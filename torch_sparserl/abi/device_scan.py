"""The device-only scan: a kernel source holds device code and nothing else (:func:`check_device_only`)."""

from __future__ import annotations

import functools
import re

from .plan import KERNEL_NAME, PlanError


# A kernel source is compiled by nvcc into a library that this process loads (toolchain/inline.py):
# host code in it (a global constructor, an __attribute__((constructor)) function, an asm block,
# a host header's static initializers) would run in the user's process at load time. Sources
# come from the cache (a file on disk) and from the policy (sampled text), so they are held to
# what the shipped families generate: device code and nothing else. A whitelist, checked on the
# text as written (comments removed) without running the preprocessor, so it is conservative:
#
# * directives: #define/#undef of a plain name (no leading underscore, no keyword; its body
#   without braces, semicolons, # or ## and bracket-balanced), #if/#ifdef/#ifndef/#elif/#else/
#   #endif (each branch bracket-balanced; at namespace scope between declarations only),
#   #error, #pragma unroll [n], and #include of the ABI's own headers only;
# * namespace scope: declarations that begin (after template<...>, inline, __forceinline__)
#   with __global__, __device__ or __constant__, extern "C" __global__ for sparserl_kernel
#   only, and typedefs without a body;
# * nowhere: __host__, __attribute__, __declspec, asm, _Pragma, extern (but the kernel's),
#   static at namespace scope, struct/class/union/enum/namespace/operator/using, [[attributes]],
#   string literals (but "C"), backslashes, digraphs.

DEVICE_INCLUDES = frozenset({"<cuda_fp16.h>", "<cuda_bf16.h>", "<mma.h>", '"sparserl/prelude.cuh"',
                             '"sparserl/spmm_common.cuh"', '"sparserl/sddmm_common.cuh"'})
"""What a kernel may include: the CUDA half-precision and warp-matrix (``nvcuda::wmma``) headers, and the ABI's own headers
(families.HEADERS, expanded before a build)."""

_BANNED = frozenset({
    "__host__", "__attribute__", "__declspec", "asm", "__asm", "__asm__", "_Pragma", "__pragma", "__managed__",
    "struct", "class", "union", "enum", "namespace", "operator", "using", "friend", "virtual", "thread_local",
    "__thread", "__cudart_builtin__", "typeid", "export", "module", "import", "co_await", "co_return", "co_yield",
    "__builtin_ia32_rdtsc", "__section__", "__constructor__", "__destructor__", "constructor", "destructor",
})
_KEYWORDS = frozenset({
    "alignas", "alignof", "auto", "bool", "break", "case", "catch", "char", "const", "constexpr", "const_cast",
    "continue", "decltype", "default", "delete", "do", "double", "dynamic_cast", "else", "explicit", "extern",
    "false", "float", "for", "goto", "if", "inline", "int", "long", "mutable", "new", "noexcept", "nullptr",
    "private", "protected", "public", "register", "reinterpret_cast", "return", "short", "signed", "sizeof",
    "static", "static_assert", "static_cast", "switch", "template", "this", "throw", "true", "try", "typedef",
    "typename", "unsigned", "void", "volatile", "wchar_t", "while", "defined",
}) | _BANNED
_LEADING = frozenset({"__global__", "__device__", "__constant__"})
_SKIPPED = frozenset({"inline", "__forceinline__", "__noinline__"})
_DIRECTIVE = re.compile(r"^[ \t]*#[ \t]*([A-Za-z_]*)(.*)$")
_DEFINE = re.compile(r"^[ \t]+([A-Za-z][A-Za-z0-9_]*)(\([A-Za-z0-9_, \t.]*\))?(.*)$")
_PRAGMA = re.compile(r"^[ \t]+unroll(?:[ \t]+\(?[ \t]*[A-Za-z0-9_]+[ \t]*\)?)?[ \t]*$")
# One C++ token after optional whitespace, in one of four groups, tried in this order: allowed
# (a name, number, character or string literal), a digraph, a punctuator, anything else.
_CPP_TOKEN_GROUPS = re.compile(r"""\s*(?:
    ([A-Za-z_][A-Za-z0-9_]*|\.?[0-9](?:[eEpP][+-]|[A-Za-z0-9_.'])*|'(?:[^'\\\n]|\\[^\n])+'|"(?:[^"\\\n]|\\[^\n])*")
  | (<%|%>|<:|:>|%:)
  | (::|->|\+\+|--|<<=|>>=|<<|>>|<=|>=|==|!=|&&|\|\||[-+*/%&|^!~=<>?:;,.(){}\[\]])
  | (\S))""", re.X | re.S)
_PAIRS = {")": "(", "]": "[", "}": "{"}
# Characters a kernel never needs and a compiler may read otherwise than this scan does: every
# C0 control but tab and newline (\r ends a line for gcc and nvcc), DEL, and Unicode's line and
# paragraph separators.
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f\u2028\u2029\x85]")


# A comment, an unterminated /*, or a string or character literal (to its closing quote, the
# end of its line, or the end of the text; a backslash takes the character after it).
_COMMENT_OR_LITERAL = re.compile(r"""//[^\n]*|/\*.*?\*/|/\*|"(?:[^"\\\n]|\\[\s\S]?)*["\n]?|'(?:[^'\\\n]|\\[\s\S]?)*['\n]?""",
                                 re.S)


def _blank_comment(m: re.Match) -> str:
    text = m.group()
    if text.startswith("//"):
        return " "
    if text == "/*":  # the alternative taken only where no */ follows
        raise PlanError("source: unterminated /* comment")
    if text.startswith("/*"):
        return " " + "\n" * text.count("\n")
    return text


def _strip_comments(text: str) -> str:
    """Comments replaced by a space (newlines kept); strings and characters left as they are."""
    return _COMMENT_OR_LITERAL.sub(_blank_comment, text)


def _tokens(text: str, where: str) -> list[str]:
    found = _CPP_TOKEN_GROUPS.findall(text)
    for _, digraph, _, other in found:
        if digraph or other:
            raise PlanError(f"source: {where}: {digraph or other!r} is not allowed in a kernel")
    return [allowed or punct for allowed, _, punct, _ in found]


class _DeviceScan:
    """The namespace-scope structure of a source, token by token (see the comment above)."""

    def __init__(self):
        self.stack: list[str] = []  # open brackets
        self.decl: list[str] = []   # tokens of the namespace-scope declaration being read
        self.head_checked = False   # its beginning has been checked
        self.groups: list[tuple[list[str], bool]] = []  # per open #if: (brackets at #if, at namespace scope)

    def fail(self, why: str):
        raise PlanError(f"source: not device code only: {why}")

    def feed(self, tokens: list[str]) -> None:
        for i, tok in enumerate(tokens):
            if tok in _BANNED:
                self.fail(f"{tok!r} is not allowed in a kernel")
            if tok == "extern" and not (tokens[i + 1:i + 3] == ['"C"', "__global__"] and not self.stack):
                self.fail('extern is allowed only as extern "C" __global__ for the kernel')
            if tok.startswith('"') and not (tok == '"C"' and i and tokens[i - 1] == "extern"):
                self.fail(f"string literal {tok[:40]} (a kernel has none)")
            if tok == "[" and i + 1 < len(tokens) and tokens[i + 1] == "[":
                self.fail("[[attributes]] are not allowed in a kernel")
            at_scope = not self.stack
            if at_scope:
                self.decl.append(tok)
            if tok in "([{":
                if tok == "{" and at_scope:
                    self._check_head(body=True)
                self.stack.append(tok)
            elif tok in ")]}":
                if not self.stack or self.stack[-1] != _PAIRS[tok]:
                    self.fail(f"unbalanced {tok!r}")
                self.stack.pop()
                if tok == "}" and not self.stack:
                    self._end(body=True)
            elif tok == ";" and at_scope:
                self._check_head(body=False)
                self._end(body=False)
            elif tok == ";" and "{" not in self.stack:
                self.fail("';' inside brackets at namespace scope")

    def _check_head(self, body: bool) -> None:
        if self.head_checked:
            return
        self.head_checked = True
        decl = self.decl
        i = 0
        if decl[:1] == ["template"]:
            if decl[1:2] != ["<"]:
                self.fail("template without <...>")
            depth, i = 0, 1
            while i < len(decl):
                depth += {"<": 1, ">": -1, ">>": -2}.get(decl[i], 0)
                i += 1
                if depth <= 0:
                    break
        if decl[i:i + 2] == ["extern", '"C"']:
            named = [decl[k - 1] for k in range(1, len(decl)) if decl[k] == "(" and decl[k - 1] != "__launch_bounds__"]
            if named[:1] != [KERNEL_NAME] or decl[i + 2:i + 3] != ["__global__"]:
                self.fail(f'extern "C" is allowed only for the __global__ {KERNEL_NAME}')
            i += 2
        while i < len(decl) and decl[i] in _SKIPPED:
            i += 1
        first = decl[i] if i < len(decl) else ";"
        if first in _LEADING:
            return
        if first == "typedef" and not body:
            return
        if first == ";" and i == len(decl) - 1:
            return
        self.fail(f"a namespace-scope declaration must be device code (begin with __global__, __device__ or "
                  f"__constant__), got {' '.join(decl[:8])!r}")

    def _end(self, body: bool) -> None:
        if body and self.decl and self.decl[0] == "typedef":
            self.fail("typedef with a body")
        self.decl, self.head_checked = [], False

    def directive(self, name: str, rest: str, line: str) -> None:
        at_boundary = not self.stack and not self.decl
        if name in ("if", "ifdef", "ifndef"):
            if not self.stack and not at_boundary:
                self.fail(f"#{name} inside a namespace-scope declaration")
            self.groups.append((list(self.stack), not self.stack))
            self._condition(rest)
        elif name in ("elif", "else", "endif"):
            if not self.groups:
                self.fail(f"#{name} without #if")
            stack, at_scope = self.groups[-1]
            if self.stack != stack or (at_scope and not at_boundary):
                self.fail(f"a branch of #if/#{name} that does not close what it opens")
            if name == "endif":
                self.groups.pop()
            elif name == "elif":
                self._condition(rest)
        elif name in ("define", "undef"):
            m = _DEFINE.match(rest)
            if not m or m.group(1) in _KEYWORDS or m.group(1).startswith(("CUDA", "CU_", "NV", "__")):
                self.fail(f"#{name} of a name a kernel may not define: {line.strip()[:80]!r}")
            body = m.group(3) or ""
            if name == "undef" and (m.group(2) or body.strip()):
                self.fail(f"malformed {line.strip()[:80]!r}")
            body_tokens = _tokens(body, "#define")
            if any(t in ("{", "}", ";") for t in body_tokens) or "#" in body:
                self.fail(f"a macro body with braces, ';' or '#': {line.strip()[:80]!r}")
            inner = _DeviceScan()
            inner.stack = ["("]  # a body is checked as an expression: balanced, no namespace-scope rules
            inner.feed(body_tokens)
            if inner.stack != ["("]:
                self.fail(f"unbalanced brackets in {line.strip()[:80]!r}")
        elif name == "include":
            if rest.strip() not in DEVICE_INCLUDES:
                self.fail(f"#include {rest.strip()[:60]} (allowed: {', '.join(sorted(DEVICE_INCLUDES))})")
            if not at_boundary:
                self.fail("#include inside a declaration")
        elif name == "pragma":
            if not _PRAGMA.match(rest):
                self.fail(f"#pragma {rest.strip()[:60]} (only #pragma unroll is allowed)")
        elif name == "error":
            pass
        else:
            self.fail(f"directive #{name or ''} is not allowed in a kernel")

    def _condition(self, rest: str) -> None:
        tokens = _tokens(rest, "#if")
        if any(t.startswith('"') or t in _BANNED or t in ("{", "}", ";") for t in tokens):
            self.fail(f"#if condition {rest.strip()[:60]!r}")


def check_device_only(source: str) -> None:
    """Raise :class:`PlanError` unless ``source`` holds device code only (the whitelist above).

    The verdict on a text is a function of the text alone: the last few hundred are kept, so
    a candidate screened, validated and installed is scanned once per process, not per stage."""
    verdict = _device_only_verdict(source)
    if verdict is not None:
        raise PlanError(verdict)


@functools.lru_cache(maxsize=256)
def _device_only_verdict(source: str) -> str | None:
    try:
        _scan_device_only(source)
    except PlanError as exc:
        return str(exc)
    return None


def _scan_device_only(source: str) -> None:
    control = _CONTROL.search(source)
    if control is not None:  # a lone \r ends a // comment for the compiler, not for this scan
        line = source.count("\n", 0, control.start()) + 1
        raise PlanError(f"source: not device code only: control character {control.group()!r} on line {line} "
                        "(a kernel's lines end in \\n; only tabs and newlines are allowed)")
    if "\\" in source or "??" in source:  # line splices (in comments too), universal character names, trigraphs
        raise PlanError("source: not device code only: backslashes and '??' are not allowed in a kernel")
    scan = _DeviceScan()
    for line in _strip_comments(source).split("\n"):
        m = _DIRECTIVE.match(line)
        if m:
            scan.directive(m.group(1), m.group(2), line)
        elif line.strip():
            scan.feed(_tokens(line, "code"))
    if scan.stack or scan.decl or scan.groups:
        scan.fail("the source ends inside a declaration, bracket or #if")
