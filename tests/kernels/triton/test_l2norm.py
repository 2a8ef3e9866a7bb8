"""Triton l2_norm: float64 reference, row invariance, gradient."""
from __future__ import annotations

import pytest
import torch

from zmrl.kernels_batch_invariant.l2norm import l2_norm, l2_norm_ref
from zmrl.kernels_batch_invariant.triton import triton_impl

from .rowwise_helpers import assert_rows_invariant, batch_sizes, randn

pytestmark = [pytest.mark.gpu, pytest.mark.triton]

# sum of squares in fp32 (<= ~1e-6 relative), sqrt and one division: ~1e-6 relative; 1e-5 leaves margin.
RTOL, ATOL = 1e-5, 1e-6


@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16])
def test_l2_norm_matches_float64(device, interpret, in_dtype) -> None:
    for d in ([1, 7, 64, 129, 4100] if interpret else [1, 7, 64, 128, 129, 4100]):
        x = randn(5, d, device=device, seed=d, scale=3.0, dtype=in_dtype)
        got = triton_impl(l2_norm)(x, 1e-6, torch.float32)
        torch.testing.assert_close(got.double(), l2_norm_ref(x, 1e-6), rtol=RTOL, atol=ATOL)
    x = randn(2, 3, 4, 16, device=device, seed=0)  # [T, H, ...] leading dims
    y = triton_impl(l2_norm)(x)
    assert y.shape == x.shape and y.dtype == x.dtype
    torch.testing.assert_close(y.double(), l2_norm_ref(x), rtol=RTOL, atol=ATOL)
    assert torch.equal(triton_impl(l2_norm)(torch.zeros(2, 8, device=device)), torch.zeros(2, 8, device=device))


def test_l2_norm_rows_invariant(device, interpret) -> None:
    d = 128  # KDA head dim (bench: 16 heads x 128)
    x = randn(6 if interpret else 64, d, device=device, seed=1, dtype=torch.bfloat16)
    assert_rows_invariant(lambda a: triton_impl(l2_norm)(a), [x], batch_sizes(interpret))
    x3 = randn(6 if interpret else 64, 4, d, device=device, seed=2)  # heads folded into the rows
    assert_rows_invariant(lambda a: triton_impl(l2_norm)(a, 1e-6, torch.float32), [x3], batch_sizes(interpret))


def test_l2_norm_reads_rows_in_place(device, interpret) -> None:
    """q and k as per-head views inside the fused q|k|v projection output, and a column slice: the bits of
    the contiguous copies (the kernel reads the rows where they lie instead of copying them first)."""
    t, h, d = 5, 3, 32
    qkv = randn(t, 3 * h * d, device=device, seed=4, dtype=torch.bfloat16)
    for part in (qkv[:, : h * d].view(t, h, d), qkv[:, h * d: 2 * h * d].view(t, h, d), qkv[:, 7: 7 + d]):
        got = triton_impl(l2_norm)(part, 1e-6, torch.float32)
        assert got.is_contiguous() and got.shape == part.shape
        assert torch.equal(got, triton_impl(l2_norm)(part.contiguous(), 1e-6, torch.float32))


def test_l2_norm_gradient(device, interpret) -> None:
    x = randn(4, 3, 33, device=device, seed=3).requires_grad_(True)
    gy = randn(4, 3, 33, device=device, seed=4)
    (got,) = torch.autograd.grad(triton_impl(l2_norm)(x), x, gy)
    xd = x.detach().double().requires_grad_(True)
    (want,) = torch.autograd.grad(l2_norm_ref(xd), xd, gy.double())
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)
