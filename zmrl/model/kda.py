"""Kimi Delta Attention layer (linear attention with a per-channel gated delta rule)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from zmrl.kernels_batch_invariant.kda import CHUNK_SIZE, kda_chunk, kda_decode_step
from zmrl.kernels_batch_invariant.kda_gate import kda_gate
from zmrl.kernels_batch_invariant.l2norm import l2_norm
from zmrl.kernels_batch_invariant.norms import rms_norm_gated
from zmrl.kernels_batch_invariant.pointwise import sigmoid_op
from zmrl.kernels_batch_invariant.short_conv import causal_short_conv, causal_short_conv_pooled

from .config import ModelConfig
from .context import ForwardContext, KDASeqState
from .layers import Linear, RMSNorm, Weight, joined_columns, project


@dataclass(frozen=True)
class _Projected:
    """The fused projections of a KDA layer's input (``KimiDeltaAttention._project``)."""

    qkv: torch.Tensor  # [T, 3*H*dk]: q|k|v before the short conv
    f_a: torch.Tensor  # [T, dk]: the decay's low-rank input
    gate_in: torch.Tensor  # [T, dk] (low-rank gate input) or [T, H*dk] (full-rank gate)


class KimiDeltaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, dtype: torch.dtype | None = None):
        super().__init__()
        la = cfg.linear_attn_config
        self.layer_idx = layer_idx
        self.num_heads, self.head_dim = la.num_heads, la.head_dim
        self.conv_size = la.short_conv_kernel_size
        self.lower_bound = cfg.gate_lower_bound
        d, hd, k = cfg.hidden_size, la.num_heads * la.head_dim, la.head_dim
        self.q_proj, self.k_proj, self.v_proj = (Linear(d, hd, dtype=dtype) for _ in range(3))
        self.q_conv1d, self.k_conv1d, self.v_conv1d = (Weight(hd, 1, self.conv_size, dtype=dtype) for _ in range(3))
        self.f_a_proj = Linear(d, k, dtype=dtype)
        self.f_b_proj = Linear(k, hd, dtype=dtype)
        # Decay parameters stay fp32 whatever the model dtype (as in FLA): they sit inside exp().
        self.A_log = nn.Parameter(torch.empty(la.num_heads, dtype=torch.float32))
        self.dt_bias = nn.Parameter(torch.empty(hd, dtype=torch.float32))
        self.b_proj = Linear(d, la.num_heads, dtype=dtype)
        if cfg.use_full_rank_gate:
            self.g_proj = Linear(d, hd, dtype=dtype)
        else:
            self.g_a_proj = Linear(d, k, dtype=dtype)
            self.g_b_proj = Linear(k, hd, dtype=dtype)
        self.o_norm = RMSNorm(k, eps=cfg.rms_norm_eps, dtype=dtype)
        self.o_proj = Linear(hd, d, dtype=dtype)

    # ------------------------------------------------------------------ init
    @torch.no_grad()
    def reset_parameters(self, gen: torch.Generator) -> None:
        """Conv, decay and dt init (the projections are drawn by the model)."""
        bound = 1.0 / math.sqrt(self.conv_size)  # Conv1d's default fan-in bound
        for conv in (self.q_conv1d, self.k_conv1d, self.v_conv1d):
            conv.weight.copy_((torch.rand(conv.weight.shape, generator=gen) * 2 - 1) * bound)
        if self.lower_bound is None:
            self.A_log.copy_(torch.log(torch.rand(self.A_log.shape, generator=gen) * 15 + 1))  # log U(1, 16)
        else:
            self.A_log.zero_()
        dt = torch.exp(torch.rand(self.dt_bias.shape, generator=gen) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus

    # ------------------------------------------------------------------ forward
    def _project(self, x: torch.Tensor) -> "_Projected":
        """Every model-dtype projection of the layer input in one fused GEMM (``project``): q|k|v side
        by side [T, 3*H*dk] (the conv's input), the decay's low-rank input and the output gate's input
        (its low-rank input, or the full-rank gate itself). beta's fp32 logits stay a separate product."""
        gate = self.g_proj if hasattr(self, "g_proj") else self.g_a_proj
        q, k, v, f_a, gate_in = project(x, [self.q_proj, self.k_proj, self.v_proj, self.f_a_proj, gate])
        return _Projected(qkv=joined_columns([q, k, v]), f_a=f_a, gate_in=gate_in)

    def _conv_weight(self) -> torch.Tensor:
        """The depthwise conv weights of q|k|v side by side [3*H*dk, W]."""
        return torch.cat([c.weight for c in (self.q_conv1d, self.k_conv1d, self.v_conv1d)]).squeeze(1)

    def _features(self, qkv: torch.Tensor, x: torch.Tensor, p: "_Projected"):
        """(q, k, v, g, beta) of the delta rule from the conv outputs and the layer input."""
        T, H, K = x.shape[0], self.num_heads, self.head_dim
        q, k, v = qkv.split(H * K, dim=-1)
        q = l2_norm(q.view(T, H, K), out_dtype=torch.float32)
        k = l2_norm(k.view(T, H, K), out_dtype=torch.float32)
        g = kda_gate(self.f_b_proj(p.f_a), self.A_log, self.dt_bias, H, self.lower_bound)
        beta = sigmoid_op(self.b_proj(x, out_dtype=torch.float32))
        return q, k, v.view(T, H, K), g, beta

    def _output(self, o: torch.Tensor, x: torch.Tensor, p: "_Projected") -> torch.Tensor:
        T, H, K = x.shape[0], self.num_heads, self.head_dim
        gate = p.gate_in if hasattr(self, "g_proj") else self.g_b_proj(p.gate_in)
        o = rms_norm_gated(o, gate.view(T, H, K), self.o_norm.weight, self.o_norm.eps, out_dtype=x.dtype)
        return self.o_proj(o.reshape(T, H * K))

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        if ctx.kda_pool is not None:
            return self._forward_static(x, ctx)
        n = ctx.num_seqs
        states = [self._state(ctx, i) for i in range(n)]

        # Short conv over q|k|v at once (depthwise: channels are independent).
        p = self._project(x)
        qkv_in, conv_w = p.qkv, self._conv_weight()
        conv_in = None
        if any(s.conv is not None for s in states):
            conv_in = torch.stack([s.conv if s.conv is not None else qkv_in.new_zeros(self.conv_size - 1, qkv_in.shape[-1])
                                   for s in states])
        qkv, conv_out = causal_short_conv(qkv_in, conv_w, ctx.cu_seqlens, conv_in, activation="silu",
                                          seq_idx=ctx.seq_idx)
        q, k, v, g, beta = self._features(qkv, x, p)

        o = self._chunked(q, k, v, g, beta, ctx, states)

        if ctx.kda_states is not None:
            for i, s in enumerate(states):
                if s.snapshots:
                    self._snapshot_conv(s, i, qkv_in, conv_in, ctx)
                s.conv = conv_out[i].detach()
        return self._output(o, x, p)

    def _forward_static(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Decode with fixed shapes and no host reads (what a CUDA graph captures): one new token per
        sequence, its KDA state in ``ctx.kda_pool`` at rows ``ctx.kda_slots``, read and written in place.

        ``kda_decode_step`` gives the new token bitwise the row the chunked formula (``forward``'s re-run
        of the current chunk, the trainer's packed pass) gives it, the state advancing when the chunk is full.
        """
        pool = ctx.kda_pool.layer(self.layer_idx)
        slots = ctx.kda_slots
        p = self._project(x)
        # the conv states read and replaced in the pool, the q, k, v conv weights read where they are
        qkv = causal_short_conv_pooled(p.qkv, [c.weight for c in (self.q_conv1d, self.k_conv1d, self.v_conv1d)],
                                       ctx.cu_seqlens, pool.conv, slots, activation="silu", seq_idx=ctx.seq_idx)
        q, k, v, g, beta = self._features(qkv, x, p)
        o = kda_decode_step(q, k, v, g, beta, ctx.positions, slots, pool.chunk)
        return self._output(o, x, p)

    def _snapshot_conv(self, s: KDASeqState, i: int, qkv_in: torch.Tensor, conv_in: torch.Tensor | None,
                       ctx: ForwardContext) -> None:
        """Pair each recorded chunk-boundary state with the short-conv inputs just before that boundary."""
        a, b = int(ctx.cu_seqlens[i]), int(ctx.cu_seqlens[i + 1])
        w = self.conv_size - 1
        prev = conv_in[i] if conv_in is not None else qkv_in.new_zeros(w, qkv_in.shape[-1])
        rows = torch.cat([prev, qkv_in[a:b]]).detach()
        start = ctx.start_positions[i]
        s.snapshots = {pos: (state, rows[pos - start: pos - start + w].clone()) for pos, state in s.snapshots.items()}

    def _state(self, ctx: ForwardContext, i: int) -> KDASeqState:
        if ctx.kda_states is None:
            return KDASeqState()
        return ctx.kda_states[i].kda.setdefault(self.layer_idx, KDASeqState())

    def _chunked(self, q, k, v, g, beta, ctx: ForwardContext, states: list[KDASeqState]) -> torch.Tensor:
        """Run ``kda_chunk`` over segments that start at chunk boundaries.

        A sequence with rows pending in its current chunk gets them prepended (with q = 0: their
        outputs were already returned) so every token is computed by the full-chunk formula.
        """
        H, K = self.num_heads, self.head_dim
        if all(s.num_pending == 0 for s in states):
            seg_q, seg_k, seg_v, seg_g, seg_b, seg_cu, offsets = q, k, v, g, beta, ctx.cu_seqlens, [0] * len(states)
        else:
            cu = ctx.cu_seqlens.tolist()  # (a host read: only where pending rows are spliced in)
            parts: list[list[torch.Tensor]] = [[], [], [], [], []]
            offsets, lens = [], []
            for i, s in enumerate(states):
                a, b = cu[i], cu[i + 1]
                r = s.num_pending
                new = (q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b])
                if r:
                    pk, pv, pg, pb = s.pending
                    old = (q.new_zeros(r, H, K), pk, pv, pg, pb)
                    new = tuple(torch.cat([o_, n_]) for o_, n_ in zip(old, new))
                for lst, t in zip(parts, new):
                    lst.append(t)
                offsets.append(r)
                lens.append(r + b - a)
            seg_q, seg_k, seg_v, seg_g, seg_b = (torch.cat(p) for p in parts)
            seg_cu = torch.tensor([0] + lens, dtype=torch.int64, device=ctx.cu_seqlens.device).cumsum(0)
        init = None
        if any(s.state is not None for s in states):
            init = torch.stack([s.state if s.state is not None else q.new_zeros(H, K, K, dtype=torch.float32)
                                for s in states])
        want_snaps = ctx.kda_states is not None and ctx.record_snapshots
        o, final, chunk_states = kda_chunk(seg_q, seg_k, seg_v, seg_g, seg_b, seg_cu, initial_state=init,
                                           output_chunk_states=want_snaps)
        if ctx.kda_states is None and len(states) and all(r == 0 for r in offsets):
            return o
        seg_cu_l = seg_cu.tolist()
        outs = []
        chunk_i = 0
        starts = ctx.start_positions
        for i, s in enumerate(states):
            a, b = seg_cu_l[i], seg_cu_l[i + 1]
            r = offsets[i]
            outs.append(o[a + r:b])
            if ctx.kda_states is None:
                continue
            seg_len = b - a
            full = seg_len // CHUNK_SIZE * CHUNK_SIZE
            boundary = starts[i] - r  # absolute position where this segment starts
            s.state = final[i].detach()
            tail = slice(a + full, b)
            s.pending = None if full == seg_len else tuple(t[tail].detach() for t in (seg_k, seg_v, seg_g, seg_b))
            s.snapshots = {}
            if want_snaps:
                for c in range(seg_len // CHUNK_SIZE):
                    s.snapshots[boundary + (c + 1) * CHUNK_SIZE] = chunk_states[chunk_i].detach()
                    chunk_i += 1
        return torch.cat(outs) if outs else o
