"""zmrl against an independent implementation of the released Kimi K3: mlx-lm's ``kimi_k3`` model.

Tiny random K3 models covering every K3 feature are written by zmrl in the release format (tensor names,
nested config, MXFP4 routed experts for one of them), then loaded by ``mlx_lm.utils.load_model`` (its own
config parsing, ``sanitize`` renames and MXFP4 dequantisation) and by ``zmrl.model.load_pretrained``.
Their fp32 logits must agree to ``TOL`` relative (max |difference| / max |logit|) over lengths inside
one 64-token KDA chunk, just past it and across two.

Why ``TOL = 1e-4``: each side's own fp32-vs-fp64 gap is measured on the same weights and inputs (zmrl
builds the model in float64; mlx runs ``set_dtype(float64)``, with its fp32-only ``gather_mm`` replaced by
a plain gather + matmul for that run; each side keeps some fp32 islands in its fp64 run: mlx its SiTU,
routing and AttnRes mix, zmrl its AttnRes mix). Rounding alone can make the two fp32 results differ by
about the sum of the two gaps; measured here the sum is at most ~2e-5, and the test asserts that the
tolerance is at least twice it (so a failure is not rounding) while the fp32 results agree to TOL. Every
semantic difference found (MLA latent-norm eps, KDA o_norm eps, top-1 renormalisation) moves these
models' logits by 4e-3 to 1 (k3_utils.random_k3_model draws small MLA latents and audible experts for
that), far outside it. A flipped expert choice (two scores within fp32 rounding) would exceed it too;
the fixed seeds here have none.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from zmrl.model import cu_seqlens_from_lens, forward_packed, load_pretrained, save_pretrained

from .k3_utils import random_k3_model, tiny_k3

mx = pytest.importorskip("mlx.core")
mlx_utils = pytest.importorskip("mlx_lm.utils")

TOL = 1e-4
LENGTHS = (7, 65, 130)  # inside one KDA chunk, just past it, across two

CONFIGS = {
    # attn-res blocks of 2 over 5 layers (partial last block), latent MoE with its norm, grouped routing
    # (4 groups, keep 2), top-2, full-rank KDA gate with lower bound, gated MLA, MXFP4 experts
    "blocks2_latent_norm_grouped_top2_fullrank_mxfp4": (tiny_k3(), True),
    # blocks of 3 over 4 layers (partial), latent MoE without its norm, ungrouped top-1 (never
    # renormalised), low-rank KDA gate with softplus decay, q_proj without q_lora, MoE every 2nd layer,
    # tied embeddings, Kimi-Linear SiTU defaults (beta 1, no up-branch cap), rms_norm_eps 1e-6
    "blocks3_latent_nonorm_top1_lowrank": (tiny_k3(
        num_hidden_layers=4, linear_attn_config=dataclasses.replace(
            tiny_k3().linear_attn_config, kda_layers=[1, 3], full_attn_layers=[2, 4]),
        attn_res_block_size=3, latent_moe_use_norm=False, n_group=1, topk_group=1, num_experts_per_tok=1,
        use_full_rank_gate=False, gate_lower_bound=None, q_lora_rank=None, moe_layer_freq=2,
        tie_word_embeddings=True, activation_situ_beta=1.0, activation_situ_linear_beta=None, rms_norm_eps=1e-6,
        mla_use_output_gate=False), False),
    # one block per layer, no latent MoE, grouped (2 groups, keep 1) top-3 without renormalisation,
    # every layer MoE
    "blocks1_nolatent_grouped_top3_norenorm": (tiny_k3(
        attn_res_block_size=1, moe_latent_size=None, n_group=2, topk_group=1, num_experts_per_tok=3,
        norm_topk_prob=False, first_k_dense_replace=0, routed_scaling_factor=1.5), False),
}


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


def _gather_mm_any_dtype(original):
    """mlx's gather_mm is fp32-only: for the fp64 run, gather the expert matrices and matmul."""
    def gather_mm(a, b, rhs_indices=None, sorted_indices=False, **kw):
        if a.dtype != mx.float64:
            return original(a, b, rhs_indices=rhs_indices, sorted_indices=sorted_indices, **kw)
        return mx.matmul(a, b[rhs_indices])
    return gather_mm


@pytest.fixture(scope="module", params=list(CONFIGS))
def checkpoints(request, tmp_path_factory):
    cfg, mxfp4 = CONFIGS[request.param]
    model = random_k3_model(cfg, seed=len(request.param), mxfp4_experts=mxfp4)
    root = tmp_path_factory.mktemp(request.param)
    save_pretrained(model, root / "release", format="k3", quantize_experts=mxfp4)
    if mxfp4:  # the same (MXFP4-representable) weights unquantised, for mlx's fp64 run
        save_pretrained(model, root / "dense", format="k3", quantize_experts=False)
    return request.param, root / "release", root / ("dense" if mxfp4 else "release")


def _mlx_logits(model, ids: torch.Tensor) -> np.ndarray:
    return np.array(model(mx.array(ids.numpy())[None])[0].astype(mx.float64))


