"""The HF config adapter for DeepSeek-V3.2 (``deepseek_v32``, ``DeepseekV32ForCausalLM``: the V3 names plus
``self_attn.indexer.{wq_b,wk,k_norm,weights_proj}`` on every layer).

transformers ships no DeepSeek-V3.2 model, so the checkpoint is a tiny random ``DeepseekV3ForCausalLM``
saved by transformers, with indexer tensors added and the V3.2 config fields set; the independent
references are transformers' V3 for everything but the indexer (sequences up to ``index_topk`` tokens
select every earlier token, so V3.2 and V3 compute the same logits: ``TOL`` as in
test_hf_deepseek_v3.py) and fla-core's naive DSA indexer for the indexer itself (test_dsa_indexer_fla.py).
"""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from zmrl.model import (CheckpointError, ConfigError, cu_seqlens_from_lens, forward_packed,
                        load_pretrained, save_pretrained)
from zmrl.model.checkpoint import check_checkpoint

from .test_hf_deepseek_v3 import TOL, _hf_model, _rel

transformers = pytest.importorskip("transformers")

TOPK, HI, DI = 24, 4, 32


def write_v32_checkpoint(path):
    """A tiny DeepSeek-V3.2 folder at ``path``; returns the transformers V3 model it was made from."""
    hf = _hf_model(q_lora_rank=32, n_group=2, topk_group=1, num_experts_per_tok=2)
    hf.save_pretrained(path)
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(model_type="deepseek_v32", architectures=["DeepseekV32ForCausalLM"], index_topk=TOPK,
               index_n_heads=HI, index_head_dim=DI, num_nextn_predict_layers=1)
    (path / "config.json").write_text(json.dumps(cfg))
    state = load_file(str(path / "model.safetensors"))
    g = torch.Generator().manual_seed(5)
    d, q_lora, layers = cfg["hidden_size"], cfg["q_lora_rank"], cfg["num_hidden_layers"]
    for i in range(layers):
        p = f"model.layers.{i}.self_attn.indexer."
        state[p + "wq_b.weight"] = torch.randn(HI * DI, q_lora, generator=g) * q_lora ** -0.5
        state[p + "wk.weight"] = torch.randn(DI, d, generator=g) * d ** -0.5
        state[p + "k_norm.weight"] = 1 + 0.1 * torch.randn(DI, generator=g)
        state[p + "k_norm.bias"] = 0.1 * torch.randn(DI, generator=g)
        state[p + "weights_proj.weight"] = torch.randn(HI, d, generator=g) * d ** -0.5
    # a multi-token-prediction layer (num_nextn_predict_layers: 1): not part of the causal LM
    state[f"model.layers.{layers}.eh_proj.weight"] = torch.zeros(d, 2 * d)
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    return hf


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("v32")
    return write_v32_checkpoint(path), path


def test_every_tensor_loads(saved) -> None:
    _, path = saved
    cfg = check_checkpoint(path)
    assert cfg.model_type == "deepseek_v32" and cfg.index_topk == TOPK and cfg.indexer_types is None
    assert cfg.index_use_hadamard and cfg.index_quant == "fp8" and cfg.rope_interleave and not cfg.index_rope_interleave
    model = load_pretrained(path, dtype="float32")
    files = load_file(str(path / "model.safetensors"))
    got = model.state_dict()
    assert sorted(got) == sorted(k for k in files if not k.startswith(f"model.layers.{cfg.num_hidden_layers}."))
    for k, v in got.items():
        assert torch.equal(v, files[k]), k


def test_convert_reports_the_mtp_layer(saved) -> None:
    from zmrl.model.convert import inspect_checkpoint

    _, path = saved
    report = inspect_checkpoint(path)
    assert report.config_format == "hf" and report.model_type == "deepseek_v32"
    assert report.dropped == {"multi-token-prediction layer": ["model.layers.3.eh_proj.weight"]}
    fields = {f.source: f.target for f in report.fields}
    assert fields["index_topk"] == "index_topk" and fields["n_routed_experts"] == "n_routed_experts"


def test_logits_agree_with_v3_up_to_index_topk(saved) -> None:
    hf, path = saved
    model = load_pretrained(path, dtype="float32")
    g = torch.Generator().manual_seed(2)
    for n in (5, TOPK):
        ids = torch.randint(0, 128, (n,), generator=g)
        with torch.no_grad():
            want = hf(ids[None]).logits[0].double()
            got = forward_packed(model, ids, cu_seqlens_from_lens([n])).double()
        assert _rel(got, want) <= TOL, f"T={n}: {_rel(got, want):.1e}"
    # past index_topk the sparse selection is active: V3.2 is no longer V3
    ids = torch.randint(0, 128, (3 * TOPK,), generator=g)
    with torch.no_grad():
        want = hf(ids[None]).logits[0].double()
        got = forward_packed(model, ids, cu_seqlens_from_lens([3 * TOPK])).double()
    assert _rel(got[:TOPK], want[:TOPK]) <= TOL and _rel(got, want) > 100 * TOL


def test_saved_as_hf_reloads(saved, tmp_path) -> None:
    _, path = saved
    model = load_pretrained(path, dtype="float32")
    save_pretrained(model, tmp_path, format="hf")
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["model_type"] == "deepseek_v32" and written["architectures"] == ["DeepseekV32ForCausalLM"]
    again = load_pretrained(tmp_path, dtype="float32")
    assert again.config == model.config
    for (k, a), (k2, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert k == k2 and torch.equal(a, b), k


def test_bad_checkpoints_name_the_problem(saved, tmp_path) -> None:
    _, path = saved
    cfg = json.loads((path / "config.json").read_text())
    state = load_file(str(path / "model.safetensors"))

    def write(c: dict, s: dict) -> None:
        (tmp_path / "config.json").write_text(json.dumps(c))
        save_file(s, str(tmp_path / "model.safetensors"))

    wk = "model.layers.1.self_attn.indexer.wk.weight"
    cases = [
        ({k: v for k, v in state.items() if k != wk}, CheckpointError, f"missing tensors ['{wk}']"),
        ({**state, "model.layers.0.self_attn.extra.weight": torch.zeros(2)}, CheckpointError,
         "unexpected tensors ['model.layers.0.self_attn.extra.weight']"),
        ({**state, wk: torch.zeros(DI + 1, cfg["hidden_size"])}, CheckpointError, f"mis-shaped tensors: {wk}"),
    ]
    for s, err, needle in cases:
        write(cfg, s)
        for fn in (check_checkpoint, load_pretrained):
            with pytest.raises(err) as ei:
                fn(tmp_path)
            assert needle in str(ei.value) and "\n" not in str(ei.value), str(ei.value)
    for over, needle in ((dict(index_head_dim=24), "Hadamard rotation needs a power of two"),
                         (dict(model_type="qwen3_moe"), "'model_type' = 'qwen3_moe' is not supported"),
                         (dict(index_topk_freq=2), "unknown config field(s) ['index_topk_freq']")):
        write({**cfg, **over}, state)
        with pytest.raises(ConfigError) as ei:
            load_pretrained(tmp_path)
        assert needle in str(ei.value) and "\n" not in str(ei.value), str(ei.value)
