"""The released Kimi K3's semantics, each driven by its config field: MLA latent-norm eps, KDA o_norm eps,
SiTU betas, the switchable latent-MoE norm, moe_layer_freq, tied embeddings, and no DSA indexer unless
the config declares one. (Top-1 routing without renormalisation: tests/kernels/test_moe_router.py; the
whole model against an independent implementation: tests/model/test_mlx_reference.py.)"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from zmrl.kernels_batch_invariant.glu import situ_glu_ref
from zmrl.kernels_batch_invariant.norms import rms_norm
from safetensors import safe_open

from zmrl.model import (ModelConfig, build_model, cu_seqlens_from_lens, forward_packed, load_pretrained,
                        packed_context, save_pretrained)
from zmrl.model.config import LinearAttnConfig
from zmrl.model.kda import KimiDeltaAttention
from zmrl.model.mla import MLAAttention
from zmrl.model.moe import MLP, MoE
from zmrl.capacity.sizing import weight_shapes


def small(**over) -> ModelConfig:
    base = dict(vocab_size=64, hidden_size=32, intermediate_size=48,
                linear_attn_config=LinearAttnConfig(num_heads=2, head_dim=8, kda_layers=[1, 3],
                                                    full_attn_layers=[2, 4]),
                num_attention_heads=2, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
                v_head_dim=8, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
                moe_intermediate_size=16)
    base.update(over)
    return ModelConfig(**base).validate()


def _logits(cfg: ModelConfig, seed: int = 0) -> torch.Tensor:
    model = build_model(cfg, seed=seed, dtype="float32")
    ids = torch.randint(0, cfg.vocab_size, (9,), generator=torch.Generator().manual_seed(1))
    return forward_packed(model, ids, cu_seqlens_from_lens([9]))


def test_mla_latent_norm_eps_is_its_own_field() -> None:
    cfg = small(rms_norm_eps=1e-5)
    assert cfg.mla_latent_norm_eps == 1e-6  # the release's fixed value, not rms_norm_eps
    attn = MLAAttention(cfg, layer_idx=1)
    assert attn.q_a_layernorm.eps == 1e-6 and attn.kv_a_layernorm.eps == 1e-6
    attn = MLAAttention(dataclasses.replace(cfg, mla_latent_norm_eps=1e-3), layer_idx=1)
    assert attn.q_a_layernorm.eps == 1e-3 and attn.kv_a_layernorm.eps == 1e-3
    # and it reaches the numbers: a different eps changes the logits
    assert not torch.equal(_logits(cfg), _logits(dataclasses.replace(cfg, mla_latent_norm_eps=1e-1)))


def test_kda_o_norm_eps_follows_rms_norm_eps() -> None:
    for eps in (1e-6, 1e-5, 1e-2):
        assert KimiDeltaAttention(small(rms_norm_eps=eps), layer_idx=0).o_norm.eps == eps


def test_situ_betas_come_from_the_config() -> None:
    cfg = small(moe_glu="situ", activation_situ_beta=2.0, activation_situ_linear_beta=None)
    model = build_model(cfg, seed=0, dtype="float64")
    x = torch.randn(5, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    moe = model.model.layers[1].mlp
    for mlp in (model.model.layers[0].mlp, moe.experts[2], moe.shared_experts):
        assert isinstance(mlp, MLP)
        want = mlp.down_proj.weight @ situ_glu_ref(x @ mlp.gate_proj.weight.T, x[:, :mlp.up_proj.in_features]
                                                   @ mlp.up_proj.weight.T, 2.0, None).T
        torch.testing.assert_close(mlp(x[:, :mlp.up_proj.in_features]), want.T, rtol=1e-12, atol=1e-14)


def test_latent_moe_norm_is_switchable() -> None:
    on, off = small(moe_latent_size=12), small(moe_latent_size=12, latent_moe_use_norm=False)
    m_on, m_off = build_model(on, seed=0, dtype="float64"), build_model(off, seed=0, dtype="float64")
    moe_on, moe_off = m_on.model.layers[1].mlp, m_off.model.layers[1].mlp
    assert isinstance(moe_on.latent_norm, torch.nn.Module) and moe_off.latent_norm is None
    assert "model.layers.1.mlp.latent_norm.weight" not in m_off.state_dict()
    # without the norm: up(combine) + shared, with the same routing and experts
    moe_off.load_state_dict({k: v for k, v in moe_on.state_dict().items() if "latent_norm" not in k})
    x = torch.randn(6, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    seen = {}
    for name, moe in (("on", moe_on), ("off", moe_off)):
        moe.latent_up_proj.register_forward_hook(lambda m, args, out, name=name: seen.__setitem__(name, args[0]))
    with_norm, without = moe_on(x), moe_off(x)
    # the same combined latent reaches latent_up_proj, normalised only when the norm is on
    # (the combine accumulates in fp32, so the fp64 norm of its rounded copy agrees to fp32 rounding)
    torch.testing.assert_close(seen["on"], rms_norm(seen["off"], moe_on.latent_norm.weight, on.rms_norm_eps),
                               rtol=1e-6, atol=0)
    shared = moe_on.shared_experts(x)
    torch.testing.assert_close(without, moe_on.latent_up_proj(seen["off"]) + shared, rtol=1e-6, atol=1e-12)
    assert not torch.allclose(with_norm, without)


def test_moe_layer_freq() -> None:
    cfg = small(num_hidden_layers=4, first_k_dense_replace=1, moe_layer_freq=2)
    assert [cfg.is_moe_layer(i) for i in range(4)] == [False, False, True, False]  # i >= 1 and i % 2 == 0
    model = build_model(cfg, seed=0)
    kinds = [type(layer.mlp) for layer in model.model.layers]
    assert kinds == [MLP, MLP, MoE, MLP]
    assert set(weight_shapes(cfg)) == set(model.state_dict())
    with pytest.raises(Exception, match="moe_layer_freq"):
        small(moe_layer_freq=0)


def test_tied_embeddings(tmp_path) -> None:
    cfg = small(tie_word_embeddings=True)
    model = build_model(cfg, seed=0, dtype="float32")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    ids = torch.randint(0, 64, (7,), generator=torch.Generator().manual_seed(0))
    hidden = model(ids, packed_context(cu_seqlens_from_lens([7])))
    torch.testing.assert_close(model.compute_logits(hidden), hidden @ model.model.embed_tokens.weight.T,
                               rtol=1e-5, atol=1e-6)
    save_pretrained(model, tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        assert "lm_head.weight" not in f.keys() and "model.embed_tokens.weight" in f.keys()
    again = load_pretrained(tmp_path)
    assert again.lm_head.weight is again.model.embed_tokens.weight
    cu = cu_seqlens_from_lens([7])
    assert torch.equal(forward_packed(again, ids, cu), forward_packed(model, ids, cu))


def test_no_indexer_unless_declared() -> None:
    assert ModelConfig().index_topk is None and not ModelConfig().has_indexer
    d = small().to_dict()
    for k in ("index_topk", "index_n_heads", "index_head_dim", "index_use_hadamard"):
        d.pop(k)
    cfg = ModelConfig.from_dict(d)
    assert not cfg.has_indexer
    assert all(getattr(layer.self_attn, "indexer", None) is None for layer in build_model(cfg).model.layers)
    # the presets keep theirs explicitly
    for name, topk in (("tiny", 64), ("bench", 2048), ("k3.1-pro", 2048)):
        assert ModelConfig.preset(name).index_topk == topk
