"""The ``sparserl`` command (also ``python -m torch_sparserl``).

Pipeline stage 13 of 14: the ``sparserl`` command (also ``python -m torch_sparserl``): its parser
and error handling (:mod:`.main`), what the commands share (:mod:`.common`), one module per
command (:mod:`.demo`, :mod:`.info`, :mod:`.tune`, :mod:`.bench`, :mod:`.explain`,
:mod:`.fastpath`, :mod:`.cache`), and the end-to-end measurements that ``sparserl bench``
reports (:mod:`.measure`).
May import: config, dtypes, data, pattern, kernels, abi, toolchain, evaluate, specialize, jit,
ops, tensor, compiler, distributed, integrations, train, torch_sparserl.

``sparserl demo`` is the README's main job: on a shipped matrix it checks the operators
against a float64 reference, compiles a two-layer GCN whole with the ``sparserl`` backend
(its output and gradient compared with the same model run without compiling), and runs the
JIT pipeline: on a GPU it specializes ``A @ X``, shows the kernel and times it against
``torch.sparse.mm`` (the C++ fast path built first); without one it generates the candidate
kernels and compiles them with nvcc.

``tune`` searches the kernel space for a matrix; ``bench`` measures the runtime end to end;
``explain`` says which kernel serves a matrix's products and why; ``cache`` manages the
specialization cache. ``SPARSERL_LOG=info`` (or ``debug``) logs the runtime's decisions.

A bad invocation (an argument out of range, a file that is not a matrix, a broken cache
folder) prints one line, ``sparserl COMMAND: what was expected (got what came)``, and exits
with status 2, as does a command that needs what the machine lacks (a CUDA GPU, a CUDA build
of torch, nvcc); ``SPARSERL_DEBUG=1`` shows the traceback instead (:data:`.main.EXIT_STATUSES`).

Results go to stdout; a line on stderr before each slow step says what starts (:func:`.common._note`).
Parsing imports neither torch nor NumPy (each command imports them when it runs; :mod:`.measure`
only the commands that measure): ``--help`` and usage errors answer at once, and the package
defers its operators to the command (``torch_sparserl/__init__.py``, :func:`.main._run`).
"""

from __future__ import annotations

from .common import MAX_N, CommandError
from .common import _progress  # noqa: F401  tests take it from here
from .main import _parser  # noqa: F401  tests take it from here
from .main import main

__all__ = ["MAX_N", "CommandError", "main"]
