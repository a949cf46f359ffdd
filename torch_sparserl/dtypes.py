"""Supported dtypes, accumulation rules and the one tolerance table.

Every comparison against a reference — tests, the evaluator, the demo — takes its
tolerance from :data:`TOLERANCES`; no tolerance is written inline anywhere else.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
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


# A float32 product through one TF32 multiply per term (plan math=tf32): operands keep 10 bits of
# mantissa, as float16's do, so its results are judged like float16's.
TF32_TOLERANCE = Tolerance(rtol=1e-2, atol=1e-2, rel_norm=5e-3)


def tolerance(dtype: torch.dtype, math_mode: str = "ieee") -> Tolerance:
    """The table's tolerance for ``dtype``; :data:`TF32_TOLERANCE` for float32 under ``math=tf32``."""
    if math_mode == "tf32" and dtype == torch.float32:
        return TF32_TOLERANCE
    return TOLERANCES[dtype]


_CHECK_CHUNK = 1 << 24  # elements compared at once: float64 temporaries of 128 MiB each


def close_to_reference(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype | None = None,
                       math_mode: str = "ieee") -> tuple[bool, str]:
    """Compare ``out`` with a float64 ``ref`` under the table's tolerance for ``dtype``
    (:func:`tolerance`: ``math_mode="tf32"`` for a float32 kernel that multiplies in TF32).

    Returns ``(ok, reason)``; ``reason`` names the first failing check. NaN never passes,
    so outputs pre-filled with NaN catch every element a kernel did not write.

    The comparison runs on ``out``'s device (``ref`` is moved there), in chunks of
    ``_CHECK_CHUNK`` elements, and reads back only scalars: a GPU output of a large graph
    (4 M rows × 128) is checked in milliseconds instead of the tens of seconds a float64 copy
    on the host takes, which would be most of a key's JIT time.
    """
    dtype = dtype or out.dtype
    tol = tolerance(dtype, math_mode)
    if out.shape != ref.shape:
        return False, f"shape {tuple(out.shape)} != reference shape {tuple(ref.shape)}"
    if out.numel() == 0:
        return True, "empty"
    got = out.detach().reshape(-1)
    want = ref.detach().to(device=got.device).reshape(-1)
    spans = [(s, min(s + _CHECK_CHUNK, got.numel())) for s in range(0, got.numel(), _CHECK_CHUNK)]

    def first(mask_of) -> tuple[int, ...]:
        """The multi-index of the first element a chunk's mask marks (failures only)."""
        for s, e in spans:
            hits = mask_of(s, e).nonzero()
            if hits.numel():
                flat = s + int(hits[0])
                return tuple(int(i) for i in np.unravel_index(flat, tuple(out.shape)))
        raise AssertionError("close_to_reference: a counted element was not found again")

    nonfinite = sum((~torch.isfinite(got[s:e])).sum() for s, e in spans)
    if int(nonfinite):
        where = first(lambda s, e: ~torch.isfinite(got[s:e]))
        return False, f"{int(nonfinite)} non-finite elements (first at {where})"
    scale = max(float(want[s:e].abs().max()) for s, e in spans)
    atol = tol.atol * max(scale, 1.0)

    def compare(s: int, e: int):
        w = want[s:e].to(torch.float64)
        diff = got[s:e].to(torch.float64) - w
        return diff, w, diff.abs() > atol + tol.rtol * w.abs()

    bad = torch.zeros((), dtype=torch.int64, device=got.device)
    err_sq = torch.zeros((), dtype=torch.float64, device=got.device)
    ref_sq = torch.zeros_like(err_sq)
    for s, e in spans:
        diff, w, outside = compare(s, e)
        bad += outside.sum()
        err_sq += diff.square().sum()
        ref_sq += w.square().sum()
    if int(bad):
        where = first(lambda s, e: compare(s, e)[2])
        return False, (f"{int(bad)} elements outside rtol={tol.rtol}, atol={tol.atol} "
                       f"(first at {where}: got {out[where].item():.6g}, want {ref[where].item():.6g})")
    ref_norm = math.sqrt(float(ref_sq))
    if ref_norm > 0:
        rel = math.sqrt(float(err_sq)) / ref_norm
        if rel > tol.rel_norm:
            return False, f"relative error {rel:.3g} > {tol.rel_norm}"
    return True, "ok"


def max_abs_difference(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``max |out − ref|`` in float64 on ``out``'s device, in chunks (NaN when ``out`` has one)."""
    got = out.detach().reshape(-1)
    want = ref.detach().to(device=got.device).reshape(-1)
    if got.numel() == 0:
        return 0.0
    chunks = ((got[s:s + _CHECK_CHUNK].to(torch.float64) - want[s:s + _CHECK_CHUNK].to(torch.float64)).abs().max()
              for s in range(0, got.numel(), _CHECK_CHUNK))
    return float(torch.stack(list(chunks)).max())


def assert_close_to_reference(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype | None = None) -> None:
    ok, reason = close_to_reference(out, ref, dtype)
    if not ok:
        raise AssertionError(f"result differs from the float64 reference: {reason}")
