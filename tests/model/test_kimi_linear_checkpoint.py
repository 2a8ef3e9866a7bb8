"""A Kimi-Linear checkpoint by its published names (``kimi_linear``: KDA + NoPE MLA without a query
latent + MoE), and the same text model under the ``kimi_k3`` multimodal wrapper.

transformers ships no Kimi-Linear model (its code is remote), so the checkpoint is written here tensor by
tensor with the names and shapes of the published model, independently of zmrl's own writer:
``block_sparse_moe.experts.{e}.w1/w3/w2`` (gate/up/down), ``block_sparse_moe.gate.*``, ``A_log`` stored
``[1, 1, H, 1]``, ``q_proj`` for MLA (``q_lora_rank: null``), a dense first layer under ``mlp.``. The tests
check that every field and tensor lands where it should, that saving writes the same names and values
back, that the model runs, and that a KDA layer computes what fla-core's naive recurrent KDA computes
from the checkpoint's tensors.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from zmrl.model import ConfigError, ModelConfig, cu_seqlens_from_lens, forward_packed, load_pretrained, save_pretrained
from zmrl.model.context import packed_context

from .fla_reference import load_fla_naive

H, DK, D, E, INTER, LAYERS = 2, 16, 64, 8, 32, 4
KIMI_LINEAR_CONFIG = {
    "architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear", "dtype": "float32",
    "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "use_cache": True, "vocab_size": 128,
    "hidden_size": D, "intermediate_size": 96, "num_hidden_layers": LAYERS, "num_attention_heads": 2,
    "num_key_value_heads": 2, "head_dim": 24, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "rope_scaling": None,
    "hidden_act": "silu", "max_position_embeddings": 512, "initializer_range": 0.02, "tie_word_embeddings": False,
    "kv_lora_rank": 32, "q_lora_rank": None, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
    "mla_use_nope": True,
    "linear_attn_config": {"head_dim": DK, "num_heads": H, "short_conv_kernel_size": 4, "kda_layers": [1, 2, 4],
                           "full_attn_layers": [3]},
    "num_experts": E, "num_experts_per_token": 2, "num_shared_experts": 1, "moe_intermediate_size": INTER,
    "moe_router_activation_func": "sigmoid", "moe_renormalize": True, "routed_scaling_factor": 2.446,
    "use_grouped_topk": True, "num_expert_group": 2, "topk_group": 1, "first_k_dense_replace": 1,
    "moe_layer_freq": 1, "num_nextn_predict_layers": 0,
}


def kimi_linear_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    """Random fp32 tensors under the published Kimi-Linear names (std 0.5/sqrt(fan_in), so every branch moves
    the logits)."""
    g = torch.Generator().manual_seed(seed)
    c = KIMI_LINEAR_CONFIG
    out: dict[str, torch.Tensor] = {}

    def lin(name: str, rows: int, cols: int) -> None:
        out[name] = torch.randn(rows, cols, generator=g) * 0.5 * cols ** -0.5

    def norm(name: str, n: int) -> None:
        out[name] = 1 + 0.1 * torch.randn(n, generator=g)

    def swiglu(prefix: str, inter: int) -> None:
        lin(prefix + "gate_proj.weight", inter, D)
        lin(prefix + "up_proj.weight", inter, D)
        lin(prefix + "down_proj.weight", D, inter)

    lin("model.embed_tokens.weight", c["vocab_size"], D)
    lin("lm_head.weight", c["vocab_size"], D)
    norm("model.norm.weight", D)
    heads, nope, rope = c["num_attention_heads"], c["qk_nope_head_dim"], c["qk_rope_head_dim"]
    v, kv = c["v_head_dim"], c["kv_lora_rank"]
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        norm(p + "input_layernorm.weight", D)
        norm(p + "post_attention_layernorm.weight", D)
        a = p + "self_attn."
        if i + 1 in c["linear_attn_config"]["kda_layers"]:
            for x in "qkv":
                lin(f"{a}{x}_proj.weight", H * DK, D)
                out[f"{a}{x}_conv1d.weight"] = torch.randn(H * DK, 1, 4, generator=g) * 0.5
            out[a + "A_log"] = torch.log(torch.empty(H).uniform_(1, 16, generator=g)).view(1, 1, H, 1)
            out[a + "dt_bias"] = 0.1 * torch.randn(H * DK, generator=g)
            lin(a + "f_a_proj.weight", DK, D)
            lin(a + "f_b_proj.weight", H * DK, DK)
            lin(a + "b_proj.weight", H, D)
            lin(a + "g_a_proj.weight", DK, D)
            lin(a + "g_b_proj.weight", H * DK, DK)
            norm(a + "o_norm.weight", DK)
            lin(a + "o_proj.weight", D, H * DK)
        else:
            lin(a + "q_proj.weight", heads * (nope + rope), D)
            lin(a + "kv_a_proj_with_mqa.weight", kv + rope, D)
            norm(a + "kv_a_layernorm.weight", kv)
            lin(a + "kv_b_proj.weight", heads * (nope + v), kv)
            lin(a + "o_proj.weight", D, heads * v)
        if i < c["first_k_dense_replace"]:
            swiglu(p + "mlp.", c["intermediate_size"])
        else:
            m = p + "block_sparse_moe."
            lin(m + "gate.weight", E, D)
            out[m + "gate.e_score_correction_bias"] = 0.01 * torch.randn(E, generator=g)
            for e in range(E):
                lin(f"{m}experts.{e}.w1.weight", INTER, D)
                lin(f"{m}experts.{e}.w3.weight", INTER, D)
                lin(f"{m}experts.{e}.w2.weight", D, INTER)
            swiglu(m + "shared_experts.", INTER)
    return out


def write_kimi_linear_checkpoint(path: Path, wrapped: bool = False, seed: int = 0) -> dict[str, torch.Tensor]:
    """Write config.json + model.safetensors (``wrapped``: the kimi_k3 multimodal wrapper, names under
    ``language_model.``); returns the text model's tensors by their Kimi-Linear names."""
    tensors = kimi_linear_tensors(seed)
    path.mkdir(parents=True, exist_ok=True)
    if wrapped:
        config = {"model_type": "kimi_k3", "architectures": ["KimiK3ForConditionalGeneration"], "dtype": "float32",
                  "text_config": KIMI_LINEAR_CONFIG, "vision_config": {"hidden_size": 8}}
        on_disk = {"language_model." + k: t for k, t in tensors.items()}
        on_disk["vision_tower.patch_embed.weight"] = torch.zeros(8, 3)  # not part of the text model
    else:
        config, on_disk = KIMI_LINEAR_CONFIG, tensors
    (path / "config.json").write_text(json.dumps(config))
    save_file(on_disk, str(path / "model.safetensors"))
    return tensors


