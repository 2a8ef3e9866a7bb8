"""Triton ``sigmoid_op`` and ``add_cast``: float64 reference, row invariance, the torch composition's bits where
the arithmetic is the same (add_cast), gradients."""
from __future__ import annotations

import pytest
import torch

from zmrl.kernels_batch_invariant.pointwise import add_cast, sigmoid_op
from zmrl.kernels_batch_invariant.triton import triton_impl

from .rowwise_helpers import assert_rows_invariant, batch_sizes, randn

pytestmark = [pytest.mark.gpu, pytest.mark.triton]


def test_sigmoid_matches_float64(device, interpret) -> None:
    # exp in fp32 (a few ulp), one add and one division: ~1e-6 relative; saturates to exactly 0 / 1 far out.
    x = randn(7, 33, device=device, seed=1, scale=8.0)
    got = triton_impl(sigmoid_op)(x)
    assert got.dtype == torch.float32 and got.shape == x.shape
    torch.testing.assert_close(got.double(), torch.sigmoid(x.double()), rtol=1e-6, atol=1e-7)
    far = torch.tensor([-200.0, 200.0], device=device)
    assert torch.equal(triton_impl(sigmoid_op)(far), torch.tensor([0.0, 1.0], device=device))


def test_sigmoid_rows_invariant(device, interpret) -> None:
    x = randn(8 if interpret else 300, 16, device=device, seed=2, scale=4.0)
    assert_rows_invariant(lambda a: triton_impl(sigmoid_op)(a), [x], batch_sizes(interpret))


def test_add_cast_is_the_torch_composition(device, interpret) -> None:
    """fp32 + widened bf16, one round-to-nearest-even to bf16: the same IEEE steps as the torch ops."""
    a = randn(9, 70, device=device, seed=3, scale=3.0)
    b = randn(9, 70, device=device, seed=4, dtype=torch.bfloat16)
    got = triton_impl(add_cast)(a, b, torch.bfloat16)
    assert got.dtype == torch.bfloat16
    want = (a + b.float()).to(torch.bfloat16)
    if interpret:  # the interpreter converts fp32 -> bf16 by truncation (the GPU rounds to nearest even): 1 ulp
        torch.testing.assert_close(got.float(), want.float(), rtol=2.0**-7, atol=0.0)
    else:
        assert torch.equal(got, want)
    assert_rows_invariant(lambda p, q: triton_impl(add_cast)(p, q, torch.bfloat16), [a, b], batch_sizes(interpret))
    with pytest.raises(ValueError, match="add_cast: a"):
        triton_impl(add_cast)(a, b[:, :5], torch.bfloat16)


def test_gradients(device, interpret) -> None:
    x = randn(4, 5, device=device, seed=5).requires_grad_(True)
    triton_impl(sigmoid_op)(x).sum().backward()
    s = torch.sigmoid(x.detach().double())
    torch.testing.assert_close(x.grad.double(), s * (1 - s), rtol=1e-6, atol=1e-7)
    a = randn(3, 4, device=device, seed=6).requires_grad_(True)
    b = randn(3, 4, device=device, seed=7, dtype=torch.bfloat16).requires_grad_(True)
    g = randn(3, 4, device=device, seed=8)
    triton_impl(add_cast)(a, b, torch.float32).backward(g)
    assert torch.equal(a.grad, g) and torch.equal(b.grad, g.to(torch.bfloat16))
