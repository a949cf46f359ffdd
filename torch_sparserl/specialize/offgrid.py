"""Kernels beyond the grid: the families' domain as a gate on written kernels, and the off-grid
neighbours of a grid point.

:func:`~torch_sparserl.specialize.families.space` enumerates a few values of each parameter
(block 256, unroll 1/2/4, three segment lengths, five bin schemes, ...); the templates accept
far more (:func:`~torch_sparserl.specialize.families.domain`). A kernel outside that grid is
*off-grid*: neither in the pattern's screened space (the autotuner's oracle) nor in the default
space (``space(op, dtype, n)`` without features).

:func:`check_declared` is the gate a kernel's text passes before any compiler sees it: its
``// family: name(params)`` line must name a family and parameters inside the family's domain,
and its plan line and ``#define SR_*`` lines must be exactly the ones the family's template
renders from those parameters. Every failure is a :class:`~torch_sparserl.abi.PlanError` (a
compile-tier failure for the evaluator) naming the parameter and the constraint.

:func:`neighbours` lists the in-domain moves around a grid point (the next or previous power of
two, unroll ± 1, the other row order, segment and chunk lengths × 3/4 or 3/2, a bin edge halved
or doubled, ...), single moves and pairs of them; :func:`off_grid` keeps the off-grid ones.
"""

from __future__ import annotations

import re
from typing import Any

from ..abi import PlanError, plan_line
from . import families as F

_FAMILY_LINE = re.compile(r"^// family: ([a-z_]+)\((.*)\)[ \t]*$", re.M)
_PARAM_SPLIT = re.compile(r",(?![^()]*\))")
_WORD = re.compile(r"^[a-z][a-z0-9_+]*$")
_DEFINE = re.compile(r"^#define (SR_\w+) (.*)$", re.M)


def _value(name: str, text: str) -> Any:
    """One parameter value as the family line writes it: an integer, a tuple of integers, a word."""
    if re.fullmatch(r"-?\d+", text):
        return int(text)
    if text.startswith("(") and text.endswith(")"):
        items = text[1:-1].split(",")
        if items and items[-1] == "":
            items.pop()  # a one-element tuple: (4,)
        if all(re.fullmatch(r"-?\d+", v) for v in items):
            return tuple(int(v) for v in items)
    elif _WORD.match(text):
        return text
    raise PlanError(f"source: family line parameter {name!r} expected an integer, a tuple of integers or a "
                    f"word, got {text!r}")


def parse_family_line(source: str) -> tuple[str, dict[str, Any]]:
    """``(family, params)`` from a kernel's ``// family: name(k=v,...)`` line; a PlanError naming
    what is malformed otherwise."""
    m = _FAMILY_LINE.search(source)
    if not m:
        raise PlanError("source: no '// family: name(param=value,...)' line (a kernel checked against a "
                        "family's domain must declare its family and parameters)")
    family, body = m.group(1), m.group(2).replace(" ", "")
    params: dict[str, Any] = {}
    for item in _PARAM_SPLIT.split(body) if body else ():
        name, eq, text = item.partition("=")
        if not eq or not re.fullmatch(r"[a-z_]+", name) or not text:
            raise PlanError(f"source: family line expected name=value items, got {item!r}")
        if name in params:
            raise PlanError(f"source: family line names parameter {name!r} twice")
        params[name] = _value(name, text)
    return family, params


def check_declared(source: str, *, op: str, dtype: str, n: int) -> tuple[str, dict[str, Any]]:
    """Check that ``source`` is its declared family's template at parameters inside the domain.

    The family line's parameters must pass :func:`~torch_sparserl.specialize.families.valid`
    for the request, and the plan line and every ``#define SR_*`` must equal the rendering's
    (so no macro carries a value the family line does not declare). The body is left to the
    compiler and the sandbox. Returns ``(family, params)``; raises PlanError otherwise.
    """
    family, params = parse_family_line(source)
    why = F.valid(family, params, op=op, dtype=dtype, n=n)
    if why is not None:
        raise PlanError(f"source: outside the domain: {why}")
    expected = F.render(family, params, op=op, dtype=dtype, n=n, compact=True).source
    if plan_line(source) != plan_line(expected):
        raise PlanError(f"source: the plan line {plan_line(source)!r} is not the one family {family} renders for "
                        f"its parameters ({plan_line(expected)!r})")
    got, want = dict(_DEFINE.findall(source)), dict(_DEFINE.findall(expected))
    for name in sorted(set(got) | set(want)):
        if got.get(name) != want.get(name):
            raise PlanError(f"source: #define {name} is {got.get(name, 'missing')!r} where family {family}'s "
                            f"parameters give {want.get(name, 'no such macro')!r}")
    return family, params


