"""Single-process checks of the virtual-shard construction (no torch.distributed needed at tp = 1)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from zmrl.lora import LoraConfig, apply_lora
from zmrl.model import ModelConfig, build_model, cu_seqlens_from_lens, forward_packed
from zmrl.parallel import (ParallelConfig, PartialLinear, VirtualShards, gather_full_state, load_full_state,
                           shard_model)
from zmrl.parallel.shard import SharedIndexer, _Slicer


def _logits(model, lens=(5, 70)):
    g = torch.Generator().manual_seed(0)
    ids = torch.cat([torch.randint(0, model.config.vocab_size, (n,), generator=g) for n in lens])
    with torch.no_grad():
        return forward_packed(model, ids, cu_seqlens_from_lens(list(lens)))


def _model(dtype="float32", lora=True):
    m = build_model(ModelConfig.preset("tiny"), seed=0, dtype=dtype)
    if lora:
        apply_lora(m, LoraConfig(r=4, alpha=8, init_b_std=0.02, init_seed=3))
    return m


def test_config_validation():
    with pytest.raises(ValueError, match="must divide virtual_shards"):
        ParallelConfig(tp=2, virtual_shards=3).validate()
    with pytest.raises(ValueError, match="reduce"):
        ParallelConfig(reduce="ring").validate()
    assert ParallelConfig(tp=2, virtual_shards=4).validate().shards_per_rank == 2


def test_v1_is_the_unsharded_model():
    ref = _logits(_model())
    m = shard_model(_model(), ParallelConfig(virtual_shards=1))
    assert not any(isinstance(x, VirtualShards) for x in m.modules())
    assert torch.equal(_logits(m), ref)


@pytest.mark.parametrize("dtype,atol", [("float32", 1e-5), ("bfloat16", 0.5)])
def test_virtual_shards_compute_the_same_function(dtype, atol):
    # V pieces sum the row-parallel products in another order (and round once after the sum), so the
    # bits differ from V=1, not the function: fp32 agrees to rounding (~1e-6 on logits of O(1));
    # bf16 activations re-round at every layer (2^-8 relative), which over 4 layers moves logits of
    # magnitude ~5-10 by a few tenths at most.
    ref = _logits(_model(dtype))
    for V in (2, 4):
        m = shard_model(_model(dtype), ParallelConfig(virtual_shards=V))
        out = _logits(m)
        torch.testing.assert_close(out, ref, rtol=0, atol=atol)
        assert not torch.equal(out, ref) or dtype == "float32"


def test_pieces_slice_heads_and_share_replicated_modules():
    m = shard_model(_model(), ParallelConfig(virtual_shards=2))
    kda, mla = m.model.layers[0].self_attn, m.model.layers[3].self_attn
    assert isinstance(kda, VirtualShards) and list(kda.pieces) == ["0", "1"]
    p0, p1 = kda.pieces["0"], kda.pieces["1"]
    assert p0.num_heads == p1.num_heads == 2 and p0.layer_idx == (0, 0) and p1.layer_idx == (0, 1)
    assert p0.f_a_proj is p1.f_a_proj and p0.o_norm is p1.o_norm  # replicated: one module object
    assert isinstance(p0.o_proj, PartialLinear) and p0.o_proj.weight.shape == (256, 128)
    # column block: shared LoRA A, sliced B; row block: sliced A, shared B
    assert p0.q_proj.adapter.lora_A is p1.q_proj.adapter.lora_A
    assert p0.q_proj.adapter.lora_B.shape == (128, 4)
    assert p0.o_proj.adapter.lora_B is p1.o_proj.adapter.lora_B and p0.o_proj.adapter.lora_A.shape == (4, 128)
    q0, q1 = mla.pieces["0"], mla.pieces["1"]
    assert q0.indexer is q1.indexer and q0.kv_a_proj_with_mqa is q1.kv_a_proj_with_mqa
    assert isinstance(q0.indexer, SharedIndexer) and q0.indexer.wq_b is m.model.layers[3].self_attn.pieces["1"].indexer.wq_b
    _logits(m)
    assert q0.indexer.memo is None  # the per-call reuse ends with the call
    assert q0.num_heads == 2 and q0.layer_idx == 3


def test_indivisible_heads_are_refused():
    cfg = ModelConfig.preset("tiny")
    cfg = dataclasses.replace(cfg, num_attention_heads=3)
    with pytest.raises(ValueError, match="num_attention_heads"):
        shard_model(build_model(cfg, seed=0), ParallelConfig(virtual_shards=2))


def test_partial_linear_is_fp32_and_unrounded():
    s = _Slicer()
    lin = _model("bfloat16").model.layers[0].self_attn.o_proj
    full = s.linear(lin, cols=slice(0, lin.in_features), partial=True)
    x = torch.randn(3, lin.in_features).to(torch.bfloat16)
    y = full(x)
    assert y.dtype == torch.float32 and torch.equal(y.to(torch.bfloat16), lin(x))


def test_sharded_twice_is_an_error():
    m = shard_model(_model(lora=False), ParallelConfig(virtual_shards=2))
    with pytest.raises(RuntimeError, match="already sharded"):
        shard_model(m, ParallelConfig(virtual_shards=2))


def test_full_state_round_trip():
    full = _model()
    ref = {n: p.detach().clone() for n, p in full.named_parameters()}
    m = shard_model(_model(), ParallelConfig(virtual_shards=2))
    got = gather_full_state(m)
    assert sorted(got) == sorted(ref)
    assert all(torch.equal(got[n], ref[n]) for n in ref)
    # LoRA moved between layouts by full names: a V=4 model with another LoRA init takes V=2's adapters
    other = _model(lora=False)
    apply_lora(other, LoraConfig(r=4, alpha=8, init_b_std=0.02, init_seed=99))
    other = shard_model(other, ParallelConfig(virtual_shards=4))
    lora = gather_full_state(m, keep=lambda n: "lora_" in n)
    assert load_full_state(other, lora, keep=lambda n: "lora_" in n) > 0
    back = gather_full_state(other, keep=lambda n: "lora_" in n)
    assert all(torch.equal(back[n], lora[n]) for n in lora)
    with pytest.raises(ValueError, match="missing"):
        load_full_state(other, {}, keep=lambda n: "lora_" in n)


def test_lora_after_sharding_is_refused():
    m = shard_model(_model(lora=False), ParallelConfig(virtual_shards=2))
    with pytest.raises(ValueError, match="shard it"):
        apply_lora(m, LoraConfig(r=4))
