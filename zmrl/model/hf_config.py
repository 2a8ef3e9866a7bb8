"""``config.json`` files written by transformers (or in its conventions), read by ``model_type`` (the HF
config adapter). Their tensor names are zmrl's (per-expert ``mlp.experts.{e}.{gate,up,down}_proj.weight``,
``self_attn.indexer.{wq_b,wk,k_norm,weights_proj}``), so only the config is adapted; a file holding
transformers' fused in-memory experts (``mlp.experts.gate_up_proj`` / ``down_proj``) is read per expert
(``fused_expert_source``), and multi-token-prediction layers are skipped (``skipped_tensor``). The released Kimi K3 /
Kimi-Linear configs (``kimi_k3`` with a nested ``text_config``, bare ``kimi_linear``) are read by
k3_release.py.

Supported here:

* ``deepseek_v3`` (transformers' ``DeepseekV3Config``): every layer MLA with rotary position embedding
  (``rope_interleave``: DeepSeek's interleaved pairs, or split-half), no DSA indexer, the first
  ``first_k_dense_replace`` layers a dense SwiGLU MLP and the rest a sigmoid-routed MoE with shared experts.
* ``deepseek_v32`` (``DeepseekV32ForCausalLM``): the V3 fields plus the DSA indexer (``index_topk``,
  ``index_n_heads``, ``index_head_dim``) on every layer, with DeepSeek-V3.2's inference semantics: indexer
  rope split-half on its first ``qk_rope_head_dim`` dims, Hadamard rotation, FP8 queries and keys.
* ``glm_moe_dsa`` (transformers' ``GlmMoeDsaConfig``): MLA with split-half rope, the DSA indexer with
  ``indexer_types`` ("full" layers compute a top-k, "shared" ones reuse the previous layer's) and
  ``mlp_layer_types`` ("dense" / "sparse"), with transformers' indexer semantics (no Hadamard rotation,
  queries and keys unquantised: ``index_quant: none``). A file's ``rope_interleave`` /
  ``indexer_rope_interleave`` (transformers' GLM class has neither and rotates split-half) are honoured.

A field a file leaves out takes the default of that model type's transformers config (not zmrl's).
zmrl's own ``config.json`` always has ``linear_attn_config``; these files never do, which is how the two
are told apart. An unknown field is an error naming it; a field zmrl knows but cannot honour (yarn rope
scaling, attention bias, another activation, a quantised checkpoint) is an error saying so.
"""
from __future__ import annotations

import logging
import re
from typing import Any

import torch

from .config import ConfigError, LinearAttnConfig, ModelConfig

log = logging.getLogger(__name__)

DEEPSEEK_V3 = "deepseek_v3"
DEEPSEEK_V32 = "deepseek_v32"
GLM_MOE_DSA = "glm_moe_dsa"
ARCHITECTURES = {DEEPSEEK_V3: "DeepseekV3ForCausalLM", DEEPSEEK_V32: "DeepseekV32ForCausalLM",
                 GLM_MOE_DSA: "GlmMoeDsaForCausalLM"}
HF_MODEL_TYPES = tuple(ARCHITECTURES)

# Fields every supported format (these HF types and the Kimi release, k3_release.TEXT_FIELDS) spells as
# ModelConfig does: the model's size and the MLA dims.
SHARED_FIELDS = {
    "vocab_size": "vocab_size", "hidden_size": "hidden_size", "num_hidden_layers": "num_hidden_layers",
    "intermediate_size": "intermediate_size", "rms_norm_eps": "rms_norm_eps",
    "max_position_embeddings": "max_position_embeddings", "initializer_range": "initializer_range",
    "tie_word_embeddings": "tie_word_embeddings", "num_attention_heads": "num_attention_heads",
    "q_lora_rank": "q_lora_rank", "kv_lora_rank": "kv_lora_rank", "qk_nope_head_dim": "qk_nope_head_dim",
    "qk_rope_head_dim": "qk_rope_head_dim", "v_head_dim": "v_head_dim",
}
# HF field -> ModelConfig field (same meaning), shared by the three types
_FIELDS = {
    **SHARED_FIELDS, "n_routed_experts": "n_routed_experts",
    "num_experts_per_tok": "num_experts_per_tok", "n_shared_experts": "n_shared_experts",
    "moe_intermediate_size": "moe_intermediate_size", "n_group": "n_group", "topk_group": "topk_group",
    "routed_scaling_factor": "routed_scaling_factor", "norm_topk_prob": "norm_topk_prob",
}
_INDEX_FIELDS = {"index_topk": "index_topk", "index_n_heads": "index_n_heads", "index_head_dim": "index_head_dim"}
# checked against the fields above, or settings with one value zmrl matches
_CHECKED = {"head_dim", "qk_head_dim", "rope_interleave", "rope_parameters", "rope_theta", "rope_scaling",
            "hidden_act", "attention_bias", "num_key_value_heads", "moe_layer_freq", "scoring_func",
            "topk_method", "first_k_dense_replace", "quantization_config"}
