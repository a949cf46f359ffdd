"""Supported dtypes, accumulation rules and the one tolerance table.

Every comparison against a reference — tests, the evaluator, the demo — takes its
tolerance from :data:`TOLERANCES`; no tolerance is written inline anywhere else.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

VALUE_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)
HALF_DTYPES = (torch.float16, torch.bfloat16)


def accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype sums are carried in: float32 for the half types, else the dtype itself."""
    return torch.float32 if dtype in HALF_DTYPES else dtype


@dataclass(frozen=True)
class Tolerance:
    """Bounds for comparing a result with a float64 reference.

    ``rel_norm`` bounds ``‖out − ref‖ / ‖ref‖`` (the whole tensor); ``rtol``/``atol``
    bound each element as in :func:`torch.testing.assert_close`, with ``atol`` scaled by
    the magnitude of the reference so that long rows of large sums are judged fairly.
    """

    rtol: float
    atol: float
    rel_norm: float


# Sums of up to ~10^4 terms accumulated in fp32 stay far under 1e-4 relative error;
# half types lose ~3 decimal digits on the final rounding alone (bf16: 8 bits of mantissa).
TOLERANCES: dict[torch.dtype, Tolerance] = {
    torch.float64: Tolerance(rtol=1e-10, atol=1e-10, rel_norm=1e-12),
    torch.float32: Tolerance(rtol=1e-4, atol=1e-5, rel_norm=1e-5),
    torch.float16: Tolerance(rtol=1e-2, atol=1e-2, rel_norm=5e-3),
    torch.bfloat16: Tolerance(rtol=3e-2, atol=3e-2, rel_norm=2e-2),
}


def close_to_reference(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype | None = None) -> tuple[bool, str]:
    """Compare ``out`` with a float64 ``ref`` under the table's tolerance for ``dtype``.

    Returns ``(ok, reason)``; ``reason`` names the first failing check. NaN never passes,
    so outputs pre-filled with NaN catch every element a kernel did not write.
    """
    dtype = dtype or out.dtype
    tol = TOLERANCES[dtype]
    if out.shape != ref.shape:
        return False, f"shape {tuple(out.shape)} != reference shape {tuple(ref.shape)}"
    got = out.detach().to(device="cpu", dtype=torch.float64)
    want = ref.detach().to(device="cpu", dtype=torch.float64)
    if got.numel() == 0:
        return True, "empty"
    nonfinite = ~torch.isfinite(got)
    if nonfinite.any():
        where = tuple(int(i) for i in nonfinite.nonzero()[0])
        return False, f"{int(nonfinite.sum())} non-finite elements (first at {where})"
    scale = float(want.abs().max())
    err = (got - want).abs()
    bound = tol.atol * max(scale, 1.0) + tol.rtol * want.abs()
    bad = err > bound
    if bad.any():
        where = tuple(int(i) for i in bad.nonzero()[0])
        return False, (f"{int(bad.sum())} elements outside rtol={tol.rtol}, atol={tol.atol} "
                       f"(first at {where}: got {got[where].item():.6g}, want {want[where].item():.6g})")
    ref_norm = float(want.norm())
    if ref_norm > 0:
        rel = float((got - want).norm()) / ref_norm
        if rel > tol.rel_norm:
            return False, f"relative error {rel:.3g} > {tol.rel_norm}"
    return True, "ok"


def assert_close_to_reference(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype | None = None) -> None:
    ok, reason = close_to_reference(out, ref, dtype)
    if not ok:
        raise AssertionError(f"result differs from the float64 reference: {reason}")
