"""KV-cache capacity planner: the article's five figures, the derived quantities, sanity on the
small presets, monotonicity, error messages and the CLI."""
from __future__ import annotations

import argparse
import math

import pytest

from zmrl.model.config import ModelConfig
from zmrl.capacity.sizing import weight_shapes
from zmrl.capacity.planner import (
    ARTICLE_TOKENS,
    GB,
    GiB,
    CapacityPlan,
    add_plan_subcommand,
    article_comparison,
    main,
    plan_capacity,
    weight_bytes_per_gpu,
)

# The brief's acceptance band: every article figure within 5 %. The model actually lands within
# 0.5 % (docs/capacity.md); a broken byte count (e.g. 656 B FlashMLA latents, index keys dropped,
# DCP not multiplying by W, KDA rows not reserved at 3 per request) moves a figure by > 5 %.
REL = 0.05


@pytest.fixture(scope="module")
def k3() -> ModelConfig:
    return ModelConfig.preset("k3.1-pro")


def _plan(k3: ModelConfig, layout: str = "tp", latent: str = "fp8", index: str = "fp8", **kw) -> CapacityPlan:
    return plan_capacity(k3, "gb300", 8, layout=layout, degree=8, latent=latent, index=index, **kw)


# ---------------------------------------------------------------------------- the article's figures
def test_tp8_fp8_tokens(k3: ModelConfig) -> None:
    assert _plan(k3).tokens_that_fit == pytest.approx(3.04e6, rel=REL)


def test_dcp8_fp8_tokens(k3: ModelConfig) -> None:
    assert _plan(k3, "dcp").tokens_that_fit == pytest.approx(21.8e6, rel=REL)


def test_tp8_nvfp4_latent_tokens(k3: ModelConfig) -> None:
    assert _plan(k3, latent="nvfp4").tokens_that_fit == pytest.approx(4.49e6, rel=REL)


def test_dcp8_nvfp4_latent_tokens(k3: ModelConfig) -> None:
    assert _plan(k3, "dcp", latent="nvfp4").tokens_that_fit == pytest.approx(32.1e6, rel=REL)


def test_nvfp4_latent_mxfp4_index_is_1_7x_fp8(k3: ModelConfig) -> None:
    ratio = _plan(k3, latent="nvfp4", index="mxfp4").tokens_that_fit / _plan(k3).tokens_that_fit
    assert ratio == pytest.approx(1.7, rel=REL)
    # 1.65 and 1.75 would also round to 1.7 in the article
    assert round(ratio, 1) == 1.7


def test_dcp8_over_tp8_is_7_2_not_8(k3: ModelConfig) -> None:
    """The DCP workspace makes the gain 7.2x; a model that just multiplies by W gives 8x, which
    this bound rejects (8 is 11 % above 7.2)."""
    for latent in ("fp8", "nvfp4"):
        ratio = _plan(k3, "dcp", latent).tokens_that_fit / _plan(k3, "tp", latent).tokens_that_fit
        assert ratio == pytest.approx(7.2, rel=REL)
        assert ratio < 7.6


def test_tp8_fp8_full_1m_requests_is_2_9(k3: ModelConfig) -> None:
    p = _plan(k3, context_len=1_048_576)
    assert round(p.full_context_requests, 1) == 2.9
    assert p.full_context_requests_whole == 2


def test_article_comparison_all_within_5pct(k3: ModelConfig) -> None:
    rows = article_comparison(k3)
    assert len(rows) >= 5
    for r in rows:
        assert abs(r.error_pct) < 100 * REL, r


