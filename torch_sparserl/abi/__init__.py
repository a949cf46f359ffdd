"""The kernel ABI: the plan line, its strict parser, and the kernel spec.

Pipeline stage 4 of 14: the kernel ABI every specialized kernel follows: the plan line and its
parser, the kernel spec, and the per-pattern preprocessing a plan names (:mod:`.prepare`).
May import: config, dtypes, data, pattern, kernels.

A specialized kernel is one complete CUDA translation unit whose first line is a plan
(``csrc/README.md`` is the contract)::

    // sparserl: op=spmm dtype=f32 n=32 rows=natural split=none block=256 grid=ceil(rows/8)

Everything here is pure Python and runs without a GPU. A malformed plan raises
:class:`PlanError`, which the evaluator scores as a compile-tier failure; nothing in a plan
is ever passed to ``eval``.
"""

from __future__ import annotations

import functools
import hashlib
import re
from dataclasses import dataclass, field

import torch

KERNEL_NAME = "sparserl_kernel"
PLAN_PREFIX = "// sparserl:"

OPS = ("spmm", "spmv", "sddmm")
DTYPES: dict[str, torch.dtype] = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
HALF_DTYPES = ("f16", "bf16")  # their kernels round y once, from float32 sums: no atomics into y
ROW_ORDERS = ("natural", "sorted_desc", "binned", "sell")
SPLITS = ("none", "nnz", "merge", "rowchunks", "tiles")
TILE_WINDOWS = (16, 32)
"""``split=tiles(W)``: rows in windows of W (one or two 16-row tensor-core tiles), each window's
distinct columns condensed into blocks of 8 (csrc/README.md section 3). Every row is stored once,
by the one warp that owns its window and column slice, or (``init=zero``, float32) added atomically
by the warps that share its window's steps."""
MATHS = ("ieee", "tf32")
"""``math=``: how a float32 kernel multiplies. ``ieee``: float32 products (a tensor-core kernel
reaches them with three TF32 products per term, split into high and low parts); ``tf32``: one
TF32 product per term, about 3 decimal digits, judged by :data:`torch_sparserl.dtypes.TF32_TOLERANCE`
and run only where torch allows TF32 (``torch.backends.cuda.matmul.allow_tf32``)."""
HUB_SPLITS = {"spmm": ("rowchunks", "nnz"), "spmv": ("rowchunks",)}
"""The splits whose half-precision kernels (op=spmm, spmv) sum a row's pieces in a float32
workspace (``work=...hubs...``), and so the only splits the ABI takes for those dtypes."""
INITS = ("none", "zero")
WORK_INITS = ("zero", "once")
"""How the plan's workspace is zeroed: ``zero``, by the caller before every launch; ``once``, by
the caller before the first launch only, since every launch leaves it zero again (a caller may
keep one workspace across the launches of one stream, with no zero-fill per call)."""
# What a kernel may apply to a finished row of y before storing it, in this order:
# y = relu(scale[row] * (A @ X)[row] + bias). A plan names a '+'-joined subset, e.g. bias+relu.
EPILOGUE_STEPS = ("scale", "bias", "relu")
EPILOGUE_BITS = {"scale": 1, "bias": 2, "relu": 4}
EXPR_NAMES = ("rows", "cols", "nnz", "n", "parts", "hubs")  # hubs: rows a split stores in more than one piece

MAX_BLOCK = 1024
MAX_SMEM_BYTES = 227 * 1024  # sm_90 opt-in limit per block
MAX_BINS = 8
MAX_CHUNK = 1 << 20

_KEYS = ("op", "dtype", "n", "rows", "split", "block", "grid", "smem", "init", "work", "work_init", "epilogue",
         "math")
_REQUIRED = ("op", "dtype", "block", "grid")


class PlanError(ValueError):
    """A plan line (or the source around it) that breaks the ABI: a compile-tier failure."""


# --------------------------------------------------------------------------- expressions

_TOKEN = re.compile(r"\s*(?:(\d+)|([A-Za-z_]\w*)|(.))")