def _zmrl_logits(model, ids: torch.Tensor) -> np.ndarray:
    with torch.no_grad():
        return forward_packed(model, ids, cu_seqlens_from_lens([len(ids)])).double().numpy()


def test_logits_agree_with_mlx_lm(checkpoints, monkeypatch) -> None:
    name, release, dense = checkpoints
    z32, z64 = load_pretrained(release, dtype="float32"), load_pretrained(release, dtype="float64")
    m32, _ = mlx_utils.load_model(Path(release))
    m64, _ = mlx_utils.load_model(Path(dense))
    m64.set_dtype(mx.float64)
    monkeypatch.setattr(mx, "gather_mm", _gather_mm_any_dtype(mx.gather_mm))
    g = torch.Generator().manual_seed(7)
    for n in LENGTHS:
        ids = torch.randint(0, z32.config.vocab_size, (n,), generator=g)
        zl32, zl64 = _zmrl_logits(z32, ids), _zmrl_logits(z64, ids)
        ml32, ml64 = _mlx_logits(m32, ids), _mlx_logits(m64, ids)
        gap_z, gap_m = _rel(zl32, zl64), _rel(ml32, ml64)
        diff, diff64 = _rel(zl32, ml32), _rel(zl64, ml64)
        info = (f"{name} T={n}: zmrl vs mlx fp32 {diff:.2e} (fp64 {diff64:.2e}); own fp32-vs-fp64 gaps: "
                f"zmrl {gap_z:.2e}, mlx {gap_m:.2e}")
        assert 2 * (gap_z + gap_m) <= TOL, "the tolerance must stay above both sides' rounding: " + info
        assert diff <= TOL, info
        assert diff64 <= TOL, info
        assert (zl32.argmax(-1) == ml32.argmax(-1)).mean() >= 0.99, info


def test_the_comparison_sees_each_semantic_fix(tmp_path, monkeypatch) -> None:
    """Undo each of the release-semantics fixes in zmrl and the comparison fails by far: so the
    agreement above is evidence, not an artefact of models too small to show the difference."""
    import zmrl.kernels_batch_invariant.moe_router as router

    ids = torch.randint(0, 128, (65,), generator=torch.Generator().manual_seed(3))
    cfg, _ = CONFIGS["blocks2_latent_norm_grouped_top2_fullrank_mxfp4"]
    save_pretrained(random_k3_model(cfg, seed=1, mxfp4_experts=False), tmp_path / "a", format="k3",
                    quantize_experts=False)
    ref = _mlx_logits(mlx_utils.load_model(tmp_path / "a")[0], ids)
    assert _rel(_zmrl_logits(load_pretrained(tmp_path / "a"), ids), ref) <= TOL
    # the old eps: rms_norm_eps for both MLA latent norms; o_norm fixed (1e-5; here rms_norm_eps is 1e-5,
    # so any other value stands for "not following rms_norm_eps")
    for attrs, eps in ((("q_a_layernorm", "kv_a_layernorm"), cfg.rms_norm_eps), (("o_norm",), 1e-6)):
        model = load_pretrained(tmp_path / "a")
        for layer in model.model.layers:
            for attr in attrs:
                if hasattr(layer.self_attn, attr):
                    getattr(layer.self_attn, attr).eps = eps
        assert _rel(_zmrl_logits(model, ids), ref) > 10 * TOL, attrs
    top1, _ = CONFIGS["blocks3_latent_nonorm_top1_lowrank"]
    save_pretrained(random_k3_model(top1, seed=2, mxfp4_experts=False), tmp_path / "b", format="k3",
                    quantize_experts=False)
    ref = _mlx_logits(mlx_utils.load_model(tmp_path / "b")[0], ids)
    model = load_pretrained(tmp_path / "b")
    assert _rel(_zmrl_logits(model, ids), ref) <= TOL
    monkeypatch.setattr(router, "renormalises", lambda norm_topk_prob, top_k: bool(norm_topk_prob))  # the old rule
    assert _rel(_zmrl_logits(model, ids), ref) > 10 * TOL


def test_mxfp4_dequantisation_matches_mlx() -> None:
    """zmrl's MXFP4 decoding against mlx's own (mx.quantize / mx.dequantize, mode mxfp4)."""
    from zmrl.model.mxfp4 import dequantize_mxfp4, quantize_mxfp4

    w = torch.randn(16, 128, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 2, 16)[:, None]
    packed, scale = mx.quantize(mx.array(w.numpy()), group_size=32, bits=4, mode="mxfp4")
    ours = dequantize_mxfp4(torch.from_numpy(np.array(packed.view(mx.uint8))), torch.from_numpy(np.array(scale)))
    theirs = torch.from_numpy(np.array(mx.dequantize(packed, scale, group_size=32, bits=4, mode="mxfp4",
                                                     dtype=mx.float32)))
    assert torch.equal(ours, theirs)
    # and our writer's packing decodes the same through mlx
    p2, s2 = quantize_mxfp4(ours)
    again = mx.dequantize(mx.array(p2.numpy()).view(mx.uint32), mx.array(s2.numpy()), group_size=32, bits=4,
                          mode="mxfp4", dtype=mx.float32)
    assert torch.equal(torch.from_numpy(np.array(again)), ours)