def test_no_special_casing_one_memory_model(k3: ModelConfig) -> None:
    """The four token scenarios share every per-GPU reserve except the DCP workspace, and the
    pool left before rows is the same for both formats of one layout."""
    plans = {key: _plan(k3, *key) for key in ARTICLE_TOKENS}
    for (layout, _, _), p in plans.items():
        assert p.weight_bytes == plans[("tp", "fp8", "fp8")].weight_bytes
        assert p.activation_bytes == plans[("tp", "fp8", "fp8")].activation_bytes
        assert (p.dcp_workspace_bytes > 0) == (layout == "dcp")
    assert plans[("tp", "fp8", "fp8")].cache_bytes == plans[("tp", "nvfp4", "fp8")].cache_bytes
    assert plans[("dcp", "fp8", "fp8")].cache_bytes == plans[("dcp", "nvfp4", "fp8")].cache_bytes


# ---------------------------------------------------------------------------- derived quantities
def test_k3_bytes_rows_and_kda_groups(k3: ModelConfig) -> None:
    tp, dcp = _plan(k3), _plan(k3, "dcp")
    assert tp.kv_bytes_per_token_per_gpu == 24 * (576 + 132) == 16992
    assert dcp.kv_bytes_per_token_per_gpu == 16992 / 8
    # 69 KDA layers in 3 groups of 23; TP8 splits 96 heads 12 per GPU; per head and layer:
    # 128x128 fp32 state + 3 conv taps x 3 (q, k, v) x 128 bf16
    assert tp.kda_groups == 3
    assert tp.kda_group_state_bytes == 23 * 12 * (128 * 128 * 4 + 3 * 3 * 128 * 2)
    # smallest power of two >= 64 whose attention row holds the KDA group state: 1024 rows are too small
    assert tp.block_size == 2048 and 1024 * 16992 < tp.kda_group_state_bytes <= tp.row_bytes
    assert tp.kda_rows == 16 * 3
    assert tp.tokens_that_fit == tp.kv_rows * 2048
    assert dcp.tokens_that_fit == dcp.kv_rows * 2048 * 8
    # the breakdown adds up
    for p in (tp, dcp):
        assert p.budget_bytes - p.weight_bytes - p.activation_bytes - p.prefill_exchange_bytes \
            - p.dcp_workspace_bytes == p.cache_bytes
        assert 0 <= p.unused_bytes < p.row_bytes
        assert p.kda_state_bytes + p.kv_pool_bytes + p.unused_bytes == p.cache_bytes


def test_k3_weights_per_gpu(k3: ModelConfig) -> None:
    """2.78 T params: routed experts at 4.25 bits (MXFP4) + the rest in bf16 = 1.56 TB; /8 plus
    the replicated tensors ~ 197 GB per GPU."""
    w = weight_bytes_per_gpu(k3, "mxfp4-experts", 8)
    assert 190 * GB < w < 200 * GB
    assert weight_bytes_per_gpu(k3, "fp8", 8) > w  # fp8 experts are twice the bytes of fp4


def test_weight_formats_exact_on_bench() -> None:
    cfg = ModelConfig.preset("bench")
    shapes = weight_shapes(cfg)
    total = sum(math.prod(s) for s in shapes.values())
    experts = sum(math.prod(s) for n, s in shapes.items() if ".mlp.experts." in n)
    assert weight_bytes_per_gpu(cfg, "bf16", 1) == 2 * total
    # bench expert widths are multiples of 32: exactly 4.25 bits per routed-expert weight
    assert weight_bytes_per_gpu(cfg, "mxfp4-experts", 1) == 2 * (total - experts) + experts * 17 // 32
    # splitting over 8 GPUs: everything but the replicated tensors is divided
    assert weight_bytes_per_gpu(cfg, "bf16", 8) < weight_bytes_per_gpu(cfg, "bf16", 1) / 4


def test_weight_bytes_override(k3: ModelConfig) -> None:
    p = _plan(k3, weight_bytes=8 * 150 * GB)
    assert p.weight_bytes == 150 * GB
    assert p.tokens_that_fit > _plan(k3).tokens_that_fit


