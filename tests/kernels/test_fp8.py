"""FP8 e4m3 block quantisation: format, error bound, batch/position invariance, straight-through grad."""
from __future__ import annotations

import pytest
import torch

from zmrl.kernels_batch_invariant.fp8 import (
    FP8_MAX,
    dequantize_fp8,
    fake_quant_fp8,
    quantize_fp8,
    quantize_fp8_ref,
)

U32 = 2.0 ** -24  # fp32 unit roundoff


def _bits(x8: torch.Tensor) -> torch.Tensor:
    return x8.view(torch.uint8)


def _sample(shape, seed: int) -> torch.Tensor:
    """Values spanning many binades inside each block (so subnormal e4m3 codes occur too)."""
    g = torch.Generator().manual_seed(seed)
    mag = torch.exp(torch.empty(shape).uniform_(-12.0, 6.0, generator=g))
    return mag * torch.randn(shape, generator=g).sign()


@pytest.mark.parametrize("block", [32, 128])
def test_scale_formula_and_shapes(block):
    x = _sample((5, 3, 256), seed=1)
    x8, s = quantize_fp8(x, block)
    assert x8.dtype == torch.float8_e4m3fn and x8.shape == x.shape
    assert s.dtype == torch.float32 and s.shape == (5, 3, 256 // block)
    # amax is exact and fp32 division is correctly rounded, so the fp32 scale must be exactly the
    # float64 formula rounded once to fp32.
    amax = x.reshape(5, 3, -1, block).abs().amax(-1).double()
    floor = float(torch.tensor(1e-4, dtype=torch.float32))
    expected = (amax.clamp_min(floor) / FP8_MAX).float()
    assert torch.equal(s, expected)
    # The block max maps onto the largest code.
    y = x8.float().reshape(5, 3, -1, block).abs().amax(-1)
    assert torch.equal(y, torch.full_like(y, FP8_MAX))


def test_amax_floor():
    x = torch.zeros(2, 128)
    x[1, :5] = torch.tensor([1e-6, -3e-6, 2e-7, 0.0, 5e-5])
    x8, s = quantize_fp8(x, 128)
    floor_scale = torch.tensor(1e-4, dtype=torch.float32) / FP8_MAX
    assert torch.equal(s[:, 0], floor_scale.expand(2))
    assert torch.equal(x8[0].float(), torch.zeros(128))  # all-zero block stays finite and zero
    assert torch.isfinite(dequantize_fp8(x8, s, 128)).all()
    # 5e-5 is half the floor: it maps to 224 (exactly representable), not to 448.
    assert x8[1, 4].float().item() == 224.0


@pytest.mark.parametrize("block", [32, 128])
def test_cast_matches_format_reference(block):
    """torch's float8 cast must be round-to-nearest-even onto the e4m3 grid (independent table search)."""
    x = _sample((12, 256), seed=2)
    x8, s = quantize_fp8(x, block)
    ref8, ref_s = quantize_fp8_ref(x, block)
    assert torch.equal(s, ref_s)
    assert torch.equal(x8.double(), ref8)


def test_round_to_nearest_even_ties():
    # Exactly representable midpoints in scaled units (s chosen so that amax -> 448 exactly).
    vals = torch.tensor([448.0, 1.0625, 1.1875, 17.0, 19.0, 2.0 ** -10, 3 * 2.0 ** -10])
    x = torch.zeros(1, 32)
    x[0, : len(vals)] = vals
    x8, s = quantize_fp8(x, 32)
    assert s.item() == 1.0
    got = x8.float()[0, : len(vals)]
    # ties go to the even mantissa: 1.0625 -> 1.0, 1.1875 -> 1.25, 17 -> 16, 19 -> 20,
    # 2^-10 (half the subnormal step 2^-9) -> 0, 3*2^-10 -> 2^-8.
    want = torch.tensor([448.0, 1.0, 1.25, 16.0, 20.0, 0.0, 2.0 ** -8])
    assert torch.equal(got, want)


@pytest.mark.parametrize("block", [32, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_error_bound(block, dtype):
    """|x - deq(q(x))| <= 2^-4 |x| + 2^-10 s, up to fp32 rounding.

    Why: y = x/s lies in [-448, 448]. e4m3 has 3 stored mantissa bits, so in the normal range
    (|y| >= 2^-6) neighbouring codes are 2^-3 |y| apart at most and round-to-nearest errs by at most
    half of that, 2^-4 |y|; in the subnormal range codes are 2^-9 apart, so the error is at most
    2^-10. Multiplying back by s gives the bound; the division x/s and the product q*s each add one
    fp32 rounding (relative 2^-24), covered by the (1 + 2^-20) slack. A wrong scale, a truncating
    cast or a mis-indexed block scale errs by far more (up to 100% of |x|).
    """
    x = _sample((7, 512), seed=3).to(dtype)
    x8, s = quantize_fp8(x, block)
    deq = dequantize_fp8(x8, s, block)
    assert deq.dtype == torch.float32
    xf = x.float().double().reshape(7, -1, block)
    err = (deq.double().reshape(7, -1, block) - xf).abs()
    bound = (2.0 ** -4 * xf.abs() + 2.0 ** -10 * s.double().unsqueeze(-1)) * (1 + 2.0 ** -20)
    assert (err <= bound).all()
    # Block-level corollary: error <= 2^-4 of the block amax.
    assert (err.amax(-1) <= 2.0 ** -4 * xf.abs().amax(-1) * (1 + 2.0 ** -20) + 2.0 ** -10 * s.double()).all()
    # The bound is not vacuous: the worst relative error in the normal range is close to it.
    normal = xf.abs() >= 2.0 ** -6 * s.double().unsqueeze(-1)
    assert (err[normal] / xf.abs()[normal]).max() > 2.0 ** -5


def test_float8_cast_position_invariant():
    """The cast must give the same bits in the SIMD bulk and the scalar tail of a tensor."""
    g = torch.Generator().manual_seed(4)
    y = (torch.randn(4099, generator=g) * 150).clamp(-FP8_MAX, FP8_MAX)
    y[::7] *= 2.0 ** -8  # subnormal codes too
    full = _bits(y.to(torch.float8_e4m3fn))
    singles = torch.stack([_bits(y[i:i + 1].to(torch.float8_e4m3fn))[0] for i in range(300)])
    assert torch.equal(singles, full[:300])
    for off in range(1, 70):
        assert torch.equal(_bits(y[off:].to(torch.float8_e4m3fn)), full[off:])
        assert torch.equal(_bits(y[: 4099 - off].to(torch.float8_e4m3fn)), full[: 4099 - off])


@pytest.mark.parametrize("block", [32, 128])
def test_quantize_batch_invariant(block):
    x = _sample((37, 256), seed=5)
    x8, s = quantize_fp8(x, block)
    for i in [0, 1, 17, 36]:
        a8, a_s = quantize_fp8(x[i:i + 1], block)
        assert torch.equal(_bits(a8[0]), _bits(x8[i])) and torch.equal(a_s[0], s[i])
    perm = torch.randperm(37, generator=torch.Generator().manual_seed(0))
    p8, p_s = quantize_fp8(x[perm], block)
    assert torch.equal(_bits(p8), _bits(x8[perm])) and torch.equal(p_s, s[perm])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fake_quant_forward_and_straight_through_grad(dtype):
    x = _sample((4, 3, 128), seed=6).to(dtype).requires_grad_(True)
    y = fake_quant_fp8(x, 64)
    assert y.dtype == dtype
    x8, s = quantize_fp8(x.detach(), 64)
    assert torch.equal(y.detach(), dequantize_fp8(x8, s, 64).to(dtype))
    g = torch.randn(4, 3, 128).to(dtype)
    y.backward(g)
    assert torch.equal(x.grad, g)


def test_block_must_divide():
    with pytest.raises(ValueError):
        quantize_fp8(torch.zeros(2, 100), 128)
