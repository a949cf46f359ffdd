"""PyTorch Geometric on sparserl: pass ``torch_sparserl.csr(adj_t)`` where a layer takes ``adj_t``.

::

    import torch_sparserl as ts
    from torch_sparserl.integrations import pyg  # installs the adapter (idempotent; also pyg.install())

    adj_t = ts.csr(data.adj_t)                   # or pyg.adjacency(data.edge_index, num_nodes=...)
    out = GCNConv(16, 32)(x, adj_t)              # GCNConv, SAGEConv, GINConv, GraphConv, ... unchanged

PyG's sparse path (a layer's ``message_and_aggregate``, reached from ``propagate`` when the
adjacency is sparse) is where the products are: ``spmm(adj_t, x, reduce)``. A
:class:`~torch_sparserl.CSRMatrix` is a strided wrapper tensor to PyG, which would take it for
an ``edge_index``; the adapter teaches PyG these things, by replacing functions in PyG's own
modules (nothing in a model changes):

* ``MessagePassing.propagate`` of every layer class, given a ``CSRMatrix``, runs the layer's
  fused ``message_and_aggregate`` on it. ``GATConv``'s message and sum become one product for
  all heads (``sparserl::spmm_heads``: the heads' attention as the values of the pattern's
  block-diagonal form, their gradient through SDDMM). The other
  layers without a fused product (GATv2Conv, TransformerConv, ...) run PyG's own
  gather/scatter path on the same matrix converted to a torch sparse tensor; eager only;
* ``MessagePassing.edge_updater`` (GATConv's attention) computes its per-edge inputs on the
  matrix's entries, in their order, as PyG does for a sparse adjacency;
* ``torch_geometric.utils.spmm`` computes ``A @ X`` on the sparserl operators — ``sum`` and
  ``mean`` (the row sums divided by the row lengths, as PyG does); ``min``/``max`` raise;
* ``gcn_norm`` (GCNConv and the layers that import it) keeps the matrix a ``CSRMatrix``: the
  self loops join the pattern once per pattern (cached like the transpose), and the values
  become ``D^-1/2 (A + fill·I) D^-1/2`` each call, differentiable;
* ``remove_self_loops`` and ``add_self_loops`` (the attention layers' loops) return a
  ``CSRMatrix`` whose pattern is computed once per pattern, likewise;
* ``to_edge_index`` and ``set_sparse_value`` read and replace a ``CSRMatrix``'s values, and in
  APPNP, GATConv and GATv2Conv ``is_torch_sparse_tensor`` counts a ``CSRMatrix`` as sparse: there
  the matrix takes PyG's torch sparse branch. APPNP's dropout drops the values of the same
  pattern; ``return_attention_weights=True`` returns what PyG returns for a torch sparse
  ``adj_t``, ``(adj, alpha)`` with ``adj`` a hybrid ``torch.sparse_csr`` tensor of size
  ``(N, N, heads)`` (a ``CSRMatrix`` holds one value per entry).

Every stand-in is for Python only: ``torch.jit.script`` of a layer compiles PyG's own functions
and methods, unchanged. A scripted layer takes PyG's own inputs, not a ``CSRMatrix`` (which is
for eager and ``torch.compile``).

Gradients reach the features through ``Aᵀ @ dY`` on the transposed pattern and the values
(edge weights, attention) through SDDMM, eagerly and under
``torch.compile(backend="sparserl")``. One graph break remains: the self-loop patterns
(``gcn_norm``, the attention layers' loops) are computed outside the graph;
``GCNConv(cached=True)`` (a fixed graph) or ``add_self_loops=False`` keeps the model one graph
from its second call on.
"""

from __future__ import annotations

import functools
import sys
import types
import warnings

import torch
from torch import Tensor

from .. import pattern as patterns
from ..tensor.construct import csr
from ..tensor.csr_matrix import CSRMatrix, indices_of, torch_csr, values_of

__all__ = ["install", "installed", "adjacency", "gcn_norm", "spmm", "remove_self_loops", "add_self_loops",
           "to_edge_index", "set_sparse_value", "is_torch_sparse_tensor"]

