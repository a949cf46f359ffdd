"""Settings of the ``sparserl`` backend: one dataclass, passed as ``torch.compile(options=...)``.

``torch.compile(model, backend="sparserl", options={"strict": True})``. Options that are not
the backend's own but name an Inductor config entry go to Inductor (``{"cpp_wrapper": True}``).
Environment variables are for debugging only: ``SPARSERL_LOG=debug`` turns on verbose logs.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass, fields
from typing import Any, Mapping

DEFAULT_STRICT = False
DEFAULT_INTERCEPT_SPARSE = True
DEFAULT_PRESPECIALIZE = True
# Off: measured on an H100 (benchmarks/results/epilogue-h100-2026-11-22.md), the fused layer
# tail was 0.99x the unfused one where it applied (2 of 12 rows), within the noise of calls
# that cost 150-370 us of CPU; and 10 of 12 products were served by split families, which
# cannot fuse. Opt in with options={"fuse_epilogues": True}.
DEFAULT_FUSE_EPILOGUES = False
DEFAULT_DIRECT_OPS = True
DEFAULT_FAST_PATH = True
DEFAULT_FLATTEN_MATRICES = True

logger = logging.getLogger("torch_sparserl")
if os.environ.get("SPARSERL_LOG"):
    logging.basicConfig()
    logger.setLevel(os.environ["SPARSERL_LOG"].upper())


@dataclass(frozen=True)
class Settings:
    """Options of the ``sparserl`` backend."""

    strict: bool = DEFAULT_STRICT
    """Raise where the library would otherwise fall back (to cuSPARSE or to torch's own
    sparse kernels) and log. Tests set it, so that a fallback never hides a bug."""

    intercept_sparse: bool = DEFAULT_INTERCEPT_SPARSE
    """Route eager products of raw ``torch.sparse_csr`` tensors, which Dynamo cannot trace,
    to the sparserl operators while a model compiled with this backend runs."""

    prespecialize: bool = DEFAULT_PRESPECIALIZE
    """Start specializing the kernels of the graph's CSRMatrix inputs (module buffers,
    constants, arguments) at compile time, for the product and its backward. How (in the
    background, or before compilation returns) is the JIT runtime's ``mode``."""

    fuse_epilogues: bool = DEFAULT_FUSE_EPILOGUES
    """Fuse the row scaling, bias add and ReLU that follow a sparse product into its kernel
    where the installed kernel can store rows through them (the post-grad pass writes
    ``sparserl::spmm_epilogue``). Off by default: no gain was measured
    (``benchmarks/bench_epilogue.py``; ``bench_gnn.py`` way ``sparserl_fused``)."""

    direct_ops: bool = DEFAULT_DIRECT_OPS
    """Run the sparse products of compiled graphs as ``sparserl_direct::*``, the operators'
    implementation-only twins, instead of through custom_op's autograd layers, which an
    already differentiated graph does not need (``ops.DIRECT_OPS``). Off: for comparisons."""

    fast_path: bool = DEFAULT_FAST_PATH
    """With ``direct_ops``, run the products as ``sparserl_fast::*``, which C++ serves once
    :mod:`torch_sparserl.fastpath` is built and loaded (the backend starts that: a subprocess
    builds it once per machine, in the background) and the Python implementation has served
    the same call. Off: for comparisons."""

    flatten_matrices: bool = DEFAULT_FLATTEN_MATRICES
    """Give AOTAutograd a graph's CSRMatrix inputs as their parts (``crow``, ``col``,
    ``val``) instead of a tensor subclass it unwraps on every call (:mod:`torch_sparserl.flatten`;
    matrices whose values need a gradient keep the subclass path). Off: for comparisons."""

    inductor: tuple[tuple[str, Any], ...] = ()
    """Inductor's own options, passed on as its config patches: any option that is not one of
    the above and names an entry of ``torch._inductor.config`` (``"cpp_wrapper"``,
    ``"max_autotune"``, ``"triton.cudagraphs"``), as the ``inductor`` backend takes them."""

    @classmethod
    def from_options(cls, options: Mapping[str, Any] | "Settings" | None) -> "Settings":
        if options is None:
            return cls()
        if isinstance(options, Settings):
            return options
        if not isinstance(options, Mapping):
            raise TypeError(f"sparserl backend: options must be a dict (got {type(options).__name__})")
        known = {f.name for f in fields(cls)} - {"inductor"}
        ours = {name: value for name, value in options.items() if name in known}
        for name, value in ours.items():
            if not isinstance(value, bool):
                raise TypeError(f"sparserl backend: option {name!r} must be a bool (got {value!r})")
        inductor = _inductor_options({name: value for name, value in options.items() if name not in known},
                                     sorted(known))
        return cls(**ours, inductor=inductor)

    def replace(self, **changes) -> "Settings":
        return dataclasses.replace(self, **changes)


def _inductor_options(options: Mapping[str, Any], ours: list[str]) -> tuple[tuple[str, Any], ...]:
    """The options that name Inductor config entries, checked as ``torch.compile`` checks the
    ``inductor`` backend's: the name must exist and the value have its type."""
    if not options:
        return ()
    from torch._inductor import config

    current = config.get_config_copy()
    unknown = sorted(name for name in options if name.replace("-", "_") not in current)
    if unknown:
        raise ValueError(f"sparserl backend: unknown option(s) {unknown}; expected some of {ours} "
                         "or an entry of torch._inductor.config")
    patches = []
    for name, value in options.items():
        key = name.replace("-", "_")
        expected = config.get_type(key) if hasattr(config, "get_type") else None
        if isinstance(expected, type) and not isinstance(value, expected):
            raise TypeError(f"sparserl backend: Inductor option {name!r} must be a {expected.__name__} "
                            f"(got {value!r})")
        patches.append((key, value))
    return tuple(sorted(patches))
