"""PEFT-format adapters (docs/model.md, LoRA): ``adapter_config.json`` + ``adapter_model.safetensors`` with PEFT
tensor names, a bitwise round trip through save/load, clear errors, and files that peft itself reads
(and applies with the same math)."""
from __future__ import annotations

import copy
import json
import re

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from zmrl.kernels_batch_invariant import linear
from zmrl.lora import LoraConfig, apply_lora, load_adapter, lora_state_dict, save_adapter, to_peft_state_dict
from zmrl.model import ModelConfig, build_model, cu_seqlens_from_lens, forward_packed
from zmrl.model.layers import Linear

R, ALPHA = 8, 24.0  # scale 3: a scale of 1 would hide an alpha/r mix-up
LENS = [70, 21]


@pytest.fixture(scope="module")
def cfg():
    return ModelConfig.preset("tiny")


@pytest.fixture(scope="module")
def base(cfg):
    return build_model(cfg, seed=0).eval()


@pytest.fixture(scope="module")
def trained(base):
    """A model whose adapters are all non-trivial (B != 0), standing in for a trained one."""
    return apply_lora(copy.deepcopy(base), LoraConfig(r=R, alpha=ALPHA, init_b_std=0.05, init_seed=7))


@pytest.fixture(scope="module")
def saved(trained, tmp_path_factory):
    path = tmp_path_factory.mktemp("adapter")
    save_adapter(trained, path, base_model_name_or_path="zmrl/tiny")
    return path


@torch.no_grad()
def logits(model, cfg):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, cfg.vocab_size, (sum(LENS),), generator=g)
    return forward_packed(model, ids, cu_seqlens_from_lens(LENS))


def expected_peft_tensors(model) -> dict[str, torch.Tensor]:
    """PEFT name -> tensor, built from the model's modules (not from to_peft_state_dict)."""
    out = {}
    for name, mod in model.named_modules():
        if isinstance(mod, Linear) and mod.adapter is not None:
            out[f"base_model.model.{name}.lora_A.weight"] = mod.adapter.lora_A.detach()
            out[f"base_model.model.{name}.lora_B.weight"] = mod.adapter.lora_B.detach()
        lora = getattr(mod, "experts_lora", None)
        if lora is not None:
            for proj in lora.projs:
                for ab in "AB":
                    t = getattr(lora, f"{proj}_lora_{ab}").detach()
                    for e in range(t.shape[0]):
                        out[f"base_model.model.{name}.experts.{e}.{proj}.lora_{ab}.weight"] = t[e]
    return out