def zmrl_name(kimi: str) -> str:
    """Where a Kimi-Linear tensor lives in zmrl's module tree (written out here, not taken from zmrl)."""
    name = kimi.replace(".block_sparse_moe.", ".mlp.")
    return re.sub(r"\.experts\.(\d+)\.w([123])\.", lambda m: f".experts.{m.group(1)}."
                  f"{ {'1': 'gate_proj', '3': 'up_proj', '2': 'down_proj'}[m.group(2)]}.", name)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("kimi_linear")
    return path, write_kimi_linear_checkpoint(path)


def test_fields_map_by_their_kimi_names(checkpoint) -> None:
    path, _ = checkpoint
    cfg = load_pretrained(path).config
    c = KIMI_LINEAR_CONFIG
    assert (cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.n_shared_experts) == (E, 2, 1)
    assert (cfg.n_group, cfg.topk_group, cfg.norm_topk_prob, cfg.routed_scaling_factor) == (2, 1, True, 2.446)
    assert cfg.q_lora_rank is None and cfg.mla_use_nope and not cfg.has_indexer and cfg.moe_glu == "swiglu"
    assert cfg.linear_attn_config.kda_layers == [1, 2, 4] and cfg.linear_attn_config.head_dim == DK
    assert cfg.gate_lower_bound is None and not cfg.use_full_rank_gate  # softplus gate, low-rank g_a/g_b
    assert [cfg.is_moe_layer(i) for i in range(LAYERS)] == [False, True, True, True]
    assert cfg.rms_norm_eps == c["rms_norm_eps"] and cfg.max_position_embeddings == c["max_position_embeddings"]


