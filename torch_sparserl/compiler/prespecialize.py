"""Specialization before the first product: for a CSRMatrix the backend sees at compile time.

When Dynamo hands the ``sparserl`` backend a graph, the adjacency a GNN multiplies by is
one of its inputs — a module buffer, a constant, or an argument — as a real
:class:`~torch_sparserl.tensor.csr_matrix.CSRMatrix` in ``example_inputs``, and every product it
takes part in is a node whose other operand has a known shape. :func:`plan_graph` reads
those products (``A @ X``, ``X @ A``, ``torch.mm``, ``torch.sparse.mm``, ``torch.addmm``,
``torch.mv``, ...) and, when the dense operand requires grad, the product its backward will
run on the transposed pattern, and those of the matrix with other values
(``A.with_values(w) @ X``). Code that calls the operators on the matrix's index tensors
itself (the PyG adapter's attention layers: ``sparserl::spmm_heads`` on ``A._crow``,
``A._col``) hands Dynamo those tensors as inputs instead: the operators' nodes on them are
read too, a heads product as the product on its block-diagonal form
(:meth:`~torch_sparserl.pattern.Pattern.with_heads`). :func:`prespecialize_graph` hands them
to the runtime, so specialization starts while the graph is being compiled (in a background thread, or before
compilation returns in ``sync`` mode) instead of at the first training step.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from .. import pattern as patterns
from ..jit import runtime as rt

log = logging.getLogger("torch_sparserl.compiler.prespecialize")

_PRODUCTS = {"matmul", "mm", "mv", "_sparse_mm", "addmm", "addmv", "__matmul__", "__rmatmul__"}


@dataclass(frozen=True)
class Planned:
    """One product to specialize: ``op`` on A's pattern or, ``transposed``, on Aᵀ's."""

    input_index: int  # which example input is the matrix (or its crow)
    op: str           # spmm, spmv, or sddmm (the gradient of the values)
    n: int
    transposed: bool
    why: str          # the graph node that asks for it
    # an operator node on the matrix's index tensors: which input is col, the columns, and
    # the number of heads of a heads product (0: a plain product)
    col_index: int | None = None
    ncols: int = 0
    dtype: torch.dtype | None = None  # of the values (None: the matrix input's)
    heads: int = 0


def _name(target) -> str:
    return target if isinstance(target, str) else getattr(target, "__name__", str(target))


def _shape(node) -> tuple | None:
    value = node.meta.get("example_value") if isinstance(node, torch.fx.Node) else None
    if not isinstance(value, torch.Tensor) or not all(isinstance(s, int) for s in value.shape):
        return None  # not a tensor, or a symbolic size: nothing to specialize for yet
    return tuple(value.shape), value.requires_grad


def _operator(target) -> str | None:
    """``spmm`` for ``torch.ops.sparserl.spmm`` (the packet or an overload), else None."""
    name = getattr(target, "_qualified_op_name", None)
    if name is None and isinstance(target, torch._ops.OpOverload):
        name = target.name()
    return name.removeprefix("sparserl::") if name is not None and name.startswith("sparserl::") else None


_FORWARD_OPERATORS = {"spmm": "spmm", "spmv": "spmv", "spmm_heads": "spmm"}  # forward operators -> the product run


def _plan_operators(gm, placeholders, example_inputs, devices, planned: dict) -> None:
    """The forward operators' nodes whose ``crow`` and ``col`` are inputs of the graph."""
    index_of = {node: i for i, node in enumerate(placeholders)}
    for node in gm.graph.nodes:
        name = _operator(node.target) if node.op == "call_function" else None
        if name not in _FORWARD_OPERATORS or len(node.args) < 5 or node.kwargs:
            continue
        crow, col, val, ncols, dense = node.args[:5]
        i, j = index_of.get(crow), index_of.get(col)
        if i is None or j is None or not isinstance(ncols, int):
            continue
        crow_value, col_value = example_inputs[i], example_inputs[j]
        if not (type(crow_value) is torch.Tensor and type(col_value) is torch.Tensor
                and col_value.device.type in devices):
            continue
        values, operand = _shape(val), _shape(dense)
        if values is None or operand is None:
            continue
        (val_shape, val_grad), (shape, needs_grad) = values, operand
        heads = val_shape[1] if name == "spmm_heads" and len(val_shape) == 2 else 0
        n = shape[-1] if name != "spmv" else 1
        why = f"{node.name} = sparserl.{name}(...)"
        dtype = val.meta["example_value"].dtype
        common = dict(col_index=j, ncols=ncols, dtype=dtype, heads=heads)
        op = _FORWARD_OPERATORS[name]
        planned.setdefault((i, op, n, False, heads), Planned(i, op, n, False, why, **common))
        if needs_grad:
            planned.setdefault((i, op, n, True, heads), Planned(i, op, n, True, f"backward of {why}", **common))
        if val_grad:
            planned.setdefault((i, "sddmm", n, False, heads),
                               Planned(i, "sddmm", n, False, f"gradient of the values of {why}", **common))


