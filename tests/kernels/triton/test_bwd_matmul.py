"""``bwd_matmul.mm_f32`` (bf16 operands, fp32 output, an optional second product in the same accumulator)
against the float64 product of the same bf16 values. Runs on CUDA, or on CPU under TRITON_INTERPRET=1.

Tolerance: the products of bf16 values are exact in fp32, so the only error is the fp32 accumulation of K
(+ K2) terms in some order, at most (K + K2) * 2^-24 * sum |a||b| per element (the standard bound for a
recursive sum), plus one rounding of the scale multiply (2^-24 relative)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from zmrl.kernels_batch_invariant.triton.bwd_matmul import MmConfig, mm_f32  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.triton]


def _bf16(*shape, seed, device):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(device, torch.bfloat16)


def _check(got, a, b, scale=1.0, second=None):
    want = a.double() @ b.double()
    mag = a.double().abs() @ b.double().abs()
    k = a.shape[1]
    if second is not None:
        a2, b2 = second
        n2 = b2.shape[1]
        want[:, :n2] += a2.double() @ b2.double()
        mag[:, :n2] += a2.double().abs() @ b2.double().abs()
        k += a2.shape[1]
    want, mag = want * scale, mag * abs(scale)
    assert got.dtype == torch.float32 and got.shape == want.shape
    bound = (k + 1) * 2.0 ** -24 * mag
    assert bool(((got.double() - want).abs() <= bound).all()), float((got.double() - want).abs().max())


@pytest.mark.parametrize("m,n,k", [(1, 1, 1), (37, 53, 29), (70, 18, 100)])
def test_matches_float64(device, m, n, k):
    a, b = _bf16(m, k, seed=1, device=device), _bf16(k, n, seed=2, device=device)
    _check(mm_f32(a, b), a, b)


def test_transposed_operands_scale_and_out_slice(device):
    """The operands are read through their strides (transposed views: the MLA backward's dS^T and K^T), the
    scale multiplies the sum, and ``out`` may be a column slice of a wider tensor (its other columns untouched)."""
    at = _bf16(45, 33, seed=3, device=device)  # a = at^T [33, 45]
    bt = _bf16(21, 45, seed=4, device=device)  # b = bt^T [45, 21]
    wide = torch.full((33, 30), 7.0, device=device)
    got = mm_f32(at.t(), bt.t(), scale=0.37, out=wide[:, 4:25])
    assert got.data_ptr() == wide[:, 4:25].data_ptr()
    _check(wide[:, 4:25], at.t(), bt.t(), scale=0.37)
    assert bool((wide[:, :4] == 7).all()) and bool((wide[:, 25:] == 7).all())


@pytest.mark.parametrize("n2", [1, 17, 40])
def test_second_product_on_the_first_columns(device, n2):
    """dK_latent + dV: the second product sums into the first N2 columns only (N2 <= N)."""
    a, b = _bf16(26, 19, seed=5, device=device), _bf16(19, 40, seed=6, device=device)
    a2, b2 = _bf16(26, 23, seed=7, device=device), _bf16(23, n2, seed=8, device=device)
    got = mm_f32(a.t().contiguous().t(), b, second=(a2, b2))
    _check(got, a, b, second=(a2, b2))


def test_deterministic_and_config_independent_shape(device, interpret):
    """Run to run the same bits; a forced config computes the same product (within the accumulation bound)."""
    a, b = _bf16(50, 70, seed=9, device=device), _bf16(70, 34, seed=10, device=device)
    first, again = mm_f32(a, b), mm_f32(a, b)
    assert torch.equal(first, again)
    other = mm_f32(a, b, config=MmConfig(32, 32, 32, 4, 1) if interpret else MmConfig(64, 32, 32, 4, 2))
    _check(other, a, b)


def test_bad_operands_are_named(device):
    a = _bf16(4, 5, seed=11, device=device)
    with pytest.raises(ValueError, match="inner dims"):
        mm_f32(a, _bf16(6, 3, seed=12, device=device))
    with pytest.raises(ValueError, match="b must be bf16"):
        mm_f32(a, torch.zeros(5, 3, device=device))
    with pytest.raises(ValueError, match="second product"):
        mm_f32(a, _bf16(5, 3, seed=13, device=device), second=(a, _bf16(5, 4, seed=14, device=device)))
    with pytest.raises(ValueError, match="out must be fp32"):
        mm_f32(a, _bf16(5, 3, seed=15, device=device), out=torch.zeros(4, 3, dtype=torch.bfloat16, device=device))
