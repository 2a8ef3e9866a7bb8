"""Named model configurations (docs/model.md).

- ``tiny``: the CPU unit-test model (architecture.md §7.1).
- ``bench``: ≈2.6 B total, fits one H200 with the shapes real kernels want (architecture.md §7.2).
- ``k3.1-pro``: the full Kimi K3.1 Pro shape (2.8 T total / 104 B active) for planning and memory
  math only; never instantiated here. Fields the public sources leave open are chosen so that
  ``param_counts()`` lands near the published totals; each choice is listed in docs/sizing.md.
"""
from __future__ import annotations

from typing import Callable

from .config import LinearAttnConfig, ModelConfig


def tiny() -> ModelConfig:
    """A few M params; layer pattern KDA,KDA,KDA,MLA+DSA; index_topk 64 so test prompts exceed it."""
    return ModelConfig()


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


def k3_1_pro() -> ModelConfig:
    """Kimi K3.1 Pro: K3 (architecture.md §5) plus a DSA indexer (32×128, top-2048) on each of its
    24 MLA layers. 93 layers = 69 KDA + 24 MLA+DSA, hidden 7168, latent MoE with 896 experts.

    Open fields (see docs/sizing.md): first_k_dense_replace 1 with a 33792-wide dense MLP,
    n_group/topk_group 1/1, shared experts in the full hidden width, rms_norm_eps 1e-5."""
    n_layers = 93
    full = _k3_full_attn_layers(n_layers)
    kda = [i for i in range(1, n_layers + 1) if i not in set(full)]
    return ModelConfig(
        model_type="kimi_k3",
        vocab_size=163840,
        hidden_size=7168,
        num_hidden_layers=n_layers,
        intermediate_size=33792,  # only layer 1 uses it; the width a third-party K3 test config uses
        rms_norm_eps=1e-5,  # assumption: Kimi-Linear's value (K2 uses 1e-6)
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
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        mla_use_nope=True,
        mla_use_output_gate=True,
        index_n_heads=32,
        index_head_dim=128,
        index_topk=2048,
        index_use_hadamard=True,
        n_routed_experts=896,
        num_experts_per_tok=16,
        n_shared_experts=2,
        moe_intermediate_size=3072,
        first_k_dense_replace=1,  # assumption: as in Kimi K2 and Kimi-Linear
        n_group=1,  # assumption: Kimi routes without group limits (K2, Kimi-Linear: 1/1)
        topk_group=1,
        routed_scaling_factor=1.0,
        norm_topk_prob=True,
        moe_latent_size=3584,
        moe_glu="situ",
        attn_res_block_size=12,
    )


PRESETS: dict[str, Callable[[], ModelConfig]] = {
    "tiny": tiny,
    "bench": bench,
    "k3.1-pro": k3_1_pro,
}
