"""MLA attention (absorbed form everywhere) with the DSA lightning indexer."""
from __future__ import annotations

import torch
from torch import nn

from zmrl.kernels_batch_invariant import grouped_linear, linear
from zmrl.kernels_batch_invariant.dsa_indexer import dsa_index_scores, dsa_topk
from zmrl.kernels_batch_invariant.fp8 import fake_quant_fp8, quantize_fp8
from zmrl.kernels_batch_invariant.matmul import LoraUp
from zmrl.kernels_batch_invariant.hadamard import hadamard_rotate
from zmrl.kernels_batch_invariant.mla_attention import mla_attention, mla_attention_dense
from zmrl.kernels_batch_invariant.pointwise import sigmoid

from .config import ModelConfig
from .context import ForwardContext
from .layers import LayerNorm, Linear, RMSNorm, project
from .rope import RotaryTable


class Indexer(nn.Module):
    """DSA lightning indexer: scores every earlier token with a few FP8 heads and keeps the top-k."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype | None = None):
        super().__init__()
        self.n_heads, self.head_dim, self.topk = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
        self.rope_dim = cfg.qk_rope_head_dim
        self.use_hadamard = cfg.index_use_hadamard
        self.rope_interleave, self.quant = cfg.index_rope_interleave, cfg.index_quant
        self.quant_block = min(128, self.head_dim)
        self.wq_b = Linear(cfg.q_lora_rank, self.n_heads * self.head_dim, dtype=dtype)
        self.wk = Linear(cfg.hidden_size, self.head_dim, dtype=dtype)
        self.k_norm = LayerNorm(self.head_dim, eps=1e-6, dtype=dtype)
        self.weights_proj = Linear(cfg.hidden_size, self.n_heads, dtype=dtype)

    def _prepare(self, t: torch.Tensor, positions: torch.Tensor, rope: RotaryTable | None) -> torch.Tensor:
        if rope is not None:
            r = self.rope_dim
            t = torch.cat([rope.rotate(t[..., :r], positions, interleaved=self.rope_interleave), t[..., r:]], dim=-1)
        if self.use_hadamard:
            t = hadamard_rotate(t)
        return t

    def _quantize(self, t: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(values, fp32 scale [..., 1]): FP8 with one scale per block, or (``index_quant: none``) the
        values in the model dtype with scale 1."""
        if self.quant == "fp8":
            return quantize_fp8(t, block=self.quant_block)
        return t.to(dtype), torch.ones(*t.shape[:-1], 1, dtype=torch.float32, device=t.device)

    def keys(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryTable | None):
        k = self.k_norm(self.wk(x, out_dtype=torch.float32))
        return self._quantize(self._prepare(k, positions, rope), x.dtype)

    def select(self, x: torch.Tensor, q_latent: torch.Tensor, k8_cache: torch.Tensor, k_scale_cache: torch.Tensor,
               ctx: ForwardContext, rope: RotaryTable | None) -> torch.Tensor:
        """Returns the selected key positions [T, topk], ascending, -1 padded."""
        T = x.shape[0]
        q = self.wq_b(q_latent, out_dtype=torch.float32).view(T, self.n_heads, self.head_dim)
        q8, q_scale = self._quantize(self._prepare(q, ctx.positions, rope), x.dtype)
        w = self.weights_proj(x, out_dtype=torch.float32) * (self.n_heads ** -0.5 * self.head_dim ** -0.5)
        scores = dsa_index_scores(q8, q_scale.squeeze(-1), w, k8_cache, k_scale_cache, ctx.block_table,
                                  ctx.seq_idx, ctx.positions, kv_len=ctx.static_kv_len)
        return dsa_topk(scores, ctx.positions, self.topk)


class MLAAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, dtype: torch.dtype | None = None):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = h = cfg.num_attention_heads
        self.nope, self.rope_dim, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.kv_lora_rank = cfg.kv_lora_rank
        self.softmax_scale = cfg.qk_head_dim ** -0.5
        d = cfg.hidden_size
        if cfg.q_lora_rank is None:
            self.q_proj = Linear(d, h * cfg.qk_head_dim, dtype=dtype)
        else:
            self.q_a_proj = Linear(d, cfg.q_lora_rank, dtype=dtype)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, eps=cfg.mla_latent_norm_eps, dtype=dtype)
            self.q_b_proj = Linear(cfg.q_lora_rank, h * cfg.qk_head_dim, dtype=dtype)
        self.kv_a_proj_with_mqa = Linear(d, cfg.kv_lora_rank + cfg.qk_rope_head_dim, dtype=dtype)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, eps=cfg.mla_latent_norm_eps, dtype=dtype)
        self.kv_b_proj = Linear(cfg.kv_lora_rank, h * (cfg.qk_nope_head_dim + cfg.v_head_dim), dtype=dtype)
        self.o_proj = Linear(h * cfg.v_head_dim, d, dtype=dtype)
        if cfg.mla_use_output_gate:
            self.g_proj = Linear(d, h * cfg.v_head_dim, dtype=dtype)
        self.indexer = Indexer(cfg, dtype=dtype) if cfg.has_indexer else None
        # A "shared" indexer layer attends over the selection of this (earlier) layer; its own indexer
        # weights stay loaded (checkpoints carry them) but do not run.
        self.index_source = cfg.index_source_layer(layer_idx) if cfg.has_indexer else layer_idx
        self.rope_interleave = cfg.rope_interleave
        self.rope = None if cfg.mla_use_nope else RotaryTable(cfg.qk_rope_head_dim, cfg.rope_theta,
                                                               cfg.max_position_embeddings)

    def _kv_b(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [H, nope, kv_lora] and W_UV [H, v, kv_lora], the absorbed halves of kv_b_proj."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_dim, self.kv_lora_rank)
        return w[:, : self.nope], w[:, self.nope:]

    def _lora_b_halves(self, lora) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b's LoRA B [H*(nope+v), r] split per head into B_UK [H, nope, r] and B_UV [H, v, r]."""
        b = lora.lora_B.view(self.num_heads, self.nope + self.v_dim, -1)
        return b[:, : self.nope], b[:, self.nope:]

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        T, H = x.shape[0], self.num_heads
        # The two projections of x in one fused GEMM (model.layers.project): q (or its latent) and kv.
        if hasattr(self, "q_proj"):
            q_latent = None
            q, kv = project(x, [self.q_proj, self.kv_a_proj_with_mqa])
        else:
            q_a, kv = project(x, [self.q_a_proj, self.kv_a_proj_with_mqa])
            q_latent = self.q_a_layernorm(q_a)
            q = self.q_b_proj(q_latent)
        q = q.reshape(T, H, self.nope + self.rope_dim)  # q_proj's output may be a column view
        q_nope, q_pe = q[..., : self.nope], q[..., self.nope:]
        c_kv = self.kv_a_layernorm(kv[:, : self.kv_lora_rank])
        k_pe = kv[:, self.kv_lora_rank:]
        if self.rope is not None:
            q_pe = self.rope.rotate(q_pe, ctx.positions, interleaved=self.rope_interleave)
            k_pe = self.rope.rotate(k_pe, ctx.positions, interleaved=self.rope_interleave)
        if ctx.latent_format == "fp8":
            # The engine caches FP8 latents; quantise->dequantise here too so both sides attend to the
            # same values (straight-through gradient). The rope part stays in the model dtype.
            c_kv = fake_quant_fp8(c_kv, block=min(128, self.kv_lora_rank))

        index_k8 = index_scale = None
        computes_selection = self.indexer is not None and self.index_source == self.layer_idx
        if computes_selection:
            index_k8, index_scale = self.indexer.keys(x, ctx.positions, self.rope)
            index_scale = index_scale.squeeze(-1)
        # the latent [c_kv | k_pe] written as its two parts (the engine's paged store: no concatenated copy)
        kv_cache, k8_cache, ks_cache = ctx.store.write_parts(self.layer_idx, ctx.slot_mapping, (c_kv, k_pe),
                                                             index_k8, index_scale)

        w_uk, w_uv = self._kv_b()
        lora = self.kv_b_proj.adapter
        q_lora = None
        if lora is not None:
            # kv_b's LoRA in the absorbed form: + scale * (q_nope[h] @ B_UK[h]) @ A, its up half computed and added
            # in fp32 by the q_lat GEMM's epilogue (grouped_linear's lora: the bits of the separate sum, without
            # the [H, T, Dc] fp32 delta in memory)
            b_uk, _ = self._lora_b_halves(lora)
            t = grouped_linear(q_nope.transpose(0, 1), b_uk.transpose(1, 2), out_dtype=torch.float32)  # [H, T, r]
            # A^T shared by every head: an expanded view (no per-step copy of it)
            q_lora = LoraUp(t, lora.lora_A.t().unsqueeze(0).expand(self.num_heads, -1, -1), lora.scale)
        # q_lat[t, h] = q_nope[t, h] @ W_UK[h]: per head, rows tiled like every other linear.
        q_lat = grouped_linear(q_nope.transpose(0, 1), w_uk.transpose(1, 2), out_dtype=torch.float32,
                               lora=q_lora).transpose(0, 1)
        if self.indexer is not None:
            if computes_selection:
                positions = ctx.index_selection[self.layer_idx] = self.indexer.select(
                    x, q_latent, k8_cache, ks_cache, ctx, self.rope)
            else:
                positions = ctx.index_selection[self.index_source]
            o_lat = mla_attention(q_lat, q_pe.float(), kv_cache, ctx.block_table, ctx.seq_idx, positions,
                                  self.softmax_scale, self.kv_lora_rank, kv_len=ctx.static_kv_len)
        else:
            o_lat = mla_attention_dense(q_lat, q_pe.float(), kv_cache, ctx.block_table, ctx.seq_idx,
                                        ctx.positions, self.softmax_scale, self.kv_lora_rank,
                                        kv_len=ctx.static_kv_len)
        if lora is None:
            o = grouped_linear(o_lat.transpose(0, 1), w_uv, out_dtype=x.dtype).transpose(0, 1)  # [T, H, v]
        else:
            # + scale * (o_lat[h] @ A^T) @ B_UV[h]^T, computed and added in fp32 before the single rounding by the
            # GEMM's epilogue (grouped_linear's lora)
            _, b_uv = self._lora_b_halves(lora)
            a = linear(o_lat.reshape(-1, self.kv_lora_rank), lora.lora_A, out_dtype=torch.float32)
            a = a.view(T, H, -1).transpose(0, 1)  # [H, T, r]
            o = grouped_linear(o_lat.transpose(0, 1), w_uv, out_dtype=x.dtype,
                               lora=LoraUp(a, b_uv, lora.scale)).transpose(0, 1)
        o = o.reshape(T, H * self.v_dim)
        if hasattr(self, "g_proj"):
            o = (o.float() * sigmoid(self.g_proj(x, out_dtype=torch.float32))).to(x.dtype)
        return self.o_proj(o)
