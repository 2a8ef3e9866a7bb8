"""Config presets, validation, (de)serialisation and the sizing math of zmrl.capacity.sizing."""
from __future__ import annotations

import dataclasses
import json
import math

import pytest

from zmrl.model.config import ConfigError, LinearAttnConfig, ModelConfig
from zmrl.model.presets import PRESETS
from zmrl.capacity.sizing import (
    format_param_breakdown,
    kda_state_bytes_per_request,
    kv_bytes_per_token_per_layer,
    param_breakdown,
    param_counts,
    weight_shapes,
)


@pytest.fixture(scope="module")
def k3() -> ModelConfig:
    return ModelConfig.preset("k3.1-pro")


@pytest.fixture(scope="module")
def k3_counts(k3: ModelConfig) -> tuple[int, int]:
    return k3.param_counts()  # ~0.6 s: 250k tensor names, so computed once


# ---------------------------------------------------------------------------- presets
@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_validates(name: str) -> None:
    cfg = ModelConfig.preset(name)
    assert isinstance(cfg, ModelConfig)
    assert cfg.validate() is cfg


def test_preset_names() -> None:
    assert {"tiny", "bench", "k3.1-pro"} <= set(PRESETS)


def test_unknown_preset_lists_presets() -> None:
    with pytest.raises(ConfigError) as ei:
        ModelConfig.preset("k9-ultra")
    msg = str(ei.value)
    assert "k9-ultra" in msg
    for name in PRESETS:
        assert name in msg


def test_k3_layer_counts(k3: ModelConfig) -> None:
    la = k3.linear_attn_config
    assert k3.num_hidden_layers == 93
    assert len(la.kda_layers) == 69 and len(la.full_attn_layers) == 24
    assert la.full_attn_layers[:3] == [4, 8, 12] and la.full_attn_layers[-2:] == [92, 93]
    assert sum(k3.is_kda_layer(i) for i in range(93)) == 69
    # 0-based indices: 1-based layers 92 and 93 are both MLA, 91 is KDA
    assert not k3.is_kda_layer(92) and not k3.is_kda_layer(91) and k3.is_kda_layer(90)


def test_bench_layer_pattern() -> None:
    cfg = ModelConfig.preset("bench")
    assert [i + 1 for i in range(16) if not cfg.is_kda_layer(i)] == [4, 8, 12, 16]
    assert cfg.num_attention_heads == 64 and cfg.index_topk == 2048 and cfg.index_use_hadamard


# ---------------------------------------------------------------------------- parameter counts
def test_k3_param_counts_near_published(k3_counts: tuple[int, int]) -> None:
    # The article: 2.8 T total, 104 B active. Open fields were chosen to land near these (see
    # docs/sizing.md); 10% is the brief's bound. Today's values are within 1.5%.
    total, active = k3_counts
    assert abs(total - 2.8e12) / 2.8e12 < 0.10, total
    assert abs(active - 1.04e11) / 1.04e11 < 0.10, active


def test_k3_counts_exact(k3: ModelConfig, k3_counts: tuple[int, int]) -> None:
    # Closed form written independently of weight_shapes, from the released tensor shapes (docs/model.md).
    D, V, H, dk, E, k, I, Lt = 7168, 163840, 96, 128, 896, 16, 3072, 3584
    hk = H * dk
    kda = 3 * hk * D + 3 * hk * 4 + dk * D + hk * dk + H + hk + H * D + hk * D + dk + D * hk
    mla = (1536 * D + 1536 + H * 192 * 1536 + 576 * D + 512 + H * 256 * 512 + H * 128 * D
           + D * H * 128)
    idx = 32 * 128 * 1536 + 128 * D + 2 * 128 + 32 * D
    norms = 2 * D + 4 * D  # input/post norms + 4 AttnRes vectors
    expert = 3 * Lt * I
    moe_fixed = E * D + E + 2 * Lt * D + Lt + 3 * D * 2 * I
    dense = 3 * D * 33792
    top = 2 * V * D + D + 2 * D
    total = top + 93 * norms + 69 * kda + 24 * (mla + idx) + dense + 92 * (moe_fixed + E * expert)
    active = total - 92 * (E - k) * expert
    assert k3_counts == (total, active)