@dataclass(frozen=True)
class Expr:
    """An integer expression over ``rows cols nnz n parts``; parsed once, evaluated per pattern."""

    text: str
    _tree: tuple = field(repr=False, compare=False, hash=False)

    def evaluate(self, env: dict[str, int]) -> int:
        return _eval(self._tree, env, self.text)

    def __str__(self) -> str:
        return self.text


def _tokenize(text: str) -> list[tuple[str, str]]:
    tokens = []
    for number, name, other in _TOKEN.findall(text):
        if number:
            tokens.append(("num", number))
        elif name:
            tokens.append(("name", name))
        elif other.strip():
            if other not in "+-*/(),":
                raise PlanError(f"plan expression {text!r}: unexpected character {other!r}")
            tokens.append(("op", other))
    return tokens


class _ExprParser:
    # expr := term (('+'|'-') term)* ; term := atom (('*'|'/') atom)* ;
    # atom := num | name | '(' expr ')' | ('ceil'|'min'|'max') '(' args ')'
    def __init__(self, text: str):
        self.text, self.tokens, self.pos = text, _tokenize(text), 0

    def fail(self, why: str):
        raise PlanError(f"plan expression {self.text!r}: {why}")

    def peek(self):
        return self.tokens[self.pos] if self.pos < len(self.tokens) else (None, None)

    def take(self, value: str):
        if self.peek()[1] != value:
            self.fail(f"expected {value!r}, got {self.peek()[1]!r}")
        self.pos += 1

    def parse(self) -> tuple:
        if not self.tokens:
            self.fail("empty")
        tree = self.expr()
        if self.pos != len(self.tokens):
            self.fail(f"unexpected {self.peek()[1]!r}")
        return tree

    def expr(self):
        tree = self.term()
        while self.peek()[1] in ("+", "-"):
            op = self.tokens[self.pos][1]
            self.pos += 1
            tree = (op, tree, self.term())
        return tree

    def term(self):
        tree = self.atom()
        while self.peek()[1] in ("*", "/"):
            op = self.tokens[self.pos][1]
            self.pos += 1
            tree = (op, tree, self.atom())
        return tree

    def atom(self):
        kind, value = self.peek()
        if kind is None:
            self.fail("ends too early")
        self.pos += 1
        if kind == "num":
            return ("num", int(value))
        if kind == "name" and value in ("ceil", "min", "max"):
            self.take("(")
            if value == "ceil":
                inner = self.expr()
                if inner[0] != "/":
                    self.fail("ceil takes a division, ceil(a/b)")
                self.take(")")
                return ("ceil", inner[1], inner[2])
            first = self.expr()
            self.take(",")
            second = self.expr()
            self.take(")")
            return (value, first, second)
        if kind == "name":
            if value not in EXPR_NAMES:
                self.fail(f"unknown name {value!r} (expected one of {', '.join(EXPR_NAMES)})")
            return ("name", value)
        if value == "(":
            tree = self.expr()
            self.take(")")
            return tree
        self.fail(f"unexpected {value!r}")


def _eval(tree: tuple, env: dict[str, int], text: str) -> int:
    kind = tree[0]
    if kind == "num":
        return tree[1]
    if kind == "name":
        return int(env[tree[1]])
    a, b = _eval(tree[1], env, text), _eval(tree[2], env, text)
    if kind == "+":
        return a + b
    if kind == "-":
        return a - b
    if kind == "*":
        return a * b
    if kind == "min":
        return min(a, b)
    if kind == "max":
        return max(a, b)
    if b == 0:
        raise PlanError(f"plan expression {text!r}: division by zero")
    return a // b if kind == "/" else -(-a // b)


def parse_expr(text: str) -> Expr:
    return Expr(text, _ExprParser(text).parse())


# --------------------------------------------------------------------------- the plan

