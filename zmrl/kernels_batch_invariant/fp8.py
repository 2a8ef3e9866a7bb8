"""Block-scaled FP8 (e4m3) quantisation, as used for the FP8 latent cache and the DSA indexer keys.

Every block of ``block`` consecutive values along the last dim gets one fp32 scale
``s = max(amax, 1e-4) / 448`` and is stored as ``x / s`` cast to ``float8_e4m3fn``. All steps are
per-element IEEE operations (abs, exact amax, one division, one clamp, one round-to-nearest cast),
so a token's quantised values depend on that token alone: quantisation is batch-invariant by
construction. tests/kernels/test_fp8.py checks that torch's float8 cast also gives the same bits in
the SIMD bulk and the scalar tail of a tensor.

The trainer applies ``fake_quant_fp8`` (quantise -> dequantise, straight-through gradient) to the
same tensors the rollout engine quantises into its cache, so both sides attend over identical values.
"""
from __future__ import annotations

import torch

from ._dispatch import invariant_op

FP8_MAX = 448.0  # largest finite float8_e4m3fn value
FP8_AMAX_FLOOR = 1e-4  # keeps an all-zero block's scale finite and non-zero
FP8_DTYPE = torch.float8_e4m3fn


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    d = x.shape[-1]
    if block <= 0 or d % block != 0:
        raise ValueError(f"fp8: last dim {d} is not a multiple of the quantisation block {block}")
    return x.reshape(*x.shape[:-1], d // block, block)


@invariant_op
def quantize_fp8(x: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise ``x [..., D]`` (D % block == 0) to FP8 e4m3 with one fp32 scale per block.

    Returns ``(x8 [..., D] float8_e4m3fn, scale [..., D // block] float32)``.
    """
    xb = _blocks(x.detach().to(torch.float32), block)
    amax = xb.abs().amax(dim=-1)  # max is exact, order-free
    scale = torch.clamp_min(amax, FP8_AMAX_FLOOR) / FP8_MAX
    # x / s can exceed 448 by an fp32 rounding step at the block max; clamp so the cast never
    # meets an out-of-range value (e4m3fn has no inf: out-of-range would become NaN).
    y = (xb / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX)
    x8 = y.to(FP8_DTYPE).reshape(x.shape)
    return x8, scale


def dequantize_fp8(x8: torch.Tensor, scale: torch.Tensor, block: int = 128) -> torch.Tensor:
    """Inverse of ``quantize_fp8``: ``x8 [..., D]``, ``scale [..., D // block]`` -> fp32 ``[..., D]``.

    The product of an e4m3 value (4 significant bits) and an fp32 scale is one IEEE rounding.
    """
    xb = _blocks(x8.to(torch.float32), block)
    return (xb * scale.to(torch.float32).unsqueeze(-1)).reshape(x8.shape)


class _FakeQuantFP8(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, block: int) -> torch.Tensor:  # type: ignore[override]
        x8, scale = quantize_fp8(x, block)
        return dequantize_fp8(x8, scale, block).to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        # Straight-through: rounding is treated as the identity for the gradient.
        return grad, None


def fake_quant_fp8(x: torch.Tensor, block: int = 128) -> torch.Tensor:
    """``dequantize(quantize(x))`` in ``x.dtype`` with a straight-through (identity) gradient.

    Bitwise equal to what a reader of the quantised cache sees after dequantising (and casting to
    ``x.dtype``), so the trainer can reproduce FP8-cache rollouts.
    """
    return _FakeQuantFP8.apply(x, block)


def quantize_fp8_ref(x: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference written from the format definition, independent of torch's float8 cast.

    The scale is computed exactly as the op does (fp32; it is part of the format). ``x / s`` is
    then rounded to the nearest finite e4m3 value, ties to the code with an even mantissa, by
    searching the table of all finite e4m3 values in float64. Returns ``(x8 values as float64, scale)``;
    compare values, not bits (the sign of a zero is not specified here).
    """
    xb = _blocks(x.detach().to(torch.float32), block)
    scale = torch.clamp_min(xb.abs().amax(dim=-1), FP8_AMAX_FLOOR) / FP8_MAX
    y = (xb / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).double().reshape(-1)
    codes = torch.arange(256, dtype=torch.int64).to(torch.uint8)
    table = codes.view(FP8_DTYPE).to(torch.float64)
    finite = ~torch.isnan(table)
    table, codes = table[finite], codes[finite].to(torch.int64)
    dist = (y.unsqueeze(-1) - table.unsqueeze(0)).abs()
    best = dist.amin(dim=-1, keepdim=True)
    cand = dist == best
    # Among equidistant candidates (an exact tie) prefer the even mantissa (the code's low bit).
    # +0 and -0 are both even and equal in value, so either pick is the same number.
    even = (codes & 1) == 0
    rank = cand.to(torch.int64) * 2 + (cand & even).to(torch.int64)
    pick = rank.argmax(dim=-1)
    return table[pick].reshape(x.shape), scale


# ----------------------------------------------------------------------------- fast mode (stock kernels)


@quantize_fp8.register("fast")
def quantize_fp8_fast(x: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Same format with stock kernels (multiply by the reciprocal scale; may differ in the last code)."""
    xb = _blocks(x.detach().to(torch.float32), block)
    scale = torch.clamp_min(xb.abs().amax(dim=-1), FP8_AMAX_FLOOR) / FP8_MAX
    y = (xb * scale.reciprocal().unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX)
    return y.to(FP8_DTYPE).reshape(x.shape), scale
