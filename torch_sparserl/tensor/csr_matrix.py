"""``CSRMatrix``: a traceable wrapper tensor for a CSR matrix (:mod:`.construct` builds one).

Dynamo refuses ``torch.sparse_csr`` tensors (the whole frame falls back to eager). A
wrapper subclass whose parts are plain dense tensors is traced instead: Dynamo inlines
``__torch_function__``, which maps the products to the ``sparserl`` operators, and
AOTAutograd flattens the matrix into ``crow``, ``col`` and ``val`` through
``__tensor_flatten__``. The shape is not in the flatten context, so a new graph of the
same structure reuses the compiled code.
"""

from __future__ import annotations

import hashlib
import numbers
import warnings
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake

from .. import pattern as patterns
from ..dtypes import VALUE_DTYPES
from ..ops import doors
from ..ops.doors import hot_product, python_product
from ..pattern.validation import check_csr_meta, require

PARTS = ("_crow", "_col", "val")
"""A matrix's inner tensors (:meth:`CSRMatrix.__tensor_flatten__`), by attribute name."""
_SOURCE_HASH = hashlib.blake2b(Path(__file__).read_bytes(), digest_size=8).hexdigest()


class CSRMatrix(Tensor):
    """A CSR matrix of shape ``(nrows, ncols)`` built from dense ``crow``, ``col``, ``val``.

    Supports ``A @ X``, ``X @ A``, ``torch.sparse.mm``, ``torch.mm``, ``torch.matmul``,
    ``torch.mv``, ``torch.addmm``, ``torch.addmv``, ``A.t()``, ``A.to_dense()``, scaling
    by a scalar, ``.to()`` / ``.cuda()`` / ``.cpu()`` and dtype casts. Gradients flow to
    ``val`` and to the dense operands. Any other tensor operation raises
    ``NotImplementedError`` naming it; use ``A.to_dense()`` for those.
    """

    # The indices every product reads. They are the library's own (validated once, never written
    # by it) and never handed out: ``crow`` / ``col`` give copies (:meth:`_exposed`), so that no
    # write a caller makes to a tensor it can reach, however it is made (in place, through
    # ``.data``, through NumPy), changes what a kernel reads.
    _crow: Tensor
    _col: Tensor
    val: Tensor

    @staticmethod
    def __new__(cls, crow: Tensor, col: Tensor, val: Tensor, size: Sequence[int]):
        _check_parts("CSRMatrix", crow, col, val, size)
        if val.requires_grad and torch.is_grad_enabled():
            return _FromParts.apply(crow, col, val, tuple(size))
        return cls._wrap(crow, col, val, size)

    def __init__(self, crow: Tensor, col: Tensor, val: Tensor, size: Sequence[int]):
        pass  # the parts are set by _wrap

    @classmethod
    def _wrap(cls, crow: Tensor, col: Tensor, val: Tensor, size: Sequence[int]) -> "CSRMatrix":
        """The wrapper itself, with no autograd link (see :class:`_FromParts`)."""
        matrix = Tensor._make_wrapper_subclass(cls, size, dtype=val.dtype, device=val.device)
        matrix._crow = crow
        matrix._col = col
        matrix.val = val
        return matrix

    # -- tracing -------------------------------------------------------------------

    def __tensor_flatten__(self):
        return list(PARTS), None

    @staticmethod
    def __tensor_unflatten__(inner_tensors, meta, outer_size, outer_stride):
        return CSRMatrix._wrap(*(inner_tensors[name] for name in PARTS), outer_size)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        handler = _FUNCTIONS.get(func)
        if handler is not None:
            return handler(*args, **kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        handler = _ATEN.get(func)
        if handler is not None:
            return handler(*args, **kwargs)
        raise NotImplementedError(
            f"CSRMatrix: {func} is not supported; supported are matrix products "
            "(@, mm, sparse.mm, matmul, mv, addmm, addmv), t(), to_dense(), scaling by a "
            "scalar and moves/casts. Use A.to_dense() for anything else.")

    # -- the hot path ---------------------------------------------------------------

    def __matmul__(self, other):
        # Eager ``A @ X``: the one eager door (ops.doors.product) inline, with nothing in between
        # (on a small graph a served call's host time is these checks and the launch; a call into
        # product() would add its own): C++'s eager door where a product of this matrix was
        # recorded there, else the installed kernel the matrix kept, else (or on a miss) the door's
        # Python path, without asking again. Only a matrix whose values need no gradient has a door.
        # Anything else goes to the same handler as torch.matmul, called here rather than through
        # Tensor.__matmul__, which turns every TypeError (a wrong dtype, a sparse operand) into
        # NotImplemented and so into Python's bare "unsupported operand type(s)".
        if type(other) is Tensor:
            door = self.__dict__.get("_door")
            if door is not None:
                dim = other.dim()
                if dim == 1 or dim == 2:
                    serve = door.cpp
                    if serve is not None and not torch.compiler.is_compiling():
                        out = serve(2 - dim, self._crow, self._col, self.val, door.ncols, other)  # 1: spmv, 0: spmm
                    else:
                        hot = door.hot
                        out = hot_product(hot, self._crow, self._col, self.val, other, dim) if hot else None
                    if out is not None:
                        return out
                    return python_product("spmv" if dim == 1 else "spmm", self._crow, self._col, self.val,
                                          door.ncols, other, door)
        if not isinstance(other, Tensor):
            return NotImplemented
        return _matmul(self, other, "CSRMatrix.matmul")

    def __rmatmul__(self, other):
        # ``X @ A``: Python asks the subclass's reflected method first, so the library's own
        # error reaches the user here too (see __matmul__).
        if not isinstance(other, Tensor):
            return NotImplemented
        return _matmul(other, self, "CSRMatrix.matmul")

    # -- conveniences --------------------------------------------------------------

    @property
    def crow(self) -> Tensor:
        """The row pointers, shape ``(nrows + 1,)``. Writing to them does not change the matrix
        (:meth:`_exposed`): build a new one with :func:`torch_sparserl.csr`."""
        return self._exposed("_crow")

    @property
    def col(self) -> Tensor:
        """The column index of each nonzero, shape ``(nnz,)``; as :attr:`crow`."""
        return self._exposed("_col")

    @crow.setter
    def crow(self, value):
        _refuse_index_write("crow")

    @col.setter
    def col(self, value):
        _refuse_index_write("col")

    def _exposed(self, name: str) -> Tensor:
        """The index part ``name`` as the caller may have it. The library's own indices (those
        :func:`csr` copied, derived forms such as ``A.t()``'s) are handed out as copies, made on
        first use and kept on the matrix: keys of the same pattern (:meth:`Pattern.expose`), so
        the runtime's records and the operators still know them as this matrix, while every
        product reads the originals. A caller's own tensors (``CSRMatrix(crow, col, ...)``) are
        theirs already: the pattern keeps a private copy of what it validated. While
        torch.compile traces, the part itself: a traced graph writes through neither ``.data``
        nor NumPy."""
        inner = self.__dict__[name]
        if torch.compiler.is_compiling() or is_fake(inner):
            return inner
        exposed = self.__dict__.get("_exposed_parts")
        if exposed is None:
            crow, col = self._crow, self._col
            if not (patterns.owned(crow) and patterns.owned(col)):
                return inner
            with torch.inference_mode(False), torch.no_grad():
                exposed = {"_crow": crow.clone(), "_col": col.clone()}
            patterns.lookup(crow, col, self.shape[1]).expose(exposed["_crow"], exposed["_col"])
            self.__dict__["_exposed_parts"] = exposed
        return exposed[name]

    @property
    def nnz(self) -> int:
        return self._col.shape[0]

    def with_values(self, val: Tensor) -> "CSRMatrix":
        """The same pattern with new values (for example attention weights each step)."""
        if val.shape != self.val.shape:
            raise ValueError(f"CSRMatrix.with_values: val must have shape {tuple(self.val.shape)} "
                             f"(got {tuple(val.shape)})")
        return CSRMatrix(self._crow, self._col, val, self.shape)

    def __repr__(self, *, tensor_contents=None) -> str:
        return (f"CSRMatrix(shape={tuple(self.shape)}, nnz={self.nnz}, dtype={self.dtype}, "
                f"index_dtype={self._crow.dtype}, device={self.device}"
                + (", requires_grad=True" if self.val.requires_grad else "") + ")")

    def __reduce_ex__(self, protocol):
        return (CSRMatrix, (self._crow, self._col, self.val, tuple(self.shape)))

    def _stable_hash_for_caching(self) -> str:
        # AOTAutograd's cache key. What is traced depends on this module's code (the
        # __torch_function__ mapping); the compiled code also asserts the sizes and strides
        # of the parts, so they are in the key, with dtypes, devices and requires_grad (as
        # torch's default hash of a wrapper subclass has them).
        parts = tuple((name, tuple(t.shape), tuple(t.stride()), str(t.dtype), str(t.device), t.requires_grad)
                      for name, t in (("crow", self._crow), ("col", self._col), ("val", self.val)))
        payload = repr((_SOURCE_HASH, tuple(self.shape), self.requires_grad, parts))
        return hashlib.blake2b(payload.encode(), digest_size=16).hexdigest()


class _FromParts(torch.autograd.Function):
    """Make a CSRMatrix whose values carry a gradient, linked to them by a grad_fn.

    Eagerly, products read ``A.val`` and the gradient reaches it through the operators.
    A compiled graph instead returns the gradient of the whole matrix (a CSRMatrix
    tangent); this function hands its values back to ``val``. Without the link the
    wrapper would be a leaf of its own and the compiled gradient would stop there.
    """

    @staticmethod
    def forward(ctx, crow, col, val, size):
        ctx.save_for_backward(crow, col)
        return CSRMatrix._wrap(crow, col, val.detach(), size)

    @staticmethod
    def backward(ctx, grad):
        if isinstance(grad, CSRMatrix):
            return None, None, grad.val, None
        # A dense gradient of the whole matrix: only the entries at the pattern matter.
        crow, col = ctx.saved_tensors
        rows = patterns.row_indices(crow, col.shape[0])
        return None, None, grad[rows, col.to(torch.int64)], None


# ------------------------------------------------------------------ torch functions


def _refuse_index_write(name: str) -> None:
    raise AttributeError(
        f"CSRMatrix.{name}: the indices of a matrix cannot be replaced (its pattern was validated once "
        f"and its kernels were chosen for it); build a new matrix: torch_sparserl.csr((crow, col, val), shape)")


def _fail_operand(op: str, name: str, t: Any, want: str) -> None:
    got = f"shape {tuple(t.shape)}" if isinstance(t, Tensor) else type(t).__name__
    raise ValueError(f"{op}: {name} must be {want} (got {got})")


class _Values(torch.autograd.Function):
    """``A.val`` with the gradient routed back through the matrix (see :class:`_FromParts`)."""

    @staticmethod
    def forward(ctx, A):
        ctx.parts = (A._crow, A._col, tuple(A.shape))
        return A.val.view_as(A.val)

    @staticmethod
    def backward(ctx, grad):
        crow, col, size = ctx.parts
        return CSRMatrix._wrap(crow, col, grad, size)


def values_of(A: CSRMatrix) -> Tensor:
    """The values of ``A``, differentiable when ``A`` requires grad."""
    return _Values.apply(A) if A.requires_grad else A.val


def _product(op: str, A: CSRMatrix, X: Tensor) -> Tensor:
    """``torch.ops.sparserl.<op>`` on A's parts, through the one eager door
    (:func:`torch_sparserl.ops.doors.product`) with the matrix's :class:`~torch_sparserl.ops.doors.Door`,
    made on its first product. A matrix whose values need a gradient has none (autograd must see
    each of its products, on the values linked to the matrix: :func:`values_of`), and a product
    torch.compile traces takes none (a trace writes nothing on a matrix)."""
    if not torch.compiler.is_compiling():
        # the door first: reading A.requires_grad costs a torch function dispatch
        door = A.__dict__.get("_door")
        if door is not None:
            return doors.product(op, A._crow, A._col, A.val, door.ncols, X, door)
        if not A.requires_grad:
            door = A.__dict__["_door"] = doors.Door(A.shape[1])
            return doors.product(op, A._crow, A._col, A.val, door.ncols, X, door)
    return doors.product(op, A._crow, A._col, values_of(A), A.shape[1], X)


def _set_requires_grad(A: CSRMatrix, value: bool) -> None:
    A.__dict__.pop("_door", None)  # what the door kept (C++'s door, kernels) was for a matrix without gradient
    with torch._C.DisableTorchFunctionSubclass():
        Tensor.requires_grad.__set__(A, value)


def _spmm(A: CSRMatrix, X: Tensor) -> Tensor:
    return _product("spmm", A, X)


def _spmv(A: CSRMatrix, x: Tensor) -> Tensor:
    return _product("spmv", A, x)


def _matmul(a, b, op: str = "CSRMatrix.matmul", vectors: bool = True) -> Tensor:
    if isinstance(a, CSRMatrix) and isinstance(b, CSRMatrix):
        raise NotImplementedError(f"{op}: sparse @ sparse is not supported; densify one side")
    if isinstance(a, CSRMatrix):
        if not isinstance(b, Tensor):
            _fail_operand(op, "the dense operand", b, "a torch.Tensor")
        if b.dim() == 2:
            return _spmm(a, b)
        if b.dim() == 1 and vectors:
            return _spmv(a, b)
        _fail_operand(op, "the dense operand", b, "2-D" if not vectors else "1-D or 2-D")
    # dense @ sparse: X @ A = (Aᵀ Xᵀ)ᵀ, on the cached transposed pattern.
    if not isinstance(a, Tensor):
        _fail_operand(op, "the dense operand", a, "a torch.Tensor")
    if a.dim() == 2:
        return _product("spmm_transposed", b, a.t()).t()
    if a.dim() == 1 and vectors:
        return _product("spmv_transposed", b, a)
    _fail_operand(op, "the dense operand", a, "2-D" if not vectors else "1-D or 2-D")


def _mm(a, b):
    return _matmul(a, b, "CSRMatrix.mm", vectors=False)


def _mv(A, x):
    if not isinstance(A, CSRMatrix):
        raise NotImplementedError("CSRMatrix.mv: the matrix operand must be the CSRMatrix")
    if not isinstance(x, Tensor) or x.dim() != 1:
        _fail_operand("CSRMatrix.mv", "the vector", x, "1-D")
    return _spmv(A, x)


def _beta_input_plus_alpha_product(name: str, product, input, beta, alpha, out) -> Tensor:
    """``beta * input + alpha * product`` with torch.addmm's rules."""
    if out is not None:
        raise NotImplementedError(f"CSRMatrix.{name}: out= is not supported")
    if not (isinstance(alpha, numbers.Number) and alpha == 1):
        product = product * alpha
    # beta == 0 ignores `input` entirely, as torch.addmm does (NaN in it must not leak).
    if isinstance(beta, numbers.Number) and beta == 0:
        return product
    return torch.add(product, input, alpha=beta)


def _addmm(input, mat1, mat2, *, beta=1, alpha=1, out=None):
    return _beta_input_plus_alpha_product("addmm", _mm(mat1, mat2), input, beta, alpha, out)


def _sparse_addmm(mat, mat1, mat2, *, beta=1.0, alpha=1.0):
    return _addmm(mat, mat1, mat2, beta=beta, alpha=alpha)


def _addmv(input, mat, vec, *, beta=1, alpha=1, out=None):
    return _beta_input_plus_alpha_product("addmv", _mv(mat, vec), input, beta, alpha, out)


@torch._dynamo.disable
def _transpose_parts(A: CSRMatrix):
    entry = patterns.lookup(A._crow, A._col, A.shape[1])
    _, crow_t, col_t, perm = entry.transpose(A._crow, A._col)
    return crow_t, col_t, perm


_T_UNDER_COMPILE = (
    "CSRMatrix.t(): the transposed pattern is computed once per pattern and cached outside any graph, so "
    "under torch.compile this is a graph break (fullgraph=True refuses it). In a graph write Aᵀ @ X as "
    "(X.t() @ A).t() (it runs on the cached transposed pattern), or transpose before compiling and pass Aᵀ in.")


def _t(A: CSRMatrix) -> CSRMatrix:
    if is_fake(A._col):  # torch.compile is tracing: refuse with the reason (a graph break, not a crash)
        raise torch._dynamo.exc.Unsupported(_T_UNDER_COMPILE)
    crow_t, col_t, perm = _transpose_parts(A)
    return CSRMatrix(crow_t, col_t, values_of(A).index_select(0, perm), (A.shape[1], A.shape[0]))


def _transpose(A: CSRMatrix, dim0: int, dim1: int) -> CSRMatrix:
    if {dim0 % 2, dim1 % 2} != {0, 1}:
        return A
    return _t(A)


def indices_of(A: CSRMatrix, op: str) -> tuple[Tensor, Tensor]:
    """``(crow, col)`` of ``A`` as its pattern validated them (:meth:`Pattern.indices`; ``op``
    names the caller in a validation error) in eager code, so that every use of a matrix reads
    the same checked indices; its parts while tracing. The library's own tensors: read them,
    never write them or hand them to a caller (clone them first). A CUDA pattern whose device
    check has not come back is waited for (its verdict raised): unlike the products, what these
    indices feed is not poisoned should the check fail."""
    if torch.compiler.is_compiling() or is_fake(A._col):
        return A._crow, A._col
    entry = patterns.lookup(A._crow, A._col, A.shape[1])
    entry.validate(op, A._crow, A._col)
    if entry.check is not None:
        entry.settle(block=True)
    return entry.indices(A._crow, A._col)


def _to_dense(A: CSRMatrix, dtype=None, *, masked_grad=None) -> Tensor:
    crow, col = indices_of(A, "CSRMatrix.to_dense")
    rows = patterns.row_indices(crow, col.shape[0])
    dense = torch.zeros(tuple(A.shape), dtype=A.dtype, device=A.device)
    dense = dense.index_put((rows, col.to(torch.int64)), values_of(A), accumulate=True)
    return dense if dtype is None else dense.to(dtype)


def _to_sparse_csr(A: CSRMatrix, dense_dim=None) -> Tensor:
    """torch's ``sparse_csr`` tensor of the matrix: on new copies of its validated indices (never
    the ones its products read, nor the copies ``A.crow`` / ``A.col`` hand out, which the caller
    may have written since: torch trusts them unchecked), and its values as they are (a gradient
    flows back to them)."""
    if dense_dim not in (None, 0):
        raise ValueError(f"CSRMatrix.to_sparse_csr: dense_dim must be None or 0 (got {dense_dim})")
    crow, col = (t.clone() for t in indices_of(A, "CSRMatrix.to_sparse_csr"))  # validated once
    return torch_csr(crow, col, values_of(A), tuple(A.shape))


def torch_csr(crow: Tensor, col: Tensor, values: Tensor, size: tuple) -> Tensor:
    """torch's ``sparse_csr`` tensor on indices that were validated (no check of torch's again),
    without torch's note that its CSR support is in beta: the library builds these for callers
    who asked for torch's tensor. ``values`` may carry trailing dimensions (a hybrid tensor)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")
        return torch.sparse_csr_tensor(crow, col, values, size, check_invariants=False)


def _moved(A: CSRMatrix, *, device=None, dtype=None, non_blocking=False, copy=False) -> CSRMatrix:
    if dtype is not None and dtype not in VALUE_DTYPES:
        raise TypeError(f"CSRMatrix.to: values must stay floating point, one of {VALUE_DTYPES} (got {dtype})")
    if not copy and (device is None or torch.device(device) == A.device) and dtype in (None, A.dtype):
        return A
    crow = A._crow.to(device=device, non_blocking=non_blocking, copy=copy)
    col = A._col.to(device=device, non_blocking=non_blocking, copy=copy)
    _own_copies(A, crow, col)
    val = values_of(A).to(device=device, dtype=dtype, non_blocking=non_blocking, copy=copy)
    return CSRMatrix(crow, col, val, A.shape)


def _own_copies(A: CSRMatrix, crow: Tensor, col: Tensor) -> None:
    """The copies of a library-owned matrix's indices (moves, clones) are the library's too."""
    if patterns.owned(A._crow) and patterns.owned(A._col):
        patterns.own(*(t for t, old in ((crow, A._crow), (col, A._col)) if t is not old))


def _to(A: CSRMatrix, *args, **kwargs) -> CSRMatrix:
    device, dtype, non_blocking, _ = torch._C._nn._parse_to(*args, **kwargs)
    return _moved(A, device=device, dtype=dtype, non_blocking=non_blocking,
                  copy=kwargs.get("copy", False))


def _scalar_op(name: str, fn, commutes: bool = True):
    def handler(a, b=None):
        if not isinstance(a, CSRMatrix) and not commutes:
            raise NotImplementedError(f"CSRMatrix.{name}: the matrix must be the left operand")
        A, other = (a, b) if isinstance(a, CSRMatrix) else (b, a)
        if isinstance(other, numbers.Number) or (isinstance(other, Tensor) and other.dim() == 0
                                                 and not isinstance(other, CSRMatrix)):
            return A.with_values(fn(values_of(A), other))
        raise NotImplementedError(f"CSRMatrix.{name}: only a scalar operand is supported "
                                  f"(got {type(other).__name__})")
    return handler


def _requires_grad_(A: CSRMatrix, requires_grad: bool = True) -> CSRMatrix:
    raise RuntimeError(
        "CSRMatrix.requires_grad_: the gradient belongs to the values; make them a leaf that "
        "requires grad and build the matrix on it: A = A.with_values(A.values().detach().requires_grad_()) "
        "(or torch_sparserl.csr(..., values that require grad))")


_FUNCTIONS = {
    torch.sparse.mm: _mm,
    torch.mm: _mm,
    Tensor.mm: _mm,
    torch.matmul: _matmul,
    Tensor.matmul: _matmul,
    Tensor.__matmul__: _matmul,
    Tensor.__rmatmul__: lambda a, b: _matmul(b, a),
    torch.mv: _mv,
    Tensor.mv: _mv,
    torch.addmm: _addmm,
    Tensor.addmm: _addmm,
    torch.sparse.addmm: _sparse_addmm,
    torch.addmv: _addmv,
    Tensor.addmv: _addmv,
    torch.t: _t,
    Tensor.t: _t,
    Tensor.T.__get__: _t,
    Tensor.mT.__get__: _t,
    torch.transpose: _transpose,
    Tensor.transpose: _transpose,
    Tensor.to_dense: _to_dense,
    Tensor.to_sparse_csr: _to_sparse_csr,  # the same method object as torch._C.TensorBase.to_sparse_csr
    Tensor.to: _to,
    Tensor.cuda: lambda A, device=None, non_blocking=False, **_: _moved(
        A, device=torch.device("cuda", device) if isinstance(device, int) else (device or "cuda"),
        non_blocking=non_blocking),
    Tensor.cpu: lambda A, **_: _moved(A, device="cpu"),
    Tensor.double: lambda A, **_: _moved(A, dtype=torch.float64),
    Tensor.float: lambda A, **_: _moved(A, dtype=torch.float32),
    Tensor.half: lambda A, **_: _moved(A, dtype=torch.float16),
    Tensor.bfloat16: lambda A, **_: _moved(A, dtype=torch.bfloat16),
    Tensor.detach: lambda A: CSRMatrix._wrap(A._crow, A._col, A.val, A.shape),
    Tensor.clone: lambda A, **_: CSRMatrix(A._crow.clone(), A._col.clone(), values_of(A).clone(), A.shape),
    Tensor.requires_grad_: _requires_grad_,
    Tensor.requires_grad.__set__: _set_requires_grad,
    Tensor.values: values_of,
    Tensor.crow_indices: lambda A: A.crow,
    Tensor.col_indices: lambda A: A.col,
    Tensor._nnz: lambda A: A._col.shape[0],
    Tensor.__mul__: _scalar_op("mul", torch.mul),
    Tensor.__rmul__: _scalar_op("mul", torch.mul),
    torch.mul: _scalar_op("mul", torch.mul),
    Tensor.mul: _scalar_op("mul", torch.mul),
    Tensor.__truediv__: _scalar_op("div", torch.div, commutes=False),
    Tensor.__div__: _scalar_op("div", torch.div, commutes=False),
    Tensor.div: _scalar_op("div", torch.div, commutes=False),
    torch.div: _scalar_op("div", torch.div, commutes=False),
    Tensor.__neg__: lambda A: A.with_values(-values_of(A)),
}


# ---------------------------------------------------------------- aten (dispatch)


def _aten_to_copy(A, *, dtype=None, layout=None, device=None, pin_memory=None,
                  non_blocking=False, memory_format=None):
    moved = [t.to(device=device, non_blocking=non_blocking, copy=True) for t in (A._crow, A._col)]
    if not is_fake(A._col):
        _own_copies(A, *moved)
    val = A.val.to(device=device, dtype=dtype, non_blocking=non_blocking, copy=True)
    return CSRMatrix._wrap(*moved, val, A.shape)


def _aten_add(a, b, *, alpha=1):
    """The sum of two gradients of one matrix (autograd accumulates them when the matrix's
    values feed several products): same pattern, values added."""
    if (isinstance(a, CSRMatrix) and isinstance(b, CSRMatrix) and a.shape == b.shape
            and (a._crow is b._crow and a._col is b._col
                 or a._col.shape == b._col.shape and torch.equal(a._crow, b._crow) and torch.equal(a._col, b._col))):
        return CSRMatrix._wrap(a._crow, a._col, torch.add(a.val, b.val, alpha=alpha), a.shape)
    raise NotImplementedError("CSRMatrix: adding is supported only for two matrices of the same pattern "
                              f"(got {type(a).__name__} and {type(b).__name__}); use A.to_dense() for anything else")


_aten = torch.ops.aten
_ATEN = {
    _aten.add.Tensor: _aten_add,
    _aten.detach.default: lambda A: CSRMatrix._wrap(A._crow, A._col, A.val.detach(), A.shape),
    _aten.alias.default: lambda A: CSRMatrix._wrap(A._crow, A._col, A.val, A.shape),
    _aten.clone.default: lambda A, **_: CSRMatrix._wrap(A._crow.clone(), A._col.clone(), A.val.clone(), A.shape),
    _aten._to_copy.default: _aten_to_copy,
}


# --------------------------------------------------------------------- construction


def _check_parts(op: str, crow, col, val, size) -> None:
    """The metadata of a matrix's parts against its shape (no data read): what every
    constructor checks, so that no matrix exists whose shape disagrees with its parts."""
    try:
        size = tuple(size)
    except TypeError:
        raise TypeError(f"{op}: shape must be a pair (nrows, ncols) (got {type(size).__name__})") from None
    if len(size) != 2 or not all(isinstance(d, (int, torch.SymInt)) and not isinstance(d, bool) for d in size):
        raise ValueError(f"{op}: shape must be a pair of ints (nrows, ncols) (got {size!r})")
    check_csr_meta(op, crow, col, val, size[1])
    require(op, size[0] >= 0, lambda: f"shape must be non-negative (got {size})")
    require(op, crow.shape[0] == size[0] + 1,
            lambda: f"crow must have nrows + 1 = {size[0] + 1} elements (got {crow.shape[0]}) for shape {size}")
