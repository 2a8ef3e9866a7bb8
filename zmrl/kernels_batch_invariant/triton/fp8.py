"""Triton block-scaled FP8 (e4m3fn) quantisation (the fast-mode backend is in
``fp8.py``).

One program per (row, quantisation block): ``amax`` (exact), ``s = max(amax, 1e-4) / 448`` and
``x / s`` are correctly rounded divisions (``div_rn``), the quotient is clamped to [-448, 448] and
rounded to e4m3fn with round-to-nearest-even. The rounding is done here with integer arithmetic on
the fp32 bits and the codes are stored as uint8 into the float8 tensor's storage, which makes the
kernel exact under Triton's interpreter too (its float8 cast is not) and independent of the PTX
conversion instruction. Every step is per element or an exact max, so a token's quantised values
depend on that token alone; the result is bitwise the torch op's (true IEEE divisions and RNE there too).
NaN inputs are not supported (the torch op yields NaN codes; here the clamp maps them into range).

``fake_quant_fp8`` (in ``zmrl/kernels_batch_invariant/fp8.py``) calls the ``quantize_fp8`` op, so on
CUDA its forward already uses this kernel; its straight-through backward needs nothing from here.
``dequantize_fp8`` is one elementwise product (not an op).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import fp8 as _ops
from ._common import await_previous_kernel, next_pow2, pdl

quantize_fp8 = _ops.quantize_fp8


@triton.jit
def _e4m3_code(y):
    """e4m3fn code (int32 in [0, 255]) of fp32 ``y`` with |y| <= 448, round to nearest even."""
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 31) & 1
    a = bits & 0x7FFFFFFF
    # Normal range (|y| >= 2^-6): keep 3 of the 23 mantissa bits, RNE; a carry moves into the exponent.
    r = a + 0x7FFFF + ((a >> 20) & 1)
    normal = (r >> 20) - (120 << 3)  # rebias the exponent 127 -> 7
    # Subnormals (|y| < 2^-6): the code is round(|y| / 2^-9) (8 = 2^-6, the smallest normal, also fits);
    # adding and subtracting 2^23 rounds to an integer with RNE (|y| * 512 < 8, exact scaling).
    v = tl.abs(y) * 512.0
    sub = ((v + 8388608.0) - 8388608.0).to(tl.int32)
    code = tl.where(tl.abs(y) >= 0.015625, normal, sub)
    return code | (sign << 7)


@triton.jit
def _quantize_fp8_kernel(x_ptr, q_ptr, s_ptr, D, QBLOCK: tl.constexpr, BLOCK_P2: tl.constexpr):
    await_previous_kernel()
    row = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1)
    nb = D // QBLOCK
    offs = tl.arange(0, BLOCK_P2)
    m = offs < QBLOCK
    base = row * D + b * QBLOCK
    x = tl.load(x_ptr + base + offs, mask=m, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=0)
    s = tl.math.div_rn(tl.maximum(amax, 1e-4), 448.0)
    y = tl.math.div_rn(x, s)
    # x / s can exceed 448 by one rounding step at the block max: clamp before rounding.
    y = tl.minimum(tl.maximum(y, -448.0), 448.0)
    tl.store(q_ptr + base + offs, _e4m3_code(y).to(tl.uint8), mask=m)
    tl.store(s_ptr + row * nb + b, s)


@quantize_fp8.register("triton")
def quantize_fp8_triton(x: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    d = x.shape[-1]
    if block <= 0 or d % block != 0:  # the torch op's check and message
        raise ValueError(f"fp8: last dim {d} is not a multiple of the quantisation block {block}")
    x2 = x.detach().reshape(-1, d).contiguous()
    r = x2.shape[0]
    nb = d // block
    x8 = torch.empty(x.shape, dtype=_ops.FP8_DTYPE, device=x.device)
    scale = torch.empty(*x.shape[:-1], nb, dtype=torch.float32, device=x.device)
    if r and nb:
        _quantize_fp8_kernel[(r, nb)](x2, x8.view(torch.uint8), scale, d, QBLOCK=block,
                                      BLOCK_P2=next_pow2(block), num_warps=4 if block <= 512 else 8, **pdl())
    return x8, scale