def plan_graph(gm: torch.fx.GraphModule, example_inputs, devices=("cuda",)) -> list[Planned]:
    """The products of each CSRMatrix input of ``gm`` on ``devices``, with their backward,
    and those of the operators' nodes on index tensors that are inputs of ``gm``."""
    from ..tensor.csr_matrix import CSRMatrix

    placeholders = [node for node in gm.graph.nodes if node.op == "placeholder"]
    planned: dict[tuple, Planned] = {}
    _plan_operators(gm, placeholders, example_inputs, devices, planned)
    for index, (placeholder, value) in enumerate(zip(placeholders, example_inputs)):
        if not isinstance(value, CSRMatrix) or value.device.type not in devices:
            continue
        # the matrix, and the matrix with other values (A.with_values(alpha): a one-head
        # attention layer), with whether the values need a gradient and their dtype
        matrices = [(placeholder, value.requires_grad, None)]
        for user in placeholder.users:
            if user.op == "call_method" and user.target == "with_values" and user.args[:1] == (placeholder,):
                values = user.args[1].meta.get("example_value") if len(user.args) > 1 else None
                if isinstance(values, torch.Tensor):
                    matrices.append((user, values.requires_grad, values.dtype))
        for node, values_grad, dtype in matrices:
            _plan_products(index, node, values_grad, dtype, planned)
    return list(planned.values())


def _plan_products(index: int, node, values_grad: bool, dtype, planned: dict) -> None:
    """The products of the matrix ``node`` (input ``index``), with their backward."""
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
        planned.setdefault((index, op, n, transposed, dtype), Planned(index, op, n, transposed, why, dtype=dtype))
        if needs_grad:  # the gradient of the dense operand runs on the other pattern
            planned.setdefault((index, op, n, not transposed, dtype),
                               Planned(index, op, n, not transposed, f"backward of {why}", dtype=dtype))
        if values_grad:  # the gradient of the values: an SDDMM on A's own pattern
            planned.setdefault((index, "sddmm", n, False, dtype),
                               Planned(index, "sddmm", n, False, f"gradient of the values of {why}", dtype=dtype))


def specialize(A, op: str = "spmm", n: int = 1, *, transposed: bool = False, runtime: rt.Runtime | None = None):
    """Decide now the kernel of ``A @ X`` (``op="spmm"``, X with ``n`` columns), ``A @ x``
    (``"spmv"``) — of ``Aᵀ`` with ``transposed=True`` — or of the SDDMM on A's pattern that
    gives the gradient of its values (``"sddmm"``, dot products of length ``n``), on the
    active runtime.

    Returns the runtime's state: Installed, Fallback, Pending (background mode) or None
    (runtime off, or A not on a GPU). ``runtime.explain`` says why.
    """
    if op not in rt.OPS:
        raise ValueError(f"specialize: op must be one of {rt.OPS} (got {op!r})")
    if op == "spmv" and n != 1:
        raise ValueError(f"specialize: op='spmv' has n=1 (got n={n})")
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"specialize: n must be a positive int (got {n!r})")
    return _on_pattern(runtime or rt.active(), A._crow, A._col, A.shape[1], op, n, transposed, A.dtype, val=A.val)


def _on_pattern(runtime: rt.Runtime, crow, col, ncols: int, op: str, n: int, transposed: bool, dtype,
                heads: int = 0, val=None):
    """The runtime's state for ``op`` on the pattern (checked, with ``val`` if given), its
    transpose, or (``heads``) the block-diagonal form of a heads product or the form's transpose."""
    from ..pattern.validation import check_csr_meta

    check_csr_meta("specialize", crow, col, val, ncols)
    entry = patterns.lookup(crow, col, ncols)
    entry.validate("specialize", crow, col)
    # compile time waits anyway: the verdict of a device check is read now, so that the graph's
    # first calls (a CUDA graph's recording among them) find the pattern checked
    entry.settle(block=True)
    if heads:
        from ..ops import check_heads_index

        check_heads_index("specialize", crow, col, ncols, heads)  # the form's indices fit their dtype
        if transposed:
            entry, crow, col, _ = entry.with_heads_transposed(crow, col, heads)
        else:
            crow, col, _, _ = entry.with_heads(crow, col, heads)
            entry = patterns.lookup(crow, col, ncols * heads)
    elif transposed:
        entry, crow, col, _ = entry.transpose(crow, col)
    return runtime.prespecialize(op, entry, crow, col, n, dtype)


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
        log.info("sparserl: compile-time specialization of %s%s%s n=%d (%s): %s", item.op,
                 f" on the {item.heads}-head form" if item.heads else "",
                 " on the transpose" if item.transposed else "", item.n, item.why, verdict)
    return started


def _start(runtime: rt.Runtime, item: Planned, example_inputs):
    """The runtime's state for one planned product (asking for it starts it), or why not."""
    try:
        value = example_inputs[item.input_index]
        if item.col_index is not None:  # an operator's node on index tensors
            return _on_pattern(runtime, value, example_inputs[item.col_index], item.ncols, item.op, item.n,
                               item.transposed, item.dtype, item.heads)
        return _on_pattern(runtime, value._crow, value._col, value.shape[1], item.op, item.n, item.transposed,
                           item.dtype or value.dtype)
    except rt.SpecializationError:
        raise
    except Exception as exc:  # noqa: BLE001 - a product that will fail says so when it runs
        return f"not specialized at compile time: {type(exc).__name__}: {exc}"