def test_files_and_names(trained, saved, cfg):
    assert sorted(p.name for p in saved.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    meta = json.loads((saved / "adapter_config.json").read_text())
    assert meta["peft_type"] == "LORA" and meta["r"] == R and meta["lora_alpha"] == ALPHA
    assert meta["lora_dropout"] == 0.0 and meta["bias"] == "none" and meta["fan_in_fan_out"] is False
    assert meta["base_model_name_or_path"] == "zmrl/tiny"
    assert set(meta["target_modules"]) == set(trained.lora_config.target_modules)

    tensors = load_file(str(saved / "adapter_model.safetensors"))
    want = expected_peft_tensors(trained)
    assert sorted(tensors) == sorted(want)
    for k, t in want.items():
        assert tensors[k].dtype == torch.float32 and torch.equal(tensors[k], t), k

    d, la = cfg.hidden_size, cfg.linear_attn_config
    q = tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"]
    assert q.shape == (R, d)  # lora_A [r, in]
    q_b = tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"]
    assert q_b.shape == (la.num_heads * la.head_dim, R)  # lora_B [out, r]
    inter = cfg.moe_intermediate_size
    for e in (0, cfg.n_routed_experts - 1):
        p = f"base_model.model.model.layers.1.mlp.experts.{e}."
        assert tensors[p + "gate_proj.lora_A.weight"].shape == (R, d)
        assert tensors[p + "gate_proj.lora_B.weight"].shape == (inter, R)
        assert tensors[p + "down_proj.lora_A.weight"].shape == (R, inter)
        assert tensors[p + "down_proj.lora_B.weight"].shape == (d, R)
    assert "base_model.model.model.layers.3.self_attn.kv_b_proj.lora_A.weight" in tensors
    assert "base_model.model.model.layers.3.self_attn.indexer.wq_b.lora_A.weight" in tensors
    assert not any(".layers.0.mlp." in k or "lm_head" in k or "embed_tokens" in k for k in tensors)


def test_load_into_fresh_model_is_bitwise(base, trained, saved, cfg):
    want = logits(trained, cfg)
    fresh = load_adapter(copy.deepcopy(base), saved)  # applies LoRA from adapter_config.json
    assert fresh.lora_config.r == R and fresh.lora_config.alpha == ALPHA
    assert torch.equal(logits(fresh, cfg), want)
    for k, v in lora_state_dict(trained).items():
        assert torch.equal(lora_state_dict(fresh)[k], v), k
    # Only LoRA is trainable after loading.
    assert {n for n, p in fresh.named_parameters() if p.requires_grad} == set(lora_state_dict(fresh))


def test_load_into_model_with_adapters_overwrites(base, trained, saved, cfg):
    other = apply_lora(copy.deepcopy(base), LoraConfig(r=R, alpha=ALPHA, init_b_std=0.05, init_seed=99))
    assert not torch.equal(logits(other, cfg), logits(trained, cfg))
    load_adapter(other, saved)
    assert torch.equal(logits(other, cfg), logits(trained, cfg))


def test_load_rejects_a_different_lora_config(base, saved):
    """A model that already has adapters with another alpha (hence scale) or rank must not silently take
    weights trained for a different scale."""
    with pytest.raises(ValueError, match="alpha"):
        load_adapter(apply_lora(copy.deepcopy(base), LoraConfig(r=R, alpha=2 * ALPHA)), saved)
    with pytest.raises(ValueError, match=r"\br\b"):
        load_adapter(apply_lora(copy.deepcopy(base), LoraConfig(r=2 * R, alpha=ALPHA)), saved)
    with pytest.raises(ValueError, match="target_modules"):
        load_adapter(apply_lora(copy.deepcopy(base), LoraConfig(r=R, alpha=ALPHA, target_modules=("q_proj",))), saved)


@pytest.mark.parametrize("victim", ["base_model.model.model.layers.3.self_attn.kv_b_proj.lora_B.weight",
                                    "base_model.model.model.layers.2.mlp.experts.5.up_proj.lora_A.weight"])
def test_missing_tensor_is_named(base, saved, tmp_path, victim):
    tensors = load_file(str(saved / "adapter_model.safetensors"))
    del tensors[victim]
    with pytest.raises(ValueError, match=re.escape(victim)):
        load_adapter(copy.deepcopy(base), _rewrite(saved, tmp_path, tensors))


def _rewrite(saved, tmp_path, tensors=None, **meta_changes):
    meta = json.loads((saved / "adapter_config.json").read_text())
    meta.update(meta_changes)
    (tmp_path / "adapter_config.json").write_text(json.dumps(meta))
    save_file(tensors if tensors is not None else load_file(str(saved / "adapter_model.safetensors")),
              str(tmp_path / "adapter_model.safetensors"))
    return tmp_path


def test_unexpected_tensor_is_named(base, saved, tmp_path):
    """A tensor no adapter takes (e.g. an adapter saved from a deeper model) must not be dropped silently."""
    tensors = load_file(str(saved / "adapter_model.safetensors"))
    extra = "base_model.model.model.layers.4.self_attn.q_proj.lora_A.weight"
    tensors[extra] = torch.zeros(R, 256)
    with pytest.raises(ValueError, match=re.escape(extra)):
        load_adapter(copy.deepcopy(base), _rewrite(saved, tmp_path, tensors))


def test_training_dropout_in_file_is_ignored(base, trained, saved, tmp_path, cfg):
    """PEFT adapters are often trained with lora_dropout > 0; dropout only acts in training, and zmrl
    trains with 0, so such a file loads (and computes exactly what it computes at inference)."""
    fresh = load_adapter(copy.deepcopy(base), _rewrite(saved, tmp_path, lora_dropout=0.05))
    assert fresh.lora_config.dropout == 0.0
    assert torch.equal(logits(fresh, cfg), logits(trained, cfg))


def test_missing_files(base, tmp_path):
    with pytest.raises(FileNotFoundError, match="adapter_config.json"):
        load_adapter(copy.deepcopy(base), tmp_path)


# ----------------------------------------------------------------------------- peft itself
def test_peft_reads_the_adapter(trained, saved):
    peft = pytest.importorskip("peft")
    from peft.utils import load_peft_weights

    pc = peft.LoraConfig.from_pretrained(str(saved))
    assert pc.peft_type == peft.PeftType.LORA
    assert pc.r == R and pc.lora_alpha == ALPHA and pc.lora_dropout == 0.0
    assert set(pc.target_modules) == set(trained.lora_config.target_modules)
    assert not pc.use_rslora and not pc.use_dora  # scaling = lora_alpha / r, as in zmrl

    weights = load_peft_weights(str(saved), device="cpu")
    ours = to_peft_state_dict(trained)
    assert sorted(weights) == sorted(ours)
    for k, v in ours.items():
        assert torch.equal(weights[k], v), k


def _hf_mirror(model) -> nn.Module:
    """A plain nn.Module tree holding an nn.Linear (same weight) at the name of every zmrl Linear, under
    ``base_model.model`` as in a PeftModel: what peft would see in an HF checkpoint of this model."""
    root = nn.Module()
    root.base_model = nn.Module()
    root.base_model.model = nn.Module()
    for name, mod in model.named_modules():
        if not isinstance(mod, Linear):
            continue
        parent = root.base_model.model
        *path, leaf = name.split(".")
        for part in path:
            if not hasattr(parent, part):
                parent.add_module(part, nn.Module())
            parent = getattr(parent, part)
        lin = nn.Linear(mod.in_features, mod.out_features, bias=False)
        lin.weight.data.copy_(mod.weight.data)
        parent.add_module(leaf, lin)
    return root


def test_peft_applies_the_same_math(trained, saved):
    """peft loads the file onto the same module names and computes every adapted projection like zmrl:
    same layout ([r, in] / [out, r]), same scale (alpha / r), per-expert tensors on the right expert."""
    peft = pytest.importorskip("peft")
    from peft.utils import load_peft_weights

    mirror = _hf_mirror(trained)
    peft.inject_adapter_in_model(peft.LoraConfig.from_pretrained(str(saved)), mirror)
    result = peft.set_peft_model_state_dict(mirror, load_peft_weights(str(saved), device="cpu"))
    assert not result.unexpected_keys
    missing_lora = sorted(k for k in result.missing_keys if ".lora_" in k)
    # peft matches target_modules by name suffix, so it also wraps the dense MLP of layer 0
    # (gate/up/down_proj), which zmrl leaves without LoRA. Those adapters stay at peft's init
    # (B = 0), i.e. a no-op: the loaded model computes the same function.
    assert all(".layers.0.mlp." in k for k in missing_lora) and len(missing_lora) == 6, missing_lora

    g = torch.Generator().manual_seed(0)
    checked = noop = 0
    for name, mod in trained.named_modules():
        peft_mod = mirror.get_submodule(f"base_model.model.{name}") if isinstance(mod, Linear) else None
        if peft_mod is None or not hasattr(peft_mod, "lora_A"):
            continue
        x = torch.randn(5, mod.in_features, generator=g)
        with torch.no_grad():
            theirs = peft_mod(x)
            base_out = linear(x, mod.weight)
            expert = re.match(r"(.*)\.experts\.(\d+)\.(\w+)$", name)
            if mod.adapter is not None:
                ours = mod(x)
            elif expert:  # a routed expert: its LoRA is the experts_lora slice of its MoE layer
                moe_name, e, proj = expert.groups()
                ours = mod(x, extra=trained.get_submodule(moe_name).experts_lora.delta(proj, int(e), x))
            else:  # layer 0's dense MLP: peft's unloaded adapter must be a no-op
                assert ".layers.0.mlp." in name, name
                assert (theirs - base_out).abs().max() < 1e-5, name
                noop += 1
                continue
        # Both are fp32 with different summation orders: agreement to a few ulps of outputs of O(1)
        # (1e-5); the adapters move every projection's output by more than 1e-2 (checked), so a wrong
        # scale, a transposed or misplaced tensor is far above that.
        assert (ours - theirs).abs().max() < 1e-5, name
        assert (ours - base_out).abs().max() > 1e-2, f"{name}: adapter has no effect"
        checked += 1
    n_linear = len([1 for n, m in trained.named_modules() if isinstance(m, Linear) and m.adapter is not None])
    n_expert = 3 * trained.config.n_routed_experts * 3  # 3 MoE layers x E experts x gate/up/down
    assert checked == n_linear + n_expert and noop == 3
