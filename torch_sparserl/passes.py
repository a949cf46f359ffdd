"""The backend's post-grad pass: where compiled graphs meet the sparserl operators.

It runs on every graph Inductor compiles (forward and backward), after AOTAutograd and
before lowering, and records each sparse product it finds with what consumes its result.
That record is the hook for the later stages — fusing the epilogue (bias, ReLU, degree
scaling) into a specialized kernel, and starting specialization at compile time when the
pattern is a constant — and it goes to the debug log and :data:`REPORTS`.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from .ops import NAMESPACE
from .settings import Settings, logger


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
        if isinstance(value, torch.Tensor) and value.dim() == 2 and isinstance(value.shape[1], int):
            n = value.shape[1]
        dtype = str(value.dtype).replace("torch.", "") if isinstance(value, torch.Tensor) else "?"
        consumers = tuple(_target_name(user) for user in node.users)
        sites.append(SparseSite(target._opname, n, dtype, consumers))
    return sites


class SparseOpsPass(CustomGraphPass):
    """Inductor ``post_grad_custom_post_pass`` of the sparserl backend."""

    def __init__(self, settings: Settings, chained: CustomGraphPass | None = None):
        self.settings = settings
        self.chained = chained  # a pass the user had configured already runs first

    def __call__(self, graph: torch.fx.Graph) -> None:
        if self.chained is not None:
            self.chained(graph)
        report = GraphReport(find_sparse_sites(graph))
        REPORTS.append(report)
        for site in report.sites:
            logger.debug("sparserl site: %s N=%s %s -> %s", site.op, site.n, site.dtype,
                         ", ".join(site.consumers) or "(graph output)")

    def uuid(self):
        chained = self.chained.uuid() if self.chained is not None else None
        return (get_hash_for_files((__file__,)), repr(self.settings), chained)