def canonical(family: str, params: dict, *, op: str, dtype: str, n: int) -> tuple[str, tuple]:
    """``(family, full sorted parameters)``: one key per kernel, defaults filled in."""
    return family, F.render(family, params, op=op, dtype=dtype, n=n, compact=True).params


def grid_keys(op: str, dtype: str, n: int, features: dict | None) -> set[tuple[str, tuple]]:
    """The canonical keys of the pattern's screened space and of the default space."""
    points = F.space(op, dtype, n, features) + F.space(op, dtype, n, None)
    return {canonical(f, p, op=op, dtype=dtype, n=n) for f, p in points}


def _scaled(v: int) -> list[int]:
    """Lengths around v: halved, doubled, x3/4, x3/2 (kept on multiples of 32 where v is one)."""
    step = 32 if v % 32 == 0 and v >= 64 else 1
    return [v // 2, v * 2, max(step, v * 3 // 4 // step * step), v * 3 // 2 // step * step]


def _moves(name: str, v: Any) -> list[Any]:
    """Candidate values for one parameter around ``v`` (the domain check filters them)."""
    if name in ("lanes", "vec") and isinstance(v, int):
        return [v // 2, v * 2]
    if name == "lanes" and isinstance(v, tuple):  # binned: one bin's lanes halved or doubled
        return [v[:i] + (w,) + v[i + 1:] for i, x in enumerate(v) for w in (x // 2, x * 2)]
    if name == "block":
        return [v // 2, v * 2, v - 64, v + 64]
    if name == "unroll":
        return [v - 1, v + 1, v * 2]
    if name in ("chunk", "seg", "items"):
        return _scaled(v)
    if name == "c":
        return [v // 2, v * 2]
    if name == "sigma":
        return [v // 2, v * 2, v * 4]
    if name == "edges":  # binned: one edge halved or doubled, or the last bin split in two
        out = [v[:i] + (w,) + v[i + 1:] for i, x in enumerate(v) for w in (x // 2, x * 2)]
        if len(v) < 7:
            out.append(v + (v[-1] * 4,))
        return out
    options = {"rows": F.ROW_ORDERS, "stage": ("shfl", "smem"), "window": F.TC_WINDOWS, "j": F.TC_SLICES,
               "ksplit": F.TC_KSPLITS, "math": ("ieee", "tf32")}
    return [o for o in options.get(name, ()) if o != v]


def _fit_binned(params: dict) -> dict:
    """binned: after a move of its edges, one lane count a bin (the last bin's kept)."""
    edges, lanes = params.get("edges"), params.get("lanes")
    if isinstance(edges, tuple) and isinstance(lanes, tuple) and len(lanes) != len(edges) + 1:
        lanes = (lanes[:len(edges)] + (lanes[-2],) * len(edges))[:len(edges)] + (lanes[-1],)
        params = {**params, "lanes": lanes}
    return params


def neighbours(family: str, params: dict, *, op: str, dtype: str, n: int, pairs: bool = True) -> list[dict]:
    """The parameter sets one move (and, with ``pairs``, two moves on different parameters) away
    from ``params``, inside the family's domain for the request, each once, in a fixed order.
    ``params`` itself is not included."""
    full = dict(F.render(family, params, op=op, dtype=dtype, n=n, compact=True).params)
    start = canonical(family, full, op=op, dtype=dtype, n=n)
    singles: list[tuple[str, dict]] = []
    for name in sorted(full):
        for value in _moves(name, full[name]):
            singles.append((name, _fit_binned({**full, name: value})))
    candidates = [p for _, p in singles]
    if pairs:
        for i, (a, pa) in enumerate(singles):
            for b, pb in singles[i + 1:]:
                if a != b:
                    candidates.append(_fit_binned({**pa, b: pb[b]}))
    out, seen = [], {start}
    for cand in candidates:
        if F.valid(family, cand, op=op, dtype=dtype, n=n) is not None:
            continue
        key = canonical(family, cand, op=op, dtype=dtype, n=n)
        if key not in seen:
            seen.add(key)
            out.append(cand)
    return out


def off_grid(anchors: list[tuple[str, dict]], *, op: str, dtype: str, n: int, features: dict | None = None,
             pairs: bool = True) -> list[tuple[str, dict]]:
    """The in-domain neighbours of ``anchors`` (grid points) that lie outside the grid for this
    pattern and request (:func:`grid_keys`), each once, the first anchor's first."""
    grid = grid_keys(op, dtype, n, features)
    out, seen = [], set(grid)
    for family, params in anchors:
        for cand in neighbours(family, params, op=op, dtype=dtype, n=n, pairs=pairs):
            key = canonical(family, cand, op=op, dtype=dtype, n=n)
            if key not in seen:
                seen.add(key)
                out.append((family, cand))
    return out
