"""The backend's post-grad pass: where compiled graphs meet the sparserl operators.

It runs on every graph Inductor compiles (forward and backward), after AOTAutograd and
before lowering. It records each sparse product it finds with what consumes its result
(the debug log and :data:`REPORTS`); it fuses epilogues (:func:`fuse_epilogues`): a
``sparserl::spmm`` followed by a row scaling (``D^-1/2`` of a symmetric normalization), a
bias add and a ReLU — a GNN layer's tail — becomes one ``sparserl::spmm_epilogue``, which
the runtime serves with the installed kernel re-rendered to apply the steps in its row
stores. Only intermediate results nothing else reads are fused away, so what AOTAutograd
saved for the backward is still computed. Last, it retargets the products to their
implementation-only twins (:func:`to_direct_ops`): the graph is differentiated already.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from ..config import BackendOptions, logger
from ..ops import DIRECT_OPS, FAST_OPS, NAMESPACE


@dataclass(frozen=True)
class SparseSite:
    """One call of a sparserl operator in a compiled graph."""

    op: str  # e.g. "spmm"
    n: int | None  # dense columns (None for a vector or a symbolic size)
    dtype: str
    consumers: tuple[str, ...]  # targets of the nodes that use the result


@dataclass
class GraphReport:
    sites: list[SparseSite] = field(default_factory=list)
    fused: list[str] = field(default_factory=list)  # e.g. "spmm -> mul -> add -> relu"

    def ops(self) -> list[str]:
        return [site.op for site in self.sites]


REPORTS: collections.deque[GraphReport] = collections.deque(maxlen=64)


def _target_name(node: torch.fx.Node) -> str:
    target = node.target
    return str(target) if not callable(target) else getattr(target, "__name__", str(target))


def find_sparse_sites(graph: torch.fx.Graph) -> list[SparseSite]:
    sites = []
    for node in graph.nodes:
        target = node.target
        if node.op != "call_function" or getattr(target, "namespace", None) != NAMESPACE:
            continue
        value = node.meta.get("val")
        n = None
        if isinstance(value, torch.Tensor) and value.dim() in (2, 3) and isinstance(value.shape[-1], int):
            n = value.shape[-1]  # (rows, N), or (rows, heads, C) for the heads products
        dtype = str(value.dtype).replace("torch.", "") if isinstance(value, torch.Tensor) else "?"
        consumers = tuple(_target_name(user) for user in node.users)
        sites.append(SparseSite(target._opname, n, dtype, consumers))
    return sites


def _tensor_meta(node) -> torch.Tensor | None:
    value = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return value if isinstance(value, torch.Tensor) else None


def _other_operand(user: torch.fx.Node, cur: torch.fx.Node):
    """The operand of a binary ``user`` that is not ``cur`` (None when both are)."""
    if len(user.args) != 2:
        return None
    a, b = user.args
    return b if a is cur and b is not cur else a if b is cur and a is not cur else None


def _epilogue_step(user: torch.fx.Node, cur: torch.fx.Node, out: torch.Tensor, done: set[str]):
    """(step, operand) when ``user`` applies the next epilogue step to ``cur``, else None."""
    aten = torch.ops.aten
    rows, n = out.shape
    if user.target is aten.relu.default and "relu" not in done:
        return "relu", None
    if user.target not in (aten.mul.Tensor, aten.add.Tensor) or "relu" in done:
        return None
    if user.target is aten.add.Tensor and user.kwargs.get("alpha", 1) != 1:
        return None
    other = _other_operand(user, cur)
    meta = _tensor_meta(other)
    if meta is None or meta.dtype != out.dtype or meta.device != out.device:
        return None
    shape = tuple(meta.shape)
    if user.target is aten.mul.Tensor and not done and shape == (rows, 1):
        return "scale", other
    if user.target is aten.add.Tensor and "bias" not in done and shape in ((n,), (1, n)):
        return "bias", other
    return None


def served_fused(node: torch.fx.Node, out: torch.Tensor) -> bool:
    """Whether the runtime holds, for the product ``node`` computes, an installed kernel that
    can take an epilogue (CUDA only; sizes must be concrete). Elsewhere Inductor's own
    pointwise kernel after the product is as good as it gets, so nothing is fused."""
    from ..jit import runtime

    crow, col, _, ncols, _ = node.args
    crow_meta, col_meta = _tensor_meta(crow), _tensor_meta(col)
    if out.device.type != "cuda" or crow_meta is None or col_meta is None:
        return False
    try:
        sizes = (int(crow_meta.shape[0]) - 1, int(col_meta.shape[0]), int(ncols), int(out.shape[1]))
    except (TypeError, ValueError):  # symbolic sizes
        return False
    active = runtime.active_or_none()
    return active is not None and active.fusable(*sizes, out.dtype)


def fuse_epilogues(graph: torch.fx.Graph, can_fuse=served_fused) -> list[str]:
    """Rewrite ``spmm -> [mul by a (rows, 1) scale] -> [add a bias of N] -> [relu]`` chains
    into ``sparserl::spmm_epilogue``; returns a line per fused chain.

    A step joins the chain only when the value before it has that step as its one user (so
    it is neither a graph output, saved for the backward, nor read elsewhere) and its
    operand has the product's dtype and device; steps come in the order scale, bias, relu.
    ``can_fuse(node, meta)`` says whether a product's kernel will apply the epilogue
    (:func:`served_fused`: the runtime has installed one that can): a fused op whose kernel
    cannot would run the steps one by one, slower than the Inductor kernel it replaced.
    """
    fused_op = torch.ops.sparserl.spmm_epilogue.default
    done_lines = []
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not torch.ops.sparserl.spmm.default:
            continue
        out = _tensor_meta(node)
        if out is None or out.dim() != 2 or not can_fuse(node, out):
            continue
        chain, operands, cur = [node], {}, node
        while len(cur.users) == 1:
            (user,) = cur.users
            step = _epilogue_step(user, cur, out, set(operands))
            if user.op != "call_function" or step is None:
                break
            operands[step[0]] = step[1]
            chain.append(user)
            cur = user
        if len(chain) == 1:
            continue
        crow, col, val, ncols, X = node.args
        with graph.inserting_before(cur):
            fused = graph.call_function(fused_op, (crow, col, val, ncols, X, operands.get("scale"),
                                                   operands.get("bias"), "relu" in operands))
        fused.meta.update(cur.meta)
        cur.replace_all_uses_with(fused)
        for old in reversed(chain):
            graph.erase_node(old)
        done_lines.append(" -> ".join(getattr(n.target, "_opname", _target_name(n)) for n in chain))
    return done_lines


def to_direct_ops(graph: torch.fx.Graph, fast: bool = False) -> int:
    """Point every ``sparserl::<op>`` call of a differentiated graph at ``sparserl_direct::<op>``
    (:data:`~torch_sparserl.ops.DIRECT_OPS`: same schema, checks and kernels, no autograd
    layers), and with ``fast`` the products at ``sparserl_fast::<op>``
    (:data:`~torch_sparserl.ops.FAST_OPS`, served in C++ where :mod:`torch_sparserl.jit.fastpath`
    is loaded); returns how many calls were retargeted."""
    count = 0
    for node in graph.nodes:
        if node.op == "call_function" and node.target in DIRECT_OPS:
            node.target = (fast and FAST_OPS.get(node.target)) or DIRECT_OPS[node.target]
            count += 1
    return count


class SparseOpsPass(CustomGraphPass):
    """Inductor ``post_grad_custom_post_pass`` of the sparserl backend."""

    def __init__(self, settings: BackendOptions, chained: CustomGraphPass | None = None):
        self.settings = settings
        self.chained = chained  # a pass the user had configured already runs first

    def __call__(self, graph: torch.fx.Graph) -> None:
        if self.chained is not None:
            self.chained(graph)
        report = GraphReport(find_sparse_sites(graph))
        if self.settings.fuse_epilogues:
            report.fused = fuse_epilogues(graph, served_fused)
        REPORTS.append(report)
        for site in report.sites:
            logger.debug("sparserl site: %s N=%s %s -> %s", site.op, site.n, site.dtype,
                         ", ".join(site.consumers) or "(graph output)")
        for line in report.fused:
            logger.debug("sparserl fused: %s", line)
        if self.settings.direct_ops:
            to_direct_ops(graph, fast=self.settings.fast_path)

    def uuid(self):
        chained = self.chained.uuid() if self.chained is not None else None
        return (get_hash_for_files((__file__,)), repr(self.settings), chained)