@dataclass(frozen=True)
class Plan:
    """A parsed plan line. Frozen and validated: an invalid combination cannot be built."""

    op: str
    dtype: str
    block: int
    grid: Expr
    n: int | None = None
    rows: str = "natural"
    rows_args: tuple[int, ...] = ()
    split: str = "none"
    split_arg: int | None = None
    smem: Expr = field(default_factory=lambda: parse_expr("0"))
    init: str = "none"
    work: Expr = field(default_factory=lambda: parse_expr("0"))
    epilogue: str = "none"
    work_init: str = "zero"
    math: str = "ieee"

    def __post_init__(self):
        def bad(key, expected, got):
            raise PlanError(f"plan: {key} must be {expected} (got {got!r})")

        if self.op not in OPS:
            bad("op", " or ".join(OPS), self.op)
        if self.dtype not in DTYPES:
            bad("dtype", " or ".join(DTYPES), self.dtype)
        if not (32 <= self.block <= MAX_BLOCK and self.block % 32 == 0):
            bad("block", f"a multiple of 32 in 32..{MAX_BLOCK}", self.block)
        if self.n is not None and self.n < 1:
            bad("n", "an integer >= 1", self.n)
        if self.op == "spmv" and self.n not in (None, 1):
            bad("n", "1 for op=spmv", self.n)
        if self.epilogue != "none":
            steps = self.epilogue.split("+")
            if (not steps or any(step not in EPILOGUE_STEPS for step in steps) or len(set(steps)) != len(steps)
                    or steps != sorted(steps, key=EPILOGUE_STEPS.index)):
                bad("epilogue", f"none or a '+'-joined subset of {'+'.join(EPILOGUE_STEPS)} in that order",
                    self.epilogue)
            if self.op != "spmm" or self.atomic or self.init != "none":
                bad("epilogue", "none unless op=spmm with split=none and init=none (each row of y stored once)",
                    self.epilogue)
        if self.dtype in HALF_DTYPES and self.op != "sddmm" and self.atomic and not (
                self.split in HUB_SPLITS[self.op] and "hubs" in self.work.text):
            allowed = " or ".join(f"{split}(T)" for split in HUB_SPLITS[self.op])
            bad(f"split for op={self.op} dtype={self.dtype}", f"none, or {allowed} with a float32 workspace "
                "for its hubs (work=...hubs...): a split sums a row's pieces, and atomics into a half-precision "
                "y would round every partial sum, where the ABI accumulates in float32",
                f"{self.split}({self.split_arg})" + ("" if self.work.text == "0" else f" with work={self.work}"))
        if self.op == "sddmm" and self.init != "none":
            bad("init", "none for op=sddmm (every output element belongs to one nonzero)", self.init)
        if self.rows not in ROW_ORDERS:
            bad("rows", " or ".join(ROW_ORDERS), self.rows)
        if self.split not in SPLITS:
            bad("split", " or ".join(SPLITS), self.split)
        if self.init not in INITS:
            bad("init", " or ".join(INITS), self.init)
        if self.work_init not in WORK_INITS:
            bad("work_init", " or ".join(WORK_INITS), self.work_init)
        if self.work_init != "zero" and self.work.text == "0":
            bad("work_init", "zero (the default) for a plan without a workspace", self.work_init)
        if self.rows == "binned":
            edges = self.rows_args
            if not 1 <= len(edges) <= MAX_BINS - 1 or edges[0] < 1 or any(
                    b <= a for a, b in zip(edges, edges[1:])):
                bad("rows=binned(...)", f"1..{MAX_BINS - 1} strictly increasing positive edges", edges)
        elif self.rows == "sell":
            if len(self.rows_args) != 2:
                bad("rows=sell(C,S)", "two integers", self.rows_args)
            c, s = self.rows_args
            if not (1 <= c <= MAX_BLOCK and c & (c - 1) == 0):
                bad("rows=sell(C,S): C", f"a power of two in 1..{MAX_BLOCK}", c)
            if s < c or s % c:
                bad("rows=sell(C,S): S", f"a positive multiple of C={c}", s)
        elif self.rows_args:
            bad(f"rows={self.rows}", "no arguments", self.rows_args)
        if self.math not in MATHS:
            bad("math", " or ".join(MATHS), self.math)
        if self.math != "ieee" and self.dtype != "f32":
            bad("math", f"ieee for dtype={self.dtype} (math=tf32 rounds float32 operands)", self.math)
        if self.split == "tiles":
            if self.op != "spmm":
                bad("split", f"not tiles for op={self.op} (tensor-core tiles are an spmm layout)", "tiles")
            if self.split_arg not in TILE_WINDOWS:
                bad("split=tiles(W): W", " or ".join(map(str, TILE_WINDOWS)), self.split_arg)
            if self.work.text != "0":
                bad("split=tiles(W)", "no workspace (a window's rows are stored once, or with init=zero "
                    "added atomically by the warps sharing its steps)", f"work={self.work}")
        if self.split == "none":
            if self.split_arg is not None:
                bad("split=none", "no argument", self.split_arg)
        else:
            if self.split_arg is None or not 1 <= self.split_arg <= MAX_CHUNK:
                bad(f"split={self.split}(C)", f"an integer in 1..{MAX_CHUNK}", self.split_arg)
            if self.rows != "natural":
                bad("rows", f"natural with split={self.split}", self.rows)

    @property
    def epilogue_steps(self) -> tuple[str, ...]:
        """The epilogue's steps in order; () without one."""
        return () if self.epilogue == "none" else tuple(self.epilogue.split("+"))

    @property
    def epilogue_bits(self) -> int:
        """``SR_EPILOGUE``: 1 scale, 2 bias, 4 relu; 0 without an epilogue."""
        return sum(EPILOGUE_BITS[s] for s in self.epilogue_steps)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def atomic(self) -> bool:
        """Work items may share a row: the kernel then accumulates into zero-filled output."""
        return self.split not in ("none", "tiles") or (self.split == "tiles" and self.init == "zero")

    def format(self) -> str:
        """The canonical plan line (parses back to an equal plan)."""
        parts = [f"op={self.op}", f"dtype={self.dtype}"]
        if self.n is not None:
            parts.append(f"n={self.n}")
        rows = self.rows + (f"({','.join(map(str, self.rows_args))})" if self.rows_args else "")
        split = self.split + (f"({self.split_arg})" if self.split_arg is not None else "")
        parts += [f"rows={rows}", f"split={split}", f"block={self.block}", f"grid={self.grid}"]
        if self.smem.text != "0":
            parts.append(f"smem={self.smem}")
        if self.init != "none":
            parts.append(f"init={self.init}")
        if self.work.text != "0":
            parts.append(f"work={self.work}")
        if self.work_init != "zero":
            parts.append(f"work_init={self.work_init}")
        if self.epilogue != "none":
            parts.append(f"epilogue={self.epilogue}")
        if self.math != "ieee":
            parts.append(f"math={self.math}")
        return f"{PLAN_PREFIX} {' '.join(parts)}"