def test_replicas_multiply_tokens(k3: ModelConfig) -> None:
    one = plan_capacity(k3, "gb300", 8, degree=8)
    two = plan_capacity(k3, "gb300", 16, degree=8)
    assert two.replicas == 2 and two.tokens_that_fit == 2 * one.tokens_that_fit


# ---------------------------------------------------------------------------- small presets
@pytest.mark.parametrize("name,gpu,n,degree,layout", [
    ("tiny", "h100", 1, 1, "tp"),
    ("bench", "h200", 1, 1, "tp"),
    ("bench", "h200", 2, 2, "dcp"),
    ("bench", "b200", 8, 4, "tp"),
])
def test_small_presets_are_sane(name: str, gpu: str, n: int, degree: int, layout: str) -> None:
    cfg = ModelConfig.preset(name)
    p = plan_capacity(cfg, gpu, n, degree=degree, layout=layout, context_len=32768)
    assert p.tokens_that_fit > 0 and p.full_context_requests > 0 and p.kv_rows > 0
    assert p.block_size >= 64 and p.block_size & (p.block_size - 1) == 0
    assert p.row_bytes >= p.kda_group_state_bytes
    # a small model on one GPU: the pool is most of the budget and holds many millions of tokens
    assert p.cache_bytes > 0.5 * p.budget_bytes
    assert p.tokens_that_fit > 10**6
    assert isinstance(p.table(), str) and "tokens that fit" in p.table()


# ---------------------------------------------------------------------------- monotonicity
def test_more_memory_more_tokens(k3: ModelConfig) -> None:
    prev = 0
    for gib in (230, 250, 268, 300, 400):
        t = plan_capacity(k3, gib * GiB, 8).tokens_that_fit
        assert t > prev
        prev = t


def test_smaller_formats_more_tokens(k3: ModelConfig) -> None:
    for layout in ("tp", "dcp"):
        bf16 = _plan(k3, layout, "bf16").tokens_that_fit
        fp8 = _plan(k3, layout, "fp8").tokens_that_fit
        nv = _plan(k3, layout, "nvfp4").tokens_that_fit
        nv_mx = _plan(k3, layout, "nvfp4", "mxfp4").tokens_that_fit
        assert bf16 < fp8 < nv < nv_mx


def test_dcp_beats_tp_and_longer_context_fewer_requests(k3: ModelConfig) -> None:
    assert _plan(k3, "dcp").tokens_that_fit > _plan(k3, "tp").tokens_that_fit
    short, long_ = _plan(k3, context_len=131072), _plan(k3, context_len=1_048_576)
    assert short.tokens_that_fit == long_.tokens_that_fit
    assert short.full_context_requests == pytest.approx(8 * long_.full_context_requests)


def test_more_seqs_and_reserves_fewer_tokens(k3: ModelConfig) -> None:
    base = _plan(k3).tokens_that_fit
    assert _plan(k3, max_num_seqs=64).tokens_that_fit < base
    assert _plan(k3, activation_gib=10).tokens_that_fit < base
    assert _plan(k3, "dcp", dcp_workspace_gib=0).tokens_that_fit == pytest.approx(8 * base, rel=0.01)


# ---------------------------------------------------------------------------- errors
@pytest.mark.parametrize("kw,words", [
    (dict(latent="int8"), ["latent", "int8", "nvfp4"]),
    (dict(index="fp4"), ["index", "fp4", "mxfp4"]),
    (dict(layout="pp"), ["layout", "pp", "dcp"]),
    (dict(weight_format="int4"), ["weight_format", "int4", "mxfp4-experts"]),
    (dict(degree=3), ["degree 3", "num_gpus 8", "[1, 2, 4, 8]"]),
    (dict(block_size=100), ["block_size", "power of two"]),
])
def test_errors_name_field_and_allowed(k3: ModelConfig, kw: dict, words: list[str]) -> None:
    args = dict(layout="tp", degree=8) | kw
    with pytest.raises(ValueError) as e:
        plan_capacity(k3, "gb300", 8, **args)
    for w in words:
        assert w in str(e.value)