_GLM_CHECKED = {"mlp_layer_types", "indexer_types", "index_topk_freq", "index_topk_pattern",
                "indexer_rope_interleave", "use_sliding_window", "sliding_window", "max_window_layers"}
# bookkeeping and training-only settings
_IGNORED = {"model_type", "architectures", "auto_map", "bos_token_id", "eos_token_id", "pad_token_id",
            "transformers_version", "use_cache", "attention_dropout", "dtype", "torch_dtype", "pretraining_tp",
            "aux_loss_alpha", "seq_aux", "ep_size", "num_nextn_predict_layers", "output_router_logits",
            "router_aux_loss_coef"}

# HF field -> ModelConfig field it sets, per model type (``zmrl convert`` prints it; fields not listed are
# checked, bookkeeping, or derived: see config_from_hf)
FIELD_TABLES: dict[str, dict[str, str]] = {
    DEEPSEEK_V3: {**_FIELDS, "first_k_dense_replace": "first_k_dense_replace", "rope_interleave": "rope_interleave",
                  "rope_parameters": "rope_theta", "rope_theta": "rope_theta"},
}
FIELD_TABLES[DEEPSEEK_V32] = {**FIELD_TABLES[DEEPSEEK_V3], **_INDEX_FIELDS}
FIELD_TABLES[GLM_MOE_DSA] = {
    **_FIELDS, **_INDEX_FIELDS, "rope_interleave": "rope_interleave", "rope_parameters": "rope_theta",
    "indexer_rope_interleave": "index_rope_interleave", "mlp_layer_types": "mlp_layer_types",
    "indexer_types": "indexer_types", "index_topk_pattern": "indexer_types", "index_topk_freq": "indexer_types"}

# The transformers config classes' defaults, for fields a file leaves out.
_DEFAULTS: dict[str, dict[str, Any]] = {
    DEEPSEEK_V3: dict(vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
                      num_hidden_layers=61, num_attention_heads=128, n_shared_experts=1, n_routed_experts=256,
                      routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64,
                      v_head_dim=128, qk_nope_head_dim=128, n_group=8, topk_group=4, num_experts_per_tok=8,
                      first_k_dense_replace=3, norm_topk_prob=True, max_position_embeddings=4096,
                      rms_norm_eps=1e-6, tie_word_embeddings=False, initializer_range=0.02, rope_interleave=True),
    GLM_MOE_DSA: dict(vocab_size=154880, hidden_size=6144, intermediate_size=12288, moe_intermediate_size=2048,
                      num_hidden_layers=78, num_attention_heads=64, n_shared_experts=1, n_routed_experts=256,
                      routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=2048, qk_rope_head_dim=64,
                      v_head_dim=256, qk_nope_head_dim=192, n_group=1, topk_group=1, num_experts_per_tok=8,
                      norm_topk_prob=True, max_position_embeddings=202752, rms_norm_eps=1e-5,
                      tie_word_embeddings=False, initializer_range=0.02, index_topk=2048, index_head_dim=128,
                      index_n_heads=32, rope_interleave=False, indexer_rope_interleave=False),
}
# DeepSeek-V3.2: V3's defaults plus the released indexer's shape
_DEFAULTS[DEEPSEEK_V32] = {**_DEFAULTS[DEEPSEEK_V3], "index_topk": 2048, "index_n_heads": 64, "index_head_dim": 128}


