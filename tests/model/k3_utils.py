"""Tiny random Kimi K3 models for the release-format and reference tests."""
from __future__ import annotations

import torch

from zmrl.model import HybridForCausalLM, ModelConfig, build_model
from zmrl.model.config import LinearAttnConfig
from zmrl.model.mxfp4 import dequantize_mxfp4, quantize_mxfp4


def tiny_k3(**over) -> ModelConfig:
    """Every K3 feature at toy width: KDA (full-rank gate with lower bound) + gated NoPE MLA, a dense first
    layer, latent MoE with its norm and grouped sigmoid routing, shared experts, SiTU-GLU, block AttnRes
    with a partial last block (5 layers, blocks of 2)."""
    base = dict(
        vocab_size=128, hidden_size=64, num_hidden_layers=5, intermediate_size=96, rms_norm_eps=1e-5,
        linear_attn_config=LinearAttnConfig(num_heads=2, head_dim=16, kda_layers=[1, 2, 4, 5], full_attn_layers=[3]),
        gate_lower_bound=-5.0, use_full_rank_gate=True, num_attention_heads=2, q_lora_rank=32, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, mla_use_nope=True, mla_use_output_gate=True,
        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=32,
        first_k_dense_replace=1, n_group=4, topk_group=2, routed_scaling_factor=2.0, moe_latent_size=32,
        latent_moe_use_norm=True, moe_glu="situ", attn_res_block_size=2,
    )
    base.update(over)
    return ModelConfig(**base).validate()


@torch.no_grad()
def random_k3_model(cfg: ModelConfig, seed: int = 0, mxfp4_experts: bool = True) -> HybridForCausalLM:
    """fp32 model with weights chosen so that every branch moves the logits: MLP / expert / latent
    projections drawn with std 0.5/sqrt(fan_in) (the model init's 0.02 leaves the MoE nearly silent, so
    its routing weights would hardly show in the logits), small MLA latents (so their norms' eps shows),
    AttnRes pseudo-queries drawn (init has them 0, a uniform mix), norms away from 1, and
    (``mxfp4_experts``) routed-expert weights rounded onto the MXFP4 grid so that the release's quantised
    storage holds them exactly. The scales also keep both implementations' fp32 rounding small
    (tests/model/test_mlx_reference.py measures it)."""
    model = build_model(cfg, seed=seed, dtype="float32")
    g = torch.Generator().manual_seed(seed + 1)
    for name, p in model.named_parameters():
        if ".mlp." in name and p.dim() == 2 and name.endswith("proj.weight"):
            p.copy_(torch.randn(p.shape, generator=g) * 0.5 * p.shape[1] ** -0.5)
        if name.endswith(("q_a_proj.weight", "kv_a_proj_with_mqa.weight")):
            # small MLA latents (rms ~8e-3, mean square within 10x of the norms' eps): the eps shows
            p.copy_(torch.randn(p.shape, generator=g) * 1e-3)
        if name.endswith("_res_proj.weight"):
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
        elif name.endswith("norm.weight") or name.endswith("layernorm.weight"):
            p.copy_(1 + torch.randn(p.shape, generator=g) * 0.1)
        if mxfp4_experts and ".experts." in name and cfg.hidden_size % 32 == 0:
            p.copy_(dequantize_mxfp4(*quantize_mxfp4(p, exact=False)))
    return model
