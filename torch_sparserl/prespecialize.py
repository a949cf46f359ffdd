"""Specialization before the first product: for a CSRMatrix the backend sees at compile time.

When Dynamo hands the ``sparserl`` backend a graph, the adjacency a GNN multiplies by is
one of its inputs — a module buffer, a constant, or an argument — as a real
:class:`~torch_sparserl.csr_matrix.CSRMatrix` in ``example_inputs``, and every product it
takes part in is a node whose other operand has a known shape. :func:`plan_graph` reads
those products (``A @ X``, ``X @ A``, ``torch.mm``, ``torch.sparse.mm``, ``torch.addmm``,
``torch.mv``, ...) and, when the dense operand requires grad, the product its backward will
run on the transposed pattern. :func:`prespecialize_graph` hands them to the runtime, so
specialization starts while the graph is being compiled (in a background thread, or before
compilation returns in ``sync`` mode) instead of at the first training step.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from . import pattern as patterns
from . import runtime as rt

log = logging.getLogger("torch_sparserl.prespecialize")

_PRODUCTS = {"matmul", "mm", "mv", "_sparse_mm", "addmm", "addmv", "__matmul__", "__rmatmul__"}


@dataclass(frozen=True)
class Planned:
    """One product to specialize: ``op`` on A's pattern or, ``transposed``, on Aᵀ's."""

    input_index: int  # which example input is the matrix
    op: str           # spmm, spmv, or sddmm (the gradient of the values)
    n: int
    transposed: bool
    why: str          # the graph node that asks for it


def _name(target) -> str:
    return target if isinstance(target, str) else getattr(target, "__name__", str(target))


def _shape(node) -> tuple | None:
    value = node.meta.get("example_value") if isinstance(node, torch.fx.Node) else None
    if not isinstance(value, torch.Tensor) or not all(isinstance(s, int) for s in value.shape):
        return None  # not a tensor, or a symbolic size: nothing to specialize for yet
    return tuple(value.shape), value.requires_grad


def plan_graph(gm: torch.fx.GraphModule, example_inputs, devices=("cuda",)) -> list[Planned]:
    """The products of each CSRMatrix input of ``gm`` on ``devices``, with their backward."""
    from .csr_matrix import CSRMatrix

    placeholders = [node for node in gm.graph.nodes if node.op == "placeholder"]
    planned: dict[tuple, Planned] = {}
    for index, (node, value) in enumerate(zip(placeholders, example_inputs)):
        if not isinstance(value, CSRMatrix) or value.device.type not in devices:
            continue
        for user in node.users:
            if user.op not in ("call_function", "call_method") or _name(user.target) not in _PRODUCTS:
                continue
            args = list(user.args)
            where = args.index(node) if node in args else -1
            if where < 0:
                continue
            after = _shape(args[where + 1]) if where + 1 < len(args) else None
            before = _shape(args[where - 1]) if where >= 1 and after is None else None
            found = after or before
            if found is None:
                continue
            shape, needs_grad = found
            transposed = after is None  # dense @ A
            if len(shape) == 2:
                op, n = "spmm", shape[0] if transposed else shape[1]
            elif len(shape) == 1:
                op, n = "spmv", 1
            else:
                continue
            why = f"{user.name} = {_name(user.target)}(...)"
            planned.setdefault((index, op, n, transposed), Planned(index, op, n, transposed, why))
            if needs_grad:  # the gradient of the dense operand runs on the other pattern
                planned.setdefault((index, op, n, not transposed),
                                   Planned(index, op, n, not transposed, f"backward of {why}"))
            if value.requires_grad:  # the gradient of the values: an SDDMM on A's own pattern
                planned.setdefault((index, "sddmm", n, False),
                                   Planned(index, "sddmm", n, False, f"gradient of the values of {why}"))
    return list(planned.values())


def specialize(A, op: str = "spmm", n: int = 1, *, transposed: bool = False, runtime: rt.Runtime | None = None):
    """Decide now the kernel of ``A @ X`` (``op="spmm"``, X with ``n`` columns), ``A @ x``
    (``"spmv"``) — of ``Aᵀ`` with ``transposed=True`` — or of the SDDMM on A's pattern that
    gives the gradient of its values (``"sddmm"``, dot products of length ``n``), on the
    active runtime.

    Returns the runtime's state: Installed, Fallback, Pending (background mode) or None
    (runtime off, or A not on a GPU). ``runtime.explain`` says why.
    """
    from .validation import check_csr_meta

    if op not in rt.OPS:
        raise ValueError(f"specialize: op must be one of {rt.OPS} (got {op!r})")
    if op == "spmv" and n != 1:
        raise ValueError(f"specialize: op='spmv' has n=1 (got n={n})")
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"specialize: n must be a positive int (got {n!r})")
    runtime = runtime or rt.active()
    crow, col, ncols = A.crow, A.col, A.shape[1]
    check_csr_meta("specialize", crow, col, A.val, ncols)
    entry = patterns.lookup(crow, col, ncols)
    entry.validate("specialize", crow, col)
    if transposed:
        entry, crow, col, _ = entry.transpose(crow, col)
    return runtime.prespecialize(op, entry, crow, col, n, A.dtype)


def prespecialize_graph(gm: torch.fx.GraphModule, example_inputs, *, wait: bool = False) -> list[tuple[Planned, object]]:
    """Start specializing every product :func:`plan_graph` finds; returns each with the
    runtime's state for it (``Pending`` in background mode) or why it was not started.
    ``wait``: in background mode, return only once those decisions are taken."""
    runtime = rt.active()
    if runtime.settings.mode == "off":
        return []
    started = [(item, _start(runtime, item, example_inputs)) for item in plan_graph(gm, example_inputs, runtime.devices)]
    if wait and any(isinstance(state, rt.Pending) for _, state in started):
        log.info("sparserl: waiting for this graph's decisions before compiling it")
        runtime.wait()
        started = [(item, _start(runtime, item, example_inputs)) for item, _ in started]  # now decided
    for item, state in started:
        verdict = state if isinstance(state, str) else runtime.describe(state)
        log.info("sparserl: compile-time specialization of %s%s n=%d (%s): %s", item.op,
                 " on the transpose" if item.transposed else "", item.n, item.why, verdict)
    return started


def _start(runtime: rt.Runtime, item: Planned, example_inputs):
    """The runtime's state for one planned product (asking for it starts it), or why not."""
    try:
        return specialize(example_inputs[item.input_index], item.op, item.n, transposed=item.transposed,
                          runtime=runtime)
    except rt.SpecializationError:
        raise
    except Exception as exc:  # noqa: BLE001 - a product that will fail says so when it runs
        return f"not specialized at compile time: {type(exc).__name__}: {exc}"
