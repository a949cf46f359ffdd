"""The tolerance check every comparison uses: verdicts, the first failing element, chunking."""

from __future__ import annotations

import pytest
import torch

from torch_sparserl import dtypes
from torch_sparserl.dtypes import TOLERANCES, close_to_reference, max_abs_difference


def _reference(device, shape=(37, 11), seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator, dtype=torch.float64).to(device)


@pytest.fixture(params=[None, 5], ids=["whole", "chunks-of-5"])
def chunk(request, monkeypatch):
    """Run each check unchunked and with chunks that do not divide the tensor."""
    if request.param is not None:
        monkeypatch.setattr(dtypes, "_CHECK_CHUNK", request.param)
    return request.param


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_a_rounded_result_passes(device, chunk, dtype):
    ref = _reference(device)
    assert close_to_reference(ref.to(dtype), ref, dtype) == (True, "ok")


def test_the_first_non_finite_element_is_named(device, chunk):
    ref = _reference(device)
    out = ref.float()
    out[30, 7], out[12, 4] = float("inf"), float("nan")
    ok, why = close_to_reference(out, ref)
    assert not ok and why == "2 non-finite elements (first at (12, 4))"


def test_the_first_element_outside_the_tolerance_is_named(device, chunk):
    ref = _reference(device)
    out = ref.float()
    out[20, 3] += 0.5
    out[36, 10] -= 0.5
    ok, why = close_to_reference(out, ref)
    assert not ok and why.startswith("2 elements outside rtol=0.0001, atol=1e-05 (first at (20, 3): got ")


def test_a_small_error_everywhere_fails_the_norm_bound(device, chunk):
    ref = _reference(device)
    tol = TOLERANCES[torch.float32]
    # inside each element's bound, but the whole tensor is off by more than rel_norm
    out = (ref * (1 + 0.9 * tol.rtol)).float()
    ok, why = close_to_reference(out, ref)
    assert not ok and why.startswith("relative error ")


def test_shapes_and_empty_tensors(device):
    ref = _reference(device)
    assert close_to_reference(ref.float()[:-1], ref) == (False, "shape (36, 11) != reference shape (37, 11)")
    assert close_to_reference(ref.float()[:0], ref[:0]) == (True, "empty")
    assert close_to_reference(torch.tensor(2.0, device=device), torch.tensor(1.0, dtype=torch.float64))[1] \
        .endswith("(first at (): got 2, want 1)")


def test_max_abs_difference(device, chunk):
    ref = _reference(device)
    out = ref.float()
    out[17, 2] += 3.0
    assert max_abs_difference(out, ref) == pytest.approx(3.0, rel=1e-6)
    out[5, 5] = float("nan")
    assert max_abs_difference(out, ref) != max_abs_difference(out, ref)  # NaN propagates
