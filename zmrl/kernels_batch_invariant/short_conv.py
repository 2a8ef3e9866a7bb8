"""Depthwise causal short convolution over packed varlen sequences (KDA's q/k/v ShortConv).

Each output token is ``sum_i weight[:, i] * x_{t-W+1+i}`` accumulated elementwise in the fixed
order i = 0..W-1 (fp32), so it depends on its own window only. The window reaches back into the
previous call's inputs through ``conv_state`` (the last W-1 inputs of each sequence, oldest
first), which makes "one shot" and "in pieces, carrying the state" bitwise identical.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from ._dispatch import invariant_op
from .pointwise import silu


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _window_index(cu_seqlens: torch.Tensor, total: int, w: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather indices into ``cat([x, state.flatten(0, 1)])`` (x has ``total`` rows).

    Returns (win [T, W]: the W inputs of each token's window, oldest first;
             last [N, W-1]: each sequence's last W-1 inputs, i.e. its next conv_state).
    Local position q < 0 of sequence s refers to state row (W-1)+q of s.
    """
    cu = cu_seqlens.to(torch.int64).cpu()
    n = cu.numel() - 1
    lens = cu[1:] - cu[:-1]
    dev = cu_seqlens.device
    seq_of_tok = torch.repeat_interleave(torch.arange(n), lens, output_size=total)
    local = torch.arange(total) - cu[:-1][seq_of_tok]  # position of each token in its sequence

    def resolve(seq: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        from_x = cu[:-1][seq] + q
        from_state = total + seq * (w - 1) + (w - 1) + q
        return torch.where(q >= 0, from_x, from_state)

    offs = torch.arange(w) - (w - 1)  # -(W-1) .. 0
    win = resolve(seq_of_tok[:, None], local[:, None] + offs[None, :])
    seqs = torch.arange(n)[:, None]
    last = resolve(seqs, lens[:, None] - 1 + offs[None, 1:])  # lens-(W-1) .. lens-1
    return win.to(dev), last.to(dev)


@invariant_op
def causal_short_conv(
    x: torch.Tensor,
    weight: torch.Tensor,
    cu_seqlens: torch.Tensor,
    conv_state: torch.Tensor | None = None,
    activation: str | None = "silu",
    seq_idx: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [T, C] packed tokens (rows may lie apart: a column slice of a wider tensor); weight: [C, W]
    (or [C, 1, W]); cu_seqlens: [N+1] int64; conv_state: [N, W-1, C] previous inputs, oldest first
    (None = zeros = sequence start); seq_idx: [T] the sequence of every token when the caller has it
    (``ForwardContext.seq_idx``; it must agree with cu_seqlens): spares the device backends a lookup
    of their own (one launch fewer per call); the values never depend on it.

    Returns (y [T, C] in x.dtype, new_state [N, W-1, C] in x.dtype).
    """
    if activation not in (None, "silu"):
        raise ValueError(f"causal_short_conv: unsupported activation {activation!r}")
    cdt = _compute_dtype(x.dtype)
    t, c = x.shape
    w = weight.shape[-1]
    n = cu_seqlens.numel() - 1
    if conv_state is None:
        conv_state = x.new_zeros(n, w - 1, c)
    src = torch.cat([x.to(cdt), conv_state.to(cdt).reshape(n * (w - 1), c)], dim=0)
    win, last = _window_index(cu_seqlens, t, w)
    xw = src[win]  # [T, W, C]
    wt = weight.to(cdt).reshape(c, w)  # also accepts HF's [C, 1, W]
    y = xw[:, 0] * wt[:, 0]
    for i in range(1, w):
        y = y + xw[:, i] * wt[:, i]
    if activation == "silu":
        y = silu(y)
    new_state = src[last].to(x.dtype)  # [N, W-1, C]
    return y.to(x.dtype), new_state


@invariant_op
def causal_short_conv_pooled(
    x: torch.Tensor,
    weights: Sequence[torch.Tensor],
    cu_seqlens: torch.Tensor,
    conv_pool: torch.Tensor,
    state_indices: torch.Tensor,
    activation: str | None = "silu",
    seq_idx: torch.Tensor | None = None,
) -> torch.Tensor:
    """``causal_short_conv`` as an engine's decode step runs it: the weight given as its blocks of channels
    (``weights``: [C_s, W] or [C_s, 1, W] each, e.g. KDA's q, k and v convs; at most 3), the states kept in a
    pool ``conv_pool`` [S, W-1, C] whose row ``state_indices[i]`` is sequence i's state, read and replaced in
    place. Returns y [T, C]. Bitwise::

        y, new = causal_short_conv(x, cat(weights), cu_seqlens, conv_pool[state_indices], activation, seq_idx)
        conv_pool[state_indices] = new

    which is this torch backend; the Triton backend indexes the pool and the weight blocks in its kernels
    (three launches fewer: the weight concatenation, the state gather and the scatter). No autograd (the pool
    is updated in place): the trainer calls ``causal_short_conv``."""
    check_pooled(x, weights, cu_seqlens, conv_pool, state_indices)
    weight = torch.cat([w.reshape(w.shape[0], w.shape[-1]) for w in weights])
    y, new_state = causal_short_conv(x, weight, cu_seqlens, conv_pool[state_indices], activation, seq_idx)
    conv_pool[state_indices] = new_state
    return y


def check_pooled(x: torch.Tensor, weights: Sequence[torch.Tensor], cu_seqlens: torch.Tensor, conv_pool: torch.Tensor,
                 state_indices: torch.Tensor) -> None:
    """``causal_short_conv_pooled``'s arguments fit one another (one error for every backend)."""
    if not 1 <= len(weights) <= 3:
        raise ValueError(f"causal_short_conv_pooled: 1 to 3 weight blocks, got {len(weights)}")
    c, w, n = x.shape[-1], weights[0].shape[-1], cu_seqlens.numel() - 1
    if (sum(wt.shape[0] for wt in weights) != c or any(wt.shape[-1] != w for wt in weights)
            or conv_pool.dim() != 3 or tuple(conv_pool.shape[1:]) != (w - 1, c) or tuple(state_indices.shape) != (n,)):
        raise ValueError(f"causal_short_conv_pooled: weights {[tuple(wt.shape) for wt in weights]}, pool "
                         f"{tuple(conv_pool.shape)} and state_indices {tuple(state_indices.shape)} do not fit x "
                         f"{tuple(x.shape)} and {n} sequences")


def causal_short_conv_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    cu_seqlens: torch.Tensor,
    conv_state: torch.Tensor | None = None,
    activation: str | None = "silu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 reference: one sequence at a time with torch's conv1d on the zero/state-padded input."""
    w = weight.shape[-1]
    c = x.shape[1]
    ys, states = [], []
    cu = cu_seqlens.tolist()
    for s in range(len(cu) - 1):
        prev = x.new_zeros(w - 1, c) if conv_state is None else conv_state[s]
        ext = torch.cat([prev.double(), x[cu[s] : cu[s + 1]].double()], dim=0)  # [W-1+L, C]
        wd = weight.double().reshape(c, 1, w)
        y = torch.nn.functional.conv1d(ext.t()[None], wd, groups=c)[0].t()
        if activation == "silu":
            y = torch.nn.functional.silu(y)
        ys.append(y)
        states.append(ext[ext.shape[0] - (w - 1) :])
    return torch.cat(ys, dim=0), torch.stack(states, dim=0)


# ----------------------------------------------------------------------------- fast mode (stock kernels)


def _device_window_index(cu: torch.Tensor, total: int, w: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``short_conv._window_index`` computed on the tensors' device (no host sync): rows of
    ``cat([x, state.flatten(0, 1)])`` of each token's window [T, W] and each sequence's next state [N, W-1]."""
    n = cu.numel() - 1
    dev = cu.device
    seq = torch.searchsorted(cu[1:], torch.arange(total, device=dev), right=True)
    start = cu[:-1]
    offs = torch.arange(w, device=dev) - (w - 1)

    def resolve(s: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        return torch.where(q >= 0, start[s] + q, total + s * (w - 1) + (w - 1) + q)

    local = torch.arange(total, device=dev) - start[seq]
    win = resolve(seq[:, None], local[:, None] + offs[None, :])
    seqs = torch.arange(n, device=dev)[:, None]
    last = resolve(seqs, (cu[1:] - start)[:, None] - 1 + offs[None, 1:])
    return win, last


@causal_short_conv.register("fast")
def causal_short_conv_fast(
    x: torch.Tensor,
    weight: torch.Tensor,
    cu_seqlens: torch.Tensor,
    conv_state: torch.Tensor | None = None,
    activation: str | None = "silu",
    seq_idx: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stock kernels: gather each token's window, contract it with the weights (einsum), F.silu."""
    if activation not in (None, "silu"):
        raise ValueError(f"causal_short_conv: unsupported activation {activation!r}")
    cdt = torch.float64 if x.dtype == torch.float64 else torch.float32
    t, c = x.shape
    w = weight.shape[-1]
    n = cu_seqlens.numel() - 1
    if conv_state is None:
        conv_state = x.new_zeros(n, w - 1, c)
    src = torch.cat([x.to(cdt), conv_state.to(cdt).reshape(n * (w - 1), c)], dim=0)
    win, last = _device_window_index(cu_seqlens.to(device=x.device, dtype=torch.int64), t, w)
    y = torch.einsum("twc,cw->tc", src[win], weight.to(cdt).reshape(c, w))
    if activation == "silu":
        y = F.silu(y)
    return y.to(x.dtype), src[last].to(x.dtype)
