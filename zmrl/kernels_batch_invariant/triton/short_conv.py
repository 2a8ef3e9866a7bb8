"""Triton depthwise causal short convolution over packed varlen sequences (KDA's q/k/v ShortConv),
with the decode state in and out (the fast-mode backend is in ``short_conv.py``).

One program per (token, channel block): the token's sequence comes from the caller's ``seq_idx`` or, without
it, from ``cu_seqlens`` (a device-side ``searchsorted``, no host sync), and its output is ``sum_i w[:, i] * x_{t-W+1+i}`` accumulated in fp32 in
the fixed order i = 0..W-1, where window positions before the sequence start read the sequence's
``conv_state`` row (or zero without a state). So a token's output depends on its own window only, and
"one shot" and "in pieces, carrying the state" agree bitwise. A second kernel gathers each sequence's
last W-1 inputs (the next state), one program per (sequence, channel block).
Backward: the closed form as one Triton pass (``rowwise_grads.py``, ``with_analytic_backward``).
"""
from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

from .. import short_conv as _ops
from . import rowwise_grads as _rowgrads
from ._autograd import with_analytic_backward
from ._common import await_previous_kernel, cdiv, next_pow2, pdl, silu

causal_short_conv = _ops.causal_short_conv
causal_short_conv_pooled = _ops.causal_short_conv_pooled

# Channel block: a function of the channel count only.
_MAX_BLOCK_C = 512


def _block_c(c: int) -> int:
    return min(next_pow2(max(c, 1)), _MAX_BLOCK_C)


@triton.jit
def _conv_weight(w_ptr, w1_ptr, w2_ptr, c, mc, i, C0, C01, W: tl.constexpr, W_BLOCKS: tl.constexpr):
    """Tap i of channels c: from one [C, W] weight, or from up to three blocks of channels (C0 and C0 + C1
    channels before the second and third)."""
    if W_BLOCKS == 1:
        return tl.load(w_ptr + c * W + i, mask=mc, other=0.0).to(tl.float32)
    wv = tl.load(w_ptr + c * W + i, mask=mc & (c < C0), other=0.0).to(tl.float32)
    wv = tl.where(c < C0, wv, tl.load(w1_ptr + (c - C0) * W + i, mask=mc & (c >= C0) & (c < C01), other=0.0).to(tl.float32))
    if W_BLOCKS == 3:
        wv = tl.where(c < C01, wv, tl.load(w2_ptr + (c - C01) * W + i, mask=mc & (c >= C01), other=0.0).to(tl.float32))
    return wv


@triton.jit
def _short_conv_kernel(x_ptr, w_ptr, w1_ptr, w2_ptr, st_ptr, idx_ptr, seq_ptr, cu_ptr, y_ptr, C, SX, C0, C01,
                       W: tl.constexpr, HAS_STATE: tl.constexpr, HAS_IDX: tl.constexpr, W_BLOCKS: tl.constexpr,
                       SILU: tl.constexpr, BLOCK_C: tl.constexpr):
    """HAS_IDX: sequence s's state is row idx[s] of the state tensor (a pool) instead of row s."""
    await_previous_kernel()
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mc = c < C
    s = tl.load(seq_ptr + t).to(tl.int64)
    start = tl.load(cu_ptr + s).to(tl.int64)
    if HAS_IDX:
        s_row = tl.load(idx_ptr + s).to(tl.int64)
    else:
        s_row = s
    y = tl.zeros([BLOCK_C], dtype=tl.float32)
    for i in tl.static_range(W):
        # Position of this window slot in its sequence (< 0: the state), as a vector so that the
        # masks below are block-shaped.
        q = tl.zeros([BLOCK_C], dtype=tl.int64) + (t - (W - 1) + i - start)
        xv = tl.load(x_ptr + (start + q) * SX + c, mask=mc & (q >= 0), other=0.0).to(tl.float32)
        if HAS_STATE:
            xs = tl.load(st_ptr + (s_row * (W - 1) + (W - 1) + q) * C + c, mask=mc & (q < 0), other=0.0).to(tl.float32)
            xv = tl.where(q >= 0, xv, xs)
        wv = _conv_weight(w_ptr, w1_ptr, w2_ptr, c, mc, i, C0, C01, W, W_BLOCKS)
        y += xv * wv
    if SILU:
        y = silu(y)
    tl.store(y_ptr + t * C + c, y.to(y_ptr.dtype.element_ty), mask=mc)


@triton.jit
def _conv_state_kernel(x_ptr, st_ptr, idx_ptr, cu_ptr, out_ptr, C, SX,
                       W: tl.constexpr, HAS_STATE: tl.constexpr, HAS_IDX: tl.constexpr, BLOCK_C: tl.constexpr):
    """HAS_IDX: the old and new states are both row idx[s] of one pool (st_ptr == out_ptr), replaced in place:
    new row j reads old row j + n (n >= 1 new tokens; n = 0 rewrites each row with itself) before row j + n is
    written, so the ascending j loop never reads a row it has already replaced."""
    await_previous_kernel()
    s = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mc = c < C
    start = tl.load(cu_ptr + s).to(tl.int64)
    n = tl.load(cu_ptr + s + 1).to(tl.int64) - start
    if HAS_IDX:
        s_row = tl.load(idx_ptr + s).to(tl.int64)
    else:
        s_row = s
    for j in tl.static_range(W - 1):
        q = tl.zeros([BLOCK_C], dtype=tl.int64) + (n - (W - 1) + j)
        v = tl.load(x_ptr + (start + q) * SX + c, mask=mc & (q >= 0), other=0.0).to(tl.float32)
        if HAS_STATE:
            vs = tl.load(st_ptr + (s_row * (W - 1) + (W - 1) + q) * C + c, mask=mc & (q < 0), other=0.0).to(tl.float32)
            v = tl.where(q >= 0, v, vs)
        tl.store(out_ptr + (s_row * (W - 1) + j) * C + c, v.to(out_ptr.dtype.element_ty), mask=mc)