def test_unknown_gpu(k3: ModelConfig) -> None:
    with pytest.raises(ValueError, match=r"unknown gpu 'a100'.*gb300"):
        plan_capacity(k3, "a100", 8)


def test_does_not_fit(k3: ModelConfig) -> None:
    with pytest.raises(ValueError, match="does not fit.*weights"):
        plan_capacity(k3, "h200", 8)
    with pytest.raises(ValueError, match="max_num_seqs=500"):
        plan_capacity(k3, 215 * GiB, 8, max_num_seqs=500)


# ---------------------------------------------------------------------------- CLI
def test_cli_plan_table(capsys: pytest.CaptureFixture) -> None:
    rc = main(["plan", "--preset", "k3.1-pro", "--gpu", "gb300", "--num-gpus", "8", "--layout", "dcp",
               "--degree", "8", "--latent", "nvfp4", "--index", "mxfp4", "--context", "1048576"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "DCP8" in out and "tokens that fit" in out and "KV bytes per token per GPU: 1,260.0" in out


def test_cli_all(capsys: pytest.CaptureFixture) -> None:
    assert main(["plan", "--all"]) == 0
    out = capsys.readouterr().out
    for fig in ("3.04", "21.8", "4.49", "32.1", "1.7", "2.9"):
        assert fig in out
    assert "error" in out


def test_cli_config_file(tmp_path, capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "config.json"
    ModelConfig.preset("bench").to_json(path)
    assert main(["plan", "--config", str(path), "--gpu-memory-gib", "100", "--num-gpus", "1"]) == 0
    assert "tokens that fit" in capsys.readouterr().out


def test_cli_argparse_errors(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as e:
        main(["plan", "--latent", "int8"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--latent" in err and "'nvfp4'" in err
    with pytest.raises(SystemExit):
        main(["plan", "--gpu", "a100"])
    assert "gb300" in capsys.readouterr().err


def test_cli_value_error_exit_code(capsys: pytest.CaptureFixture) -> None:
    assert main(["plan", "--num-gpus", "8", "--degree", "3"]) == 2
    assert "degree 3" in capsys.readouterr().err


def test_add_plan_subcommand_like_zmrl_cli(capsys: pytest.CaptureFixture) -> None:
    """How zmrl/cli.py wires it: a required subparsers group, then args.func(args)."""
    parser = argparse.ArgumentParser(prog="zmrl")
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)
    add_plan_subcommand(sub)
    args = parser.parse_args(["plan", "--layout", "tp", "--latent", "fp8"])
    assert args.func(args) == 0
    assert "3.0" in capsys.readouterr().out


def test_shared_and_unquantised_index_layers(k3: ModelConfig) -> None:
    """Only MLA layers whose indexer computes its own selection store index keys ("shared" layers reuse
    an earlier layer's top-k: ModelConfig.index_key_layers, the rule the engine's page pool uses too), and
    a config with ``index_quant: none`` stores them in the model dtype (Di x 2 B in bf16), whatever
    quantisation the plan names."""
    import dataclasses

    mla = [i for i in range(k3.num_hidden_layers) if not k3.is_kda_layer(i)]
    types = ["full"] * k3.num_hidden_layers
    for i in mla[1::2]:  # every second MLA layer shares the previous one's selection
        types[i] = "shared"
    shared = dataclasses.replace(k3, indexer_types=types)
    assert shared.index_key_layers() == mla[0::2]
    assert _plan(shared).kv_bytes_per_token_per_gpu == 24 * 576 + 12 * 132
    plain = dataclasses.replace(k3, index_quant="none")
    assert plain.kv_bytes_per_token_per_layer("fp8", "mxfp4") == (576, 128 * 2)
    assert _plan(plain).kv_bytes_per_token_per_gpu == 24 * (576 + 256)
