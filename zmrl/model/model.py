"""The hybrid causal LM (KDA + MLA/DSA + MoE) and its two entry points.

* ``forward_packed``: whole sequences packed with ``cu_seqlens`` — the trainer's path (the trainer takes
  the hidden states, ``forward_packed_hidden``, and ``compute_token_logprobs`` of the rows it scores).
* ``forward_incremental``: any number of new tokens per sequence over a cache — the engine's path
  (1 = decode, more = a prefill chunk).
Both build a ``ForwardContext`` and call the same ``HybridForCausalLM.forward``.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


from zmrl.kernels_batch_invariant.lm_head_logprobs import DEFAULT_CHUNK_ROWS, lm_head_token_logprobs
from zmrl.kernels_batch_invariant.logprob import token_logprobs
from zmrl.kernels_batch_invariant.norms import add_rms_norm

from .attn_res import AttnResState, depth_attention
from .config import ModelConfig
from .context import ForwardContext, packed_context
from .kda import KimiDeltaAttention
from .layers import Linear, RMSNorm, Weight
from .mla import MLAAttention
from .moe import MLP, MoE, glu_of

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, dtype: torch.dtype | None = None):
        super().__init__()
        self.layer_idx = layer_idx
        self.is_kda = cfg.is_kda_layer(layer_idx)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.self_attn = (KimiDeltaAttention if self.is_kda else MLAAttention)(cfg, layer_idx, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.mlp = (MoE(cfg, dtype=dtype) if cfg.is_moe_layer(layer_idx)
                    else MLP(cfg.hidden_size, cfg.intermediate_size, glu_of(cfg), dtype=dtype))
        if cfg.attn_res_block_size is not None:
            # Names as in the K3 checkpoint: <site>_res_norm.weight and <site>_res_proj.weight, [D] each.
            self.self_attention_res_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
            self.self_attention_res_proj = Weight(cfg.hidden_size, dtype=dtype)
            self.mlp_res_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
            self.mlp_res_proj = Weight(cfg.hidden_size, dtype=dtype)
        # Activation-recompute policy of the training forward (model/recompute.py sets it).
        self.recompute: str = "none"

    def _token_mixer(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return self.self_attn(self.input_layernorm(x), ctx)

    def _channel_mixer(self, h: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.post_attention_layernorm(h))

    def _plain(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        # the residual add and the channel mixer's norm in one op (bitwise the two; one launch on the GPU)
        post = self.post_attention_layernorm
        h, normed = add_rms_norm(x, self._token_mixer(x, ctx), post.weight, post.eps)
        return h + self.mlp(normed)

    def _policy(self, ctx: ForwardContext) -> str:
        # Recompute needs a recorded graph and a forward without side effects: the trainer's
        # (no per-sequence engine state to update twice).
        if self.recompute == "none" or not torch.is_grad_enabled() or ctx.kda_states is not None:
            return "none"
        return self.recompute

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        policy = self._policy(ctx)
        if policy == "none":
            return self._plain(x, ctx)
        if policy == "layer":
            return checkpoint(self._plain, x, ctx, use_reentrant=False)
        h = x + checkpoint(self._token_mixer, x, ctx, use_reentrant=False)
        if policy == "attention":
            return h + self._channel_mixer(h)
        return h + checkpoint(self._channel_mixer, h, use_reentrant=False)

    def forward_attn_res(self, state: AttnResState, ctx: ForwardContext) -> None:
        # The depth mixing reads the AttnRes state (a list of earlier outputs), so the checkpointed
        # regions are the two sub-blocks; ``layer`` recomputes both, like ``selective``.
        policy = self._policy(ctx)
        h = depth_attention(state.candidates(), self.self_attention_res_norm.weight,
                            self.self_attention_res_proj.weight, self.self_attention_res_norm.eps)
        state.add(self._token_mixer(h, ctx) if policy == "none"
                  else checkpoint(self._token_mixer, h, ctx, use_reentrant=False))
        h = depth_attention(state.candidates(), self.mlp_res_norm.weight, self.mlp_res_proj.weight,
                            self.mlp_res_norm.eps)
        state.add(self._channel_mixer(h) if policy in ("none", "attention")
                  else checkpoint(self._channel_mixer, h, use_reentrant=False))
        state.end_layer(self.layer_idx)


class HybridModel(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype | None = None):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, dtype=dtype) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.attn_res_block_size = cfg.attn_res_block_size
        if cfg.attn_res_block_size is not None:
            self.output_attn_res_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
            self.output_attn_res_proj = Weight(cfg.hidden_size, dtype=dtype)

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        if self.attn_res_block_size is None:
            for layer in self.layers:
                h = layer(h, ctx)
        else:
            state = AttnResState(h, self.attn_res_block_size)
            for layer in self.layers:
                layer.forward_attn_res(state, ctx)
            h = depth_attention(state.candidates(), self.output_attn_res_norm.weight,
                                self.output_attn_res_proj.weight, self.output_attn_res_norm.eps)
        return self.norm(h)


class HybridForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype | None = None):
        super().__init__()
        self.config = cfg
        self.model = HybridModel(cfg, dtype=dtype)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, dtype=dtype)
        self.tie_weights()

    def tie_weights(self) -> None:
        """With ``tie_word_embeddings``: one Parameter under two names (again after ``to_empty``, which
        unties); checkpoints store it once, as ``model.embed_tokens.weight``."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    def check_token_ids(self, input_ids: torch.Tensor) -> None:
        if input_ids.numel() == 0:
            return
        lo, hi = int(input_ids.min()), int(input_ids.max())
        if lo < 0 or hi >= self.config.vocab_size:
            bad = lo if lo < 0 else hi
            raise ValueError(f"token id {bad} is out of range for vocab_size={self.config.vocab_size} "
                             f"(allowed 0..{self.config.vocab_size - 1})")

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Final hidden states [T, D] for the new tokens described by ``ctx``."""
        if ctx.validate_ids:
            self.check_token_ids(input_ids)
        return self.model(input_ids, ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits [T, V]; each row depends on its hidden state alone."""
        return self.lm_head(hidden, out_dtype=torch.float32)

    def compute_token_logprobs(self, hidden: torch.Tensor, token_ids: torch.Tensor,
                               segments: Sequence[tuple[int, float]], chunk_rows: int | None = DEFAULT_CHUNK_ROWS
                               ) -> torch.Tensor:
        """``token_logprobs(compute_logits(hidden), token_ids, T)`` row by row, bitwise, without the
        [R, V] logits: ``lm_head_token_logprobs`` runs the same ops chunk by chunk over the rows (and
        recomputes each chunk's logits in the backward). ``segments``: consecutive (rows, temperature)
        runs covering the rows. An adapter on lm_head takes the unchunked path (autograd through it)."""
        if self.lm_head.adapter is not None:
            logits = self.compute_logits(hidden)
            parts, start = [], 0
            for n, t in segments:
                parts.append(token_logprobs(logits[start:start + n], token_ids[start:start + n], t))
                start += n
            return torch.cat(parts) if parts else logits.new_zeros(0)
        return lm_head_token_logprobs(hidden, self.lm_head.weight, self.lm_head.bias, token_ids, segments,
                                      chunk_rows)

    # ------------------------------------------------------------------ init
    @torch.no_grad()
    def reset_parameters(self, seed: int = 0) -> None:
        """Seeded init of every parameter, drawn in fp32 on CPU in a fixed order, then cast."""
        gen = torch.Generator().manual_seed(seed)
        std = self.config.initializer_range
        for name, p in self.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.copy_(torch.ones(p.shape))
            elif name.endswith(".bias") or name.endswith("_res_proj.weight"):
                # zero pseudo-queries: AttnRes starts as a uniform mix over depth
                p.copy_(torch.zeros(p.shape))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
        for layer in self.model.layers:
            if isinstance(layer.self_attn, KimiDeltaAttention):
                layer.self_attn.reset_parameters(gen)
            if isinstance(layer.mlp, MoE):
                bias = layer.mlp.gate.e_score_correction_bias
                bias.copy_(torch.randn(bias.shape, generator=gen) * 0.01)
        # Residual-branch outputs start smaller so the depth of the stack does not blow up activations.
        out_std = std / (2 * self.config.num_hidden_layers) ** 0.5
        for name, p in self.named_parameters():
            if name.endswith("o_proj.weight") or name.endswith("down_proj.weight"):
                p.copy_(torch.randn(p.shape, generator=gen) * out_std)


