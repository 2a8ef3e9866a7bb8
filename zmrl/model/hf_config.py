"""``config.json`` files written by transformers, read by ``model_type`` (the HF config adapter).

Supported here: ``deepseek_v3`` (transformers' ``DeepseekV3Config``): every layer MLA with rotary
position embedding, no DSA indexer, the first ``first_k_dense_replace`` layers a dense SwiGLU MLP and the
rest a sigmoid-routed MoE with shared experts. Its tensor names are zmrl's (transformers writes the
per-expert ``mlp.experts.{e}.{gate,up,down}_proj.weight`` names), so only the config is adapted. The
released Kimi K3 / Kimi-Linear configs are read by k3_release.py.

zmrl's own ``config.json`` always has ``linear_attn_config``; a ``deepseek_v3`` file never does, which is
how the two are told apart. An unknown field is an error naming it; a field zmrl knows but cannot honour
(yarn rope scaling, split-half rope, attention bias, another activation) is an error saying so.
"""
from __future__ import annotations

from typing import Any

from .config import ConfigError, LinearAttnConfig, ModelConfig

DEEPSEEK_V3 = "deepseek_v3"

# HF field -> ModelConfig field (same meaning)
_DS_FIELDS = {
    "vocab_size": "vocab_size", "hidden_size": "hidden_size", "num_hidden_layers": "num_hidden_layers",
    "intermediate_size": "intermediate_size", "rms_norm_eps": "rms_norm_eps",
    "max_position_embeddings": "max_position_embeddings", "initializer_range": "initializer_range",
    "tie_word_embeddings": "tie_word_embeddings", "num_attention_heads": "num_attention_heads",
    "q_lora_rank": "q_lora_rank", "kv_lora_rank": "kv_lora_rank", "qk_nope_head_dim": "qk_nope_head_dim",
    "qk_rope_head_dim": "qk_rope_head_dim", "v_head_dim": "v_head_dim", "n_routed_experts": "n_routed_experts",
    "num_experts_per_tok": "num_experts_per_tok", "n_shared_experts": "n_shared_experts",
    "moe_intermediate_size": "moe_intermediate_size", "first_k_dense_replace": "first_k_dense_replace",
    "n_group": "n_group", "topk_group": "topk_group", "routed_scaling_factor": "routed_scaling_factor",
    "norm_topk_prob": "norm_topk_prob",
}
# checked against the fields above, or settings with one value zmrl matches
_DS_CHECKED = {"head_dim", "qk_head_dim", "rope_interleave", "rope_parameters", "rope_theta", "rope_scaling",
               "hidden_act", "attention_bias", "num_key_value_heads", "moe_layer_freq", "scoring_func",
               "topk_method"}
# bookkeeping and training-only settings
_DS_IGNORED = {"model_type", "architectures", "auto_map", "bos_token_id", "eos_token_id", "pad_token_id",
               "transformers_version", "use_cache", "attention_dropout", "dtype", "torch_dtype", "pretraining_tp",
               "aux_loss_alpha", "seq_aux", "ep_size", "num_nextn_predict_layers", "output_router_logits",
               "router_aux_loss_coef"}


def is_hf_config(data: dict[str, Any]) -> bool:
    """A transformers config this module reads (zmrl's own always carries ``linear_attn_config``)."""
    return data.get("model_type") == DEEPSEEK_V3 and "linear_attn_config" not in data


def _unsupported(name: str, value: Any, allowed: str) -> ConfigError:
    return ConfigError(f"config field {name!r} = {value!r} is known but not supported by zmrl ({allowed})")


