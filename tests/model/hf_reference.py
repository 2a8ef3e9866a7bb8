"""Shared pieces of the transformers reference tests (tiny eager models built and saved in the test)."""
from __future__ import annotations

import pytest
import torch


def build_hf_model(model_cls, cfg):
    """An eager, float64-capable ``model_cls(cfg)`` with weights of std 0.5/sqrt(fan_in) (HF's init std
    0.02 would leave the experts nearly silent and the comparison weak); router correction biases small,
    k_norm affine parameters near identity."""
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "eager"  # the per-expert loop: its grouped_mm path has no float64
    torch.manual_seed(0)
    model = model_cls(cfg).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith("e_score_correction_bias"):
                t.copy_(torch.randn(t.shape, generator=g) * 0.01)
            elif name.endswith("k_norm.weight"):
                t.copy_(1 + 0.1 * torch.randn(t.shape, generator=g))
            elif name.endswith("k_norm.bias"):
                t.copy_(0.1 * torch.randn(t.shape, generator=g))
            elif t.dim() == 2:
                t.copy_(torch.randn(t.shape, generator=g) * 0.5 * t.shape[1] ** -0.5)
            elif t.dim() == 3:  # fused experts [E, out, in]
                t.copy_(torch.randn(t.shape, generator=g) * 0.5 * t.shape[2] ** -0.5)
    return model


def saved_fixture(make_model, variants: dict[str, dict]):
    """A module-scoped fixture over ``variants``: (the transformers model, the folder it was saved to)."""
    @pytest.fixture(scope="module", params=list(variants))
    def saved(request, tmp_path_factory):
        model = make_model(**variants[request.param])
        path = tmp_path_factory.mktemp(request.param)
        model.save_pretrained(path)
        return model, path

    return saved


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def assert_saves_as_hf(hf, path, out, model_cls):
    """zmrl loads the transformers checkpoint at ``path``, saves it in the HF layout to ``out``, and
    transformers reads back exactly hf's tensors; returns (zmrl's model, transformers' reload)."""
    from zmrl.model import ModelConfig, load_pretrained, save_pretrained

    model = load_pretrained(path, dtype="float32")
    save_pretrained(model, out, format="hf")
    again = model_cls.from_pretrained(out, dtype=torch.float32)
    want, got = hf.state_dict(), again.state_dict()
    assert want.keys() == got.keys()
    for k in want:
        assert torch.equal(want[k], got[k]), k
    assert ModelConfig.from_json(out / "config.json") == model.config
    return model, again


def assert_config_error(path, over: dict, needle: str) -> None:
    """The saved config.json with ``over`` applied stops with a one-line ConfigError containing ``needle``."""
    import json

    from zmrl.model import ConfigError, ModelConfig

    data = {**json.loads((path / "config.json").read_text()), **over}
    with pytest.raises(ConfigError) as ei:
        ModelConfig.from_dict(data)
    assert needle in str(ei.value) and "\n" not in str(ei.value), str(ei.value)
