"""Fingerprints: a stable hash of a sparsity pattern, and the key a specialization is cached by.

The pattern hash is computed where the indices are: with integer torch ops on a GPU, with
numpy on the host (the same arithmetic, on the calling thread). The runtime's
:func:`fingerprint` hashes a small CUDA pattern (at most
:data:`~torch_sparserl.pattern.HOST_KEPT_MAX` index elements) on the host, from the copy that
the specializer's search reads too (:meth:`~torch_sparserl.pattern.Pattern.host_indices`).
It runs in the background thread while a training loop runs: the hash's few dozen small GPU
kernels (the first time in a process most of all) and a side-stream copy of the indices
delay the loop's epochs, while numpy's host arithmetic does not measurably. A copy grows with
the pattern, so larger patterns are hashed on the GPU, where only two 64-bit sums cross to
the host. The hash is cached on the pattern's entry, keyed by tensor identity and version
counter, so repeated calls on the same adjacency pay a dictionary lookup.

Every element ``a[i]`` of ``crow`` and ``col`` is mixed with its position by the splitmix64
finalizer, and the mixes are summed modulo 2^64 (two lanes with different seeds): the sum
does not depend on reduction order, so CPU and GPU give the same value. The shape and the
index dtype are folded in on the host.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass

import numpy as np
import torch

from . import cache
from .cache import Pattern

_MASK64 = (1 << 64) - 1
_CHUNK = 1 << 24  # elements per step: bounds the int64 temporaries on huge patterns
_SEEDS = (0x243F6A8885A308D3, 0x13198A2E03707344)  # two independent lanes (digits of pi)
_GOLDEN = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB


def _signed(value: int) -> int:
    """The int64 that has the bits of the uint64 ``value`` (torch integers are signed)."""
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    # torch's >> is arithmetic on int64; masking the sign-extended bits makes it logical.
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer on int64 (wrapping arithmetic)."""
    x = x ^ _shift_right(x, 30)
    x = x * _signed(_MIX1)
    x = x ^ _shift_right(x, 27)
    x = x * _signed(_MIX2)
    return x ^ _shift_right(x, 31)


def _lane_sums(values: torch.Tensor, salt: int) -> list[int]:
    sums = []
    for seed in _SEEDS:
        total = torch.zeros((), dtype=torch.int64, device=values.device)
        for start in range(0, values.numel(), _CHUNK):
            part = values[start:start + _CHUNK].to(torch.int64)
            position = torch.arange(start, start + part.numel(), dtype=torch.int64, device=values.device)
            key = part * _signed(_GOLDEN) + position * _signed(seed ^ salt) + _signed(seed)
            total = total + _mix(key).sum()
        sums.append(total)
    return sums


def _host_lane_sums(values: torch.Tensor, salt: int) -> list[int]:
    """:func:`_lane_sums` of host indices, in numpy's wrapping uint64 arithmetic (the same
    bits), on the calling thread. torch's CPU ops spread each step over every core, beside the
    training or compiling loop this runs next to, and are slower than numpy on a host of few
    cores."""
    array = values.numpy()
    sums = [0] * len(_SEEDS)
    with np.errstate(over="ignore"):
        for start in range(0, array.size, _CHUNK):
            part = array[start:start + _CHUNK].astype(np.int64).view(np.uint64)
            position = np.arange(start, start + part.size, dtype=np.uint64)
            for lane, seed in enumerate(_SEEDS):
                x = part * np.uint64(_GOLDEN) + position * np.uint64((seed ^ salt) & _MASK64) + np.uint64(seed)
                x ^= x >> np.uint64(30)
                x *= np.uint64(_MIX1)
                x ^= x >> np.uint64(27)
                x *= np.uint64(_MIX2)
                x ^= x >> np.uint64(31)
                sums[lane] = (sums[lane] + int(x.sum(dtype=np.uint64))) & _MASK64
    return sums


def pattern_hash(crow: torch.Tensor, col: torch.Tensor, ncols: int) -> str:
    """A 128-bit hex hash of ``(crow, col, shape, index dtype)``; equal on every device."""
    if crow.device.type == "cpu" and col.device.type == "cpu":
        lanes = _host_lane_sums(crow, 1) + _host_lane_sums(col, 2)
    else:
        lanes = torch.stack(_lane_sums(crow, 1) + _lane_sums(col, 2)).cpu().tolist()  # one host sync
    h = hashlib.sha256()
    h.update(f"csr:{crow.numel() - 1}x{int(ncols)}:nnz={col.numel()}:{crow.dtype}:{col.dtype}".encode())
    for lane in lanes:
        h.update((int(lane) & _MASK64).to_bytes(8, "little"))
    return h.hexdigest()[:32]


def fingerprint(pattern: Pattern, crow: torch.Tensor, col: torch.Tensor) -> str:
    """The pattern hash, computed once per :class:`Pattern` entry (identity and version)."""
    if pattern.fingerprint is None:
        if crow.is_cuda and crow.numel() + col.numel() <= cache.HOST_KEPT_MAX:
            crow, col = pattern.host_indices(crow, col)
        pattern.fingerprint = pattern_hash(crow, col, pattern.ncols)
    return pattern.fingerprint


@dataclass(frozen=True)
class SpecializationKey:
    """Everything a specialized kernel depends on; the cache key says what it depends on."""

    pattern: str   # pattern_hash
    op: str        # spmm, spmv, spmm_transposed, ...
    n: int         # dense columns (1 for vectors)
    dtype: str     # f32, f16, bf16
    arch: str      # sm_90
    policy: str    # hash of the policy checkpoint, or "autotune"
    torch_version: str = torch.__version__
    cuda_version: str = str(torch.version.cuda)

    def digest(self) -> str:
        h = hashlib.sha256()
        for name, value in sorted(asdict(self).items()):
            h.update(f"{name}={value}\0".encode())
        return h.hexdigest()[:32]