def test_k3_shapes_match_architecture_notes(k3: ModelConfig) -> None:
    s = weight_shapes(k3)
    mla = "model.layers.3.self_attn."
    assert s[mla + "kv_b_proj.weight"] == (24576, 512)  # architecture.md §5
    assert s[mla + "g_proj.weight"] == (12288, 7168)
    assert s[mla + "indexer.wq_b.weight"] == (4096, 1536)
    kda = "model.layers.0.self_attn."
    assert s[kda + "g_proj.weight"] == (12288, 7168) and kda + "g_a_proj.weight" not in s
    moe = "model.layers.1.mlp."
    assert s[moe + "latent_down_proj.weight"] == (3584, 7168)
    assert s[moe + "latent_up_proj.weight"] == (7168, 3584)
    assert s[moe + "latent_norm.weight"] == (3584,)
    assert s[moe + "gate.weight"] == (896, 7168)
    assert s[moe + "experts.895.down_proj.weight"] == (3584, 3072)
    assert s[moe + "shared_experts.gate_proj.weight"] == (6144, 7168)
    assert s["model.layers.0.mlp.gate_proj.weight"] == (33792, 7168)  # first_k_dense_replace 1
    assert s["model.output_attn_res_proj.weight"] == (7168,)
    assert s["model.layers.5.mlp_res_norm.weight"] == (7168,)


def test_tiny_and_bench_match_architecture_notes() -> None:
    # architecture.md §7 derived these independently: tiny ≈5.25 M; bench ≈2.62 B total,
    # ≈0.63 B active without embeddings; per layer KDA 17.9 M, MLA 37.4 M, indexer 3.5 M,
    # MoE 102.4 M. Rounding in the notes is to the printed digit.
    t_total, _ = param_counts(ModelConfig.preset("tiny"))
    assert round(t_total / 1e6, 2) == 5.25
    bench = ModelConfig.preset("bench")
    total, active = bench.param_counts()
    assert round(total / 1e9, 2) == 2.62
    assert round((active - 2 * 163840 * 2048) / 1e9, 2) == 0.63
    rows = {r.component: r for r in param_breakdown(bench)}
    assert round(rows["KDA attention"].per_layer_total / 1e6, 1) == 17.9
    assert round(rows["MLA attention"].per_layer_total / 1e6, 1) == 37.4
    assert round(rows["DSA indexer"].per_layer_total / 1e6, 1) == 3.5
    moe = sum(rows[c].per_layer_total for c in ("MoE router", "MoE routed experts", "MoE shared experts"))
    assert round(moe / 1e6, 1) == 102.4


def _deepseek_v3() -> ModelConfig:
    """All-MLA, no indexer, DeepSeek-V3 shapes: a public total/active pair to calibrate against."""
    return ModelConfig(
        vocab_size=129280, hidden_size=7168, num_hidden_layers=61, intermediate_size=18432,
        linear_attn_config=LinearAttnConfig(kda_layers=[], full_attn_layers=list(range(1, 62))),
        num_attention_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, index_topk=None, n_routed_experts=256,
        num_experts_per_tok=8, n_shared_experts=1, moe_intermediate_size=2048,
        first_k_dense_replace=3, n_group=8, topk_group=4,
    ).validate()


def test_counting_convention_reproduces_deepseek_v3() -> None:
    # DeepSeek-V3 publishes 671 B total (without its MTP module) and 37 B active; the same
    # enumeration (embeddings + lm_head in both) must give those, or the convention is off.
    total, active = param_counts(_deepseek_v3())
    assert round(total / 1e9) == 671
    assert round(active / 1e9) in (37, 38)  # 37.55 B: the publication rounds down
    assert abs(active - 37e9) / 37e9 < 0.02


def test_breakdown_sums_to_counts(k3: ModelConfig, k3_counts: tuple[int, int]) -> None:
    for cfg, counts in ((k3, k3_counts), (ModelConfig.preset("tiny"), None), (ModelConfig.preset("bench"), None)):
        counts = counts or param_counts(cfg)
        rows = param_breakdown(cfg)
        assert (sum(r.total for r in rows), sum(r.active for r in rows)) == counts
    table = format_param_breakdown(ModelConfig.preset("tiny"))
    assert f"{param_counts(ModelConfig.preset('tiny'))[0]:,}" in table


def test_active_counts_only_top_k_experts() -> None:
    base = ModelConfig.preset("tiny")
    t1, a1 = param_counts(base)
    t2, a2 = param_counts(dataclasses.replace(base, num_experts_per_tok=3).validate())
    per_expert = 3 * base.moe_intermediate_size * base.hidden_size
    n_moe = base.num_hidden_layers - base.first_k_dense_replace
    assert t1 == t2 and a2 - a1 == n_moe * per_expert


