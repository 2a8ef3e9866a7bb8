"""Model configuration: one dataclass whose field names follow the HF ``config.json`` of
Kimi-Linear / Kimi-K3 / DeepSeek-V3.2, so real configs load by name."""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any

# Keys that appear in real HF config.json files but carry nothing this implementation uses.
# They are accepted and dropped; any other unknown key is an error.
IGNORED_HF_KEYS = frozenset({
    "architectures", "auto_map", "bos_token_id", "eos_token_id", "pad_token_id",
    "transformers_version", "use_cache", "hidden_act", "attention_dropout", "attention_bias",
    "quantization_config", "num_nextn_predict_layers", "scoring_func", "topk_method",
    "aux_loss_alpha", "seq_aux", "ep_size", "pretraining_tp",
    "num_key_value_heads", "rope_scaling", "dtype",
})

KDA_CHUNK_SIZE = 64  # fixed by the bitwise contract: chunks aligned to absolute positions 0, 64, ...


class ConfigError(ValueError):
    """A config field is unknown, missing or inconsistent; the message names it."""


@dataclass
class LinearAttnConfig:
    num_heads: int = 4
    head_dim: int = 64
    short_conv_kernel_size: int = 4
    kda_layers: list[int] = field(default_factory=lambda: [1, 2, 3])  # 1-based, as in Kimi
    full_attn_layers: list[int] = field(default_factory=lambda: [4])  # 1-based


