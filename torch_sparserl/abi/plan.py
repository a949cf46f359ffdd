"""The plan line: its grammar, its strict parser, and the ABI's vocabulary.

A specialized kernel's first line is its plan (``csrc/README.md`` is the contract)::

    // sparserl: op=spmm dtype=f32 n=32 rows=natural split=none block=256 grid=ceil(rows/8)

:func:`parse_plan` reads it into a frozen, validated :class:`Plan`; its integer expressions
(``grid``, ``smem``, ``work``) are parsed once into :class:`Expr` and evaluated per pattern.
A malformed plan raises :class:`PlanError`; nothing in a plan is ever passed to ``eval``.
"""

from __future__ import annotations

import functools
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



def plan_line(source: str) -> str:
    """The first non-empty line of ``source``, which the ABI says is the plan."""
    for line in source.splitlines():
        if line.strip():
            return line.strip()
    raise PlanError("source: empty, expected a plan line first")