def is_hf_config(data: dict[str, Any]) -> bool:
    """A transformers config this module reads (zmrl's own always carries ``linear_attn_config``)."""
    return data.get("model_type") in HF_MODEL_TYPES and "linear_attn_config" not in data


def _unsupported(name: str, value: Any, allowed: str) -> ConfigError:
    return ConfigError(f"config field {name!r} = {value!r} is known but not supported by zmrl ({allowed})")


def _known(mt: str) -> set[str]:
    known = {*_FIELDS, *_CHECKED, *_IGNORED}
    if mt in (DEEPSEEK_V32, GLM_MOE_DSA):
        known |= set(_INDEX_FIELDS)
    if mt == GLM_MOE_DSA:
        known |= _GLM_CHECKED
    return known


def _layer_kinds(data: dict[str, Any], layers: int) -> tuple[list[str], list[str] | None]:
    """GLM-MoE-DSA's (mlp_layer_types, indexer_types), filled in as transformers does when absent."""
    mlp = data.get("mlp_layer_types")
    if mlp is None:  # transformers: the first three layers dense (whatever first_k_dense_replace says)
        mlp = ["dense"] * min(3, layers) + ["sparse"] * max(layers - 3, 0)
    if not isinstance(mlp, list):
        raise ConfigError(f"config field 'mlp_layer_types' must be a list of 'dense' / 'sparse', got {mlp!r}")
    if "first_k_dense_replace" in data:
        k = data["first_k_dense_replace"]
        if mlp != ["dense"] * min(k, len(mlp)) + ["sparse"] * max(len(mlp) - k, 0):
            raise ConfigError(f"config field 'first_k_dense_replace' = {k} is inconsistent with the MLP layer "
                              f"types {mlp} (transformers reads 'mlp_layer_types', default 3 dense layers)")
    indexer = data.get("indexer_types")
    if indexer is None:
        pattern, freq = data.get("index_topk_pattern"), data.get("index_topk_freq", 1)
        if pattern is not None:
            codes = {"F": "full", "S": "shared"}
            if isinstance(pattern, str):
                bad = sorted(set(pattern) - set(codes))
                if bad:
                    raise ConfigError(f"config field 'index_topk_pattern': letters must be F or S, got {bad}")
                indexer = [codes[c] for c in pattern]
            else:
                indexer = list(pattern)
        else:
            indexer = ["full" if max(i - 1, 0) % freq == 0 else "shared" for i in range(layers)]
    return list(mlp), (None if all(k == "full" for k in indexer) else list(indexer))