@dataclass
class ModelConfig:
    model_type: str = "kimi_k3"
    vocab_size: int = 2048
    hidden_size: int = 256
    num_hidden_layers: int = 4
    intermediate_size: int = 512  # dense MLP of the first `first_k_dense_replace` layers
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    initializer_range: float = 0.02
    tie_word_embeddings: bool = False
    torch_dtype: str = "float32"

    # KDA (linear attention)
    linear_attn_config: LinearAttnConfig = field(default_factory=LinearAttnConfig)
    gate_lower_bound: float | None = None  # K3 "safe" gate: lb * sigmoid(...); None = softplus gate
    use_full_rank_gate: bool = False  # K3: output gate g_proj [H*dk, D] instead of g_a/g_b

    # MLA
    num_attention_heads: int = 4
    q_lora_rank: int | None = 128
    kv_lora_rank: int = 64
    # eps of q_a_layernorm / kv_a_layernorm: the released K3 code fixes it at 1e-6 whatever
    # rms_norm_eps is (it matters when the latents are small)
    mla_latent_norm_eps: float = 1e-6
    qk_nope_head_dim: int = 32
    qk_rope_head_dim: int = 16
    v_head_dim: int = 32
    mla_use_nope: bool = True  # Kimi: no rotary anywhere
    mla_use_output_gate: bool = False  # K3 gated MLA: o * sigmoid(g_proj x) before o_proj
    rope_theta: float = 10000.0
    # Rotary layout (when mla_use_nope is false): True rotates the pairs (0,1), (2,3), ... (DeepSeek MLA);
    # False rotates (i, i + dim/2) (split-half / NeoX, as GLM-MoE-DSA's MLA). Same on every path.
    rope_interleave: bool = True
    index_rope_interleave: bool = False  # the same choice for the DSA indexer's rope dims (DeepSeek: split-half)

    # DSA indexer (on every MLA layer when index_topk is set; a config without it has none)
    index_n_heads: int = 4
    index_head_dim: int = 32
    index_topk: int | None = None
    index_use_hadamard: bool = False
    # "fp8": indexer queries and keys quantised to FP8 e4m3 with one scale per 128 values (DeepSeek-V3.2's
    # inference); "none": kept in the model dtype (transformers' GlmMoeDsa indexer). Both sides use it.
    index_quant: str = "fp8"
    # Per layer "full" (computes its top-k) or "shared" (reuses the selection of the nearest earlier MLA
    # layer, as GLM-MoE-DSA's indexer_types); None = every MLA layer full. Shared layers keep their
    # indexer weights (checkpoints carry them) but never run them.
    indexer_types: list[str] | None = None

    # MoE
    n_routed_experts: int = 8
    num_experts_per_tok: int = 2
    n_shared_experts: int = 1
    moe_intermediate_size: int = 128
    first_k_dense_replace: int = 1
    moe_layer_freq: int = 1  # MoE on layers i >= first_k_dense_replace with i % moe_layer_freq == 0
    # Per layer "dense" or "sparse" (GLM-MoE-DSA's mlp_layer_types); overrides the two fields above when set.
    mlp_layer_types: list[str] | None = None
    n_group: int = 4
    topk_group: int = 2
    routed_scaling_factor: float = 2.5
    norm_topk_prob: bool = True  # renormalise the top-k weights (only when num_experts_per_tok > 1)
    moe_latent_size: int | None = None  # K3 latent MoE: experts run in this width
    latent_moe_use_norm: bool = True  # RMSNorm of the combined latent before latent_up_proj
    moe_glu: str = "swiglu"  # "swiglu" | "situ" (K3 SiTU-GLU), in the dense MLP and every expert
    # SiTU-GLU: beta*tanh(g/beta)*sigmoid(g) * linear_beta*tanh(u/linear_beta); linear_beta None = no cap
    activation_situ_beta: float = 4.0
    activation_situ_linear_beta: float | None = 25.0

    # K3 block attention-residuals; None = plain residual stream
    attn_res_block_size: int | None = None

    # ------------------------------------------------------------------ derived
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def has_indexer(self) -> bool:
        return self.index_topk is not None

    def is_kda_layer(self, layer_idx: int) -> bool:
        """layer_idx is 0-based; the config lists are 1-based."""
        return (layer_idx + 1) in self.linear_attn_config.kda_layers

    def is_moe_layer(self, layer_idx: int) -> bool:
        if self.n_routed_experts <= 0:
            return False
        if self.mlp_layer_types is not None:
            return self.mlp_layer_types[layer_idx] == "sparse"
        return layer_idx >= self.first_k_dense_replace and layer_idx % self.moe_layer_freq == 0

    def index_source_layer(self, layer_idx: int) -> int:
        """The MLA layer whose DSA top-k selection layer ``layer_idx`` uses: itself when its indexer is
        "full" (or no earlier MLA layer exists), else the source of the nearest earlier MLA layer."""
        if self.indexer_types is None or self.indexer_types[layer_idx] == "full":
            return layer_idx
        earlier = [i for i in range(layer_idx) if not self.is_kda_layer(i)]
        return self.index_source_layer(earlier[-1]) if earlier else layer_idx

    def index_key_layers(self) -> list[int]:
        """The MLA layers that store DSA index keys: those whose indexer computes its own selection
        ("shared" layers reuse an earlier layer's and store none). Empty without an indexer."""
        if not self.has_indexer:
            return []
        return [i for i in range(self.num_hidden_layers) if not self.is_kda_layer(i) and self.index_source_layer(i) == i]

    # ------------------------------------------------------------------ validation
    def validate(self) -> "ModelConfig":
        def need(cond: bool, name: str, msg: str) -> None:
            if not cond:
                raise ConfigError(f"config field {name!r}: {msg}")

        la = self.linear_attn_config
        need(isinstance(la, LinearAttnConfig), "linear_attn_config", "must be an object with num_heads, head_dim, ...")
        for name in ("num_attention_heads", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim", "intermediate_size",
                     "max_position_embeddings"):
            need(getattr(self, name) > 0, name, f"must be > 0, got {getattr(self, name)}")
        for name in ("first_k_dense_replace", "n_shared_experts", "n_routed_experts", "qk_rope_head_dim"):
            need(getattr(self, name) >= 0, name, f"must be >= 0, got {getattr(self, name)}")
        need(self.n_group >= 1, "n_group", f"must be >= 1, got {self.n_group}")
        need(self.moe_layer_freq >= 1, "moe_layer_freq", f"must be >= 1, got {self.moe_layer_freq}")
        need(self.mla_latent_norm_eps > 0, "mla_latent_norm_eps", f"must be > 0, got {self.mla_latent_norm_eps}")
        need(self.rms_norm_eps > 0, "rms_norm_eps", f"must be > 0, got {self.rms_norm_eps}")
        need(self.activation_situ_beta > 0, "activation_situ_beta", f"must be > 0, got {self.activation_situ_beta}")
        if self.activation_situ_linear_beta is not None:
            need(self.activation_situ_linear_beta > 0, "activation_situ_linear_beta",
                 f"must be > 0 or null, got {self.activation_situ_linear_beta}")
        if self.moe_latent_size is not None:
            need(self.moe_latent_size > 0, "moe_latent_size", f"must be > 0 or null, got {self.moe_latent_size}")
        need(len(set(la.kda_layers)) == len(la.kda_layers) and len(set(la.full_attn_layers)) == len(la.full_attn_layers),
             "linear_attn_config.kda_layers", "layer lists must not repeat a layer")
        need(self.vocab_size > 0, "vocab_size", f"must be > 0, got {self.vocab_size}")
        need(self.hidden_size > 0, "hidden_size", f"must be > 0, got {self.hidden_size}")
        need(self.num_hidden_layers > 0, "num_hidden_layers", "must be > 0")
        all_layers = set(range(1, self.num_hidden_layers + 1))
        kda, full = set(la.kda_layers), set(la.full_attn_layers)
        need(kda | full == all_layers and not (kda & full), "linear_attn_config.kda_layers",
             f"kda_layers {sorted(kda)} and full_attn_layers {sorted(full)} must partition the 1-based "
             f"layers 1..{self.num_hidden_layers}")
        need(la.short_conv_kernel_size == 4, "linear_attn_config.short_conv_kernel_size",
             f"only 4 is supported, got {la.short_conv_kernel_size}")
        need(la.head_dim > 0 and la.num_heads > 0, "linear_attn_config.num_heads", "heads and head_dim must be > 0")
        need(self.qk_rope_head_dim % 2 == 0, "qk_rope_head_dim", f"must be even, got {self.qk_rope_head_dim}")
        if self.has_indexer:
            need(self.q_lora_rank is not None, "q_lora_rank",
                 "the DSA indexer reads the MLA query latent, so q_lora_rank must be set when index_topk is")
            need(self.index_topk > 0, "index_topk", f"must be > 0 or null, got {self.index_topk}")
            need(self.index_n_heads > 0, "index_n_heads", f"must be > 0, got {self.index_n_heads}")
            need(self.index_head_dim % 2 == 0 and self.index_head_dim >= self.qk_rope_head_dim,
                 "index_head_dim", f"must be even and >= qk_rope_head_dim, got {self.index_head_dim}")
            if self.index_use_hadamard:
                d = self.index_head_dim
                need(d & (d - 1) == 0, "index_head_dim", f"Hadamard rotation needs a power of two, got {d}")
        if self.n_routed_experts > 0:
            need(0 < self.num_experts_per_tok <= self.n_routed_experts, "num_experts_per_tok",
                 f"must be in [1, n_routed_experts={self.n_routed_experts}], got {self.num_experts_per_tok}")
            need(self.n_routed_experts % self.n_group == 0, "n_group",
                 f"n_routed_experts={self.n_routed_experts} is not divisible by n_group={self.n_group}")
            need(1 <= self.topk_group <= self.n_group, "topk_group",
                 f"must be in [1, n_group={self.n_group}], got {self.topk_group}")
            per_group = self.n_routed_experts // self.n_group
            need(self.n_group == 1 or per_group >= 2, "n_group", "group scores need >= 2 experts per group")
            need(self.topk_group * per_group >= self.num_experts_per_tok, "topk_group",
                 "the kept groups hold fewer experts than num_experts_per_tok")
        for name, allowed in (("indexer_types", ("full", "shared")), ("mlp_layer_types", ("dense", "sparse"))):
            kinds = getattr(self, name)
            if kinds is not None:
                need(isinstance(kinds, list) and len(kinds) == self.num_hidden_layers, name,
                     f"must list one entry per layer ({self.num_hidden_layers}), got {kinds!r}")
                bad = sorted({k for k in kinds if k not in allowed})
                need(not bad, name, f"entries must be one of {list(allowed)}, got {bad}")
        need(self.indexer_types is None or self.has_indexer, "indexer_types",
             "set without a DSA indexer (index_topk is null)")
        need(self.index_quant in ("fp8", "none"), "index_quant", f"must be 'fp8' or 'none', got {self.index_quant!r}")
        need(self.moe_glu in ("swiglu", "situ"), "moe_glu", f"must be 'swiglu' or 'situ', got {self.moe_glu!r}")
        need(self.torch_dtype in ("float32", "bfloat16", "float16", "float64"), "torch_dtype",
             f"unsupported dtype {self.torch_dtype!r}")
        if self.gate_lower_bound is not None:
            need(self.gate_lower_bound < 0, "gate_lower_bound", f"must be negative, got {self.gate_lower_bound}")
        if self.attn_res_block_size is not None:
            need(self.attn_res_block_size > 0, "attn_res_block_size", "must be > 0 or null")
        return self

    # ------------------------------------------------------------------ (de)serialisation
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ModelConfig":
        """zmrl's flat config, the released Kimi K3 / Kimi-Linear format (k3_release.py), or a transformers
        config of a supported ``model_type`` (hf_config.py)."""
        from .hf_config import config_from_hf, is_hf_config
        from .k3_release import config_from_release, is_release_config

        if is_release_config(data):
            return config_from_release(data)
        if is_hf_config(data):
            return config_from_hf(data)
        from .hf_config import HF_MODEL_TYPES
        from .k3_release import RELEASE_MODEL_TYPE, TEXT_MODEL_TYPE

        supported = (RELEASE_MODEL_TYPE, TEXT_MODEL_TYPE, *HF_MODEL_TYPES)
        if data.get("model_type", RELEASE_MODEL_TYPE) not in supported:
            raise ConfigError(f"config field 'model_type' = {data['model_type']!r} is not supported (supported: "
                              f"{list(supported)})")
        data = dict(data)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(k for k in data if k not in known and k not in IGNORED_HF_KEYS)
        if unknown:
            raise ConfigError(f"unknown config field(s) {unknown}; valid fields: {sorted(known)}")
        la = data.get("linear_attn_config")
        if isinstance(la, dict):
            la_known = {f.name for f in dataclasses.fields(LinearAttnConfig)}
            la_unknown = sorted(set(la) - la_known)
            if la_unknown:
                raise ConfigError(f"unknown field(s) linear_attn_config.{la_unknown}; valid: {sorted(la_known)}")
            data["linear_attn_config"] = LinearAttnConfig(**la)
        return cls(**{k: v for k, v in data.items() if k in known}).validate()

    def to_json(self, path: str | os.PathLike) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=2, sort_keys=True)
            f.write("\n")

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> "ModelConfig":
        with open(path) as f:
            try:
                data = json.load(f)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path}: not valid JSON ({e})") from e
        try:
            return cls.from_dict(data)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from e

    @classmethod
    def preset(cls, name: str) -> "ModelConfig":
        from .presets import PRESETS

        if name not in PRESETS:
            raise ConfigError(f"unknown preset {name!r}; available: {sorted(PRESETS)}")
        return PRESETS[name]().validate()

    # ------------------------------------------------------------------ sizing (see sizing.py)
    def param_counts(self) -> tuple[int, int]:
        """(total, active) parameter counts, embeddings and lm_head included (sizing.param_counts)."""
        from zmrl.capacity.sizing import param_counts

        return param_counts(self)

    def kv_bytes_per_token_per_layer(self, latent: str = "bf16", index: str = "fp8") -> tuple[int, int]:
        """(latent_bytes, index_key_bytes) per token per MLA layer (sizing.kv_bytes_per_token_per_layer)."""
        from zmrl.capacity.sizing import kv_bytes_per_token_per_layer

        return kv_bytes_per_token_per_layer(self, latent=latent, index=index)

    def kda_state_bytes_per_request(self) -> int:
        """KDA recurrent + short-conv state bytes of one request (sizing.kda_state_bytes_per_request)."""
        from zmrl.capacity.sizing import kda_state_bytes_per_request

        return kda_state_bytes_per_request(self)
