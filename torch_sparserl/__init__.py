"""torch-sparserl: sparse CSR products with kernels specialized to the sparsity pattern.

Three ways in, one runtime:

* ``torch.ops.sparserl.spmm(crow, col, val, ncols, X)`` and friends (:mod:`.ops`);
* :func:`csr` builds a :class:`CSRMatrix`, a tensor subclass whose ``@``, ``torch.mm``,
  ``torch.sparse.mm``, ``torch.mv`` and ``torch.addmm`` run on those operators and that
  ``torch.compile`` traces whole;
* ``torch.compile(model, backend="sparserl")`` (found by name, no import needed) and
  :func:`compile`, which also converts sparse arguments and buffers to :class:`CSRMatrix`.

:func:`capture_step` runs an eager training step on a fixed graph as one CUDA graph.

The package is laid out in the pipeline's order: each stage is a folder that imports only from
the stages above it in this list (``tests/repo/test_layout.py`` checks it, function-level imports
included):

    data/          matrices: the shipped ones (``ts.load_matrix``) and synthetic generators
    pattern/       a CSR pattern's structure, validated once: derived forms, fingerprint, features
    kernels/       products that need no specialization: torch's own (fallback, baseline), the reference
    abi/           the kernel ABI: the plan line, the kernel spec, a plan's preprocessing
    toolchain/     ABI source -> launchable kernel: NVRTC, extension builder, nvcc; files and trust
    evaluate/      the referee: a candidate's correctness and speed, in a sandboxed process
    specialize/    which kernel for a pattern: kernel families, autotuner, learned policy
    jit/           the runtime: decided once per (pattern, op, N, dtype), cached, installed, fast path
    ops/           the torch.ops.sparserl operators: schema, checks, fake, autograd
    tensor/        CSRMatrix and csr(); raw torch.sparse_csr products routed to the operators
    compiler/      torch.compile: the sparserl backend, its passes, ts.compile
    distributed/   a matrix split by rows over a process group's ranks, its halo exchange
    integrations/  other libraries on the operators: PyTorch Geometric
    train/         a whole training step as one CUDA graph (``ts.capture_step``)
    cli/           the sparserl command (python -m torch_sparserl); sparserl bench's measurements

In the root: ``config`` (the settings tree, :mod:`torch_sparserl.config`) and ``dtypes`` (the
supported dtypes and the one tolerance table), which every stage reads; ``__main__`` (the
command).

Configuration: ``ts.config`` is the one settings tree (its docstring lists every field and
environment variable); ``ts.configure(**fields)`` replaces the process's JIT runtime with
fields of :class:`~torch_sparserl.config.JitOptions` changed (``ts.configure(mode="sync")``);
a compiled model's options go through ``torch.compile(..., options={...})``
(:class:`~torch_sparserl.config.BackendOptions`).
"""

import os
import sys
from importlib import import_module
from typing import TYPE_CHECKING

from . import config

__version__ = "0.1.0"


def _started_as_the_command() -> bool:
    """Whether this process is the ``sparserl`` command or ``python -m torch_sparserl``, this
    import being the one that starts it."""
    if sys.argv and sys.argv[0] == "-m":  # python -m: set so while the module to run is being found
        names = {"torch_sparserl", "torch_sparserl.__main__"}
        line = getattr(sys, "orig_argv", [])
        return any((arg == "-m" and following in names) or (arg.startswith("-m") and arg[2:] in names)
                   for arg, following in zip(line, line[1:] + [""]))
    launcher = os.path.basename(sys.argv[0]) if sys.argv else ""
    for suffix in ("-script.pyw", "-script.py", ".exe"):  # the console script's names on Windows
        launcher = launcher.removesuffix(suffix)
    return launcher == "sparserl"


# The command answers --help and usage errors without importing torch (seconds on some hosts):
# there the operators are registered by the command once its arguments parse (cli._run), and
# ``ops`` and ``intercept_sparse`` load on first use like the names below.
if not _started_as_the_command():
    from . import ops  # registers the torch.ops.sparserl operators
    from .tensor.intercept import intercept_sparse

config.warn_unknown_variables()  # a mistyped SPARSERL_* variable is named, not ignored

__all__ = ["CSRMatrix", "capture_step", "compile", "config", "configure", "csr", "distributed", "intercept_sparse",
           "list_matrices", "load_matrix", "ops"]

# Loaded on first use: the tensor subclass imports torch._dynamo (seconds on some hosts), which
# the sandbox's worker, a process of this package that never compiles, should not wait for.
_LAZY = {"CSRMatrix": "tensor.csr_matrix", "csr": "tensor.construct", "compile": "compiler.convert",
         "list_matrices": "data.datasets", "load_matrix": "data.datasets", "ops": "ops",
         "intercept_sparse": "tensor.intercept", "configure": "jit.runtime", "capture_step": "train.capture",
         "distributed": "distributed"}


if TYPE_CHECKING:  # the lazy names, for type checkers and editors
    from . import distributed, ops
    from .compiler.convert import compile
    from .data.datasets import list_matrices, load_matrix
    from .jit.runtime import configure
    from .tensor.construct import csr
    from .tensor.csr_matrix import CSRMatrix
    from .tensor.intercept import intercept_sparse
    from .train.capture import capture_step


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = import_module(f".{module}", __name__)
    value = value if module == name else getattr(value, name)  # ``ops`` is the module itself
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