def test_every_tensor_lands_in_place(checkpoint) -> None:
    path, tensors = checkpoint
    state = load_pretrained(path, dtype="float32").state_dict()
    assert sorted(state) == sorted(zmrl_name(k) for k in tensors)
    for k, t in tensors.items():
        want = t.reshape(H) if k.endswith(".A_log") else t
        assert torch.equal(state[zmrl_name(k)], want), k


def test_wrapper_and_round_trip(checkpoint, tmp_path) -> None:
    path, tensors = checkpoint
    model = load_pretrained(path, dtype="float32")
    wrapped = write_kimi_linear_checkpoint(tmp_path / "k3", wrapped=True)
    other = load_pretrained(tmp_path / "k3", dtype="float32")
    assert other.config == model.config and wrapped.keys() == tensors.keys()
    ids = torch.arange(77) % 128
    cu = cu_seqlens_from_lens([77])
    with torch.no_grad():
        logits = forward_packed(model, ids, cu)
        assert torch.equal(forward_packed(other, ids, cu), logits)
    assert torch.isfinite(logits).all() and logits.std(dim=-1).min() > 1e-3
    # zmrl writes the published names back: same names, shapes (A_log [1, 1, H, 1]) and values
    save_pretrained(model, tmp_path / "out", format="k3", quantize_experts=False)
    written = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert sorted(written) == sorted("language_model." + k for k in tensors)
    for k, t in tensors.items():
        assert torch.equal(written["language_model." + k], t), k
    assert load_pretrained(tmp_path / "out").config == model.config


def _kda_layer_by_the_published_math(a: dict[str, torch.Tensor], x: torch.Tensor, kda) -> torch.Tensor:
    """Layer 0 (KDA) computed from the checkpoint's tensors ``a`` (float64) by the published math: short
    conv + SiLU, per-head L2 norm, softplus gate, ``kda(q, k, v, g, beta, scale)`` for the recurrence (fla's
    naive or chunked kernel, [1, T, H, d] inputs), gated RMSNorm, o_proj. Returns [T, D] in x's dtype."""
    n = x.shape[0]
    xd = x.double()

    def conv_silu(name: str) -> torch.Tensor:
        u = xd @ a[f"{name}_proj.weight"].T  # [T, C]
        y = F.conv1d(F.pad(u.T[None], (3, 0)), a[f"{name}_conv1d.weight"], groups=u.shape[1])[0].T
        return F.silu(y).view(n, H, DK)

    q, k, v = conv_silu("q"), conv_silu("k"), conv_silu("v")
    q, k = (z / torch.sqrt((z * z).sum(-1, keepdim=True) + 1e-6) for z in (q, k))
    gate = -a["A_log"].reshape(H, 1).exp() * F.softplus(
        (xd @ a["f_a_proj.weight"].T @ a["f_b_proj.weight"].T + a["dt_bias"]).view(n, H, DK))
    beta = torch.sigmoid(xd @ a["b_proj.weight"].T)
    o = kda(q[None], k[None], v[None], gate[None], beta[None], DK ** -0.5)[0].double()
    o = o * torch.rsqrt((o * o).mean(-1, keepdim=True) + KIMI_LINEAR_CONFIG["rms_norm_eps"]) * a["o_norm.weight"]
    o = o * torch.sigmoid((xd @ a["g_a_proj.weight"].T @ a["g_b_proj.weight"].T).view(n, H, DK))
    return (o.reshape(n, H * DK) @ a["o_proj.weight"].T).to(x.dtype)


def _layer0_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k.split("self_attn.")[1]: v.double() for k, v in tensors.items() if k.startswith("model.layers.0.self_attn.")}


