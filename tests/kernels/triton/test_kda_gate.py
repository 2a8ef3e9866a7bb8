"""Triton kda_gate: float64 reference (both variants), row invariance, gradients."""
from __future__ import annotations

import pytest
import torch

from zmrl.kernels_batch_invariant.kda_gate import kda_gate, kda_gate_ref
from zmrl.kernels_batch_invariant.triton import triton_impl

from .rowwise_helpers import assert_rows_invariant, batch_sizes, randn

pytestmark = [pytest.mark.gpu, pytest.mark.triton]

# softplus/sigmoid from exp/log with an accurate log1p: a few ulp. The fp32 product a * x (rounded
# once, |a x| up to ~50) moves sigmoid's exponent by u * |a x| ~ 3e-6 relative: rtol 1e-5.
RTOL, ATOL = 1e-5, 1e-7


def _inputs(t: int, h: int, dk: int, device, seed: int, dtype=torch.float32):
    z = randn(t, h * dk, device=device, seed=seed, scale=6.0, dtype=dtype)
    a_log = randn(h, device=device, seed=seed + 1, scale=0.5)
    dt_bias = randn(h * dk, device=device, seed=seed + 2)
    return z, a_log, dt_bias


@pytest.mark.parametrize("lower_bound", [None, -5.0])
@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16])
def test_kda_gate_matches_float64(device, interpret, lower_bound, in_dtype) -> None:
    shapes = [(3, 1, 7), (5, 4, 16)] if interpret else [(3, 1, 7), (5, 4, 16), (33, 16, 128)]
    for t, h, dk in shapes:
        z, a_log, dt_bias = _inputs(t, h, dk, device, seed=t * h, dtype=in_dtype)
        z[0, 0] = -60.0  # far below 0: softplus ~ exp(z), relative accuracy needs log1p
        z[-1, -1] = 30.0  # above the softplus threshold (identity)
        g = triton_impl(kda_gate)(z, a_log, dt_bias, h, lower_bound)
        assert g.shape == (t, h, dk) and g.dtype == torch.float32
        torch.testing.assert_close(g.double(), kda_gate_ref(z, a_log, dt_bias, h, lower_bound), rtol=RTOL, atol=ATOL)
    # HF's A_log layout [1, 1, H, 1]
    z, a_log, dt_bias = _inputs(3, 4, 8, device, seed=9)
    assert torch.equal(triton_impl(kda_gate)(z, a_log.view(1, 1, 4, 1), dt_bias, 4, lower_bound),
                       triton_impl(kda_gate)(z, a_log, dt_bias, 4, lower_bound))
    with pytest.raises(ValueError, match="do not split into 5 heads"):
        triton_impl(kda_gate)(z, a_log, dt_bias, 5, lower_bound)


@pytest.mark.parametrize("lower_bound", [None, -5.0])
def test_kda_gate_rows_invariant(device, interpret, lower_bound) -> None:
    h, dk = (2, 8) if interpret else (16, 128)
    z, a_log, dt_bias = _inputs(6 if interpret else 64, h, dk, device, seed=3, dtype=torch.bfloat16)
    assert_rows_invariant(lambda a: triton_impl(kda_gate)(a, a_log, dt_bias, h, lower_bound), [z],
                          batch_sizes(interpret))


@pytest.mark.parametrize("lower_bound", [None, -5.0])
def test_kda_gate_gradient(device, interpret, lower_bound) -> None:
    z, a_log, dt_bias = _inputs(4, 2, 8, device, seed=4)
    for p in (z, a_log, dt_bias):
        p.requires_grad_(True)
    gy = randn(4, 2, 8, device=device, seed=5)
    got = torch.autograd.grad(triton_impl(kda_gate)(z, a_log, dt_bias, 2, lower_bound), (z, a_log, dt_bias), gy)
    leaves = [p.detach().double().requires_grad_(True) for p in (z, a_log, dt_bias)]
    want = torch.autograd.grad(kda_gate_ref(*leaves, 2, lower_bound), leaves, gy.double())
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-5)