_ORIGINAL: dict[str, object] = {}
_WRAPPED_FLAG = "_sparserl_wrapped"


def _require_pyg():
    try:
        import torch_geometric  # noqa: F401
        import torch_geometric.nn  # noqa: F401  (imports every layer module, so all are patched)
    except ImportError as exc:  # pragma: no cover - exercised only without PyG
        raise ImportError("torch_sparserl.integrations.pyg: PyTorch Geometric is not installed "
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
        crow, _ = indices_of(src, "torch_sparserl.integrations.pyg.spmm")
        lengths = (crow[1:] - crow[:-1]).clamp(min=1).to(other.dtype)
        return (src @ other) / lengths.unsqueeze(-1) if other.dim() == 2 else (src @ other) / lengths
    raise NotImplementedError(f"torch_sparserl.integrations.pyg.spmm: reduce={reduce!r} is not supported on a CSRMatrix "
                              "(supported: 'sum', 'add', 'mean')")


# ------------------------------------------------------------------ normalization


@torch._dynamo.disable
def _looped_pattern(A: CSRMatrix):
    entry = patterns.lookup(A._crow, A._col, A.shape[1])
    return entry.with_diagonal(A._crow, A._col)


def _add_self_loops(A: CSRMatrix, val: Tensor, fill: Tensor | float) -> CSRMatrix:
    """``A + diag(fill)`` with ``val`` as A's values, on A's pattern with every diagonal position
    ``(i, i)``, ``i < min(rows, cols)``: a diagonal entry A has already gets ``fill`` added, as
    torch's coalescing sums the loop PyG appends to a torch sparse matrix."""
    crow_d, col_d, src_pos, diag_pos = _looped_pattern(A)
    if not isinstance(fill, Tensor):
        fill = val.new_full((diag_pos.shape[0],), fill)
    looped = val.new_zeros(col_d.shape[0]).index_copy(0, src_pos, val).index_add(0, diag_pos, fill)
    return CSRMatrix(crow_d, col_d, looped, A.shape)


@torch._dynamo.disable
def _unlooped_pattern(A: CSRMatrix):
    return patterns.lookup(A._crow, A._col, A.shape[1]).without_diagonal(A._crow, A._col)


def remove_self_loops(edge_index, edge_attr=None):
    """``torch_geometric.utils.remove_self_loops`` for a ``CSRMatrix``: the matrix without its
    diagonal entries and ``edge_attr`` without their rows (anything else goes to PyG's own)."""
    if not isinstance(edge_index, CSRMatrix):
        return _ORIGINAL["remove_self_loops"](edge_index, edge_attr)
    A = edge_index
    crow_n, col_n, keep = _unlooped_pattern(A)
    out = CSRMatrix(crow_n, col_n, values_of(A).index_select(0, keep), A.shape)
    return out, (None if edge_attr is None else edge_attr.index_select(0, keep))


_FILL_REDUCTIONS = {"add": "sum", "sum": "sum", "mean": "mean", "max": "amax", "min": "amin", "mul": "prod"}


def add_self_loops(edge_index, edge_attr=None, fill_value=None, num_nodes=None):
    """``torch_geometric.utils.add_self_loops`` for a ``CSRMatrix``, as PyG adds them to a torch
    sparse matrix: ``fill_value`` (1 by default; ``"mean"``, ``"add"``, ... reduce the row's
    values, its incoming edges) at every ``(i, i)``, ``i < min(rows, cols)``, added to the
    diagonal entry where there is one already. ``num_nodes`` is not read, as PyG does not read
    it for a torch sparse matrix (GATConv passes the source count for a bipartite
    ``(x_src, None)``). Anything else goes to PyG's own."""
    if not isinstance(edge_index, CSRMatrix):
        return _ORIGINAL["add_self_loops"](edge_index, edge_attr, fill_value, num_nodes)
    op = "torch_sparserl.integrations.pyg.add_self_loops"
    A = edge_index
    loops = min(A.shape)
    if edge_attr is not None:
        raise NotImplementedError(f"{op}: edge_attr with self loops is not supported on a CSRMatrix (as PyG for "
                                  "SparseTensor); add the loops to the matrix and the attributes yourself and "
                                  "set add_self_loops=False")
    val = values_of(A)
    if fill_value is None or isinstance(fill_value, (int, float)):
        fill = val.new_full((loops,), 1.0 if fill_value is None else float(fill_value))
    elif isinstance(fill_value, str) and fill_value in _FILL_REDUCTIONS:
        rows = patterns.row_indices(A._crow, A.nnz)
        fill = val.new_zeros(A.shape[0]).scatter_reduce(0, rows, val, _FILL_REDUCTIONS[fill_value],
                                                         include_self=False)[:loops]
    else:
        raise NotImplementedError(f"{op}: fill_value must be None, a number or one of "
                                  f"{sorted(_FILL_REDUCTIONS)} for a CSRMatrix (got {fill_value!r})")
    return _add_self_loops(A, val, fill), None


# ------------------------------------------------------------------- sparse values

# The layers that read or replace a sparse adjacency's values through ``is_torch_sparse_tensor``,
# ``to_edge_index`` and ``set_sparse_value``: APPNP's dropout on the values, the attention
# layers' ``return_attention_weights``. There a CSRMatrix takes the torch sparse branch.
# Elsewhere in PyG that branch calls torch sparse methods a CSRMatrix does not have.
_SPARSE_VALUE_LAYERS = ("torch_geometric.nn.conv.appnp", "torch_geometric.nn.conv.gat_conv",
                        "torch_geometric.nn.conv.gatv2_conv")


def is_torch_sparse_tensor(src) -> bool:
    """``torch_geometric.utils.is_torch_sparse_tensor``, True for a ``CSRMatrix`` as well (the
    layers of ``_SPARSE_VALUE_LAYERS`` see this one)."""
    return isinstance(src, CSRMatrix) or _ORIGINAL["is_torch_sparse_tensor"](src)


def to_edge_index(adj):
    """``torch_geometric.utils.to_edge_index`` for a ``CSRMatrix``: ``(stack([row, col]), values)``
    in the matrix's order, the values differentiable (anything else goes to PyG's own)."""
    if not isinstance(adj, CSRMatrix):
        return _ORIGINAL["to_edge_index"](adj)
    crow, col = indices_of(adj, "torch_sparserl.integrations.pyg.to_edge_index")
    rows = patterns.row_indices(crow, adj.nnz)
    return torch.stack([rows, col.to(torch.int64)]), values_of(adj)


def set_sparse_value(adj, value: Tensor):
    """``torch_geometric.utils.set_sparse_value`` for a ``CSRMatrix``: one value per entry gives
    the ``CSRMatrix`` of the same pattern (APPNP's dropout keeps the products sparserl's); a
    vector per entry (the heads' attention, ``(nnz, heads)``) gives what PyG gives for a torch
    sparse CSR adjacency, a hybrid ``torch.sparse_csr`` tensor of size ``(rows, cols, heads)``
    on the matrix's pattern, which a ``CSRMatrix`` (one value per entry) cannot hold. Anything
    else goes to PyG's own."""
    if not isinstance(adj, CSRMatrix):
        return _ORIGINAL["set_sparse_value"](adj, value)
    if value.dim() == 1:
        return adj.with_values(value)
    if value.shape[0] != adj.nnz:
        raise ValueError(f"torch_sparserl.integrations.pyg.set_sparse_value: value must have {adj.nnz} rows, one "
                         f"per entry of the CSRMatrix (got shape {tuple(value.shape)})")
    crow, col = (t.clone() for t in indices_of(adj, "torch_sparserl.integrations.pyg.set_sparse_value"))
    return torch_csr(crow, col, value, (*adj.shape, *value.shape[1:]))


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
        raise ValueError(f"torch_sparserl.integrations.pyg.gcn_norm: the adjacency must be square (got shape {tuple(A.shape)})")
    dtype = dtype if dtype is not None and dtype.is_floating_point else A.dtype
    if add_self_loops:
        A = _add_self_loops(A, values_of(A).to(dtype), 2.0 if improved else 1.0)
    val = values_of(A).to(dtype)
    rows = patterns.row_indices(A._crow, A.nnz)
    deg = val.new_zeros(A.shape[0]).index_add(0, rows, val)
    inv_sqrt = deg.pow(-0.5)
    inv_sqrt = inv_sqrt.masked_fill(torch.isinf(inv_sqrt), 0.0)
    crow, col = indices_of(A, "torch_sparserl.integrations.pyg.gcn_norm")
    normed = inv_sqrt.index_select(0, rows) * val * inv_sqrt.index_select(0, col.to(torch.int64))
    return A.with_values(normed), None


# --------------------------------------------------------------------- propagate


def _adj_data(A: CSRMatrix, kwargs: dict) -> dict:
    """The user's arguments with what PyG's ``_collect`` adds for a sparse adjacency: the
    matrix, the sizes, the row pointers, the values as ``edge_weight``."""
    data = dict(kwargs)
    data.update(adj_t=A, edge_index=None, size=[A.shape[1], A.shape[0]], size_i=A.shape[0], size_j=A.shape[1],
                dim_size=A.shape[0], ptr=indices_of(A, "torch_sparserl.integrations.pyg.propagate")[0])
    if data.get("edge_weight") is None:
        data["edge_weight"] = values_of(A)
    return data


def _edge_data(A: CSRMatrix, kwargs: dict, names) -> dict:
    """:func:`_adj_data` and the per-edge arguments, for a ``CSRMatrix`` (traceable: no torch
    sparse tensor): ``index`` (the row, the target node) and every ``<arg>_j`` / ``<arg>_i`` of
    ``names`` lifted to the edges (the source row ``col`` / the target row), in the matrix's
    order; ``ptr`` is None, as PyG gives it for a torch sparse adjacency (scatter softmax)."""
    crow, col = indices_of(A, "torch_sparserl.integrations.pyg.propagate")
    rows = patterns.row_indices(crow, A.nnz)
    cols = col.to(torch.int64)
    data = _adj_data(A, kwargs)
    data.update(edge_index_i=rows, edge_index_j=cols, index=rows, ptr=None)
    for name in names:
        if name[-2:] not in ("_i", "_j") or name in kwargs:
            continue
        value = kwargs.get(name[:-2])
        if isinstance(value, (tuple, list)):
            value = value[0 if name.endswith("_j") else 1]
        if isinstance(value, Tensor):
            value = value.index_select(0, cols if name.endswith("_j") else rows)
        data[name] = value
    return data


def _check_flow(module, A: CSRMatrix, size, what: str) -> None:
    if module.flow != "source_to_target":
        raise ValueError(f"{type(module).__name__}.{what}: flow={module.flow!r} is invalid for a sparse "
                         "adjacency (as in PyG); pass the transposed matrix, adj_t.t(), instead")
    if size is not None and (size[0] not in (None, A.shape[1]) or size[1] not in (None, A.shape[0])):
        raise ValueError(f"{type(module).__name__}.{what}: size {tuple(size)} does not match the adjacency "
                         f"(expected [{A.shape[1]}, {A.shape[0]}] for adj_t of shape {tuple(A.shape)})")


def _plain(module, kind: str) -> bool:
    """No PyG machinery that needs its own path: explain mode, hooks of ``kind``, decomposed layers."""
    hooks = any(getattr(module, f"_{kind}_{when}", None) for when in ("forward_pre_hooks", "forward_hooks"))
    return not (getattr(module, "_explain", None) or hooks or getattr(module, "decomposed_layers", 1) > 1)


def _edge_updater_csr(module, A: CSRMatrix, size, kwargs: dict) -> Tensor:
    _check_flow(module, A, size, "edge_updater")
    if not _plain(module, "edge_update"):
        sparse = A.to_sparse_csr()
        return type(module)._sparserl_original_edge_updater(module, sparse, size=size, **kwargs)
    data = _edge_data(A, kwargs, module._edge_user_args)
    return module.edge_update(**module.inspector.collect_param_data("edge_update", data))


def _attention_product(module, A: CSRMatrix, kwargs: dict) -> Tensor | None:
    """GATConv's message and sum, ``alpha.unsqueeze(-1) * x_j`` summed into each target, as
    sparse products with the attention as the matrix's values: for several heads one
    ``sparserl::spmm_heads`` (every head in one product on the pattern's block-diagonal form),
    for one head a product on the matrix itself. None for any other layer."""
    from torch_geometric.nn.conv.gat_conv import GATConv

    from ..ops.doors import autocast_operands

    if type(module).message is not GATConv.message or module.aggr != "add":
        return None
    x, alpha = kwargs.get("x"), kwargs.get("alpha")
    x_src = x[0] if isinstance(x, (tuple, list)) else x
    if not (isinstance(x_src, Tensor) and x_src.dim() == 3 and isinstance(alpha, Tensor)
            and alpha.shape == (A.nnz, x_src.shape[1])):
        return None
    heads = x_src.shape[1]
    if heads == 1:
        return (A.with_values(alpha[:, 0]) @ x_src[:, 0]).unsqueeze(1)
    if max(A.nnz, *A.shape) * heads > torch.iinfo(A._col.dtype).max:  # indices beyond int32: a product per head
        return torch.stack([A.with_values(alpha[:, h].contiguous()) @ x_src[:, h] for h in range(heads)], dim=1)
    alpha, x_src = autocast_operands(alpha, x_src)
    return torch.ops.sparserl.spmm_heads(A._crow, A._col, alpha, A.shape[1], x_src)


def _propagate_csr(module, A: CSRMatrix, size, kwargs: dict) -> Tensor:
    _check_flow(module, A, size, "propagate")
    plain = _plain(module, "propagate") and _plain(module, "message_and_aggregate")
    out = _attention_product(module, A, kwargs) if plain else None
    if out is not None:
        return module.update(out, **module.inspector.collect_param_data("update", _adj_data(A, kwargs)))
    if not module.fuse or not plain:
        # No fused product for this layer (or PyG machinery that needs its own path): PyG's
        # gather/scatter on a torch sparse CSR tensor with the same pattern and values.
        sparse = A.to_sparse_csr()
        return type(module)._sparserl_original_propagate(module, sparse, size=size, **kwargs)
    data = _adj_data(A, kwargs)
    inputs = module.inspector.collect_param_data("message_and_aggregate", data)
    out = module.message_and_aggregate(A, **inputs)
    return module.update(out, **module.inspector.collect_param_data("update", data))


def _wrap(cls, name: str, on_csr) -> None:
    """``cls.<name>`` (``propagate`` or ``edge_updater``) routing a ``CSRMatrix`` adjacency to
    ``on_csr``; the original stays as ``cls._sparserl_original_<name>``."""
    method = cls.__dict__.get(name)
    if method is None or getattr(method, _WRAPPED_FLAG, False):
        return
    setattr(cls, f"_sparserl_original_{name}", method)
    setattr(cls, name, _routing(method, on_csr))


def _compiled_by_torchscript_as(stand_in, original):
    """``stand_in`` (whose names come from its closure only, prefixed ``_sparserl_``) made what
    TorchScript compiles as ``original``.

    TorchScript compiles a function or method from the source and signature ``inspect`` finds
    through ``__wrapped__`` (``original``'s here), resolving its names in the function's globals
    and closure: here ``original``'s globals, and closure names ``original`` does not use.
    """
    stand_in = types.FunctionType(stand_in.__code__, original.__globals__, original.__name__,
                                  stand_in.__defaults__, stand_in.__closure__)
    return functools.update_wrapper(stand_in, original)


def _routing(method, on_csr):
    """``method(self, edge_index, size=None, **kwargs)``, with a ``CSRMatrix`` sent to
    ``on_csr``; ``torch.jit.script`` of a layer compiles ``method``, unchanged."""
    _sparserl_csr, _sparserl_on_csr, _sparserl_method = CSRMatrix, on_csr, method

    def routed(self, edge_index, size=None, **kwargs):
        if isinstance(edge_index, _sparserl_csr):
            return _sparserl_on_csr(self, edge_index, size, kwargs)
        return _sparserl_method(self, edge_index, size=size, **kwargs)

    routed = _compiled_by_torchscript_as(routed, method)
    setattr(routed, _WRAPPED_FLAG, True)
    return routed


# TorchScript's name for PyG's functions where the adapter stands in for them (see below).
_SCRIPTED_AS = f"{__name__}.scripted_as_pyg"


def _scripted_as_original(ours, original):
    """What PyG's modules call in place of ``original``: ``ours`` in Python, ``original`` to
    TorchScript (:func:`_compiled_by_torchscript_as`).

    ``original``'s overloads (``torch.jit._overload``), which TorchScript looks up by the
    function's qualified name, are registered again under this function's own name
    (``_SCRIPTED_AS``) so that compiling either leaves the other's intact; if TorchScript
    compiled them already, their compiled forms are shared.
    """
    _sparserl_ours = ours

    def adapter(*args, **kwargs):
        return _sparserl_ours(*args, **kwargs)

    adapter = _compiled_by_torchscript_as(adapter, original)
    adapter.__module__ = _SCRIPTED_AS
    declared = torch._jit_internal._get_fn_overloads(torch._jit_internal._qualified_name(original))
    if declared:
        for declaration in declared:
            again = functools.update_wrapper(lambda: None, declaration)  # its source: the declaration's
            again.__module__ = _SCRIPTED_AS
            torch.jit._overload(again)
    else:
        compiled = torch.jit._state._try_get_jit_cached_overloads(original)
        if compiled:
            torch.jit._state._set_jit_overload_cache(adapter, compiled)
    return adapter


def _wrap_propagate(cls) -> None:
    _wrap(cls, "propagate", _propagate_csr)
    _wrap(cls, "edge_updater", _edge_updater_csr)


def _all_subclasses(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from _all_subclasses(sub)


# ----------------------------------------------------------------------- install


def installed() -> bool:
    return bool(_ORIGINAL)


def install() -> None:
    """Route PyG's sparse path to sparserl for ``CSRMatrix`` adjacencies (idempotent).

    Replaces ``spmm``, ``gcn_norm``, ``remove_self_loops``, ``add_self_loops``,
    ``to_edge_index``, ``set_sparse_value`` and ``MessagePassing.propagate`` /
    ``edge_updater`` where PyG's modules refer to them, and ``is_torch_sparse_tensor`` in the
    layers of ``_SPARSE_VALUE_LAYERS``; other inputs reach PyG's original functions unchanged,
    and ``torch.jit.script`` compiles PyG's originals.
    """
    if _ORIGINAL:
        return
    _require_pyg()
    import torch_geometric.utils as pyg_utils
    import torch_geometric.utils.sparse as pyg_sparse
    from torch_geometric.nn import MessagePassing
    from torch_geometric.nn.conv import gcn_conv

    ours = {"spmm": spmm, "gcn_norm": gcn_norm, "remove_self_loops": remove_self_loops,
            "add_self_loops": add_self_loops, "to_edge_index": to_edge_index, "set_sparse_value": set_sparse_value,
            "is_torch_sparse_tensor": is_torch_sparse_tensor}
    homes = {"gcn_norm": gcn_conv, "set_sparse_value": pyg_sparse}
    for name in ours:
        _ORIGINAL[name] = getattr(homes.get(name, pyg_utils), name)
    replacements = {id(_ORIGINAL[name]): _scripted_as_original(new, _ORIGINAL[name]) for name, new in ours.items()}
    layers_only = id(_ORIGINAL["is_torch_sparse_tensor"])
    for name, module in list(sys.modules.items()):
        if not name.startswith("torch_geometric") or module is None:
            continue
        for attr, value in list(vars(module).items()):
            new = replacements.get(id(value))
            if new is not None and (id(value) != layers_only or name in _SPARSE_VALUE_LAYERS):
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
    op = "torch_sparserl.integrations.pyg.adjacency"
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