def test_shape_variants() -> None:
    base = ModelConfig.preset("tiny")
    s = weight_shapes(base)
    assert "lm_head.weight" in s and "model.layers.0.self_attn.g_a_proj.weight" in s
    assert "model.layers.3.self_attn.g_proj.weight" not in s  # MLA output gate off by default
    tied = weight_shapes(dataclasses.replace(base, tie_word_embeddings=True))
    assert "lm_head.weight" not in tied
    noq = weight_shapes(dataclasses.replace(base, q_lora_rank=None, index_topk=None))
    assert noq["model.layers.3.self_attn.q_proj.weight"] == (4 * 48, 256)
    assert not any(".indexer." in n or "q_a_proj" in n for n in noq)
    gated = weight_shapes(dataclasses.replace(base, mla_use_output_gate=True))
    assert gated["model.layers.3.self_attn.g_proj.weight"] == (4 * 32, 256)
    dense = weight_shapes(dataclasses.replace(base, n_routed_experts=0))
    assert not any(".experts." in n or ".mlp.gate." in n for n in dense)
    assert dense["model.layers.3.mlp.up_proj.weight"] == (512, 256)


# ---------------------------------------------------------------------------- cache bytes
def test_k3_kv_bytes(k3: ModelConfig) -> None:
    # The article's per-token per-layer figures (FP8/NVFP4 latent, FP8/MXFP4 index key).
    assert k3.kv_bytes_per_token_per_layer("fp8", "fp8") == (576, 132)
    assert k3.kv_bytes_per_token_per_layer("nvfp4", "mxfp4") == (352, 68)
    assert k3.kv_bytes_per_token_per_layer("bf16", "fp8") == (2 * 576, 132)
    assert kv_bytes_per_token_per_layer(k3) == (1152, 132)  # defaults: bf16 latent, fp8 keys
    # MXFP4 keys save 48.5% of the index cache (the article's figure)
    assert round(100 * (1 - 68 / 132), 1) == 48.5


def test_tiny_kv_bytes_scale_with_shape() -> None:
    tiny = ModelConfig.preset("tiny")  # kv_lora 64, rope 16, index_head_dim 32
    assert kv_bytes_per_token_per_layer(tiny, "bf16", "fp8") == (160, 32 + 4)
    assert kv_bytes_per_token_per_layer(tiny, "fp8", "mxfp4") == (80, 16 + 1)
    assert kv_bytes_per_token_per_layer(tiny, "nvfp4", "fp8") == (32 + 4 + 16, 36)
    noidx = dataclasses.replace(tiny, index_topk=None)
    assert kv_bytes_per_token_per_layer(noidx, "fp8", "fp8") == (80, 0)


@pytest.mark.parametrize("kw,bad", [({"latent": "fp4"}, "fp4"), ({"index": "bf16"}, "bf16")])
def test_kv_bytes_unknown_format(kw: dict, bad: str) -> None:
    with pytest.raises(ValueError) as ei:
        kv_bytes_per_token_per_layer(ModelConfig.preset("tiny"), **kw)
    msg = str(ei.value)
    assert repr(bad) in msg
    allowed = ("bf16", "fp8", "nvfp4") if "latent" in kw else ("fp8", "mxfp4")
    assert all(a in msg for a in allowed)


def test_kda_state_bytes(k3: ModelConfig) -> None:
    # 69 layers × (96·128·128·4 B fp32 state + 3 conv taps · 3 (q,k,v) · 96·128 · 2 B bf16)
    assert k3.kda_state_bytes_per_request() == 69 * (96 * 128 * 128 * 4 + 3 * 3 * 96 * 128 * 2)
    bench = ModelConfig.preset("bench")
    # architecture.md §7.2: 1 MiB fp32 state per layer, 12 layers
    state_only = 12 * 16 * 128 * 128 * 4
    assert state_only == 12 * 2**20
    assert kda_state_bytes_per_request(bench) == state_only + 12 * 3 * 3 * 16 * 128 * 2
    tiny = ModelConfig.preset("tiny")  # fp32 model: conv taps are 4 B
    assert kda_state_bytes_per_request(tiny) == 3 * (4 * 64 * 64 * 4 + 3 * 3 * 4 * 64 * 4)


# ---------------------------------------------------------------------------- (de)serialisation
@pytest.mark.parametrize("name", sorted(PRESETS))
def test_json_round_trip(name: str, tmp_path) -> None:
    cfg = ModelConfig.preset(name)
    path = tmp_path / "config.json"
    cfg.to_json(path)
    back = ModelConfig.from_json(path)
    assert back == cfg
    assert isinstance(back.linear_attn_config, LinearAttnConfig)
    assert json.loads(path.read_text())["hidden_size"] == cfg.hidden_size


def _tiny_dict() -> dict:
    return ModelConfig.preset("tiny").to_dict()


