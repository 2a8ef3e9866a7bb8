import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from zmrl.model import CheckpointError, ModelConfig, build_model, load_pretrained, save_pretrained
from zmrl.capacity.sizing import weight_shapes


@pytest.fixture(scope="module")
def model():
    return build_model(ModelConfig.preset("tiny"), seed=3, dtype="bfloat16")


def _same_params(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) and sa[k].dtype == sb[k].dtype for k in sa)


def test_round_trip(tmp_path, model):
    save_pretrained(model, tmp_path)
    assert (tmp_path / "config.json").exists() and (tmp_path / "model.safetensors").exists()
    loaded = load_pretrained(tmp_path)
    assert loaded.dtype == torch.bfloat16
    assert _same_params(model, loaded)
    # decay / routing-bias parameters stay fp32 in a bf16 model
    assert loaded.model.layers[0].self_attn.A_log.dtype == torch.float32


def test_sharded_round_trip(tmp_path, model):
    save_pretrained(model, tmp_path, max_shard_bytes=2_000_000)
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    assert _same_params(model, load_pretrained(tmp_path))


def test_weight_shapes_match_modules(model):
    """sizing.weight_shapes (used for K3.1 Pro parameter math) names exactly the tensors the modules hold."""
    for cfg in (ModelConfig.preset("tiny"), _k3_flags_tiny()):
        built = {k: tuple(v.shape) for k, v in build_model(cfg).state_dict().items()}
        assert built == weight_shapes(cfg)


def _k3_flags_tiny() -> ModelConfig:
    cfg = ModelConfig.preset("tiny")
    cfg.gate_lower_bound, cfg.use_full_rank_gate, cfg.mla_use_output_gate = -5.0, True, True
    cfg.moe_latent_size, cfg.moe_glu, cfg.attn_res_block_size = 96, "situ", 2
    return cfg.validate()


def _rewrite(tmp_path, fn):
    state = load_file(str(tmp_path / "model.safetensors"))
    fn(state)
    save_file(state, str(tmp_path / "model.safetensors"))


def test_missing_tensor_named(tmp_path, model):
    save_pretrained(model, tmp_path)
    _rewrite(tmp_path, lambda s: s.pop("model.layers.3.self_attn.indexer.wk.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensors \['model.layers.3.self_attn.indexer.wk.weight'\]"):
        load_pretrained(tmp_path)


def test_unexpected_tensor_named(tmp_path, model):
    save_pretrained(model, tmp_path)
    _rewrite(tmp_path, lambda s: s.__setitem__("model.layers.0.bogus.weight", torch.zeros(2)))
    with pytest.raises(CheckpointError, match=r"unexpected tensors \['model.layers.0.bogus.weight'\]"):
        load_pretrained(tmp_path)


def test_misshaped_tensor_named(tmp_path, model):
    save_pretrained(model, tmp_path)
    _rewrite(tmp_path, lambda s: s.__setitem__("lm_head.weight", torch.zeros(3, 3, dtype=torch.bfloat16)))
    with pytest.raises(CheckpointError, match=r"lm_head.weight: checkpoint \(3, 3\)"):
        load_pretrained(tmp_path)


def test_no_safetensors_refused(tmp_path, model):
    save_pretrained(model, tmp_path)
    (tmp_path / "model.safetensors").unlink()
    (tmp_path / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        load_pretrained(tmp_path)


def test_bad_config_field_named(tmp_path, model):
    save_pretrained(model, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["hiden_size"] = 3
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="hiden_size"):
        load_pretrained(tmp_path)
