"""Fused epilogues: ``relu(scale[:, None] * (A @ X) + bias)`` in the product's own launch.

A part of :class:`~torch_sparserl.jit.runtime.Runtime` (the :class:`FusedInstalls` mixin). The
fused kernel is the pattern's installed SpMM kernel rendered again with the epilogue in its row
stores (the families of :data:`~torch_sparserl.specialize.families.EPILOGUE_FAMILIES`), built by
the runtime's ``fused_installer`` and checked against float64 before its first use. Each
``(pattern, n, dtype, epilogue)`` is decided once, like any product, under the op name
``spmm+<epilogue>``; where none is installed the caller runs the product and the epilogue.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from ..abi import DTYPES
from ..pattern import Pattern, run_kept
from .decisions import Fallback, Installed, Pending, SpecializationError
from .install import family_params, on_device

log = logging.getLogger("torch_sparserl.jit.fused")


def check_fused(launch: Callable, pattern: Pattern, crow, col, n: int, dtype: torch.dtype, epilogue: str) -> None:
    """Run a fused kernel, ``launch(crow, col, val, X, bias, scale)``, once against the float64
    reference (:func:`~torch_sparserl.evaluate.verdict.launch_check`); raise
    :class:`SpecializationError` where they differ."""
    from ..evaluate.verdict import launch_check

    why = launch_check(lambda val, X, bias, scale: launch(crow, col, val, X, bias, scale), pattern, crow, col,
                       op="spmm", n=n, dtype=dtype, seed=pattern.nnz * 7 + n, epilogue=epilogue)
    if why is not None:
        raise SpecializationError(f"the fused kernel {why}")


class FusedInstalls:
    """The fused epilogues of a :class:`~torch_sparserl.jit.runtime.Runtime` (a mixin)."""

    def call_fused(self, pattern: Pattern, crow: torch.Tensor, col: torch.Tensor, val: torch.Tensor,
                   X: torch.Tensor, epilogue: str, bias: torch.Tensor | None,
                   scale: torch.Tensor | None) -> torch.Tensor | None:
        """``relu(scale[:, None] * (A @ X) + bias)`` (the steps ``epilogue`` names) in one
        launch, or None: the caller runs the product and applies the epilogue itself.

        The fused kernel is the pattern's installed SpMM kernel rendered again with the
        epilogue in its row stores (families that store each row once: group_row,
        warp_row_staged), built, and checked against float64 before its first use. It is
        decided once per (pattern, n, dtype, epilogue), like any product.
        """
        n = X.shape[1]
        decision = self._decisions.get(pattern, f"spmm+{epilogue}", n, val.dtype)
        state = None if decision is None else decision.state
        if state is None or (state.__class__ is Pending and state.future.done()):
            if not self.decides_on(X.device):
                return None
            state = self._resolve_fused(pattern, crow, col, val.dtype, n, epilogue)
        if state.__class__ is not Installed:
            if state.__class__ is Fallback and self.settings.strict and not state.decided:
                raise SpecializationError(f"sparserl runtime: spmm+{epilogue} n={n}: {state.reason}")
            return None
        if bias is not None and (not bias.is_contiguous() or bias.data_ptr() % 16):  # read in vectors
            bias = bias.clone(memory_format=torch.contiguous_format)
        if scale is not None and not scale.is_contiguous():
            scale = scale.contiguous()
        return self.launch(state.launch, crow, col, val, X, bias, scale)

    def fusable(self, nrows: int, nnz: int, ncols: int, n: int, dtype: torch.dtype) -> bool:
        """Whether a live pattern of this shape has an installed SpMM kernel for ``(n, dtype)``
        whose family can store its rows through an epilogue: the post-grad pass asks before it
        fuses (it sees shapes, not the matrix), so a graph fuses only what a kernel will serve."""
        from ..specialize.families import EPILOGUE_FAMILIES

        for pattern, decision in self._decisions.items():
            # a forward product's epilogue: transposes (the backward's products) do not count
            if (decision.op, decision.n, decision.dtype) != ("spmm", n, dtype) or pattern.is_transpose \
                    or (pattern.nrows, pattern.nnz, pattern.ncols) != (nrows, nnz, ncols):
                continue
            state = decision.state
            if state.__class__ is Installed and state.entry is not None and state.entry.family in EPILOGUE_FAMILIES:
                return True
        return False

    def _resolve_fused(self, pattern, crow, col, dtype, n, epilogue):
        with self._lock:
            decision = self._decisions.record(pattern, f"spmm+{epilogue}", n, dtype)
            state = decision.state
            if state is not None and not (state.__class__ is Pending and state.future.done()):
                return state
            base = self.state("spmm", pattern, n, dtype)
            if base is None:
                base = self._resolve("spmm", n, pattern, crow, col, dtype)
            if base.__class__ is Pending:
                return base  # not decided yet: the unfused path serves, and asks again next call
            if base.__class__ is Fallback:
                return self._fallback(pattern, decision, None, f"no fused epilogue: the product itself is served "
                                      f"by cuSPARSE ({base.reason})", None, quiet=True)
            if self.settings.mode == "sync":
                with self._clock("jit_s"):
                    return self._install_fused(pattern, decision, base, crow, col, n, epilogue)
            state = Pending(base.key, self._in_background(self._install_fused, pattern, decision, base, crow, col, n,
                                                          epilogue))
            self._decisions.set(decision, state)
            return state

    def _install_fused(self, pattern, decision, base: Installed, crow, col, n, epilogue):
        from ..specialize.families import EPILOGUE_FAMILIES, render

        entry = base.entry
        family = entry.family if entry is not None else ""
        if family not in EPILOGUE_FAMILIES:
            return self._fallback(pattern, decision, base.key, f"no fused epilogue: the installed kernel "
                                  f"({family or 'unknown family'}) does not store each row once", None, quiet=True)
        try:
            spec = render(family, {**family_params(entry.params), "epilogue": epilogue}, op="spmm",
                          dtype=base.key.dtype, n=n)
            with on_device(col):
                launch = run_kept(col.device, self.fused_installer, spec, crow, col, pattern.ncols, n)
                check_fused(launch, pattern, crow, col, n, DTYPES[base.key.dtype], epilogue)
        except Exception as exc:  # noqa: BLE001 - the unfused path is always there
            return self._fallback(pattern, decision, base.key, f"fused {family} with epilogue {epilogue} failed: "
                                  f"{type(exc).__name__}: {exc}", exc)
        state = Installed(base.key, launch, f"{family}(epilogue={epilogue})", f"fused into {base.description}", entry)
        self._set(pattern, decision, state)
        log.info("sparserl: spmm+%s n=%d %s -> %s", epilogue, n, base.key.dtype, state.description)
        return state
