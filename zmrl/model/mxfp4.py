"""MXFP4 weights as the released Kimi K3 stores its routed experts (compressed-tensors
``mxfp4-pack-quantized``): ``weight_packed`` uint8 [out, in/2] holds two FP4 (E2M1) codes per byte, the
even column in the low nibble; ``weight_scale`` uint8 [out, in/32] holds one E8M0 power-of-two scale
per 32 consecutive columns (value = 2**(byte - 127)).

Dequantisation is exact: every E2M1 value times a power of two is representable in fp32 and bf16
(one mantissa bit) unless it overflows, which a finite scale byte below 255 keeps it from doing in fp32.
Quantisation (for writing the format back) picks per block the smallest power of two ``2**e`` with
``amax <= 6 * 2**e`` (no value saturates; mlx's MXFP4 quantiser makes the same choice) and rounds each
value to the nearest E2M1 code; ``quantize_mxfp4``
with ``exact=True`` refuses weights it cannot represent, so a checkpoint read from MXFP4 writes back the
same values.
"""
from __future__ import annotations

import torch

BLOCK = 32  # columns per E8M0 scale
SCALE_BIAS = 127
# E2M1 code -> value; bit 3 is the sign
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


class MXFP4Error(ValueError):
    """Packed weights with the wrong dtype or shape, or values MXFP4 cannot hold exactly."""


def check_mxfp4_shapes(packed: torch.Tensor, scale: torch.Tensor, name: str = "weight") -> tuple[int, int]:
    """(out, in) of the dense weight the pair encodes; raises MXFP4Error naming ``name`` otherwise."""
    if packed.dtype != torch.uint8 or scale.dtype != torch.uint8:
        raise MXFP4Error(f"{name}: weight_packed and weight_scale must be uint8, got {packed.dtype} and {scale.dtype}")
    if packed.dim() != 2 or scale.dim() != 2 or packed.shape[0] != scale.shape[0]:
        raise MXFP4Error(f"{name}: weight_packed {tuple(packed.shape)} and weight_scale {tuple(scale.shape)} "
                         "must be [out, in/2] and [out, in/32]")
    out, cols = packed.shape[0], packed.shape[1] * 2
    if cols != scale.shape[1] * BLOCK:
        raise MXFP4Error(f"{name}: weight_packed {tuple(packed.shape)} holds {cols} columns but weight_scale "
                         f"{tuple(scale.shape)} covers {scale.shape[1] * BLOCK}")
    return out, cols


def dequantize_mxfp4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32,
                     name: str = "weight") -> torch.Tensor:
    """The dense [out, in] weight, exactly (computed in fp32, then cast: exact for fp32 and bf16)."""
    out, cols = check_mxfp4_shapes(packed, scale, name)
    if bool((scale == 255).any()):
        raise MXFP4Error(f"{name}: weight_scale holds 255 (E8M0 NaN)")
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    codes = torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(out, cols).long()
    exps = scale.to(torch.int32) - SCALE_BIAS  # [-127, 127]
    factors = torch.ldexp(torch.ones(exps.shape), exps.float())  # exact powers of two
    values = table[codes].view(out, cols // BLOCK, BLOCK) * factors[..., None]
    return values.view(out, cols).to(dtype)


def quantize_mxfp4(weight: torch.Tensor, exact: bool = True, name: str = "weight") -> tuple[torch.Tensor, torch.Tensor]:
    """(weight_packed, weight_scale) of a dense [out, in] weight (in a multiple of 32).

    ``exact``: raise MXFP4Error when some value is not representable (instead of rounding it)."""
    if weight.dim() != 2 or weight.shape[1] % BLOCK:
        raise MXFP4Error(f"{name}: MXFP4 needs a 2-D weight whose columns are a multiple of {BLOCK}, "
                         f"got {tuple(weight.shape)}")
    w = weight.detach().to(torch.float32).cpu()
    out, cols = w.shape
    blocks = w.view(out, cols // BLOCK, BLOCK)
    amax = blocks.abs().amax(dim=-1)
    # the smallest e with amax <= 6 * 2**e (log2 estimate, then corrected exactly); all-zero blocks get 2**0
    pos = torch.where(amax > 0, amax, 6.0).double()
    e = torch.ceil(torch.log2(pos / 6.0))
    e = e + (pos > 6.0 * torch.exp2(e)).double() - (pos <= 6.0 * torch.exp2(e - 1)).double()
    e = e.clamp(-SCALE_BIAS, SCALE_BIAS).float()
    scaled = blocks / torch.ldexp(torch.ones_like(e), e)[..., None]
    table = torch.tensor(E2M1_VALUES[:8], dtype=torch.float32)
    mag = scaled.abs().clamp(max=6.0)
    idx = (mag[..., None] - table).abs().argmin(dim=-1)  # nearest magnitude (ties: the smaller code)
    if exact and not torch.equal(table[idx], scaled.abs()):
        bad = int((table[idx] != scaled.abs()).sum())
        raise MXFP4Error(f"{name}: {bad} value(s) are not representable in MXFP4; save the routed experts "
                         "unquantised instead")
    codes = (idx | ((scaled < 0) | ((scaled == 0) & torch.signbit(scaled))).long() << 3).view(out, cols).to(torch.uint8)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed.contiguous(), (e + SCALE_BIAS).to(torch.uint8).contiguous()
