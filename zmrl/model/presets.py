"""Named model configurations (docs/model.md).

- ``tiny``: the CPU unit-test model (architecture.md §7.1).
- ``bench``: ≈2.6 B total, fits one H200 with the shapes real kernels want (architecture.md §7.2).
- ``k3``: the released Kimi K3, field for field as its published ``config.json`` (docs/k3_release.md):
  no DSA indexer. For planning and memory math; never instantiated here.
- ``k3.1-pro``: K3 + the seed's DSA indexer (32 heads x 128, top-2048, Hadamard) on each MLA layer —
  the seed article's K3.1 Pro (2.8 T total / 104 B active). Planning only, like ``k3``.
"""
from __future__ import annotations

import dataclasses

from typing import Callable

from .config import LinearAttnConfig, ModelConfig


def tiny() -> ModelConfig:
    """A few M params; layer pattern KDA,KDA,KDA,MLA+DSA; index_topk 64 so test prompts exceed it."""
    return ModelConfig(index_topk=64)


def bench() -> ModelConfig:
    """architecture.md §7.2: 16 layers (KDA×12 + MLA+DSA×4), hidden 2048, 64 MLA heads, kv_lora 512,
    indexer 32×128 top-2048 with Hadamard, 64 experts top-8 + 1 shared. ≈2.62 B params."""
    return ModelConfig(
        model_type="kimi_k3",
        vocab_size=163840,
        hidden_size=2048,
        num_hidden_layers=16,
        intermediate_size=6144,
        rms_norm_eps=1e-5,
        max_position_embeddings=131072,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
        linear_attn_config=LinearAttnConfig(
            num_heads=16,
            head_dim=128,
            short_conv_kernel_size=4,
            kda_layers=[1, 2, 3, 5, 6, 7, 9, 10, 11, 13, 14, 15],
            full_attn_layers=[4, 8, 12, 16],
        ),
        gate_lower_bound=-5.0,
        use_full_rank_gate=False,
        num_attention_heads=64,  # FlashMLA sparse needs 64 or 128 query heads
        q_lora_rank=768,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        mla_use_nope=True,
        mla_use_output_gate=False,
        index_n_heads=32,
        index_head_dim=128,
        index_topk=2048,
        index_use_hadamard=True,
        n_routed_experts=64,
        num_experts_per_tok=8,
        n_shared_experts=1,
        moe_intermediate_size=256,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=2.446,
        norm_topk_prob=True,
        moe_latent_size=None,
        moe_glu="swiglu",
        attn_res_block_size=None,
    )


def _k3_full_attn_layers(num_layers: int = 93) -> list[int]:
    """K3: every 4th layer (1-based) is MLA, plus the last one: [4, 8, ..., 92, 93]."""
    layers = list(range(4, num_layers + 1, 4))
    if layers[-1] != num_layers:
        layers.append(num_layers)
    return layers


def k3() -> ModelConfig:
    """The released Kimi K3 (docs/k3_release.md lists the published fields): 93 layers = 69 KDA + 24
    dense MLA (NoPE, output gate), hidden 7168, latent MoE (896 experts top-16 in a 3584-wide latent with
    its norm, 2 shared experts at full width, no group limits, no renormalisation at top-1), SiTU-GLU
    (4, 25) everywhere, block AttnRes of 12 layers (7 full blocks + a partial one), rms_norm_eps 1e-5
    with the MLA latent norms at 1e-6."""
    n_layers = 93
    full = _k3_full_attn_layers(n_layers)
    kda = [i for i in range(1, n_layers + 1) if i not in set(full)]
    return ModelConfig(
        model_type="kimi_k3",
        vocab_size=163840,
        hidden_size=7168,
        num_hidden_layers=n_layers,
        intermediate_size=33792,  # the dense first layer
        rms_norm_eps=1e-5,
        max_position_embeddings=1048576,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
        linear_attn_config=LinearAttnConfig(
            num_heads=96,
            head_dim=128,
            short_conv_kernel_size=4,
            kda_layers=kda,
            full_attn_layers=full,
        ),
        gate_lower_bound=-5.0,
        use_full_rank_gate=True,
        num_attention_heads=96,
        q_lora_rank=1536,
        kv_lora_rank=512,
        mla_latent_norm_eps=1e-6,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        mla_use_nope=True,
        mla_use_output_gate=True,
        index_topk=None,  # the release has no DSA indexer
        n_routed_experts=896,
        num_experts_per_tok=16,
        n_shared_experts=2,
        moe_intermediate_size=3072,
        first_k_dense_replace=1,
        moe_layer_freq=1,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=1.0,
        norm_topk_prob=True,
        moe_latent_size=3584,
        latent_moe_use_norm=True,
        moe_glu="situ",
        activation_situ_beta=4.0,
        activation_situ_linear_beta=25.0,
        attn_res_block_size=12,
    )


def k3_1_pro() -> ModelConfig:
    """K3 + the seed's DSA indexer: the released K3 (``k3``) with a lightning indexer (32 heads x 128,
    top-2048, Hadamard-rotated FP8 keys) on each of its 24 MLA layers; everything else is K3's."""
    return dataclasses.replace(k3(), index_n_heads=32, index_head_dim=128, index_topk=2048, index_use_hadamard=True)


PRESETS: dict[str, Callable[[], ModelConfig]] = {
    "tiny": tiny,
    "bench": bench,
    "k3": k3,
    "k3.1-pro": k3_1_pro,
}
