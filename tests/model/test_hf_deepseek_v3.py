"""The HF config adapter for ``deepseek_v3`` (zmrl/model/hf_config.py) against transformers' own
``DeepseekV3ForCausalLM``: tiny random models built and saved by transformers in the test (no network)
load in zmrl with every tensor accounted for, the fp32 logits agree, and what zmrl saves with
``format="hf"`` reloads in transformers with the same tensors.

Why ``TOL = 1e-5`` relative (max |difference| / max |logit|): both implementations also run in float64
on the same weights, and each side's fp32-vs-fp64 gap is measured; they are ~5e-7 here, and the test
asserts the tolerance is at least 5x their sum (so a failure is not rounding). The fp64 runs agree to a
few 1e-7, not 1e-15: both keep the rotary embedding in fp32 (zmrl's cos/sin table and rotation are
fp32 by design, so that the engine and the trainer share one table).
"""
from __future__ import annotations

import copy

import pytest
import torch

from zmrl.model import (ConfigError, ModelConfig, build_model, cu_seqlens_from_lens, forward_packed, load_pretrained,
                        save_pretrained)

from .hf_reference import assert_config_error, assert_saves_as_hf, build_hf_model, rel_err, saved_fixture

transformers = pytest.importorskip("transformers")

TOL = 1e-5
LENGTHS = (5, 64, 100)

VARIANTS = {
    "q_lora_grouped": dict(q_lora_rank=32, n_group=2, topk_group=1, num_experts_per_tok=2),
    "q_proj_ungrouped_top3": dict(q_lora_rank=None, n_group=1, topk_group=1, num_experts_per_tok=3,
                                  norm_topk_prob=False, first_k_dense_replace=2),
    # split-half rope (zmrl's rope_interleave: false) on the MLA rope dims
    "split_half_rope": dict(q_lora_rank=32, n_group=2, topk_group=1, num_experts_per_tok=2, rope_interleave=False),
}


def _hf_model(**over):
    fields = dict(
        vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=2, num_key_value_heads=2, n_shared_experts=1, n_routed_experts=8,
        first_k_dense_replace=1, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        max_position_embeddings=256, routed_scaling_factor=2.5)
    return build_hf_model(transformers.DeepseekV3ForCausalLM, transformers.DeepseekV3Config(**{**fields, **over}))


saved = saved_fixture(_hf_model, VARIANTS)
_rel = rel_err


def test_logits_agree_with_transformers(saved) -> None:
    hf, path = saved
    cfg = ModelConfig.from_json(path / "config.json")
    assert cfg.model_type == "deepseek_v3" and not cfg.has_indexer and not cfg.linear_attn_config.kda_layers
    assert cfg.rope_interleave == hf.config.rope_interleave
    z32, z64 = load_pretrained(path, dtype="float32"), load_pretrained(path, dtype="float64")
    hf64 = copy.deepcopy(hf).double()
    g = torch.Generator().manual_seed(2)
    for n in LENGTHS:
        ids = torch.randint(0, 128, (n,), generator=g)
        with torch.no_grad():
            h32, h64 = hf(ids[None]).logits[0].double(), hf64(ids[None]).logits[0]
            l32 = forward_packed(z32, ids, cu_seqlens_from_lens([n])).double()
            l64 = forward_packed(z64, ids, cu_seqlens_from_lens([n])).double()
        gap_h, gap_z, diff, diff64 = _rel(h32, h64), _rel(l32, l64), _rel(l32, h32), _rel(l64, h64)
        info = f"T={n}: zmrl vs HF fp32 {diff:.1e}, fp64 {diff64:.1e}; gaps HF {gap_h:.1e}, zmrl {gap_z:.1e}"
        assert 5 * (gap_h + gap_z) <= TOL, info
        assert diff <= TOL, info
        assert diff64 <= TOL, info


def test_zmrl_format_of_a_deepseek_model_reloads(saved, tmp_path) -> None:
    _, path = saved
    model = load_pretrained(path, dtype="float32")
    save_pretrained(model, tmp_path)
    again = load_pretrained(tmp_path, dtype="float32")
    assert again.config == model.config
    ids = torch.arange(20) % 128
    with torch.no_grad():
        assert torch.equal(forward_packed(again, ids, cu_seqlens_from_lens([20])),
                           forward_packed(model, ids, cu_seqlens_from_lens([20])))


@pytest.mark.parametrize("over,needle", [
    ({"brand_new": 1}, "unknown config field(s) ['brand_new']"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}}, "known but not supported"),
    ({"num_key_value_heads": 1}, "'num_key_value_heads' = 1 is known but not supported"),
    ({"quantization_config": {"quant_method": "fp8"}}, "'quantization_config.quant_method' = 'fp8' is known but"),
    ({"model_type": "llama"}, "'model_type' = 'llama' is not supported"),
    ({"hidden_act": "gelu"}, "'hidden_act' = 'gelu'"),
    ({"num_experts_per_tok": 1, "norm_topk_prob": True}, "renormalises only when top-k > 1"),
    ({"qk_head_dim": 7}, "'qk_head_dim' = 7 is inconsistent"),
])
def test_config_errors_name_the_field(saved, over: dict, needle: str) -> None:
    assert_config_error(saved[1], over, needle)


def test_saved_as_hf_reloads_in_transformers(saved, tmp_path) -> None:
    hf, path = saved
    model, again = assert_saves_as_hf(hf, path, tmp_path, transformers.DeepseekV3ForCausalLM)
    with pytest.raises(ConfigError, match="cannot be written as a transformers config.json"):
        save_pretrained(build_model(ModelConfig.preset("tiny")), tmp_path / "x", format="hf")  # KDA, DSA: not V3
    assert not (tmp_path / "x").exists()