def _launch(x: torch.Tensor, weights: list[torch.Tensor], cu_seqlens: torch.Tensor, state: torch.Tensor | None,
            state_idx: torch.Tensor | None, new_state: torch.Tensor, activation: str | None,
            seq_idx: torch.Tensor | None) -> torch.Tensor:
    """y of the conv and the new states into ``new_state`` (at rows ``state_idx`` when given: a pool)."""
    t, c = x.shape
    w = weights[0].shape[-1]
    n = cu_seqlens.numel() - 1
    # Rows read where they lie (q|k|v inside the fused projection's output): only the columns must be adjacent.
    xc = x if x.stride(-1) == 1 or c <= 1 else x.contiguous()
    ws = [wt.reshape(wt.shape[0], w).contiguous() for wt in weights]  # also accepts HF's [C, 1, W]
    c0 = ws[0].shape[0]
    c01 = c0 + (ws[1].shape[0] if len(ws) > 1 else 0)
    cu = cu_seqlens.to(device=x.device, dtype=torch.int64).contiguous()
    st = state.contiguous() if state is not None else xc
    idx = state_idx.to(device=x.device, dtype=torch.int64).contiguous() if state_idx is not None else cu
    y = torch.empty(t, c, dtype=x.dtype, device=x.device)
    block = _block_c(c)
    if t and c:
        if seq_idx is not None:
            seq = seq_idx.to(device=x.device, dtype=torch.int64)
        else:  # sequence of each token: cu[s] <= t < cu[s+1]  (right=True skips empty sequences)
            seq = torch.searchsorted(cu[1:], torch.arange(t, device=x.device, dtype=torch.int64), right=True)
        _short_conv_kernel[(t, cdiv(c, block))](
            xc, ws[0], ws[min(1, len(ws) - 1)], ws[-1], st, idx, seq, cu, y, c, xc.stride(0), c0, c01, W=w,
            HAS_STATE=state is not None, HAS_IDX=state_idx is not None, W_BLOCKS=len(ws), SILU=activation == "silu",
            BLOCK_C=block, num_warps=4, **pdl())
    if n and c and w > 1:
        _conv_state_kernel[(n, cdiv(c, block))](
            xc, st, idx, cu, new_state, c, xc.stride(0), W=w, HAS_STATE=state is not None,
            HAS_IDX=state_idx is not None, BLOCK_C=block, num_warps=4, **pdl())
    return y


@causal_short_conv.register("triton")
@with_analytic_backward(causal_short_conv.impls["torch"], _rowgrads.causal_short_conv_grads)
def causal_short_conv_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    cu_seqlens: torch.Tensor,
    conv_state: torch.Tensor | None = None,
    activation: str | None = "silu",
    seq_idx: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    if activation not in (None, "silu"):
        raise ValueError(f"causal_short_conv: unsupported activation {activation!r}")
    if x.dtype == torch.float64:  # gradchecks only: the torch backend computes in fp64
        return causal_short_conv.impls["torch"](x, weight, cu_seqlens, conv_state, activation, seq_idx)
    t, c = x.shape
    w = weight.shape[-1]
    n = cu_seqlens.numel() - 1
    if w < 1:
        raise ValueError(f"causal_short_conv: window {w} must be >= 1")
    if conv_state is not None and tuple(conv_state.shape) != (n, w - 1, c):
        raise ValueError(f"causal_short_conv: conv_state {tuple(conv_state.shape)} must be {(n, w - 1, c)}")
    new_state = torch.empty(n, w - 1, c, dtype=x.dtype, device=x.device)
    y = _launch(x, [weight], cu_seqlens, conv_state, None, new_state, activation, seq_idx)
    return y, new_state


@causal_short_conv_pooled.register("triton")
def causal_short_conv_pooled_triton(
    x: torch.Tensor,
    weights: Sequence[torch.Tensor],
    cu_seqlens: torch.Tensor,
    conv_pool: torch.Tensor,
    state_indices: torch.Tensor,
    activation: str | None = "silu",
    seq_idx: torch.Tensor | None = None,
) -> torch.Tensor:
    if activation not in (None, "silu"):
        raise ValueError(f"causal_short_conv_pooled: unsupported activation {activation!r}")
    _ops.check_pooled(x, weights, cu_seqlens, conv_pool, state_indices)
    if x.dtype == torch.float64 or not conv_pool.is_contiguous():  # the kernels address the pool as contiguous
        return causal_short_conv_pooled.impls["torch"](x, weights, cu_seqlens, conv_pool, state_indices, activation,
                                                      seq_idx)
    return _launch(x, list(weights), cu_seqlens, conv_pool, state_indices, conv_pool, activation, seq_idx)
