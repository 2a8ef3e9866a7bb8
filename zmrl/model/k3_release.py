"""The released Kimi K3 checkpoint format: its nested ``config.json`` and its tensor names, both ways.

Config: ``{"model_type": "kimi_k3", "text_config": {"model_type": "kimi_linear", ...}, ...}`` (a
multimodal wrapper; the text model is inside). A bare ``kimi_linear`` config (no wrapper) is read the same
way (its tensors carry no ``language_model.`` prefix). Field names map to ``ModelConfig`` as in
``TEXT_FIELDS``; the KDA gate fields live inside ``linear_attn_config``. A field missing from the text config takes Kimi-Linear's default (``DEFAULTS``),
not zmrl's. No ``index_*`` field means no DSA indexer (the K3 release has none; K3.1 Pro adds one).

Tensors (text model under ``language_model.``): MoE layers under ``block_sparse_moe.`` with
``experts.{e}.w1/w3/w2`` = gate/up/down (dense, or MXFP4 as ``weight_packed`` + ``weight_scale``),
``routed_expert_{down_proj,up_proj,norm}`` = zmrl's ``latent_{down_proj,up_proj,norm}``; AttnRes
projections stored ``[1, hidden]`` (also spelled ``…_res.proj_weight`` / ``…_res.norm_weight``);
``A_log`` of any shape whose first ``num_heads`` entries are used. ``vision_tower.*``,
``mm_projector.*``, ``multi_modal_projector.*``, MTP tensors and layers past ``num_hidden_layers`` are
not part of the text model: they are skipped with a log line.
"""
from __future__ import annotations

import dataclasses
import logging
import re
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch

from .config import ConfigError, LinearAttnConfig, ModelConfig
from .hf_config import SHARED_FIELDS, fused_expert_shape, slice_fused_expert
from .mxfp4 import dequantize_mxfp4, quantize_mxfp4

log = logging.getLogger(__name__)

PREFIX = "language_model."
RELEASE_MODEL_TYPE = "kimi_k3"
TEXT_MODEL_TYPE = "kimi_linear"

# release text-config field -> ModelConfig field (same meaning)
TEXT_FIELDS = {
    **SHARED_FIELDS, "mla_use_nope": "mla_use_nope",
    "mla_use_output_gate": "mla_use_output_gate", "rope_theta": "rope_theta",
    "num_experts": "n_routed_experts", "num_experts_per_token": "num_experts_per_tok",
    "num_shared_experts": "n_shared_experts", "moe_intermediate_size": "moe_intermediate_size",
    "moe_renormalize": "norm_topk_prob", "routed_scaling_factor": "routed_scaling_factor",
    "first_k_dense_replace": "first_k_dense_replace", "moe_layer_freq": "moe_layer_freq",
    "num_expert_group": "n_group", "topk_group": "topk_group",
    "routed_expert_hidden_size": "moe_latent_size", "latent_moe_use_norm": "latent_moe_use_norm",
    "activation_situ_beta": "activation_situ_beta", "activation_situ_linear_beta": "activation_situ_linear_beta",
    "attn_res_block_size": "attn_res_block_size",
    # K3.1 Pro's DSA indexer (absent from the K3 release)
    "index_topk": "index_topk", "index_n_heads": "index_n_heads", "index_head_dim": "index_head_dim",
    "index_use_hadamard": "index_use_hadamard",
}
# Kimi-Linear's defaults for fields a text config leaves out (they differ from zmrl's own defaults)
DEFAULTS: dict[str, Any] = {
    "first_k_dense_replace": 0, "moe_layer_freq": 1, "num_shared_experts": 0, "moe_renormalize": True,
    "routed_scaling_factor": 1.0, "num_expert_group": 1, "topk_group": 1, "latent_moe_use_norm": False,
    "tie_word_embeddings": False, "mla_use_nope": True, "mla_use_output_gate": False, "hidden_act": "situ",
    "activation_situ_beta": None, "activation_situ_linear_beta": None, "attn_res_block_size": None,
    "routed_expert_hidden_size": None, "use_grouped_topk": True, "moe_router_activation_func": "sigmoid",
}
LINEAR_ATTN_FIELDS = ("kda_layers", "full_attn_layers", "num_heads", "head_dim", "short_conv_kernel_size",
                      "gate_lower_bound", "use_full_rank_gate")
