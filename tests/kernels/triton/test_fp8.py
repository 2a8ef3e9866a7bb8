"""Triton quantize_fp8: exact against the format-definition reference and the torch op, row
invariance, fake_quant_fp8 through the same quantiser."""
from __future__ import annotations

import pytest
import torch

from zmrl.kernels_batch_invariant.fp8 import dequantize_fp8, fake_quant_fp8, quantize_fp8, quantize_fp8_ref
from zmrl.kernels_batch_invariant.triton import triton_impl

from .rowwise_helpers import assert_rows_invariant, batch_sizes, randn

pytestmark = [pytest.mark.gpu, pytest.mark.triton]


def _x(shape: tuple[int, ...], device, seed: int, dtype=torch.float32) -> torch.Tensor:
    # magnitudes from 1e-8 to 1e3 along the last dim: subnormal codes, normal codes, the clamp at 448
    x = randn(*shape, device=device, seed=seed) * torch.logspace(-8, 3, shape[-1], device=device)
    x[..., :64] = 0.0  # an all-zero block (the 1e-4 amax floor) when block <= 64
    return x.to(dtype)


@pytest.mark.parametrize("block", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_exact(device, interpret, block, dtype) -> None:
    # exact: amax is exact, the two divisions are correctly rounded, the e4m3 rounding is RNE
    shapes = [(5, 256), (2, 3, 512)] if interpret else [(5, 256), (2, 3, 512), (33, 576 - 64), (257, 512)]
    for shape in shapes:
        x = _x(shape, device, seed=shape[0], dtype=dtype)
        x8, scale = triton_impl(quantize_fp8)(x, block)
        assert x8.dtype == torch.float8_e4m3fn and x8.shape == x.shape
        assert scale.dtype == torch.float32 and scale.shape == (*shape[:-1], shape[-1] // block)
        # the torch op on the CPU (true IEEE divisions there) gives the same bits
        t8, tscale = quantize_fp8.impls["torch"](x.cpu(), block)
        assert torch.equal(scale.cpu(), tscale)
        assert torch.equal(x8.cpu().view(torch.uint8), t8.view(torch.uint8))
        v, rscale = quantize_fp8_ref(x.cpu(), block)
        assert torch.equal(x8.cpu().double(), v)
    with pytest.raises(ValueError, match="not a multiple of the quantisation block 128"):
        triton_impl(quantize_fp8)(torch.zeros(2, 200, device=device), 128)


def test_quantize_rows_invariant(device, interpret) -> None:
    x = _x((6 if interpret else 64, 512), device, seed=1, dtype=torch.bfloat16)  # kv_lora 512
    assert_rows_invariant(lambda a: triton_impl(quantize_fp8)(a, 128), [x], batch_sizes(interpret))


def test_fake_quant_uses_the_quantiser(device, interpret) -> None:
    x = _x((4, 256), device, seed=2).requires_grad_(True)
    x8, scale = triton_impl(quantize_fp8)(x, 128)
    y = fake_quant_fp8(x, 128)  # dispatches quantize_fp8: Triton on CUDA, torch on the CPU
    assert torch.equal(y.detach(), dequantize_fp8(x8, scale, 128).to(x.dtype))
    (g,) = torch.autograd.grad(y, x, torch.ones_like(y))
    assert torch.equal(g, torch.ones_like(x))  # straight-through
