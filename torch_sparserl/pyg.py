"""PyTorch Geometric on sparserl: pass ``torch_sparserl.csr(adj_t)`` where a layer takes ``adj_t``.

::

    import torch_sparserl as ts
    import torch_sparserl.pyg          # installs the adapter (idempotent; also ts.pyg.install())

    adj_t = ts.csr(data.adj_t)         # or ts.pyg.adjacency(data.edge_index, num_nodes=...)
    out = GCNConv(16, 32)(x, adj_t)    # GCNConv, SAGEConv, GINConv, GraphConv, ... unchanged

PyG's sparse path (a layer's ``message_and_aggregate``, reached from ``propagate`` when the
adjacency is sparse) is where the products are: ``spmm(adj_t, x, reduce)``. A
:class:`~torch_sparserl.CSRMatrix` is a strided wrapper tensor to PyG, which would take it for
an ``edge_index``; the adapter teaches PyG three things, by replacing functions in PyG's own
modules (nothing in a model changes):

* ``MessagePassing.propagate`` of every layer class, given a ``CSRMatrix``, runs the layer's
  fused ``message_and_aggregate`` on it (the layers without one run PyG's own gather/scatter
  path on the same matrix converted to a torch sparse tensor; eager only);
* ``torch_geometric.utils.spmm`` computes ``A @ X`` on the sparserl operators — ``sum`` and
  ``mean`` (the row sums divided by the row lengths, as PyG does); ``min``/``max`` raise;
* ``gcn_norm`` (GCNConv and the layers that import it) keeps the matrix a ``CSRMatrix``: the
  self loops join the pattern once per pattern (cached like the transpose), and the values
  become ``D^-1/2 (A + fill·I) D^-1/2`` each call, differentiable.

Gradients reach the features through ``Aᵀ @ dY`` on the transposed pattern and the values
(edge weights, attention) through SDDMM, eagerly and under
``torch.compile(backend="sparserl")``. One graph break remains: ``gcn_norm`` with self loops
computes the looped pattern outside the graph; ``GCNConv(cached=True)`` (a fixed graph) or
``add_self_loops=False`` keeps the model one graph from its second call on.
"""

from __future__ import annotations

import functools
import sys
import warnings

import torch
from torch import Tensor

from . import pattern as patterns
from .csr_matrix import CSRMatrix, csr, values_of

__all__ = ["install", "installed", "adjacency", "gcn_norm", "spmm"]

_ORIGINAL: dict[str, object] = {}
_WRAPPED_FLAG = "_sparserl_wrapped"


def _require_pyg():
    try:
        import torch_geometric  # noqa: F401
        import torch_geometric.nn  # noqa: F401  (imports every layer module, so all are patched)
    except ImportError as exc:  # pragma: no cover - exercised only without PyG
        raise ImportError("torch_sparserl.pyg: PyTorch Geometric is not installed "
                          "(pip install torch_geometric)") from exc
    return torch_geometric


# ----------------------------------------------------------------------- products


def spmm(src, other: Tensor, reduce: str = "sum") -> Tensor:
    """``torch_geometric.utils.spmm`` for a ``CSRMatrix`` (anything else goes to PyG's own)."""
    if not isinstance(src, CSRMatrix):
        return _ORIGINAL["spmm"](src, other, reduce)
    reduce = "sum" if reduce == "add" else reduce
    if reduce == "sum":
        return src @ other
    if reduce == "mean":
        lengths = (src.crow[1:] - src.crow[:-1]).clamp(min=1).to(other.dtype)
        return (src @ other) / lengths.unsqueeze(-1) if other.dim() == 2 else (src @ other) / lengths
    raise NotImplementedError(f"torch_sparserl.pyg.spmm: reduce={reduce!r} is not supported on a CSRMatrix "
                              "(supported: 'sum', 'add', 'mean')")


# ------------------------------------------------------------------ normalization


@torch._dynamo.disable
def _looped_pattern(A: CSRMatrix):
    entry = patterns.lookup(A.crow, A.col, A.shape[1])
    return entry.with_diagonal(A.crow, A.col)


