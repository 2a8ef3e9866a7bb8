"""A backward GEMM: bf16 operands, fp32 accumulation and fp32 output, with an optional second product
summed into the same accumulator.

    out[M, N] = scale * (a[M, K] @ b[K, N]  +  a2[M, K2] @ b2[K2, N2])      (N2 <= N: the second product
                                                                           adds to the first N2 columns)

Operands may have any strides (a transposed view is read where it lies, no copy). One program owns one
[BLOCK_M, BLOCK_N] output tile and walks K in ascending BLOCK_K steps, then K2 the same way, into one fp32
accumulator; the scale multiplies once before the single store. No atomics and no split K, and the launch
configuration (``mm_config``) is a function of the product's shape alone, so the same call gives the same
bits every run (what the trainer's backward needs: it is not required to be batch-invariant).

Why it exists: torch's ``mm(out_dtype=float32)`` of bf16 operands, the product the MLA backward's bf16 path
needs (the scores and dP feed a softmax and a cancellation that must see fp32), ran on cuBLAS's sm75 CUTLASS
kernels on the H200 (~390 TFLOP/s at the bench shapes; benchmarks/mla_bwd_gemms.py measures both on the
real chunk shapes). The second product lets the MLA key gradient and value gradient (both [U, Dc] sums
over the chunk's rows) share one pass: dK_latent + dV = dS^T q + P^T dO.

Speed needs every size and row stride a multiple of 16 elements (the MLA backward pads its key count to
``PAD``): the compiler then vectorises the masked loads and stores.

Under the Triton interpreter the dot is an explicit fp32 product and sum (``matmul.dot_acc``): the
interpreter's bf16 dot is wrong.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._common import INTERPRET, cdiv
from .matmul import dot_acc


@dataclass(frozen=True)
class MmConfig:
    """Tile shape and launch parameters of ``mm_f32`` (a function of M, N, K only)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    group_m: int = 8

    def __str__(self) -> str:
        return f"{self.block_m}x{self.block_n}x{self.block_k}/w{self.num_warps}/s{self.num_stages}"

    @classmethod
    def parse(cls, text: str) -> "MmConfig":
        """``"128x128x64/w8/s3"`` -> MmConfig (benchmark command lines)."""
        tile, w, s = text.split("/")
        bm, bn, bk = (int(v) for v in tile.split("x"))
        return cls(bm, bn, bk, int(w.lstrip("w")), int(s.lstrip("s")))


# Wide outputs (the [G*H, U] scores and dP of the MLA backward: K = 512-576) take large tiles; narrow
# outputs with a long K (dQ [G*H, 576] over U keys, dK [U, 576] over G*H rows) take 64-column tiles: 576 is
# nine of them (128-column tiles would leave the fifth half empty).
WIDE = MmConfig(128, 256, 64, 8, 3)
NARROW = MmConfig(128, 64, 64, 4, 4)
INTERPRET_CONFIG = MmConfig(16, 16, 16, 4, 1)
# The multiple callers round varying sizes up to (see the module doc).
PAD = 16


def mm_config(m: int, n: int, k: int) -> MmConfig:
    """The launch configuration of an [m, k] @ [k, n] product (shape only: deterministic run to run)."""
    del m, k
    if INTERPRET:
        return INTERPRET_CONFIG
    return WIDE if n >= 1024 else NARROW