def test_unknown_top_level_key(tmp_path) -> None:
    d = _tiny_dict()
    d["zz_not_a_field"] = 1
    with pytest.raises(ConfigError, match="zz_not_a_field"):
        ModelConfig.from_dict(d)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(d))
    with pytest.raises(ConfigError, match="zz_not_a_field"):
        ModelConfig.from_json(path)


def test_unknown_linear_attn_key() -> None:
    d = _tiny_dict()
    d["linear_attn_config"]["zz_bogus_conv"] = 3
    with pytest.raises(ConfigError, match="zz_bogus_conv"):
        ModelConfig.from_dict(d)


def test_hf_extras_accepted() -> None:
    d = _tiny_dict()
    d["architectures"] = ["KimiLinearForCausalLM"]
    d["transformers_version"] = "4.57.1"
    assert ModelConfig.from_dict(d) == ModelConfig.preset("tiny")


def _set(d: dict, key: str, value) -> None:
    if "." in key:
        outer, inner = key.split(".")
        d[outer][inner] = value
    else:
        d[key] = value


@pytest.mark.parametrize("changes,field", [
    ({"linear_attn_config.kda_layers": [1, 2]}, "kda_layers"),  # layer 3 in neither list
    ({"linear_attn_config.full_attn_layers": [3, 4]}, "kda_layers"),  # layer 3 in both
    ({"num_experts_per_tok": 9}, "num_experts_per_tok"),  # 8 experts
    ({"n_group": 3}, "n_group"),  # 8 experts not divisible by 3
    ({"q_lora_rank": None}, "q_lora_rank"),  # index_topk set without q_lora
])
def test_inconsistent_fields(changes: dict, field: str) -> None:
    d = _tiny_dict()
    for k, v in changes.items():
        _set(d, k, v)
    with pytest.raises(ConfigError, match=field):
        ModelConfig.from_dict(d)


def test_q_lora_none_fine_without_indexer() -> None:
    d = _tiny_dict()
    d["q_lora_rank"] = None
    d["index_topk"] = None
    cfg = ModelConfig.from_dict(d)
    assert not cfg.has_indexer and math.prod(weight_shapes(cfg)["model.layers.3.self_attn.q_proj.weight"]) > 0


def test_layer_kind_fields() -> None:
    """``mlp_layer_types`` overrides the dense prefix; a "shared" indexer layer takes its top-k from the
    nearest earlier MLA layer that computes one (KDA layers in between are skipped), a shared first MLA
    layer computes its own."""
    la = LinearAttnConfig(num_heads=2, head_dim=16, kda_layers=[2, 4], full_attn_layers=[1, 3, 5, 6])
    cfg = ModelConfig(num_hidden_layers=6, linear_attn_config=la, index_topk=8,
                      indexer_types=["shared", "full", "shared", "full", "full", "shared"],
                      mlp_layer_types=["sparse", "dense", "sparse", "dense", "dense", "sparse"]).validate()
    assert [cfg.is_moe_layer(i) for i in range(6)] == [True, False, True, False, False, True]
    assert [cfg.index_source_layer(i) for i in (0, 2, 4, 5)] == [0, 0, 4, 4]


@pytest.mark.parametrize("changes,needle", [
    (dict(indexer_types=["full"] * 3), "'indexer_types': must list one entry per layer (4)"),
    (dict(indexer_types=["full", "full", "full", "lazy"]), "'indexer_types': entries must be one of"),
    (dict(mlp_layer_types=["dense", "moe", "dense", "dense"]), "'mlp_layer_types': entries must be one of"),
    (dict(index_quant="int8"), "'index_quant': must be 'fp8' or 'none'"),
    (dict(index_topk=None, indexer_types=["full"] * 4), "'indexer_types': set without a DSA indexer"),
])
def test_layer_kind_errors(changes: dict, needle: str) -> None:
    with pytest.raises(ConfigError) as ei:
        dataclasses.replace(ModelConfig.preset("tiny"), **changes).validate()
    assert needle in str(ei.value)


@pytest.mark.parametrize("changes", [dict(rope_interleave=False), dict(index_quant="none"),
                                     dict(indexer_types=["full"] * 4)])
def test_release_format_refuses_fields_it_cannot_write(changes: dict) -> None:
    from zmrl.model.k3_release import config_to_release

    cfg = dataclasses.replace(ModelConfig.preset("tiny"), **changes).validate()
    with pytest.raises(ConfigError, match=f"'{next(iter(changes))}' = .* cannot be written in the release format"):
        config_to_release(cfg, quantized_experts=False)