def config_from_hf(data: dict[str, Any]) -> ModelConfig:
    mt = data.get("model_type")
    if mt != DEEPSEEK_V3:
        raise ConfigError(f"config field 'model_type' = {mt!r}: no HF adapter for it (supported: {DEEPSEEK_V3!r})")
    unknown = sorted(k for k in data if k not in _DS_FIELDS and k not in _DS_CHECKED and k not in _DS_IGNORED)
    if unknown:
        raise ConfigError(f"unknown config field(s) {unknown} for model_type {mt!r}; known: "
                          f"{sorted([*_DS_FIELDS, *_DS_CHECKED, *_DS_IGNORED])}")
    out: dict[str, Any] = {z: data[h] for h, z in _DS_FIELDS.items() if h in data}
    rope = data.get("rope_parameters") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default" or data.get("rope_scaling"):
        raise _unsupported("rope_parameters.rope_type", data.get("rope_scaling") or rope_type, "'default' only")
    theta = rope.get("rope_theta", data.get("rope_theta"))
    if theta is not None:
        out["rope_theta"] = float(theta)
    if not data.get("rope_interleave", True):
        raise _unsupported("rope_interleave", False, "interleaved MLA rope only")
    if data.get("hidden_act", "silu") != "silu":
        raise _unsupported("hidden_act", data["hidden_act"], "'silu' only")
    if data.get("attention_bias", False):
        raise _unsupported("attention_bias", True, "no bias")
    for name, want in (("moe_layer_freq", 1), ("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
        if name in data and data[name] != want:
            raise _unsupported(name, data[name], f"{want!r} only")
    nope, rope_dim = data.get("qk_nope_head_dim", 128), data.get("qk_rope_head_dim", 64)
    for name, want in (("qk_head_dim", nope + rope_dim), ("head_dim", rope_dim)):
        if name in data and data[name] != want:
            raise ConfigError(f"config field {name!r} = {data[name]} is inconsistent: expected {want} from "
                              "qk_nope_head_dim / qk_rope_head_dim")
    if out.get("num_experts_per_tok") == 1 and out.get("norm_topk_prob"):
        # DeepSeek-V3 renormalises even a single expert's weight (to 1); zmrl follows the Kimi K3 rule
        raise _unsupported("norm_topk_prob", True, "with num_experts_per_tok 1 DeepSeek-V3 renormalises to 1; "
                           "zmrl renormalises only when top-k > 1")
    layers = out.get("num_hidden_layers", ModelConfig.num_hidden_layers)
    out["linear_attn_config"] = LinearAttnConfig(kda_layers=[], full_attn_layers=list(range(1, layers + 1)))
    out.update(model_type=DEEPSEEK_V3, mla_use_nope=False, index_topk=None, moe_glu="swiglu",
               latent_moe_use_norm=False, moe_latent_size=None, attn_res_block_size=None)
    dtype = data.get("torch_dtype") or data.get("dtype")
    if dtype is not None:
        out["torch_dtype"] = dtype
    return ModelConfig(**out).validate()


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """The transformers ``config.json`` of ``cfg`` (``deepseek_v3``: an all-MLA rotary model without the
    Kimi extensions); a config outside what that model type expresses is an error naming the field."""
    checks = (("model_type", cfg.model_type == DEEPSEEK_V3),
              ("linear_attn_config", not cfg.linear_attn_config.kda_layers),
              ("index_topk", not cfg.has_indexer), ("mla_use_nope", not cfg.mla_use_nope),
              ("mla_use_output_gate", not cfg.mla_use_output_gate), ("moe_latent_size", cfg.moe_latent_size is None),
              ("moe_glu", cfg.moe_glu == "swiglu"), ("attn_res_block_size", cfg.attn_res_block_size is None),
              ("moe_layer_freq", cfg.moe_layer_freq == 1), ("mla_latent_norm_eps", cfg.mla_latent_norm_eps == 1e-6))
    for name, ok in checks:
        if not ok:
            raise ConfigError(f"config field {name!r} = {getattr(cfg, name)!r} cannot be written as a "
                              f"{DEEPSEEK_V3} config.json")
    out: dict[str, Any] = {h: getattr(cfg, z) for h, z in _DS_FIELDS.items()}
    out.update(model_type=DEEPSEEK_V3, architectures=["DeepseekV3ForCausalLM"], hidden_act="silu",
               num_key_value_heads=cfg.num_attention_heads, head_dim=cfg.qk_rope_head_dim,
               qk_head_dim=cfg.qk_head_dim, rope_interleave=True, attention_bias=False,
               rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta}, torch_dtype=cfg.torch_dtype)
    return out
