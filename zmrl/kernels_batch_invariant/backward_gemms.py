"""GEMMs of the hand-written backwards: 16-bit operands with fp32 accumulation and an fp32 output.

The backward need not be batch invariant (docs/numerics.md), only the gradient of the forward's function
and deterministic run to run, so these are stock cuBLAS products. What they save is traffic: a 16-bit
gradient is multiplied as it is, never copied to fp32 first (at 16K tokens the output gradient of a fused
projection is hundreds of MB in fp32).
"""
from __future__ import annotations

import torch

_FP32_OUT_BF16_MM: dict[torch.device, bool] = {}  # per CUDA device: do this torch's mm / addmm take out_dtype?
HALF = (torch.bfloat16, torch.float16)


def fp32_out_gemms(device: torch.device) -> bool:
    """Whether 16-bit products can return fp32 here: anywhere but on a CUDA torch whose ``mm`` / ``addmm`` have no
    fp32 output for 16-bit operands. Probed once per device with a 1 x 1 product, so a failing real product
    (e.g. out of memory) is never taken for a missing feature."""
    if device.type != "cuda":
        return True
    if device not in _FP32_OUT_BF16_MM:
        one = torch.ones(1, 1, dtype=torch.bfloat16, device=device)
        try:
            out = torch.addmm(one.float(), one, one, beta=0, out_dtype=torch.float32,
                              out=torch.empty(1, 1, device=device))
            _FP32_OUT_BF16_MM[device] = (torch.mm(one, one, out_dtype=torch.float32).dtype == torch.float32
                                         and out.dtype == torch.float32)
        except (TypeError, RuntimeError, NotImplementedError):
            _FP32_OUT_BF16_MM[device] = False
    return _FP32_OUT_BF16_MM[device]


def mm_f32(a: torch.Tensor, b: torch.Tensor, scale: float = 1.0, out: torch.Tensor | None = None) -> torch.Tensor:
    """scale * (a @ b) of 16-bit operands, accumulated and returned in fp32 (written into ``out`` if given):
    cuBLAS's 16-bit GEMM with an fp32 output on CUDA (torch's ``out_dtype``; ``fp32_out_gemms`` says it exists,
    the scale in its alpha; beta = 0 ignores the unfilled ``out``), the exact fp32 GEMM of the 16-bit values
    elsewhere."""
    if a.is_cuda:
        if out is None and scale == 1.0:
            return torch.mm(a, b, out_dtype=torch.float32)
        if out is None:
            out = torch.empty(a.shape[0], b.shape[1], dtype=torch.float32, device=a.device)
        return torch.addmm(out, a, b, beta=0, alpha=scale, out_dtype=torch.float32, out=out)
    y = a.float() @ b.float()
    if scale != 1.0:
        y.mul_(scale)
    return y if out is None else out.copy_(y)


def mm_fp32_factor(a: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    """a @ f in fp32 for a 16-bit ``a`` [M, K] and an fp32 ``f`` [K, N] without an fp32 copy of ``a``: ``f`` as its
    16-bit halves hi = f.to(a.dtype), lo = f - hi, side by side in one [K, 2N] operand, so one 16-bit GEMM (fp32
    accumulation and output) reads ``a`` once for both, and the two column halves of its result are summed.
    a is exact; f is carried to ~2^-16 relative (bf16 halves; TF32 would round it to 2^-11). For skinny factors
    (LoRA: N = r) the GEMM is a read of ``a`` in 16 bits, instead of writing and reading an fp32 copy of it (or
    reading it once per half)."""
    n = f.shape[1]
    halves = torch.empty((f.shape[0], 2 * n), dtype=a.dtype, device=f.device)
    hi, lo = halves[:, :n], halves[:, n:]
    hi.copy_(f)
    torch.sub(f, hi, out=lo)  # f - hi in fp32 (hi promoted exactly inside the one kernel), rounded into lo
    both = mm_f32(a, halves)
    return torch.add(both[:, :n], both[:, n:])