def test_kda_layer_matches_fla_naive(checkpoint) -> None:
    """Layer 0 (KDA) of the loaded model against the published KDA math on the checkpoint's own tensors,
    with fla-core's ``naive_recurrent_kda`` for the recurrence. zmrl computes the chunked form in fp32 and
    fla the token recurrence in float64 here; the fp32 rounding of the chunked form over 150 tokens stays
    near 1e-6 of the output's scale, so 2e-5 relative is a real check of the semantics (a wrong gate, norm
    or scale moves it by >1e-2)."""
    naive = load_fla_naive("kda", "naive_recurrent_kda")
    path, t = checkpoint
    model = load_pretrained(path, dtype="float32")
    n = 150
    x = torch.randn(n, D, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        got = model.model.layers[0].self_attn(x, packed_context(cu_seqlens_from_lens([n]))).double()
    want = _kda_layer_by_the_published_math(
        _layer0_tensors(t), x.double(), lambda q, k, v, g, b, scale: naive.naive_recurrent_kda(q, k, v, g, b, scale=scale)[0])
    rel = float((got - want).abs().max() / want.abs().max())
    print(f"KDA layer vs fla naive: {rel:.1e}")
    assert rel <= 2e-5, rel


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_kda_layer_matches_fla_chunk_kda_gpu(checkpoint) -> None:
    """On the GPU: layer 0 (KDA) of the loaded model, run by zmrl's kernels on CUDA in fp32, against the
    same layer computed with fla-core's Triton ``chunk_kda`` on the same weights and inputs (fp32), both
    measured against the float64 naive recurrence. fla's chunked kernel has its own fp32/TF32 rounding,
    so the check is relative: zmrl's error is no larger than 2x fla's (or 2e-5 of the output's scale,
    the CPU bound above, whichever is larger); both errors are printed side by side."""
    chunk_kda = pytest.importorskip("fla.ops.kda").chunk_kda
    naive = load_fla_naive("kda", "naive_recurrent_kda")
    path, t = checkpoint
    model = load_pretrained(path, dtype="float32").cuda()
    a = _layer0_tensors(t)
    for n in (150, 1000):
        x = torch.randn(n, D, generator=torch.Generator().manual_seed(n))
        with torch.no_grad():
            got = model.model.layers[0].self_attn(x.cuda(), packed_context(cu_seqlens_from_lens([n], device="cuda")))
        want = _kda_layer_by_the_published_math(
            a, x.double(), lambda q, k, v, g, b, scale: naive.naive_recurrent_kda(q, k, v, g, b, scale=scale)[0])

        def fla_chunk(q, k, v, g, b, scale):
            args = [z.float().cuda().contiguous() for z in (q, k, v, g, b)]
            return chunk_kda(*args, scale=scale)[0].double().cpu()

        ref_fla = _kda_layer_by_the_published_math({k: w.cuda() for k, w in a.items()}, x.double().cuda(),
                                                   lambda *z, **kw: fla_chunk(*z, **kw).cuda()).cpu()
        scale = float(want.abs().max())
        err_zmrl = float((got.double().cpu() - want).abs().max()) / scale
        err_fla = float((ref_fla - want).abs().max()) / scale
        print(f"KDA layer, T = {n}: zmrl (CUDA) vs float64 {err_zmrl:.1e}, fla chunk_kda vs float64 {err_fla:.1e}")
        assert err_zmrl <= max(2e-5, 2 * err_fla), (n, err_zmrl, err_fla)


@pytest.mark.parametrize("over,needle", [
    ({"num_experts_per_tokens": 2}, "unknown config field(s) ['text_config.num_experts_per_tokens']"),
    ({"moe_router_activation_func": "softmax"}, "'moe_router_activation_func' = 'softmax' is known but not supported"),
    ({"hidden_act": "gelu"}, "'hidden_act' = 'gelu' is known but not supported"),
    ({"rope_scaling": {"type": "yarn"}}, "'rope_scaling'"),
    ({"linear_attn_config": {**KIMI_LINEAR_CONFIG["linear_attn_config"], "short_conv_kernel_size": 3}},
     "'linear_attn_config.short_conv_kernel_size': only 4 is supported"),
])
def test_config_errors_name_the_field(over: dict, needle: str) -> None:
    with pytest.raises(ConfigError) as ei:
        ModelConfig.from_dict({**KIMI_LINEAR_CONFIG, **over})
    assert needle in str(ei.value) and "\n" not in str(ei.value), str(ei.value)