# M, N, K stay specialised (Triton compiles a variant per "divisible by 16"): a mask along an operand's or the
# output's contiguous dimension vectorises only when its bound is known to be a multiple of the vector width.
# Without it (do_not_specialize) every load and store went scalar: 3-10x slower than cuBLAS on the H200
# (benchmarks/results/2026-12-02_mla_bwd_gemms_6c4c92b_h200.json). Callers pad varying sizes to 16.
@triton.jit
def _mm_f32_kernel(
    a_ptr, b_ptr, a2_ptr, b2_ptr, o_ptr, M, N, K, N2, K2,
    s_am, s_ak, s_bk, s_bn, s_a2m, s_a2k, s_b2k, s_b2n, s_om, s_on, scale,
    HAS_SECOND: tl.constexpr, SCALED: tl.constexpr, INTERPRET: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    # Programs in groups of GROUP_M row tiles that sweep the column tiles together: a group's a rows and
    # b columns stay in L2 while it runs.
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    rows = offs_m.to(tl.int64)
    cols = offs_n.to(tl.int64)

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    a_ptrs = a_ptr + rows[:, None] * s_am + offs_k[None, :].to(tl.int64) * s_ak
    b_ptrs = b_ptr + offs_k[:, None].to(tl.int64) * s_bk + cols[None, :] * s_bn
    for k0 in range(0, K, BLOCK_K):
        k_mask = offs_k < K - k0
        a = tl.load(a_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc = dot_acc(acc, a, b, True, "ieee", INTERPRET)
        a_ptrs += BLOCK_K * s_ak
        b_ptrs += BLOCK_K * s_bk
    if HAS_SECOND:
        if pid_n * BLOCK_N < N2:  # column tiles past N2 get no second product
            n2_mask = offs_n < N2
            a2_ptrs = a2_ptr + rows[:, None] * s_a2m + offs_k[None, :].to(tl.int64) * s_a2k
            b2_ptrs = b2_ptr + offs_k[:, None].to(tl.int64) * s_b2k + cols[None, :] * s_b2n
            for k0 in range(0, K2, BLOCK_K):
                k_mask = offs_k < K2 - k0
                a = tl.load(a2_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
                b = tl.load(b2_ptrs, mask=k_mask[:, None] & n2_mask[None, :], other=0.0)
                acc = dot_acc(acc, a, b, True, "ieee", INTERPRET)
                a2_ptrs += BLOCK_K * s_a2k
                b2_ptrs += BLOCK_K * s_b2k
    if SCALED:
        acc = acc * scale
    tl.store(o_ptr + rows[:, None] * s_om + cols[None, :] * s_on, acc, mask=m_mask[:, None] & n_mask[None, :])


def mm_f32(a: torch.Tensor, b: torch.Tensor, scale: float = 1.0,
           second: tuple[torch.Tensor, torch.Tensor] | None = None, out: torch.Tensor | None = None,
           config: MmConfig | None = None) -> torch.Tensor:
    """``scale * (a @ b + a2 @ b2)`` in fp32 for bf16 a [M, K], b [K, N] and the optional ``second = (a2, b2)``,
    a2 [M, K2], b2 [K2, N2] with N2 <= N (added to the first N2 columns). Any operand strides. ``out``: an fp32
    [M, N] tensor (any strides, e.g. a column slice) to write into, else a new contiguous one. ``config``
    overrides ``mm_config`` (benchmarks)."""
    m, k = a.shape
    k_b, n = b.shape
    if k_b != k:
        raise ValueError(f"mm_f32: a {tuple(a.shape)} @ b {tuple(b.shape)}: inner dims differ")
    operands = [("a", a), ("b", b)]
    if second is not None:
        a2, b2 = second
        if a2.shape[0] != m or b2.shape[0] != a2.shape[1] or b2.shape[1] > n:
            raise ValueError(f"mm_f32: second product a2 {tuple(a2.shape)} @ b2 {tuple(b2.shape)} does not fit "
                             f"the [{m}, {n}] output")
        operands += [("a2", a2), ("b2", b2)]
    for name, t in operands:
        if t.dtype != torch.bfloat16:
            raise ValueError(f"mm_f32: {name} must be bf16, got {t.dtype}")
    if out is None:
        out = torch.empty(m, n, dtype=torch.float32, device=a.device)
    elif out.shape != (m, n) or out.dtype != torch.float32:
        raise ValueError(f"mm_f32: out must be fp32 [{m}, {n}], got {out.dtype} {tuple(out.shape)}")
    if m == 0 or n == 0:
        return out
    a2, b2 = second if second is not None else (a, b)
    n2, k2 = (b2.shape[1], a2.shape[1]) if second is not None else (0, 0)
    cfg = config or mm_config(m, n, k)
    grid = (cdiv(m, cfg.block_m) * cdiv(n, cfg.block_n),)
    _mm_f32_kernel[grid](
        a, b, a2, b2, out, m, n, k, n2, k2,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), a2.stride(0), a2.stride(1), b2.stride(0), b2.stride(1),
        out.stride(0), out.stride(1), float(scale),
        HAS_SECOND=second is not None, SCALED=scale != 1.0, INTERPRET=INTERPRET,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out