def _add_self_loops(A: CSRMatrix, fill: float, dtype) -> CSRMatrix:
    crow_d, col_d, src_pos, diag_pos = _looped_pattern(A)
    val = values_of(A).to(dtype)
    looped = val.new_zeros(col_d.shape[0]).index_copy(0, src_pos, val)
    looped = looped.index_add(0, diag_pos, val.new_full((diag_pos.shape[0],), fill))
    return CSRMatrix(crow_d, col_d, looped, A.shape)


def gcn_norm(edge_index, edge_weight=None, num_nodes=None, improved=False, add_self_loops=True,
             flow="source_to_target", dtype=None):
    """PyG's ``gcn_norm`` for a ``CSRMatrix`` (anything else goes to PyG's own).

    Returns ``(D^-1/2 (A + fill·I) D^-1/2, None)`` as a ``CSRMatrix``, D the row sums of
    ``A + fill·I`` and fill 2 when ``improved`` else 1, exactly as PyG normalizes a torch
    sparse ``adj_t`` (where ``edge_weight`` is ignored: the weights are the matrix values).
    """
    if not isinstance(edge_index, CSRMatrix):
        return _ORIGINAL["gcn_norm"](edge_index, edge_weight, num_nodes, improved, add_self_loops, flow, dtype)
    A = edge_index
    if A.shape[0] != A.shape[1]:
        raise ValueError(f"torch_sparserl.pyg.gcn_norm: the adjacency must be square (got shape {tuple(A.shape)})")
    dtype = dtype if dtype is not None and dtype.is_floating_point else A.dtype
    if add_self_loops:
        A = _add_self_loops(A, 2.0 if improved else 1.0, dtype)
    val = values_of(A).to(dtype)
    rows = patterns.row_indices(A.crow, A.col.shape[0])
    deg = val.new_zeros(A.shape[0]).index_add(0, rows, val)
    inv_sqrt = deg.pow(-0.5)
    inv_sqrt = inv_sqrt.masked_fill(torch.isinf(inv_sqrt), 0.0)
    normed = inv_sqrt.index_select(0, rows) * val * inv_sqrt.index_select(0, A.col.to(torch.int64))
    return CSRMatrix(A.crow, A.col, normed, A.shape), None


# --------------------------------------------------------------------- propagate


def _propagate_csr(module, A: CSRMatrix, size, kwargs: dict) -> Tensor:
    if module.flow != "source_to_target":
        raise ValueError(f"{type(module).__name__}.propagate: flow={module.flow!r} is invalid for a sparse "
                         "adjacency (as in PyG); pass the transposed matrix, adj_t.t(), instead")
    if size is not None and (size[0] not in (None, A.shape[1]) or size[1] not in (None, A.shape[0])):
        raise ValueError(f"{type(module).__name__}.propagate: size {tuple(size)} does not match the adjacency "
                         f"(expected [{A.shape[1]}, {A.shape[0]}] for adj_t of shape {tuple(A.shape)})")
    hooks = any(getattr(module, name, None) for name in (
        "_propagate_forward_pre_hooks", "_propagate_forward_hooks", "_message_and_aggregate_forward_pre_hooks",
        "_message_and_aggregate_forward_hooks"))
    if not module.fuse or getattr(module, "_explain", None) or hooks or getattr(module, "decomposed_layers", 1) > 1:
        # No fused product for this layer (or PyG machinery that needs its own path): PyG's
        # gather/scatter on a torch sparse CSR tensor with the same pattern and values.
        sparse = torch.sparse_csr_tensor(A.crow, A.col, values_of(A), tuple(A.shape))
        return type(module)._sparserl_original_propagate(module, sparse, size=size, **kwargs)
    data = dict(kwargs)
    data.update(adj_t=A, edge_index=None, size=[A.shape[1], A.shape[0]], size_i=A.shape[0], size_j=A.shape[1],
                dim_size=A.shape[0], ptr=A.crow)
    if data.get("edge_weight") is None:
        data["edge_weight"] = values_of(A)
    inputs = module.inspector.collect_param_data("message_and_aggregate", data)
    out = module.message_and_aggregate(A, **inputs)
    return module.update(out, **module.inspector.collect_param_data("update", data))