_CALL = re.compile(r"^([a-z_]+)(?:\(([^()]*)\))?$")


def _int(key: str, text: str) -> int:
    if not re.fullmatch(r"\d+", text):
        raise PlanError(f"plan: {key} must be a non-negative integer (got {text!r})")
    return int(text)


def _call(key: str, text: str) -> tuple[str, tuple[int, ...]]:
    match = _CALL.match(text)
    if not match:
        raise PlanError(f"plan: {key} must be a name or name(int,...) (got {text!r})")
    name, args = match.group(1), match.group(2)
    if args is None:
        return name, ()
    return name, tuple(_int(f"{key}={name}(...)", a.strip()) for a in args.split(","))


@functools.lru_cache(maxsize=4096)
def parse_plan(line: str) -> Plan:
    """Parse one plan line (with or without the ``// sparserl:`` prefix)."""
    if not isinstance(line, str):
        raise PlanError(f"parse_plan: expected a str, got {type(line).__name__}")
    body = line.strip()
    if body.startswith(PLAN_PREFIX):
        body = body[len(PLAN_PREFIX):]
    elif body.startswith("//"):
        raise PlanError(f"plan: expected a line starting with {PLAN_PREFIX!r} (got {line.strip()[:60]!r})")
    fields: dict[str, str] = {}
    for item in body.split():
        key, eq, value = item.partition("=")
        if not eq or not value:
            raise PlanError(f"plan: expected key=value, got {item!r}")
        if key not in _KEYS:
            raise PlanError(f"plan: unknown key {key!r} (expected one of {', '.join(_KEYS)})")
        if key in fields:
            raise PlanError(f"plan: key {key!r} given twice")
        fields[key] = value
    missing = [k for k in _REQUIRED if k not in fields]
    if missing:
        raise PlanError(f"plan: missing required key(s) {', '.join(missing)}")
    rows, rows_args = _call("rows", fields.get("rows", "natural"))
    split, split_args = _call("split", fields.get("split", "none"))
    if len(split_args) > 1:
        raise PlanError(f"plan: split={split}(...) takes one integer (got {split_args})")
    return Plan(
        op=fields["op"], dtype=fields["dtype"],
        block=_int("block", fields["block"]), grid=parse_expr(fields["grid"]),
        n=_int("n", fields["n"]) if "n" in fields else None,
        rows=rows, rows_args=rows_args, split=split,
        split_arg=split_args[0] if split_args else None,
        smem=parse_expr(fields.get("smem", "0")), init=fields.get("init", "none"),
        work=parse_expr(fields.get("work", "0")), epilogue=fields.get("epilogue", "none"),
        work_init=fields.get("work_init", "zero"), math=fields.get("math", "ieee"),
    )


