"""Triton kernels of the MLA attention backward's bf16 path (``backward_matmul_precision="bf16"``,
``mla_attention_grads._chunk_grads_bf16``): its stages over the chunk's [G*H, U] buffers, each one kernel
instead of the torch composition's several.

* ``masked_softmax_bf16``: P = softmax over each row's listed keys of the fp32 scores S [G*H, U]
  (already scaled), written in bf16 (the next GEMMs' operand); unlisted keys and rows without any key
  get exact zeros. The listed keys come as a [G, U] bool mask shared by the H rows of a query.
  Torch: masked_fill, softmax, masked_fill, cast (about 30 bytes moved per element); here 10.
* ``dp_ds_bf16``: dS / scale = P (dP - delta) in bf16 as the epilogue of dP = dO C^T's GEMM (bf16 operands,
  fp32 accumulation), delta = rowsum(dO * O) given: dP is never written. A cuBLAS dP in fp32 and then a pass
  over it move about 16 bytes per element; here 4 (P read, dS written).
* ``query_bf16``: bf16(scale * [q_lat | q_pe]) [G*H, Dc + Dr] in one pass over the (strided) query halves
  (``mla_attention.split_query``'s kernel, hi half only).

Registered on ``mla_attention_grads`` for CUDA tensors (and CPU tensors under the interpreter, the
CPU tests); their reference is the torch composition there (``_softmax_bf16_torch`` / ``_dp_ds_bf16_torch``),
which tests/kernels/triton/test_mla_attention_bwd.py compares them with. The backward need not be
batch-invariant, only correct and deterministic: each output element is computed by one program in a
fixed order (no atomics).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import mla_attention_grads as _grads
from ._common import INTERPRET, await_previous_kernel, pdl
from .mla_attention import split_query

SOFTMAX_BLOCK = 1024  # keys per step of the row loops (the rows are up to the chunk's union of keys)
# dS tiles (rows x keys) and the dP GEMM's K step: wgmma-sized bf16 tiles, 3 stages (~96 KB of shared memory)
DP_DS_BLOCK_R, DP_DS_BLOCK_U, DP_DS_BLOCK_K = 128, 128, 64


@triton.jit(do_not_specialize=["U"])
def _masked_softmax_kernel(s_ptr, keep_ptr, p_ptr, H, U, BLOCK: tl.constexpr):
    """One program per row (query g, head h): an online max / sum pass over the listed keys, then the
    normalised probabilities, ascending key blocks."""
    await_previous_kernel()
    row = tl.program_id(0).to(tl.int64)
    g = row // H
    s_row = s_ptr + row * U
    keep_row = keep_ptr + g * U
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    acc = tl.zeros([BLOCK], tl.float32)
    for u0 in range(0, U, BLOCK):
        offs = u0 + tl.arange(0, BLOCK)
        listed = (offs < U) & (tl.load(keep_row + offs, mask=offs < U, other=0) != 0)
        s = tl.load(s_row + offs, mask=listed, other=float("-inf"))
        m_new = tl.maximum(m, s)
        # lanes that saw no listed key yet keep (-inf, 0): no exp of (-inf) - (-inf)
        seen = m_new > float("-inf")
        acc = tl.where(seen, acc * tl.exp(m - tl.where(seen, m_new, 0.0)) + tl.exp(s - tl.where(seen, m_new, 0.0)),
                       0.0)
        m = m_new
    row_max = tl.max(m, axis=0)
    has = row_max > float("-inf")
    lane_w = tl.where(m > float("-inf"), tl.exp(m - tl.where(has, row_max, 0.0)), 0.0)
    total = tl.sum(acc * lane_w, axis=0)
    inv = tl.where(has, 1.0 / tl.where(has, total, 1.0), 0.0)
    for u0 in range(0, U, BLOCK):
        offs = u0 + tl.arange(0, BLOCK)
        listed = (offs < U) & (tl.load(keep_row + offs, mask=offs < U, other=0) != 0)
        s = tl.load(s_row + offs, mask=listed, other=float("-inf"))
        # (a row without keys has no listed lane)
        p = tl.where(listed, tl.exp(s - tl.where(has, row_max, 0.0)) * inv, 0.0)
        tl.store(p_ptr + row * U + offs, p.to(tl.bfloat16), mask=offs < U)


@triton.jit(do_not_specialize=["R", "U", "c_stride"])
def _dp_ds_kernel(go_ptr, c_ptr, p_ptr, delta_ptr, ds_ptr, R, U, c_stride, DC: tl.constexpr,
                  BLOCK_R: tl.constexpr, BLOCK_U: tl.constexpr, BLOCK_K: tl.constexpr, F32_DOT: tl.constexpr):
    """One program per [BLOCK_R, BLOCK_U] tile of dS: dP = dO C^T over the Dc latent columns (ascending BLOCK_K
    steps, fp32 accumulation), then dS = P (dP - delta) rounded to bf16. Row tiles vary fastest: the programs of
    a wave share their C tile, and dO (32 MB for a 512-query chunk at 64 heads) stays mostly in L2 between them."""
    await_previous_kernel()
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_U + tl.arange(0, BLOCK_U)
    rm = rows < R
    cm = cols < U
    # 32-bit offsets (the host checks R * U, R * DC and U * c_stride < 2^31): a [BLOCK_R, BLOCK_U] tensor of 64-bit
    # addresses took twice the registers
    go_rows = go_ptr + (rows * DC)[:, None]
    c_rows = c_ptr + (cols * c_stride)[:, None]
    acc = tl.zeros([BLOCK_R, BLOCK_U], tl.float32)
    for k0 in range(0, DC, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        km = kk < DC
        a = tl.load(go_rows + kk[None, :], mask=rm[:, None] & km[None, :], other=0.0)
        b = tl.load(c_rows + kk[None, :], mask=cm[:, None] & km[None, :], other=0.0)
        if F32_DOT:  # the interpreter's bf16 dot is wrong: the same products of bf16 values in fp32
            acc = tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), acc)
        else:
            acc = tl.dot(a, tl.trans(b), acc)
    delta = tl.load(delta_ptr + rows, mask=rm, other=0.0)
    offs = (rows * U)[:, None] + cols[None, :]
    m = rm[:, None] & cm[None, :]
    p = tl.load(p_ptr + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(ds_ptr + offs, (p * (acc - delta[:, None])).to(tl.bfloat16), mask=m)


def masked_softmax_bf16(s: torch.Tensor, keep: torch.Tensor, heads: int) -> torch.Tensor:
    """s [G*H, U] fp32 (contiguous), keep [G, U] bool -> P [G*H, U] bf16."""
    _check("masked_softmax_bf16", s, torch.float32)
    rows, u = s.shape
    if keep.shape != (rows // heads, u) or rows % heads:
        raise ValueError(f"masked_softmax_bf16: keep {tuple(keep.shape)} does not match s {tuple(s.shape)} "
                         f"with {heads} heads")
    p = torch.empty(rows, u, dtype=torch.bfloat16, device=s.device)
    if rows and u:
        _masked_softmax_kernel[(rows,)](s, keep.contiguous().view(torch.uint8), p, heads, u,
                                        BLOCK=SOFTMAX_BLOCK, num_warps=4, **pdl())
    return p


def dp_ds_bf16(go16: torch.Tensor, c: torch.Tensor, p: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """dO [R, Dc] bf16 (contiguous), C [U, Dc] bf16 (unit column stride, any row stride: the latent columns of the
    chunk's keys), P [R, U] bf16 (contiguous), delta [R] fp32 -> dS = P (dO C^T - delta) [R, U] bf16."""
    _check("dp_ds_bf16", go16, torch.bfloat16)
    _check("dp_ds_bf16", p, torch.bfloat16)
    rows, dc = go16.shape
    u = c.shape[0]
    if c.dtype != torch.bfloat16 or c.dim() != 2 or c.shape[1] != dc or c.stride(1) != 1:
        raise ValueError(f"dp_ds_bf16: C {tuple(c.shape)} {c.dtype} strides {c.stride()} does not match dO "
                         f"{tuple(go16.shape)} (bf16 rows of unit column stride expected)")
    if p.shape != (rows, u) or delta.shape != (rows,) or delta.dtype != torch.float32 or not delta.is_contiguous():
        raise ValueError(f"dp_ds_bf16: P {tuple(p.shape)} / delta {tuple(delta.shape)} {delta.dtype} do not match "
                         f"dO {tuple(go16.shape)} and C {tuple(c.shape)}")
    if max(rows * u, rows * dc, u * c.stride(0)) >= 2**31:
        raise ValueError(f"dp_ds_bf16: {rows} x {u} is past the kernel's 32-bit offsets (chunk the queries)")
    ds = torch.empty(rows, u, dtype=torch.bfloat16, device=p.device)
    if rows and u:
        grid = (triton.cdiv(rows, DP_DS_BLOCK_R), triton.cdiv(u, DP_DS_BLOCK_U))
        _dp_ds_kernel[grid](go16, c, p, delta, ds, rows, u, c.stride(0), DC=dc, BLOCK_R=DP_DS_BLOCK_R,
                            BLOCK_U=DP_DS_BLOCK_U, BLOCK_K=DP_DS_BLOCK_K, F32_DOT=INTERPRET, num_warps=8,
                            num_stages=3, **pdl())
    return ds


def query_bf16(q_lat: torch.Tensor, q_pe: torch.Tensor, scale: float) -> torch.Tensor:
    """bf16(scale * [q_lat | q_pe]) [G*H, Dc + Dr] for q_lat [G, H, Dc], q_pe [G, H, Dr] (any strides over G, H)."""
    hi, _ = split_query(q_lat, q_pe, scale=scale, lo=False)
    return hi.view(-1, hi.shape[-1])


def _check(name: str, t: torch.Tensor, dtype: torch.dtype) -> None:
    """The kernels address rows as ``row * U``: a 2-D contiguous tensor of the expected dtype."""
    if t.dim() != 2 or not t.is_contiguous() or t.dtype != dtype:
        raise ValueError(f"{name}: expected a contiguous 2-D {dtype} tensor, got {tuple(t.shape)} {t.dtype} "
                         f"with strides {t.stride()}")


def _runs_here(device: torch.device) -> bool:
    """CUDA tensors, and CPU tensors under the interpreter (the CPU tests of these kernels)."""
    return device.type == "cuda" or (INTERPRET and device.type == "cpu")


_grads.register_bf16_kernels(_grads.Bf16Stages(masked_softmax_bf16, dp_ds_bf16, query_bf16), _runs_here)