def _wrap_propagate(cls) -> None:
    propagate = cls.__dict__.get("propagate")
    if propagate is None or getattr(propagate, _WRAPPED_FLAG, False):
        return

    @functools.wraps(propagate)
    def wrapped(self, edge_index, size=None, **kwargs):
        if isinstance(edge_index, CSRMatrix):
            return _propagate_csr(self, edge_index, size, kwargs)
        return propagate(self, edge_index, size=size, **kwargs)

    setattr(wrapped, _WRAPPED_FLAG, True)
    cls._sparserl_original_propagate = propagate
    cls.propagate = wrapped


def _all_subclasses(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from _all_subclasses(sub)


# ----------------------------------------------------------------------- install


def installed() -> bool:
    return bool(_ORIGINAL)


def install() -> None:
    """Route PyG's sparse path to sparserl for ``CSRMatrix`` adjacencies (idempotent).

    Replaces ``spmm``, ``gcn_norm`` and ``MessagePassing.propagate`` where PyG's modules
    refer to them; other inputs reach PyG's original functions unchanged.
    """
    if _ORIGINAL:
        return
    _require_pyg()
    import torch_geometric.utils as pyg_utils
    from torch_geometric.nn import MessagePassing
    from torch_geometric.nn.conv import gcn_conv

    _ORIGINAL["spmm"] = pyg_utils.spmm
    _ORIGINAL["gcn_norm"] = gcn_conv.gcn_norm
    replacements = {id(_ORIGINAL["spmm"]): spmm, id(_ORIGINAL["gcn_norm"]): gcn_norm}
    for name, module in list(sys.modules.items()):
        if not name.startswith("torch_geometric") or module is None:
            continue
        for attr, value in list(vars(module).items()):
            new = replacements.get(id(value))
            if new is not None:
                setattr(module, attr, new)

    # propagate: PyG generates a class's propagate when its first instance is built; wrap
    # whatever a class has then, and every class built so far.
    original_templates = MessagePassing._set_jittable_templates

    @functools.wraps(original_templates)
    def set_templates(self, *args, **kwargs):
        original_templates(self, *args, **kwargs)
        for cls in type(self).__mro__:
            if isinstance(cls, type) and issubclass(cls, MessagePassing):
                _wrap_propagate(cls)

    _ORIGINAL["_set_jittable_templates"] = original_templates
    MessagePassing._set_jittable_templates = set_templates
    for cls in (MessagePassing, *_all_subclasses(MessagePassing)):
        _wrap_propagate(cls)


# ---------------------------------------------------------------------- building


def adjacency(edge_index: Tensor, num_nodes: int | None = None, edge_weight: Tensor | None = None, *,
              dtype: torch.dtype | None = None) -> CSRMatrix:
    """``adj_t`` of PyG's ``edge_index`` (row 0 the sources, row 1 the targets) as a
    ``CSRMatrix``: row i holds the edges into node i, as in ``ToSparseTensor``.

    Duplicate edges are summed; ``edge_weight`` gives the values (default ones).
    """
    op = "torch_sparserl.pyg.adjacency"
    if not isinstance(edge_index, Tensor) or edge_index.dim() != 2 or edge_index.shape[0] != 2 \
            or edge_index.is_floating_point():
        got = tuple(edge_index.shape) if isinstance(edge_index, Tensor) else type(edge_index).__name__
        raise ValueError(f"{op}: edge_index must be an integer tensor of shape (2, E) (got {got})")
    if num_nodes is None:
        num_nodes = int(edge_index.max()) + 1 if edge_index.numel() else 0
    if edge_weight is None:
        edge_weight = torch.ones(edge_index.shape[1], dtype=dtype or torch.get_default_dtype(),
                                 device=edge_index.device)
    elif edge_weight.shape != (edge_index.shape[1],):
        raise ValueError(f"{op}: edge_weight must have shape ({edge_index.shape[1]},) "
                         f"(got {tuple(edge_weight.shape)})")
    target, source = edge_index[1], edge_index[0]
    with warnings.catch_warnings():  # torch's "sparse support is in beta" notes, for an internal step
        warnings.simplefilter("ignore", UserWarning)
        coo = torch.sparse_coo_tensor(torch.stack([target, source]), edge_weight, (num_nodes, num_nodes))
        return csr(coo.coalesce(), dtype=dtype)


install()
