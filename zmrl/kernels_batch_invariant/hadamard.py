"""Hadamard rotation for the DSA indexer (q_I and k_I are rotated before FP8 quantisation, which
spreads outliers across the dims so one block scale fits them all).

The rotation is a plain matmul against the Sylvester matrix through the row-invariant ``linear``,
so each token's rotated vector is independent of the batch. n is small (the indexer head dim,
<= 128), so a fast Walsh-Hadamard transform would buy nothing on CPU.
"""
from __future__ import annotations

import functools

import torch

from .matmul import linear


@functools.lru_cache(maxsize=16)
def _sylvester(n: int) -> torch.Tensor:
    if n <= 0 or n & (n - 1):
        raise ValueError(f"hadamard: n must be a power of two, got {n}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], dim=1), torch.cat([h, -h], dim=1)], dim=0)
    return h


def hadamard_matrix(n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Sylvester Hadamard matrix ``[n, n]`` with entries +-1 (symmetric, ``H @ H.T == n * I``)."""
    return _sylvester(n).to(dtype)


@functools.lru_cache(maxsize=64)
def _hadamard_on(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``hadamard_matrix(n, dtype)`` on ``device``, made once per (n, dtype, device): a host->device
    copy per call would be a sync and, under CUDA-graph capture, a copy from a temporary host buffer."""
    return hadamard_matrix(n, dtype).to(device)


def hadamard_rotate(x: torch.Tensor) -> torch.Tensor:
    """``x [..., n] @ H_n * n**-0.5`` (orthonormal), computed in fp32 (fp64 for fp64), in ``x.dtype``."""
    n = x.shape[-1]
    cdt = torch.float64 if x.dtype == torch.float64 else torch.float32
    h = _hadamard_on(n, cdt, x.device)
    # H is symmetric, so x @ H == linear(x, H). The +-1 products are exact; the scale is applied
    # once to the fp32 result, the way fast_hadamard_transform(x, scale) does.
    y = linear(x, h, out_dtype=cdt) * (n ** -0.5)
    return y.to(x.dtype)