def checkpoint_state(model: HybridForCausalLM) -> dict[str, torch.Tensor]:
    """The model's tensors by checkpoint name: ``state_dict`` without the tied ``lm_head.weight``."""
    state = model.state_dict()
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return state


def build_model(cfg: ModelConfig, seed: int = 0, dtype: torch.dtype | str | None = None,
                device: torch.device | str = "cpu") -> HybridForCausalLM:
    """A freshly initialised model (seeded, deterministic)."""
    cfg.validate()
    dtype = DTYPES[dtype] if isinstance(dtype, str) else (dtype or DTYPES[cfg.torch_dtype])
    model = HybridForCausalLM(cfg, dtype=torch.float32)
    model.reset_parameters(seed)
    return cast_model(model, dtype).to(device)


FP32_PARAMS = ("A_log", "dt_bias", "e_score_correction_bias")


def cast_model(model: HybridForCausalLM, dtype: torch.dtype) -> HybridForCausalLM:
    """Cast to ``dtype`` except the decay and routing-bias parameters, which stay fp32 (they feed exp()
    and expert selection)."""
    for name, p in model.named_parameters():
        if not name.endswith(FP32_PARAMS):
            p.data = p.data.to(dtype)
    return model


def forward_packed_hidden(model: HybridForCausalLM, input_ids: torch.Tensor, cu_seqlens: torch.Tensor,
                          latent_format: str = "native", page_size: int = 64) -> torch.Tensor:
    """Trainer path: final hidden states [T, D] for whole sequences packed by ``cu_seqlens``."""
    ctx = packed_context(cu_seqlens.to(input_ids.device), page_size=page_size, latent_format=latent_format)
    return model(input_ids, ctx)


def forward_packed(model: HybridForCausalLM, input_ids: torch.Tensor, cu_seqlens: torch.Tensor,
                   latent_format: str = "native", page_size: int = 64) -> torch.Tensor:
    """Trainer path: logits [T, V] (fp32) for whole sequences packed by ``cu_seqlens``."""
    return model.compute_logits(forward_packed_hidden(model, input_ids, cu_seqlens, latent_format, page_size))
