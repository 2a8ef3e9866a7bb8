"""The released Kimi K3 checkpoint format (zmrl/model/k3_release.py, mxfp4.py): nested config, tensor
renames both ways, MXFP4 routed experts, alternative spellings, skipped non-text tensors, bad input."""
from __future__ import annotations

import dataclasses
import json
import logging

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from zmrl.model import (CheckpointError, ConfigError, ModelConfig, cu_seqlens_from_lens, forward_packed,
                        load_pretrained, save_pretrained)
from zmrl.model.k3_release import config_to_release
from zmrl.model.mxfp4 import E2M1_VALUES, MXFP4Error, dequantize_mxfp4, quantize_mxfp4

from .k3_utils import random_k3_model, tiny_k3

IDS = torch.randint(0, 128, (70,), generator=torch.Generator().manual_seed(0))  # crosses a 64-token chunk


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return forward_packed(model, IDS, cu_seqlens_from_lens([70]))


@pytest.fixture(scope="module")
def release_dir(tmp_path_factory):
    cfg = tiny_k3()
    model = random_k3_model(cfg)
    path = tmp_path_factory.mktemp("k3")
    save_pretrained(model, path, format="k3")
    return path, model


# ----------------------------------------------------------------------------- config


def release_config(**text_over) -> dict:
    """A K3-shaped release config.json at toy width (field names as published)."""
    text = {
        "model_type": "kimi_linear", "vocab_size": 128, "hidden_size": 64, "num_hidden_layers": 5,
        "intermediate_size": 96, "rms_norm_eps": 1e-5, "num_attention_heads": 2, "num_key_value_heads": 2,
        "q_lora_rank": 32, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
        "mla_use_nope": True, "mla_use_output_gate": True, "hidden_act": "situ", "activation_situ_beta": 4.0,
        "activation_situ_linear_beta": 25.0, "num_experts": 8, "num_experts_per_token": 2, "num_shared_experts": 1,
        "moe_intermediate_size": 32, "moe_renormalize": True, "moe_router_activation_func": "sigmoid",
        "routed_scaling_factor": 1.0, "first_k_dense_replace": 1, "moe_layer_freq": 1, "use_grouped_topk": True,
        "num_expert_group": 1, "topk_group": 1, "routed_expert_hidden_size": 32, "latent_moe_use_norm": True,
        "attn_res_block_size": 2, "tie_word_embeddings": False, "num_nextn_predict_layers": 1,
        "linear_attn_config": {"kda_layers": [1, 2, 4, 5], "full_attn_layers": [3], "num_heads": 2, "head_dim": 16,
                               "short_conv_kernel_size": 4, "gate_lower_bound": -5.0, "use_full_rank_gate": True},
    }
    text.update(text_over)
    return {"model_type": "kimi_k3", "architectures": ["KimiK3ForConditionalGeneration"], "text_config": text,
            "vision_config": {"hidden_size": 8}, "torch_dtype": "bfloat16",
            "quantization_config": {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized"}}


def test_release_config_maps_every_field() -> None:
    cfg = ModelConfig.from_dict(release_config())
    assert (cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.n_shared_experts) == (8, 2, 1)
    assert (cfg.moe_latent_size, cfg.latent_moe_use_norm, cfg.moe_glu) == (32, True, "situ")
    assert (cfg.activation_situ_beta, cfg.activation_situ_linear_beta) == (4.0, 25.0)
    assert (cfg.gate_lower_bound, cfg.use_full_rank_gate) == (-5.0, True)  # from linear_attn_config
    assert cfg.linear_attn_config.kda_layers == [1, 2, 4, 5] and cfg.attn_res_block_size == 2
    assert cfg.torch_dtype == "bfloat16" and cfg.mla_use_output_gate and cfg.norm_topk_prob
    assert cfg.mla_latent_norm_eps == 1e-6 and cfg.rms_norm_eps == 1e-5
    assert not cfg.has_indexer  # the K3 release: dense MLA
    pro = ModelConfig.from_dict(release_config(index_topk=16, index_n_heads=2, index_head_dim=16))
    assert pro.has_indexer and pro.index_topk == 16
    # Kimi-Linear's defaults for what a text config leaves out (not zmrl's)
    d = release_config()
    for k in ("latent_moe_use_norm", "activation_situ_beta", "activation_situ_linear_beta", "first_k_dense_replace"):
        d["text_config"].pop(k)
    bare = ModelConfig.from_dict(d)
    assert (bare.latent_moe_use_norm, bare.activation_situ_beta, bare.activation_situ_linear_beta,
            bare.first_k_dense_replace) == (False, 1.0, None, 0)
    # a bare kimi_linear config (no wrapper) reads the same way
    assert ModelConfig.from_dict(release_config()["text_config"]).n_routed_experts == 8


def test_release_config_round_trips() -> None:
    cfg = tiny_k3()
    assert ModelConfig.from_dict(json.loads(json.dumps(config_to_release(cfg, True)))) == cfg
    pro = tiny_k3(index_topk=16, index_n_heads=2, index_head_dim=16)
    assert ModelConfig.from_dict(config_to_release(pro, False)) == pro


@pytest.mark.parametrize("over,needle", [
    (dict(some_new_field=1), "text_config.some_new_field"),
    (dict(hidden_act="gelu"), "'hidden_act' = 'gelu' is known but not supported"),
    (dict(moe_router_activation_func="softmax"), "'moe_router_activation_func' = 'softmax' is known but not"),
    (dict(rope_scaling={"type": "yarn"}), "'rope_scaling'"),
    (dict(model_type="deepseek_v3"), "text_config.model_type"),
])
def test_release_config_errors_name_the_field(over: dict, needle: str) -> None:
    with pytest.raises(ConfigError) as ei:
        ModelConfig.from_dict(release_config(**over))
    assert needle in str(ei.value)


def test_release_config_wrapper_and_nested_errors() -> None:
    d = release_config()
    d["surprise"] = 1
    with pytest.raises(ConfigError, match="surprise"):
        ModelConfig.from_dict(d)
    d = release_config()
    d["text_config"]["linear_attn_config"]["kda_chunk"] = 64
    with pytest.raises(ConfigError, match="kda_chunk"):
        ModelConfig.from_dict(d)
    d = release_config()
    d["quantization_config"]["format"] = "nvfp4-pack-quantized"
    with pytest.raises(ConfigError, match="quantization_config.format.*known but not supported"):
        ModelConfig.from_dict(d)


# ----------------------------------------------------------------------------- MXFP4


def test_mxfp4_dequantises_exactly() -> None:
    g = torch.Generator().manual_seed(0)
    packed = torch.randint(0, 256, (3, 32), generator=g, dtype=torch.uint8)
    scale = torch.randint(100, 150, (3, 2), generator=g, dtype=torch.uint8)
    w = dequantize_mxfp4(packed, scale)
    assert w.shape == (3, 64)
    for r in range(3):
        for c in range(64):
            code = int(packed[r, c // 2]) >> (4 * (c % 2)) & 0xF  # even column: low nibble
            assert w[r, c].item() == E2M1_VALUES[code] * 2.0 ** (int(scale[r, c // 32]) - 127)
    assert torch.equal(dequantize_mxfp4(packed, scale, torch.bfloat16).float(), w)  # exact in bf16 too
    p2, s2 = quantize_mxfp4(w)
    assert torch.equal(dequantize_mxfp4(p2, s2), w)  # representable values round-trip exactly
    with pytest.raises(MXFP4Error, match="not representable"):
        quantize_mxfp4(torch.full((1, 32), 0.3))
    assert torch.equal(dequantize_mxfp4(*quantize_mxfp4(torch.full((1, 32), 0.3), exact=False)),
                       torch.full((1, 32), 0.25))  # scale 2**-4 (0.3 <= 6 * 2**-4); 4.8 -> nearest code 4
    with pytest.raises(MXFP4Error, match="covers"):
        dequantize_mxfp4(packed, scale[:, :1])


# ----------------------------------------------------------------------------- checkpoints


def test_release_layout_on_disk(release_dir) -> None:
    path, model = release_dir
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "kimi_k3" and config["text_config"]["model_type"] == "kimi_linear"
    assert config["quantization_config"]["format"] == "mxfp4-pack-quantized"
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        assert all(n.startswith("language_model.") for n in names)
        moe = "language_model.model.layers.1.block_sparse_moe."
        for n in ("gate.weight", "gate.e_score_correction_bias", "experts.7.w1.weight_packed",
                  "experts.7.w3.weight_scale", "experts.0.w2.weight_packed", "shared_experts.down_proj.weight",
                  "routed_expert_down_proj.weight", "routed_expert_up_proj.weight", "routed_expert_norm.weight"):
            assert moe + n in names, n
        assert "language_model.model.layers.0.mlp.gate_proj.weight" in names  # the dense first layer
        assert f.get_tensor("language_model.model.layers.1.mlp_res_proj.weight").shape == (1, 64)
        assert f.get_tensor("language_model.model.output_attn_res_proj.weight").shape == (1, 64)
        assert f.get_tensor("language_model.model.layers.0.self_attn.A_log").shape == (1, 1, 2, 1)
        assert f.get_tensor(moe + "experts.7.w1.weight_packed").dtype == torch.uint8
        assert not any(".mlp.experts." in n or "latent_" in n for n in names)


def test_release_round_trip(release_dir, tmp_path) -> None:
    path, model = release_dir
    loaded = load_pretrained(path, dtype="float32")
    for (n, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), n
    assert torch.equal(_logits(loaded), _logits(model))
    save_pretrained(loaded, tmp_path, format="k3")
    first, second = load_file(str(path / "model.safetensors")), load_file(str(tmp_path / "model.safetensors"))
    assert first.keys() == second.keys()
    for n in first:
        assert torch.equal(first[n], second[n]), n
    # and zmrl's own format from a release checkpoint
    save_pretrained(loaded, tmp_path / "zmrl")
    assert torch.equal(_logits(load_pretrained(tmp_path / "zmrl")), _logits(model))


def test_unquantised_experts_and_refusing_lossy_mxfp4(tmp_path) -> None:
    cfg = tiny_k3()
    model = random_k3_model(cfg, mxfp4_experts=False)
    with pytest.raises(MXFP4Error, match="not representable"):
        save_pretrained(model, tmp_path / "q", format="k3")
    save_pretrained(model, tmp_path / "dense", format="k3", quantize_experts=False)
    assert "quantization_config" not in json.loads((tmp_path / "dense" / "config.json").read_text())
    assert torch.equal(_logits(load_pretrained(tmp_path / "dense")), _logits(model))


def test_alternative_spellings_and_skipped_tensors(release_dir, tmp_path, caplog) -> None:
    path, model = release_dir
    tensors = load_file(str(path / "model.safetensors"))
    p = "language_model.model."
    # AttnRes as <site>_res.proj_weight / .norm_weight, the bias beside the gate, A_log padded to head_dim
    tensors[p + "layers.2.self_attention_res.proj_weight"] = tensors.pop(p + "layers.2.self_attention_res_proj.weight")
    tensors[p + "output_attn_res.norm_weight"] = tensors.pop(p + "output_attn_res_norm.weight")
    bias = tensors.pop(p + "layers.3.block_sparse_moe.gate.e_score_correction_bias")
    tensors[p + "layers.3.block_sparse_moe.e_score_correction_bias"] = bias
    a_log = tensors[p + "layers.0.self_attn.A_log"].reshape(-1)
    tensors[p + "layers.0.self_attn.A_log"] = torch.cat([a_log, torch.full((14,), 99.0)])
    # not the text model: vision, projector, MTP, a layer past num_hidden_layers
    extra = {"vision_tower.blocks.0.weight": torch.zeros(2), "mm_projector.proj.weight": torch.zeros(2),
             p + "mtp.0.enorm.weight": torch.zeros(2), p + "layers.5.input_layernorm.weight": torch.zeros(2)}
    tensors.update(extra)
    out = tmp_path / "alt"
    out.mkdir()
    (out / "config.json").write_text((path / "config.json").read_text())
    save_file(tensors, str(out / "model.safetensors"))
    with caplog.at_level(logging.INFO, logger="zmrl.model.checkpoint"):
        loaded = load_pretrained(out, dtype="float32")
    assert torch.equal(_logits(loaded), _logits(model))
    logged = caplog.text
    assert "skipped 3 tensor(s) outside the text model (vision / projector / MTP)" in logged
    assert "skipped 1 tensor(s) outside the text model (layer past num_hidden_layers (MTP))" in logged


def test_bad_release_checkpoints(release_dir, tmp_path) -> None:
    path, _ = release_dir
    tensors = load_file(str(path / "model.safetensors"))
    moe = "language_model.model.layers.1.block_sparse_moe."

    def write(name: str, ts: dict) -> object:
        out = tmp_path / name
        out.mkdir()
        (out / "config.json").write_text((path / "config.json").read_text())
        save_file(ts, str(out / "model.safetensors"))
        return out

    missing = {k: v for k, v in tensors.items() if k != moe + "experts.3.w2.weight_scale"}
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.experts\.3\.down_proj\.weight.*w2"):
        load_pretrained(write("missing", missing))
    extra = {**tensors, "language_model.model.layers.1.surprise.weight": torch.zeros(1)}
    with pytest.raises(CheckpointError, match="unexpected tensors.*surprise"):
        load_pretrained(write("extra", extra))
    scale = tensors[moe + "experts.0.w1.weight_scale"]
    bad = {**tensors, moe + "experts.0.w1.weight_scale": torch.cat([scale, scale], dim=1)}  # covers 64 columns
    with pytest.raises(CheckpointError, match="experts.0.w1.weight_packed"):
        load_pretrained(write("badscale", bad))
    with pytest.raises(ValueError, match="format must be one of"):
        save_pretrained(load_pretrained(path), tmp_path / "x", format="gguf")


# ----------------------------------------------------------------------------- presets

# The published K3 text config's fields as far as public transcriptions show (docs/k3_release.md).
PUBLISHED_K3_TEXT = {
    "vocab_size": 163840, "num_hidden_layers": 93, "hidden_size": 7168, "first_k_dense_replace": 1,
    "moe_layer_freq": 1, "num_experts": 896, "num_experts_per_token": 16, "num_shared_experts": 2,
    "routed_expert_hidden_size": 3584, "moe_intermediate_size": 3072, "moe_renormalize": True,
    "moe_router_activation_func": "sigmoid", "num_expert_group": 1, "topk_group": 1,
    "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0, "routed_scaling_factor": 1.0,
    "latent_moe_use_norm": True, "rms_norm_eps": 1e-5, "hidden_act": "situ", "attn_res_block_size": 12,
    "mla_use_nope": True, "mla_use_output_gate": True, "tie_word_embeddings": False,
}


def test_k3_preset_is_the_published_config() -> None:
    k3 = ModelConfig.preset("k3")
    text = config_to_release(k3, quantized_experts=True)["text_config"]
    for k, v in PUBLISHED_K3_TEXT.items():
        assert text[k] == v, k
    assert not k3.has_indexer and not any(k.startswith("index_") for k in text)
    la = text["linear_attn_config"]
    assert len(la["kda_layers"]) == 69 and len(la["full_attn_layers"]) == 24 and la["full_attn_layers"][-1] == 93
    assert ModelConfig.from_dict(config_to_release(k3, True)) == k3  # through the release format and back


def test_k3_1_pro_is_k3_plus_the_seed_indexer() -> None:
    pro, k3 = ModelConfig.preset("k3.1-pro"), ModelConfig.preset("k3")
    assert (pro.index_n_heads, pro.index_head_dim, pro.index_topk, pro.index_use_hadamard) == (32, 128, 2048, True)
    assert dataclasses.replace(pro, index_topk=None, index_n_heads=k3.index_n_heads, index_head_dim=k3.index_head_dim,
                               index_use_hadamard=k3.index_use_hadamard) == k3


def test_bare_kimi_linear_layout(release_dir, tmp_path) -> None:
    """A ``kimi_linear`` config without the multimodal wrapper: the same names without ``language_model.``."""
    path, model = release_dir
    text = json.loads((path / "config.json").read_text())["text_config"]
    text["quantization_config"] = {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized"}
    (tmp_path / "config.json").write_text(json.dumps(text))
    tensors = {k.removeprefix("language_model."): v for k, v in load_file(str(path / "model.safetensors")).items()}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    assert torch.equal(_logits(load_pretrained(tmp_path, dtype="float32")), _logits(model))


def test_header_only_check_and_training_preflight(release_dir, tmp_path) -> None:
    """``check_checkpoint`` (headers only) accepts the release layout and names a mis-shaped tensor;
    the training preflight (``model.path``) uses it, so a release checkpoint passes it too."""
    from zmrl.model.checkpoint import check_checkpoint
    from zmrl.rl.preflight import InputError
    from zmrl.rl.preflight import check_checkpoint as preflight

    path, _ = release_dir
    assert check_checkpoint(path) == load_pretrained(path).config
    preflight(str(path))
    tensors = load_file(str(path / "model.safetensors"))
    name = "language_model.model.layers.2.mlp_res_proj.weight"
    tensors[name] = torch.zeros(1, 63)
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=rf"{name}: checkpoint \(63,\) vs model \(64,\)"):
        check_checkpoint(tmp_path)
    with pytest.raises(InputError, match="model.path=.*mlp_res_proj"):
        preflight(str(tmp_path))