# accepted and dropped: bookkeeping, or settings MLA / inference do not use
TEXT_IGNORED = frozenset({
    "model_type", "architectures", "auto_map", "bos_token_id", "eos_token_id", "pad_token_id",
    "transformers_version", "use_cache", "attention_dropout", "num_key_value_heads", "head_dim", "dtype",
    "torch_dtype", "quantization_config", "num_nextn_predict_layers", "rope_scaling", "hidden_act",
    "use_grouped_topk", "moe_router_activation_func",
})
WRAPPER_IGNORED = frozenset({
    "model_type", "text_config", "vision_config", "architectures", "auto_map", "bos_token_id", "eos_token_id",
    "pad_token_id", "transformers_version", "use_cache", "dtype", "torch_dtype", "quantization_config",
    "tie_word_embeddings", "media_placeholder_token_id", "ignore_index", "image_token_index",
})
SUPPORTED_QUANT = {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized"}
SKIPPED_PREFIXES = ("vision_tower.", "vision_model.", "mm_projector.", "multi_modal_projector.", "model.mtp.",
                    "mtp.")


def is_release_config(data: dict[str, Any]) -> bool:
    """A nested ``kimi_k3`` config or a bare ``kimi_linear`` one (zmrl's own format is flat ``kimi_k3``)."""
    mt = data.get("model_type")
    return (mt == RELEASE_MODEL_TYPE and "text_config" in data) or mt == TEXT_MODEL_TYPE


def text_config_of(data: dict[str, Any]) -> dict[str, Any]:
    return data["text_config"] if "text_config" in data else data


def _unsupported(name: str, value: Any, allowed: str) -> ConfigError:
    return ConfigError(f"config field {name!r} = {value!r} is known but not supported by zmrl ({allowed})")


def quantization_of(data: dict[str, Any]) -> dict[str, Any] | None:
    """The checkpoint's quantization_config (wrapper or text config), checked to be one zmrl reads."""
    q = data.get("quantization_config") or text_config_of(data).get("quantization_config")
    if q is None:
        return None
    for key, want in SUPPORTED_QUANT.items():
        if q.get(key) != want:
            raise _unsupported(f"quantization_config.{key}", q.get(key), f"only {want!r} is read")
    return q


def config_from_release(data: dict[str, Any]) -> ModelConfig:
    """A ``ModelConfig`` from a release ``config.json`` (already parsed)."""
    if "text_config" in data:
        unknown = sorted(k for k in data if k not in WRAPPER_IGNORED)
        if unknown:
            raise ConfigError(f"unknown config field(s) {unknown} in the {RELEASE_MODEL_TYPE} wrapper; known: "
                              f"{sorted(WRAPPER_IGNORED)}")
    text = text_config_of(data)
    if not isinstance(text, dict):
        raise ConfigError("config field 'text_config' must be an object")
    if text.get("model_type", TEXT_MODEL_TYPE) != TEXT_MODEL_TYPE:
        raise _unsupported("text_config.model_type", text.get("model_type"), f"only {TEXT_MODEL_TYPE!r}")
    unknown = sorted(k for k in text if k not in TEXT_FIELDS and k not in TEXT_IGNORED and k != "linear_attn_config")
    if unknown:
        raise ConfigError(f"unknown config field(s) {['text_config.' + k for k in unknown]}; known: "
                          f"{sorted([*TEXT_FIELDS, *TEXT_IGNORED, 'linear_attn_config'])}")
    t = {**DEFAULTS, **text}
    if t["hidden_act"] not in ("situ", "silu"):
        raise _unsupported("hidden_act", t["hidden_act"], "'situ' or 'silu'")
    if t["moe_router_activation_func"] != "sigmoid":
        raise _unsupported("moe_router_activation_func", t["moe_router_activation_func"], "only 'sigmoid'")
    if t.get("rope_scaling"):
        raise _unsupported("rope_scaling", t["rope_scaling"], "no rope scaling; null only")
    if t.get("num_nextn_predict_layers"):
        log.info("config: %d MTP layer(s) are not part of the text model and are not loaded",
                 t["num_nextn_predict_layers"])
    quantization_of(data)
    out: dict[str, Any] = {zname: t[rname] for rname, zname in TEXT_FIELDS.items() if rname in t}
    out["moe_glu"] = "situ" if t["hidden_act"] == "situ" else "swiglu"
    if out["activation_situ_beta"] is None:
        out["activation_situ_beta"] = 1.0  # Kimi-Linear's SiTU without a beta
    if not t["use_grouped_topk"]:
        out["n_group"], out["topk_group"] = 1, 1
    dtype = data.get("torch_dtype") or data.get("dtype") or text.get("torch_dtype") or text.get("dtype")
    if dtype is not None:
        out["torch_dtype"] = dtype
    la = text.get("linear_attn_config")
    if not isinstance(la, dict):
        raise ConfigError("config field 'text_config.linear_attn_config' is required (kda_layers, full_attn_layers, "
                          "num_heads, head_dim, short_conv_kernel_size)")
    la_unknown = sorted(set(la) - set(LINEAR_ATTN_FIELDS))
    if la_unknown:
        raise ConfigError(f"unknown field(s) linear_attn_config.{la_unknown}; known: {list(LINEAR_ATTN_FIELDS)}")
    out["linear_attn_config"] = LinearAttnConfig(**{k: la[k] for k in
                                                    ("num_heads", "head_dim", "short_conv_kernel_size",
                                                     "kda_layers", "full_attn_layers") if k in la})
    out["gate_lower_bound"] = la.get("gate_lower_bound")
    out["use_full_rank_gate"] = bool(la.get("use_full_rank_gate", False))
    out.setdefault("index_topk", None)
    out["model_type"] = RELEASE_MODEL_TYPE
    return ModelConfig(**out).validate()


def config_to_release(cfg: ModelConfig, quantized_experts: bool) -> dict[str, Any]:
    """The release ``config.json`` for ``cfg`` (every text field written, none left to defaults)."""
    d = dataclasses.asdict(cfg)
    text: dict[str, Any] = {"model_type": TEXT_MODEL_TYPE}
    for rname, zname in TEXT_FIELDS.items():
        if zname.startswith("index_") and not cfg.has_indexer:
            continue
        text[rname] = d[zname]
    text["hidden_act"] = "situ" if cfg.moe_glu == "situ" else "silu"
    text["moe_router_activation_func"] = "sigmoid"
    text["use_grouped_topk"] = cfg.n_group > 1
    la = cfg.linear_attn_config
    text["linear_attn_config"] = {
        "kda_layers": list(la.kda_layers), "full_attn_layers": list(la.full_attn_layers), "num_heads": la.num_heads,
        "head_dim": la.head_dim, "short_conv_kernel_size": la.short_conv_kernel_size,
        "gate_lower_bound": cfg.gate_lower_bound, "use_full_rank_gate": cfg.use_full_rank_gate,
    }
    out: dict[str, Any] = {"model_type": RELEASE_MODEL_TYPE, "torch_dtype": cfg.torch_dtype,
                           "tie_word_embeddings": cfg.tie_word_embeddings, "text_config": text}
    if quantized_experts:
        out["quantization_config"] = dict(SUPPORTED_QUANT)
    # settings the release format has no field for: only their Kimi values can be written
    for name in ("rope_interleave", "index_rope_interleave", "index_quant", "indexer_types", "mlp_layer_types"):
        if getattr(cfg, name) != getattr(ModelConfig, name):
            raise ConfigError(f"config field {name!r} = {getattr(cfg, name)!r} cannot be written in the release "
                              f"format (it has no such field; Kimi's value is {getattr(ModelConfig, name)!r})")
    if cfg.mla_latent_norm_eps != ModelConfig.mla_latent_norm_eps:
        raise ConfigError(f"config field 'mla_latent_norm_eps' = {cfg.mla_latent_norm_eps} cannot be written in the "
                          f"release format (its code fixes {ModelConfig.mla_latent_norm_eps})")
    return out


# ----------------------------------------------------------------------------- tensor names

_MOE_RE = re.compile(r"^model\.layers\.(\d+)\.mlp\.(.*)$")
_EXPERT_PROJ = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
_LATENT = {"latent_down_proj": "routed_expert_down_proj", "latent_up_proj": "routed_expert_up_proj",
           "latent_norm": "routed_expert_norm"}


@dataclass(frozen=True)
class Source:
    """Where one zmrl tensor comes from in a release checkpoint: ``names`` (one, or packed + scale) and
    the transform to zmrl's layout."""

    names: tuple[str, ...]
    # "plain" | "mxfp4" | "row" ([1, D] -> [D]) | "a_log" (first num_heads entries) | "fused_gate" /
    # "fused_up" / "fused_down" (expert ``expert`` of transformers' fused expert tensors, hf_config.py)
    kind: str
    expert: int | None = None


def _moe_rest(rest: str) -> str:
    """zmrl name inside ``mlp.`` of an MoE layer -> release name inside ``block_sparse_moe.``."""
    parts = rest.split(".")
    if parts[0] == "experts":  # experts.{e}.{gate,up,down}_proj.weight
        return f"experts.{parts[1]}.{_EXPERT_PROJ[parts[2]]}.{parts[3]}"
    if parts[0] in _LATENT:
        return ".".join([_LATENT[parts[0]], *parts[1:]])
    return rest  # gate.weight, gate.e_score_correction_bias, shared_experts.*


def release_name(cfg: ModelConfig, name: str) -> str:
    """The release name (without ``language_model.``) of zmrl tensor ``name``."""
    m = _MOE_RE.match(name)
    if m and cfg.is_moe_layer(int(m.group(1))):
        return f"model.layers.{m.group(1)}.block_sparse_moe.{_moe_rest(m.group(2))}"
    return name


def tensor_prefix(data: dict[str, Any]) -> str:
    """``language_model.`` under the multimodal ``kimi_k3`` wrapper; none for a bare ``kimi_linear`` model."""
    return PREFIX if "text_config" in data else ""


def _alternatives(cfg: ModelConfig, name: str, prefix: str) -> list[Source]:
    """Release spellings of zmrl tensor ``name``, preferred first."""
    base = prefix + release_name(cfg, name)
    if ".block_sparse_moe.experts." in base and base.endswith(".weight"):
        stem = base[: -len(".weight")]
        return [Source((base,), "plain"), Source((stem + ".weight_packed", stem + ".weight_scale"), "mxfp4")]
    for kind in ("proj", "norm"):
        if name.endswith(f"_res_{kind}.weight"):  # <site>_res_proj.weight, also spelled <site>_res.proj_weight
            site = name[: -len(f"_{kind}.weight")]
            return [Source((base,), "row"), Source((f"{prefix}{site}.{kind}_weight",), "row")]
    if name.endswith(".A_log"):
        return [Source((base,), "a_log")]
    if name.endswith(".gate.e_score_correction_bias") and ".block_sparse_moe." in base:
        return [Source((base,), "plain"), Source((base.replace(".gate.e_score", ".e_score"),), "plain")]
    return [Source((base,), "plain")]


def skip_reason(cfg: ModelConfig, name: str) -> str | None:
    """Why a release tensor outside the text model is skipped (None: it should be part of it)."""
    inner = name[len(PREFIX):] if name.startswith(PREFIX) else name
    if inner.startswith(SKIPPED_PREFIXES) or name.startswith(SKIPPED_PREFIXES):
        return "vision / projector / MTP"
    m = re.match(r"^model\.layers\.(\d+)\.", inner)
    if m and int(m.group(1)) >= cfg.num_hidden_layers:
        return "layer past num_hidden_layers (MTP)"
    return None


def map_release_tensors(cfg: ModelConfig, expected: Iterable[str], available: Iterable[str], prefix: str = PREFIX
                        ) -> tuple[dict[str, Source], list[str], list[str], dict[str, list[str]]]:
    """(zmrl name -> Source, missing zmrl names with their release spellings, unexpected release names,
    skipped release names by reason). ``prefix``: ``tensor_prefix`` of the config."""
    have = set(available)
    used: set[str] = set()
    sources: dict[str, Source] = {}
    missing: list[str] = []
    for name in expected:
        alts = _alternatives(cfg, name, prefix)
        found = next((a for a in alts if all(n in have for n in a.names)), None)
        if found is None:
            missing.append(f"{name} (release: {' or '.join('+'.join(a.names) for a in alts)})")
            continue
        sources[name] = found
        used.update(found.names)
    skipped: dict[str, list[str]] = {}
    unexpected = []
    for n in sorted(have - used):
        reason = skip_reason(cfg, n)
        if reason is None:
            unexpected.append(n)
        else:
            skipped.setdefault(reason, []).append(n)
    return sources, missing, unexpected, skipped


def convert_tensor(src: Source, read: Callable[[str], torch.Tensor], num_heads: int) -> torch.Tensor:
    """The zmrl tensor for ``src`` (``read`` returns a release tensor by name)."""
    if src.kind.startswith("fused_"):
        return slice_fused_expert(read(src.names[0]), src.kind[len("fused_"):], src.expert)
    if src.kind == "mxfp4":
        return dequantize_mxfp4(read(src.names[0]), read(src.names[1]), name=src.names[0])
    t = read(src.names[0])
    if src.kind == "row":
        return t.reshape(-1)
    if src.kind == "a_log":
        return t.reshape(-1)[:num_heads]
    return t


def converted_shape(src: Source, shapes: list[tuple[int, ...]], num_heads: int) -> tuple[int, ...]:
    """The zmrl shape ``convert_tensor`` gives for ``src`` from its tensors' header shapes alone."""
    if src.kind.startswith("fused_"):
        return fused_expert_shape(shapes[0], src.kind[len("fused_"):])
    if src.kind == "mxfp4":
        (out, half), _ = shapes
        return (out, 2 * half)
    n = 1
    for d in shapes[0]:
        n *= d
    if src.kind == "row":
        return (n,)
    if src.kind == "a_log":
        return (min(n, num_heads),)
    return shapes[0]


def release_state(cfg: ModelConfig, state: dict[str, torch.Tensor], quantize_experts: bool, prefix: str = PREFIX
                  ) -> dict[str, torch.Tensor]:
    """zmrl tensors (checkpoint names) -> release tensors. Routed experts become MXFP4 when
    ``quantize_experts`` (exactly, or MXFP4Error); AttnRes projections [1, D]; ``A_log`` [1, 1, H, 1]."""
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        rname = prefix + release_name(cfg, name)
        if ".block_sparse_moe.experts." in rname and quantize_experts:
            stem = rname[: -len(".weight")]
            out[stem + ".weight_packed"], out[stem + ".weight_scale"] = quantize_mxfp4(t, exact=True, name=name)
        elif name.endswith("_res_proj.weight"):
            out[rname] = t.reshape(1, -1)
        elif name.endswith(".A_log"):
            out[rname] = t.reshape(1, 1, -1, 1)
        else:
            out[rname] = t
    return out
