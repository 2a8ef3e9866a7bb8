"""Triton kernels of the MLA attention backward's bf16 path (``backward_matmul_precision="bf16"``,
``mla_attention_grads._chunk_grads_bf16``): the two elementwise stages between its GEMMs, each one pass
over the chunk's [G*H, U] buffers instead of the torch composition's several.

* ``masked_softmax_bf16``: P = softmax over each row's listed keys of the fp32 scores S [G*H, U]
  (already scaled), written in bf16 (the next GEMMs' operand); unlisted keys and rows without any key
  get exact zeros. The listed keys come as a [G, U] bool mask shared by the H rows of a query.
  Torch: masked_fill, softmax, masked_fill, cast (about 30 bytes moved per element); here 10.
* ``ds_bf16``: dS / scale = P (dP - delta) in bf16, from dP [G*H, U] fp32 and P (bf16), with the row's
  delta = rowsum(P dP) (= rowsum(dO * O)) summed by the same program in a first pass over the row. Torch:
  mul, sum, sub, mul, cast (about 30 bytes per element); here 14 (the second pass mostly from cache).
* ``query_bf16``: bf16(scale * [q_lat | q_pe]) [G*H, Dc + Dr] in one pass over the (strided) query halves
  (``mla_attention.split_query``'s kernel, hi half only).

Registered on ``mla_attention_grads`` for CUDA tensors (and CPU tensors under the interpreter, the
CPU tests); their reference is the torch composition there (``_softmax_bf16_torch`` / ``_ds_bf16_torch``),
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
DS_BLOCK = 1024  # keys per step of the dS kernel's row loops


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


@triton.jit(do_not_specialize=["U"])
def _ds_kernel(dp_ptr, p_ptr, ds_ptr, U, BLOCK: tl.constexpr):
    """One program per row: delta = sum(P dP) over the row (ascending key blocks, fp32), then
    dS = P (dP - delta) rounded to bf16."""
    await_previous_kernel()
    row = tl.program_id(0).to(tl.int64)
    dp_row = dp_ptr + row * U
    p_row = p_ptr + row * U
    acc = tl.zeros([BLOCK], tl.float32)
    for u0 in range(0, U, BLOCK):
        offs = u0 + tl.arange(0, BLOCK)
        live = offs < U
        acc += tl.load(p_row + offs, mask=live, other=0.0).to(tl.float32) * tl.load(dp_row + offs, mask=live, other=0.0)
    delta = tl.sum(acc, axis=0)
    for u0 in range(0, U, BLOCK):
        offs = u0 + tl.arange(0, BLOCK)
        live = offs < U
        dp = tl.load(dp_row + offs, mask=live, other=0.0)
        p = tl.load(p_row + offs, mask=live, other=0.0).to(tl.float32)
        tl.store(ds_ptr + row * U + offs, (p * (dp - delta)).to(tl.bfloat16), mask=live)


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


def ds_bf16(dp: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """dP [R, U] fp32, P [R, U] bf16 (both contiguous) -> P (dP - rowsum(P dP)) [R, U] bf16."""
    _check("ds_bf16", dp, torch.float32)
    _check("ds_bf16", p, torch.bfloat16)
    rows, u = dp.shape
    if p.shape != dp.shape:
        raise ValueError(f"ds_bf16: P {tuple(p.shape)} does not match dP {tuple(dp.shape)}")
    ds = torch.empty(rows, u, dtype=torch.bfloat16, device=dp.device)
    if rows and u:
        _ds_kernel[(rows,)](dp, p, ds, u, BLOCK=DS_BLOCK, num_warps=4, **pdl())
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


_grads.register_bf16_kernels(_grads.Bf16Stages(masked_softmax_bf16, ds_bf16, query_bf16), _runs_here)