def config_from_hf(data: dict[str, Any]) -> ModelConfig:
    mt = data.get("model_type")
    if mt not in HF_MODEL_TYPES:
        raise ConfigError(f"config field 'model_type' = {mt!r}: no HF adapter for it (supported: "
                          f"{list(HF_MODEL_TYPES)}, and kimi_k3 / kimi_linear through the Kimi release format)")
    known = _known(mt)
    unknown = sorted(k for k in data if k not in known)
    if unknown:
        raise ConfigError(f"unknown config field(s) {unknown} for model_type {mt!r}; known: {sorted(known)}")
    if data.get("quantization_config"):
        q = data["quantization_config"]
        method = q.get("quant_method") if isinstance(q, dict) else q
        raise _unsupported("quantization_config.quant_method", method,
                           "zmrl reads unquantised (bf16/fp32) weights of this model type; dequantise first")
    d = {**_DEFAULTS[mt], **data}
    fields = {**_FIELDS, **(_INDEX_FIELDS if mt != DEEPSEEK_V3 else {})}
    out: dict[str, Any] = {z: d[h] for h, z in fields.items()}
    rope = data.get("rope_parameters") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default" or data.get("rope_scaling"):
        raise _unsupported("rope_parameters.rope_type", data.get("rope_scaling") or rope_type, "'default' only")
    theta = rope.get("rope_theta", data.get("rope_theta"))
    if theta is not None:
        out["rope_theta"] = float(theta)
    out["rope_interleave"] = bool(d["rope_interleave"])
    if d.get("hidden_act", "silu") != "silu":
        raise _unsupported("hidden_act", d["hidden_act"], "'silu' only")
    if d.get("attention_bias", False):
        raise _unsupported("attention_bias", True, "no bias")
    if d.get("use_sliding_window"):
        raise _unsupported("use_sliding_window", True, "full causal attention only")
    for name, want in (("moe_layer_freq", 1), ("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
        if name in data and data[name] != want:
            raise _unsupported(name, data[name], f"{want!r} only")
    nope, rope_dim = d["qk_nope_head_dim"], d["qk_rope_head_dim"]
    checks = [("qk_head_dim", nope + rope_dim)]
    if mt != GLM_MOE_DSA:  # transformers' GLM config has no head_dim (GLM-5's file carries an unused one)
        checks.append(("head_dim", rope_dim))
    for name, want in checks:
        if name in data and data[name] != want:
            raise ConfigError(f"config field {name!r} = {data[name]} is inconsistent: expected {want} from "
                              "qk_nope_head_dim / qk_rope_head_dim")
    if "num_key_value_heads" in data and data["num_key_value_heads"] != d["num_attention_heads"]:
        raise _unsupported("num_key_value_heads", data["num_key_value_heads"],
                           "MLA has one latent per token: it must equal num_attention_heads="
                           f"{d['num_attention_heads']}")
    if out["num_experts_per_tok"] == 1 and out["norm_topk_prob"]:
        # DeepSeek-V3 renormalises even a single expert's weight (to 1); zmrl follows the Kimi K3 rule
        raise _unsupported("norm_topk_prob", True, "with num_experts_per_tok 1 DeepSeek-V3 renormalises to 1; "
                           "zmrl renormalises only when top-k > 1")
    layers = out["num_hidden_layers"]
    if mt == GLM_MOE_DSA:
        out["mlp_layer_types"], out["indexer_types"] = _layer_kinds(data, layers)
        out["first_k_dense_replace"] = 0
        out["index_rope_interleave"] = bool(d["indexer_rope_interleave"])
        out.update(index_quant="none", index_use_hadamard=False)
    else:
        out["first_k_dense_replace"] = d["first_k_dense_replace"]
    if mt == DEEPSEEK_V32:
        out.update(index_quant="fp8", index_use_hadamard=True, index_rope_interleave=False)
    out["linear_attn_config"] = LinearAttnConfig(kda_layers=[], full_attn_layers=list(range(1, layers + 1)))
    out.update(model_type=mt, mla_use_nope=False, moe_glu="swiglu", latent_moe_use_norm=False,
               moe_latent_size=None, attn_res_block_size=None)
    if mt == DEEPSEEK_V3:
        out["index_topk"] = None
    dtype = data.get("torch_dtype") or data.get("dtype")
    if dtype is not None:
        out["torch_dtype"] = dtype
    return ModelConfig(**out).validate()


def skipped_tensor(data: dict[str, Any], name: str) -> bool:
    """Tensors of the multi-token-prediction layers (``model.layers.{i}`` with i >= num_hidden_layers, present
    when ``num_nextn_predict_layers`` > 0) are not part of the causal LM and are not loaded."""
    if not data.get("num_nextn_predict_layers"):
        return False
    m = re.match(r"^model\.layers\.(\d+)\.", name)
    layers = data.get("num_hidden_layers", _DEFAULTS.get(data.get("model_type"), {}).get("num_hidden_layers"))
    return bool(m) and layers is not None and int(m.group(1)) >= layers


_EXPERT_RE = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")


def fused_expert_source(name: str, available: set[str]) -> tuple[str, str, int] | None:
    """Where per-expert tensor ``name`` sits in transformers' fused in-memory expert layout, when a file
    stores that instead: ``(fused name, part, expert)`` with ``mlp.experts.gate_up_proj`` [E, 2I, D]
    (gate rows first, then up) and ``mlp.experts.down_proj`` [E, D, I]; None when not fused there."""
    m = _EXPERT_RE.match(name)
    if m is None:
        return None
    fused = f"{m.group(1)}.{'down_proj' if m.group(3) == 'down' else 'gate_up_proj'}"
    return (fused, m.group(3), int(m.group(2))) if fused in available else None


def slice_fused_expert(t: torch.Tensor, part: str, expert: int) -> torch.Tensor:
    """Expert ``expert``'s ``part`` (gate / up / down) of a fused tensor (see ``fused_expert_source``)."""
    t = t[expert]
    if part == "down":
        return t
    half = t.shape[0] // 2
    return t[:half] if part == "gate" else t[half:]


def fused_expert_shape(shape: tuple[int, ...], part: str) -> tuple[int, ...]:
    return tuple(shape[1:]) if part == "down" else (shape[1] // 2, *shape[2:])


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """The transformers ``config.json`` of ``cfg`` in its ``model_type`` (deepseek_v3, deepseek_v32 or
    glm_moe_dsa); a config outside what that type expresses is an error naming the field."""
    mt = cfg.model_type
    if mt not in HF_MODEL_TYPES:
        raise ConfigError(f"config field 'model_type' = {mt!r} cannot be written as a transformers config.json "
                          f"(supported: {list(HF_MODEL_TYPES)}; Kimi models save with format='k3')")
    checks = [("linear_attn_config", not cfg.linear_attn_config.kda_layers), ("mla_use_nope", not cfg.mla_use_nope),
              ("mla_use_output_gate", not cfg.mla_use_output_gate), ("moe_latent_size", cfg.moe_latent_size is None),
              ("moe_glu", cfg.moe_glu == "swiglu"), ("attn_res_block_size", cfg.attn_res_block_size is None),
              ("mla_latent_norm_eps", cfg.mla_latent_norm_eps == 1e-6)]
    if mt == DEEPSEEK_V3:
        checks += [("index_topk", not cfg.has_indexer)]
    if mt in (DEEPSEEK_V3, DEEPSEEK_V32):
        checks += [("moe_layer_freq", cfg.moe_layer_freq == 1), ("mlp_layer_types", cfg.mlp_layer_types is None)]
    if mt == DEEPSEEK_V32:
        checks += [("index_topk", cfg.has_indexer), ("index_quant", cfg.index_quant == "fp8"),
                   ("index_use_hadamard", cfg.index_use_hadamard),
                   ("index_rope_interleave", not cfg.index_rope_interleave),
                   ("indexer_types", cfg.indexer_types is None)]
    if mt == GLM_MOE_DSA:
        checks += [("index_topk", cfg.has_indexer), ("index_quant", cfg.index_quant == "none"),
                   ("index_use_hadamard", not cfg.index_use_hadamard), ("rope_interleave", not cfg.rope_interleave),
                   ("index_rope_interleave", not cfg.index_rope_interleave)]
    for name, ok in checks:
        if not ok:
            raise ConfigError(f"config field {name!r} = {getattr(cfg, name)!r} cannot be written as a "
                              f"{mt} config.json")
    fields = {**_FIELDS, **(_INDEX_FIELDS if mt != DEEPSEEK_V3 else {})}
    out: dict[str, Any] = {h: getattr(cfg, z) for h, z in fields.items()}
    out.update(model_type=mt, architectures=[ARCHITECTURES[mt]], hidden_act="silu",
               num_key_value_heads=cfg.num_attention_heads, qk_head_dim=cfg.qk_head_dim, attention_bias=False,
               rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta}, torch_dtype=cfg.torch_dtype)
    if mt == GLM_MOE_DSA:
        layers = range(cfg.num_hidden_layers)
        out["mlp_layer_types"] = ["sparse" if cfg.is_moe_layer(i) else "dense" for i in layers]
        out["indexer_types"] = list(cfg.indexer_types or ["full"] * cfg.num_hidden_layers)
    else:
        out.update(head_dim=cfg.qk_rope_head_dim, rope_interleave=cfg.rope_interleave,
                   first_k_dense_replace=cfg.first_k_dense_replace)
    return out
