"""Hand a compiled graph its CSRMatrix inputs as their parts, before AOTAutograd sees them.

A CSRMatrix that reaches the backend as a graph input (a module attribute, a global, an
argument) is a tensor subclass to AOTAutograd, which then unwraps it through
``__tensor_flatten__`` on every call and keeps subclass bookkeeping in the forward and the
backward, a host cost paid on every training step on torch 2.11; torch 2.13 generates those
wrappers and the two forms cost the same.

:func:`flatten_matrix_inputs` rewrites Dynamo's graph so that each such input becomes three
plain placeholders and the matrix is rebuilt from them at the top of the graph (a call of
:func:`from_parts`, which AOTAutograd traces through: the products become ``sparserl``
operators on the parts, as before). The compiled function it returns takes Dynamo's
arguments and passes the parts on, a tuple per matrix.

Only matrices whose values need no gradient are flattened: a gradient for ``A.val`` must
reach the user's values through the matrix's own autograd link, which only the subclass path
keeps. The matrix's shape lives only in the wrapper (``ncols`` is in no part's size), so the
rebuilt matrix takes it from Dynamo's graph, never from the example in hand: a size Dynamo
holds static (its guards check it) is a constant, a dynamic one (automatic dynamic shapes
after a second size, or ``dynamic=True``) is the graph input Dynamo lifted for its symbol. A
matrix with a dynamic size that has no such input is left to the subclass path. Under CUDA
graphs the backend leaves the graph as it is (its replays have no per-call cost to save, and
the parts would not be known as static).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..tensor.csr_matrix import PARTS, CSRMatrix


def from_parts(crow: torch.Tensor, col: torch.Tensor, val: torch.Tensor, size: Sequence[int]) -> CSRMatrix:
    """The matrix again, inside the flattened graph (no autograd link: its values need none)."""
    return CSRMatrix._wrap(crow, col, val, size)


def _flattenable(x) -> bool:
    return type(x) is CSRMatrix and not x.requires_grad and not x.val.requires_grad


def _symbol_inputs(placeholders) -> dict:
    """The placeholders Dynamo lifted for the basic symbols of its inputs' sizes, by symbol."""
    found = {}
    for node in placeholders:
        value = node.meta.get("example_value")
        if isinstance(value, torch.SymInt) and value.node.expr.is_Symbol:
            found.setdefault(value.node.expr, node)
    return found


def _graph_size(node: torch.fx.Node, symbols: dict) -> tuple | None:
    """The matrix's size as Dynamo's graph has it: per dimension the int Dynamo specialized
    on (and guards), or the placeholder of its symbol; None when Dynamo's value for the
    matrix is missing or a symbolic size has no placeholder. Never the size of the example
    in hand: under dynamic shapes that is one call's size, and a constant of it would be
    reused for every later size."""
    fake = node.meta.get("example_value")
    if not isinstance(fake, CSRMatrix) or fake.dim() != 2:
        return None
    size = []
    for dim in fake.shape:
        if isinstance(dim, int):
            size.append(dim)
        elif isinstance(dim, torch.SymInt) and dim.node.expr in symbols:
            size.append(symbols[dim.node.expr])
        else:
            return None
    return tuple(size)


def flatten_matrix_inputs(gm: torch.fx.GraphModule, example_inputs: list):
    """``(graph, inputs, to_flat)`` with every flattenable CSRMatrix input replaced by its
    parts, or None when there is none. ``to_flat(args)`` maps the original call's arguments
    to the new graph's. A part that Dynamo already made an input of its own (a model that
    reads ``A.crow``, say) is not added twice: the matrix is rebuilt from that input."""
    from torch._dynamo.source import AttrSource

    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    if len(placeholders) != len(example_inputs):
        return None
    symbols = _symbol_inputs(placeholders)
    sizes = {i: _graph_size(node, symbols) for i, (node, x) in enumerate(zip(placeholders, example_inputs))
             if _flattenable(x)}
    slots = {i for i, size in sizes.items() if size is not None}
    if not slots:
        return None
    by_source = {node._dynamo_source: node for node in placeholders if getattr(node, "_dynamo_source", None) is not None}
    by_identity = {id(x): node for node, x in zip(placeholders, example_inputs)}
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    inputs: list = []
    added: list[tuple[str, ...] | None] = []  # per original input: the parts it adds, or None
    parts_of: dict[int, list] = {}  # slot -> its parts: new placeholders, or original ones
    for i, (node, x) in enumerate(zip(placeholders, example_inputs)):
        if i not in slots:
            copy = graph.placeholder(node.name, type_expr=node.type)
            copy.meta = dict(node.meta)
            if hasattr(node, "_dynamo_source"):
                copy._dynamo_source = node._dynamo_source
            env[node] = copy
            inputs.append(x)
            added.append(None)
            continue
        source = getattr(node, "_dynamo_source", None)
        parts, names = [], []
        for name in PARTS:
            tensor = getattr(x, name)
            twin = by_source.get(AttrSource(source, name)) if source is not None else None
            twin = twin or by_identity.get(id(tensor))
            if twin is not None:
                parts.append(twin)  # mapped through env once every placeholder is copied
                continue
            part = graph.placeholder(f"{node.name}_{name}", type_expr=torch.Tensor)
            part.meta["example_value"] = tensor
            if source is not None:  # AOTAutograd matches Dynamo's inputs to their sources
                part._dynamo_source = AttrSource(source, name)
            parts.append(part)
            names.append(name)
            inputs.append(tensor)
        parts_of[i] = parts
        added.append(tuple(names))
    for i, node in enumerate(placeholders):
        if i in slots:
            parts = [env.get(part, part) for part in parts_of[i]]
            size = tuple(env[dim] if isinstance(dim, torch.fx.Node) else dim for dim in sizes[i])
            env[node] = graph.call_function(from_parts, (*parts, size))
            env[node].meta["example_value"] = node.meta["example_value"]
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            env[node] = graph.node_copy(node, lambda n: env[n])
    flat = torch.fx.GraphModule(gm, graph)
    flat.meta.update(gm.meta)
    if hasattr(gm, "_param_name_to_source"):
        flat._param_name_to_source = gm._param_name_to_source
    return flat, inputs, _flattener(added)


def _flattener(added: list[tuple[str, ...] | None]) -> Callable[[Sequence], list]:
    """The argument mapping of :func:`flatten_matrix_inputs`: one list built per call, each
    matrix's added parts spliced in at its position."""
    def to_flat(args: Sequence) -> list:
        flat = []
        for arg, names in zip(args, added):
            if names is None:
                flat.append(arg)
            else:
                flat += [getattr(arg, name) for name in names]
        return flat

    return to_flat


def call_flattened(compiled, to_flat: Callable[[Sequence], list]):
    """Dynamo's compiled function (called with Dynamo's arguments, positionally) over the
    flattened graph's ``compiled``."""
    def run(*args):
        return compiled(*to_flat(args))

    return run
