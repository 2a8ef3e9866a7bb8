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

import torch
import triton
import triton.language as tl

from .. import short_conv as _ops
from . import rowwise_grads as _rowgrads
from ._autograd import with_analytic_backward
from ._common import cdiv, next_pow2, silu

causal_short_conv = _ops.causal_short_conv

# Channel block: a function of the channel count only.
_MAX_BLOCK_C = 512


def _block_c(c: int) -> int:
    return min(next_pow2(max(c, 1)), _MAX_BLOCK_C)


@triton.jit
def _short_conv_kernel(x_ptr, w_ptr, st_ptr, seq_ptr, cu_ptr, y_ptr, C, SX,
                       W: tl.constexpr, HAS_STATE: tl.constexpr, SILU: tl.constexpr, BLOCK_C: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mc = c < C
    s = tl.load(seq_ptr + t).to(tl.int64)
    start = tl.load(cu_ptr + s).to(tl.int64)
    y = tl.zeros([BLOCK_C], dtype=tl.float32)
    for i in tl.static_range(W):
        # Position of this window slot in its sequence (< 0: the state), as a vector so that the
        # masks below are block-shaped.
        q = tl.zeros([BLOCK_C], dtype=tl.int64) + (t - (W - 1) + i - start)
        xv = tl.load(x_ptr + (start + q) * SX + c, mask=mc & (q >= 0), other=0.0).to(tl.float32)
        if HAS_STATE:
            xs = tl.load(st_ptr + (s * (W - 1) + (W - 1) + q) * C + c, mask=mc & (q < 0), other=0.0).to(tl.float32)
            xv = tl.where(q >= 0, xv, xs)
        wv = tl.load(w_ptr + c * W + i, mask=mc, other=0.0).to(tl.float32)
        y += xv * wv
    if SILU:
        y = silu(y)
    tl.store(y_ptr + t * C + c, y.to(y_ptr.dtype.element_ty), mask=mc)


@triton.jit
def _conv_state_kernel(x_ptr, st_ptr, cu_ptr, out_ptr, C, SX,
                       W: tl.constexpr, HAS_STATE: tl.constexpr, BLOCK_C: tl.constexpr):
    s = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mc = c < C
    start = tl.load(cu_ptr + s).to(tl.int64)
    n = tl.load(cu_ptr + s + 1).to(tl.int64) - start
    for j in tl.static_range(W - 1):
        q = tl.zeros([BLOCK_C], dtype=tl.int64) + (n - (W - 1) + j)
        v = tl.load(x_ptr + (start + q) * SX + c, mask=mc & (q >= 0), other=0.0).to(tl.float32)
        if HAS_STATE:
            vs = tl.load(st_ptr + (s * (W - 1) + (W - 1) + q) * C + c, mask=mc & (q < 0), other=0.0).to(tl.float32)
            v = tl.where(q >= 0, v, vs)
        tl.store(out_ptr + (s * (W - 1) + j) * C + c, v.to(out_ptr.dtype.element_ty), mask=mc)


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
    # Rows read where they lie (q|k|v inside the fused projection's output): only the columns must be adjacent.
    xc = x if x.stride(-1) == 1 or c <= 1 else x.contiguous()
    wt = weight.reshape(c, w).contiguous()  # also accepts HF's [C, 1, W]
    cu = cu_seqlens.to(device=x.device, dtype=torch.int64).contiguous()
    st = conv_state.contiguous() if conv_state is not None else xc
    y = torch.empty(t, c, dtype=x.dtype, device=x.device)
    new_state = torch.empty(n, w - 1, c, dtype=x.dtype, device=x.device)
    block = _block_c(c)
    if t and c:
        if seq_idx is not None:
            seq = seq_idx.to(device=x.device, dtype=torch.int64)
        else:  # sequence of each token: cu[s] <= t < cu[s+1]  (right=True skips empty sequences)
            seq = torch.searchsorted(cu[1:], torch.arange(t, device=x.device, dtype=torch.int64), right=True)
        _short_conv_kernel[(t, cdiv(c, block))](
            xc, wt, st, seq, cu, y, c, xc.stride(0), W=w, HAS_STATE=conv_state is not None, SILU=activation == "silu",
            BLOCK_C=block, num_warps=4)
    if n and c and w > 1:
        _conv_state_kernel[(n, cdiv(c, block))](
            xc, st, cu, new_state, c, xc.stride(0), W=w, HAS_STATE=conv_state is not None, BLOCK_C=block, num_warps=4)
    return y, new_state