# extern "C" __global__ void [__launch_bounds__(...)] sparserl_kernel(  (qualifiers in any order)
_KERNEL_DEF = re.compile(
    r'extern\s+"C"\s+(?:(?:__global__|void|__launch_bounds__\s*\([^)]*\))\s*)+' + KERNEL_NAME + r"\s*\(")


def plan_line(source: str) -> str:
    """The first non-empty line of ``source``, which the ABI says is the plan."""
    for line in source.splitlines():
        if line.strip():
            return line.strip()
    raise PlanError("source: empty, expected a plan line first")


def check_source(source: str) -> Plan:
    """Check what can be checked without a compiler; return the parsed plan."""
    if not isinstance(source, str):
        raise PlanError(f"check_source: expected the kernel source as a str, got {type(source).__name__}")
    first = plan_line(source)
    if not first.startswith(PLAN_PREFIX):
        raise PlanError(f"source: the first line must be the plan ({PLAN_PREFIX} ...), got {first[:60]!r}")
    plan = parse_plan(first)
    if not _KERNEL_DEF.search(source):
        raise PlanError(f'source: no definition of extern "C" __global__ void {KERNEL_NAME}(...)')
    if re.search(r'#\s*include\s*["<](?:torch|ATen|c10)/', source):
        raise PlanError("source: torch headers are not allowed in a kernel (the ABI is header-lean)")
    check_device_only(source)
    return plan


# --------------------------------------------------------------------------- device code only
#
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


def operand_shapes(op: str, rows: int, cols: int, nnz: int, n: int) -> dict[str, tuple[int, ...]]:
    """The shapes of the kernel's ``val``, ``x`` and ``y`` slots for ``op`` (``csrc/README.md`` §2).

    ``spmm``/``spmv``: ``val`` holds the nonzeros' values, ``y = A @ x``. ``sddmm``: ``val``
    holds the left dense operand D (rows x n), ``x`` the right one (cols x n), and ``y`` one
    value per nonzero, ``y[k] = dot(D[row(k)], x[col(k)])``.
    """
    if op == "spmm":
        return {"val": (nnz,), "x": (cols, n), "y": (rows, n)}
    if op == "spmv":
        return {"val": (nnz,), "x": (cols,), "y": (rows,)}
    if op == "sddmm":
        return {"val": (rows, n), "x": (cols, n), "y": (nnz,)}
    raise PlanError(f"operand_shapes: op must be one of {', '.join(OPS)} (got {op!r})")


@dataclass(frozen=True)
class KernelSpec:
    """A candidate kernel: its source, and where it came from (family and parameters)."""

    source: str
    family: str = ""
    params: tuple = ()

    @functools.cached_property
    def plan(self) -> Plan:
        return check_source(self.source)

    @functools.cached_property
    def key(self) -> str:
        """Content hash of the source: names built modules and cache entries."""
        return hashlib.sha256(self.source.encode()).hexdigest()[:20]

    def describe(self) -> str:
        params = ",".join(f"{k}={v}" for k, v in self.params)
        return f"{self.family or 'custom'}({params})"
