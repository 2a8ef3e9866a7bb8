"""zmrl.lora: where adapters go, that they start as an exact no-op, that the unfused math is right
(one Linear, MLA's absorbed kv_b, batched expert LoRA), and config validation (docs/model.md, LoRA)."""
from __future__ import annotations

import contextlib
import copy
import importlib

import pytest
import torch

from zmrl.kernels_batch_invariant import linear
from zmrl.kernels_batch_invariant.moe_router import moe_route
from zmrl.lora import ExpertLoRA, LoraAdapter, LoraConfig, apply_lora, lora_parameters, lora_state_dict
from zmrl.model import ModelConfig, build_model, cu_seqlens_from_lens, forward_packed
from zmrl.model.layers import Linear
from zmrl.model.mla import MLAAttention
from zmrl.model.moe import MLP, MoE

U32 = 2.0 ** -24  # fp32 unit roundoff

# Lengths crossing a 64-token KDA chunk and longer than tiny's index_topk=64 (sparse selection on).
LENS = [70, 33]

K3_FLAGS = dict(gate_lower_bound=-5.0, use_full_rank_gate=True, mla_use_output_gate=True, moe_latent_size=96,
                moe_glu="situ", attn_res_block_size=2)


def tiny_cfg(**overrides) -> ModelConfig:
    cfg = ModelConfig.preset("tiny")
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg.validate()


@pytest.fixture(scope="module")
def base_fp32():
    return build_model(tiny_cfg(), seed=0).eval()


def seqs_for(cfg: ModelConfig, lens=LENS, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (sum(lens),), generator=g)
    return ids, cu_seqlens_from_lens(lens)


@torch.no_grad()
def logits_of(model, cfg, lens=LENS):
    ids, cu = seqs_for(cfg, lens)
    return forward_packed(model, ids, cu)


# ----------------------------------------------------------------------------- float64 reference
# The model code rounds to fp32 at fixed points (``out_dtype=torch.float32``, ``.float()``), so
# ``build_model(cfg, dtype="float64")`` is not an fp64 computation end to end. Inside this context the
# model modules see a ``torch`` whose ``float32`` is float64, and ``Tensor.float()`` keeps fp64 tensors
# fp64: every op (they all pick fp64 compute for fp64 inputs) then runs in fp64. Only the DSA indexer's
# FP8 quantisation stays fp32, and it feeds the discrete top-k selection alone.
_FP32_POINTS = ("zmrl.model.layers", "zmrl.model.kda", "zmrl.model.mla", "zmrl.model.moe", "zmrl.model.model",
                "zmrl.model.attn_res", "zmrl.lora.layers")


class _Float64Torch:
    float32 = torch.float64

    def __getattr__(self, name):
        return getattr(torch, name)


@contextlib.contextmanager
def float64_compute():
    mods = [importlib.import_module(m) for m in _FP32_POINTS]
    saved = [m.torch for m in mods]
    own_float = torch.Tensor.__dict__.get("float")
    base_float = torch.Tensor.float

    def _float(self, *a, **k):
        return self if self.dtype == torch.float64 else base_float(self, *a, **k)

    for m in mods:
        m.torch = _Float64Torch()
    torch.Tensor.float = _float
    try:
        yield
    finally:
        if own_float is None:
            del torch.Tensor.float
        else:
            torch.Tensor.float = own_float
        for m, t in zip(mods, saved):
            m.torch = t


@contextlib.contextmanager
def assert_all_float64(model):
    """Fails if any module of ``model`` returns a floating tensor that is not fp64."""
    bad: set[str] = set()

    def hook(mod, args, out):
        if isinstance(out, torch.Tensor) and out.is_floating_point() and out.dtype != torch.float64:
            bad.add(f"{type(mod).__name__} -> {out.dtype}")

    handles = [m.register_forward_hook(hook) for m in model.modules()]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
    assert not bad, f"float64 reference is not fp64 end to end: {sorted(bad)}"


def to_float64(model):
    m = copy.deepcopy(model)
    for p in m.parameters():
        p.data = p.data.double()
    return m


# ----------------------------------------------------------------------------- expected placement
def expected_adapters(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """Module name -> (in, out) of every Linear that must carry a LoraAdapter, from the config alone."""
    la = cfg.linear_attn_config
    D, H, dk = cfg.hidden_size, la.num_heads, la.head_dim
    HD = H * dk
    Hm, nope, rope, v = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    qlr, kvlr = cfg.q_lora_rank, cfg.kv_lora_rank
    Hi, di = cfg.index_n_heads, cfg.index_head_dim
    inter_s = cfg.n_shared_experts * cfg.moe_intermediate_size
    out: dict[str, tuple[int, int]] = {}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        if cfg.is_kda_layer(i):
            attn = {"q_proj": (D, HD), "k_proj": (D, HD), "v_proj": (D, HD), "f_a_proj": (D, dk),
                    "f_b_proj": (dk, HD), "b_proj": (D, H), "o_proj": (HD, D)}
            attn.update({"g_proj": (D, HD)} if cfg.use_full_rank_gate else {"g_a_proj": (D, dk), "g_b_proj": (dk, HD)})
        else:
            attn = {"q_a_proj": (D, qlr), "q_b_proj": (qlr, Hm * (nope + rope)), "kv_a_proj_with_mqa": (D, kvlr + rope),
                    "kv_b_proj": (kvlr, Hm * (nope + v)), "o_proj": (Hm * v, D),
                    "indexer.wq_b": (qlr, Hi * di), "indexer.wk": (D, di), "indexer.weights_proj": (D, Hi)}
            if cfg.mla_use_output_gate:
                attn["g_proj"] = (D, Hm * v)
        out.update({f"{p}self_attn.{k}": s for k, s in attn.items()})
        if cfg.is_moe_layer(i) and cfg.n_shared_experts:
            shared = {"gate_proj": (D, inter_s), "up_proj": (D, inter_s), "down_proj": (inter_s, D)}
            out.update({f"{p}mlp.shared_experts.{k}": s for k, s in shared.items()})
    return out


def expected_lora_param_count(cfg: ModelConfig, r: int) -> int:
    """r·(in+out) per adapted Linear, plus E·r·(in+out) per routed-expert projection of every MoE layer."""
    linear = sum(r * (i + o) for i, o in expected_adapters(cfg).values())
    de, inter = cfg.moe_latent_size or cfg.hidden_size, cfg.moe_intermediate_size
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    return linear + moe_layers * cfg.n_routed_experts * 3 * r * (de + inter)


@pytest.mark.parametrize("flags,r", [({}, 32), ({}, 8), (K3_FLAGS, 32)], ids=["tiny-r32", "tiny-r8", "k3-flags"])
def test_apply_lora_placement_and_count(flags, r):
    cfg = tiny_cfg(**flags)
    # The tiny layout this test relies on: KDA x3 then MLA+DSA; layer 0 dense, layers 1.. MoE.
    assert [cfg.is_kda_layer(i) for i in range(4)] == [True, True, True, False]
    assert [cfg.is_moe_layer(i) for i in range(4)] == [False, True, True, True]
    lcfg = LoraConfig(r=r, alpha=16.0)
    model = apply_lora(build_model(cfg, seed=0), lcfg)
    want = expected_adapters(cfg)
    if flags:
        assert "model.layers.0.self_attn.g_proj" in want and "model.layers.3.self_attn.g_proj" in want

    got = {n: m for n, m in model.named_modules() if isinstance(m, Linear) and m.adapter is not None}
    assert sorted(got) == sorted(want), (
        f"missing {sorted(set(want) - set(got))}, unexpected {sorted(set(got) - set(want))}")
    for name, (fan_in, fan_out) in want.items():
        ad = got[name].adapter
        assert isinstance(ad, LoraAdapter)
        assert got[name].in_features == fan_in and got[name].out_features == fan_out, name
        assert ad.lora_A.shape == (r, fan_in) and ad.lora_B.shape == (fan_out, r), name
        assert ad.lora_A.dtype == ad.lora_B.dtype == torch.float32
        assert ad.scale == 16.0 / r
        assert torch.count_nonzero(ad.lora_B) == 0, f"{name}: B must start at zero"
        assert torch.count_nonzero(ad.lora_A) > 0, f"{name}: A must be initialised"

    de, inter, E = cfg.moe_latent_size or cfg.hidden_size, cfg.moe_intermediate_size, cfg.n_routed_experts
    for i, layer in enumerate(model.model.layers):
        mlp = layer.mlp
        if i == 0:  # dense MLP: never adapted
            assert isinstance(mlp, MLP)
            assert all(getattr(mlp, p).adapter is None for p in ("gate_proj", "up_proj", "down_proj"))
            continue
        assert isinstance(mlp, MoE) and isinstance(mlp.experts_lora, ExpertLoRA)
        lora = mlp.experts_lora
        for proj, (fi, fo) in {"gate_proj": (de, inter), "up_proj": (de, inter), "down_proj": (inter, de)}.items():
            assert getattr(lora, f"{proj}_lora_A").shape == (E, r, fi)
            assert getattr(lora, f"{proj}_lora_B").shape == (E, fo, r)
        # The routed experts' own Linears stay bare: their LoRA lives batched in experts_lora.
        assert all(getattr(ex, p).adapter is None for ex in mlp.experts for p in ("gate_proj", "up_proj", "down_proj"))
        if cfg.moe_latent_size:
            assert mlp.latent_down_proj.adapter is None and mlp.latent_up_proj.adapter is None
    assert model.lm_head.adapter is None

    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == set(lora_state_dict(model))
    assert all(".adapter.lora_" in n or ".experts_lora." in n for n in trainable)
    assert not any(n.startswith(("lm_head", "model.embed_tokens")) or ".mlp.gate." in n for n in trainable)
    assert [id(p) for p in lora_parameters(model)] == [id(p) for n, p in model.named_parameters() if n in trainable]
    assert sum(p.numel() for p in lora_parameters(model)) == expected_lora_param_count(cfg, r)


def test_target_subset():
    cfg = tiny_cfg()
    model = apply_lora(build_model(cfg, seed=0), LoraConfig(r=4, target_modules=("kv_b_proj", "gate_proj")))
    adapted = sorted(n for n, m in model.named_modules() if isinstance(m, Linear) and m.adapter is not None)
    assert adapted == ["model.layers.1.mlp.shared_experts.gate_proj", "model.layers.2.mlp.shared_experts.gate_proj",
                       "model.layers.3.mlp.shared_experts.gate_proj", "model.layers.3.self_attn.kv_b_proj"]
    lora = model.model.layers[1].mlp.experts_lora
    assert lora.projs == ("gate_proj",) and not hasattr(lora, "up_proj_lora_A")
    none = apply_lora(build_model(cfg, seed=0), LoraConfig(r=4, target_modules=("q_proj",)))
    assert all(layer.mlp.experts_lora is None for layer in none.model.layers[1:])


# ----------------------------------------------------------------------------- B = 0 is an exact no-op
@pytest.mark.parametrize("dtype,flags", [("float32", {}), ("bfloat16", {}), ("float32", K3_FLAGS)],
                         ids=["fp32", "bf16", "k3-flags-fp32"])
def test_zero_b_is_bitwise_noop(dtype, flags):
    """fp32 base + an adapter output of exactly 0.0, rounded once, equals the direct rounding of the fp32
    base: x + 0.0 == x for every finite x (-0.0 becomes +0.0, which compares equal)."""
    cfg = tiny_cfg(**flags)
    base = build_model(cfg, seed=0, dtype=dtype).eval()
    lora = apply_lora(copy.deepcopy(base), LoraConfig())
    ref, got = logits_of(base, cfg), logits_of(lora, cfg)
    assert torch.isfinite(ref).all()
    assert torch.equal(ref, got), f"max |diff| {float((ref - got).abs().max()):.3e}"
    with torch.no_grad():  # the adapters are live: one non-zero B changes the output
        lora.model.layers[3].self_attn.kv_b_proj.adapter.lora_B.fill_(0.01)
    assert not torch.equal(logits_of(lora, cfg), ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zero_b_linear_bitwise(dtype):
    g = torch.Generator().manual_seed(0)
    lin = Linear(48, 40, bias=True, dtype=dtype)
    lin.weight.data = (torch.randn(40, 48, generator=g) * 0.2).to(dtype)
    lin.bias.data = torch.randn(40, generator=g).to(dtype)
    x = torch.randn(37, 48, generator=g).to(dtype)
    ref = lin(x)
    lin.adapter = LoraAdapter(48, 40, r=8, scale=2.0)
    lin.adapter.lora_A.data = torch.randn(8, 48, generator=g)
    assert torch.equal(lin(x), ref)
    assert lin(x).dtype == dtype


# ----------------------------------------------------------------------------- the math
def _linear_with_adapter(g, dtype, k=48, n=40, r=8, scale=3.0):
    lin = Linear(k, n, bias=True, dtype=dtype)
    lin.weight.data = (torch.randn(n, k, generator=g) * 0.2).to(dtype)
    lin.bias.data = (torch.randn(n, generator=g) * 0.1).to(dtype)
    lin.adapter = LoraAdapter(k, n, r, scale)  # scale 3: not a power of two, so the scaling rounds
    lin.adapter.lora_A.data = torch.randn(r, k, generator=g) * 0.3
    lin.adapter.lora_B.data = torch.randn(n, r, generator=g) * 0.3
    return lin


def _ref_and_bound(lin, x):
    """float64 ``x W^T + b + s (x A^T) B^T`` and a first-order bound on fp32 evaluation error:
    each dot product of length m is off by at most m·u·Σ|terms| (standard bound), the rank-r product
    inherits the first product's error through |B|, and the scaling and the two adds round once each,
    so (K + r + 3)·u·(|x||W|^T + |b| + s (|x||A|^T)|B|^T) covers every term."""
    xd, w, a, b = x.double(), lin.weight.double(), lin.adapter.lora_A.double(), lin.adapter.lora_B.double()
    s, bias = lin.adapter.scale, lin.bias.double()
    ref = xd @ w.T + bias + s * (xd @ a.T) @ b.T
    mag = xd.abs() @ w.abs().T + bias.abs() + s * (xd.abs() @ a.abs().T) @ b.abs().T
    k, r = w.shape[1], a.shape[0]
    return ref, (k + r + 3) * U32 * mag, s * (xd @ a.T) @ b.T


def test_linear_adapter_matches_float64():
    g = torch.Generator().manual_seed(0)
    lin = _linear_with_adapter(g, torch.float32)
    x = torch.randn(37, 48, generator=g)
    y = lin(x)
    ref, bound, delta = _ref_and_bound(lin, x)
    err = (y.double() - ref).abs()
    assert (err <= bound).all(), f"max err/bound {float((err / bound).max()):.2f}"
    # The test can fail: the LoRA term is ~1e5x the bound, so dropping it, its scale, or transposing
    # A/B is caught.
    assert delta.abs().mean() > 1e4 * bound.mean()


def test_linear_adapter_single_rounding_bf16():
    """bf16 model: base and adapter are summed in fp32 and rounded once to bf16."""
    g = torch.Generator().manual_seed(1)
    lin = _linear_with_adapter(g, torch.bfloat16)
    x = torch.randn(37, 48, generator=g).to(torch.bfloat16)
    fp32 = linear(x, lin.weight, lin.bias, out_dtype=torch.float32) + lin.adapter(x)
    y = lin(x)
    assert y.dtype == torch.bfloat16 and torch.equal(y, fp32.to(torch.bfloat16))
    ref, bound, _ = _ref_and_bound(lin, x)
    # one bf16 rounding (8 significant bits): at most half an ulp = 2^-8 relative, on top of the fp32 bound
    assert ((y.double() - ref).abs() <= bound + 2.0 ** -8 * ref.abs()).all()


def test_mla_absorbed_kv_b_lora_equals_merged_weight():
    """MLA never materialises kv_b(c_kv): its LoRA is applied in the absorbed form (q_nope·B_UK·A on
    the query side, o_lat·Aᵀ·B_UVᵀ on the output side). That must equal the MLA computed with the
    merged weight W + s·B·A. Both run in float64, where they agree to ~1e-15 (measured 1.3e-15 on
    logits of size ~1.5); the kv_b adapter moves the logits by ~0.9, so a mis-split B (UK/UV halves
    swapped: measured 0.75), a missing scale or a transposed A is ~1e8x over the 1e-9 tolerance."""
    cfg = tiny_cfg()
    model = apply_lora(build_model(cfg, seed=0), LoraConfig(r=8, alpha=16.0, init_b_std=0.05, init_seed=3))
    assert sum(isinstance(m, MLAAttention) for m in model.modules()) == 1

    def mlas(m):
        return [x for x in m.modules() if isinstance(x, MLAAttention)]

    off = copy.deepcopy(model)  # kv_b adapter dropped: shows the adapter matters
    for mla in mlas(off):
        mla.kv_b_proj.adapter = None
    m64, off64, merged64, merged32 = to_float64(model), to_float64(off), to_float64(off), copy.deepcopy(off)
    with torch.no_grad():
        for src, d64, d32 in zip(mlas(m64), mlas(merged64), mlas(merged32)):
            ad = src.kv_b_proj.adapter  # fp64 copy of the adapter
            d64.kv_b_proj.weight += ad.scale * ad.lora_B @ ad.lora_A
            d32.kv_b_proj.weight.copy_(d64.kv_b_proj.weight.float())
    ids, cu = seqs_for(cfg)
    with float64_compute(), torch.no_grad(), assert_all_float64(m64):
        y_lora = forward_packed(m64, ids, cu)
        y_merged = forward_packed(merged64, ids, cu)
        y_off = forward_packed(off64, ids, cu)
    assert y_lora.dtype == torch.float64
    tol = 1e-9
    assert (y_lora - y_merged).abs().max() < tol
    assert (y_lora - y_off).abs().max() > 0.1, "kv_b adapter has no effect: the test could not fail"

    # The same comparison in the fp32 model (merged weight rounded to fp32): agreement to fp32 noise.
    # The logits are O(1) and a few hundred fp32 ops deep (measured 4.8e-7); 2e-5 is ~170 ulps of a
    # logit of 1 and still 1/40000 of the kv_b adapter's effect.
    with torch.no_grad():
        y32, y32m = forward_packed(model, ids, cu), forward_packed(merged32, ids, cu)
    assert (y32 - y32m).abs().max() < 2e-5


# ----------------------------------------------------------------------------- batched expert LoRA
@pytest.fixture(scope="module")
def moe_with_lora(base_fp32):
    model = apply_lora(copy.deepcopy(base_fp32), LoraConfig(r=8, alpha=16.0, init_b_std=0.05, init_seed=5))
    return model.model.layers[1].mlp


def test_expert_lora_equals_per_expert_adapters(moe_with_lora):
    """experts_lora slice e behaves exactly (bitwise) like a LoraAdapter on expert e's own Linears."""
    moe, lora = moe_with_lora, moe_with_lora.experts_lora
    g = torch.Generator().manual_seed(0)
    x = torch.randn(21, moe.experts[0].gate_proj.in_features, generator=g)
    for e, expert in enumerate(moe.experts):
        ref = copy.deepcopy(expert)
        for proj in ("gate_proj", "up_proj", "down_proj"):
            lin = getattr(ref, proj)
            r = getattr(lora, f"{proj}_lora_A").shape[1]
            lin.adapter = LoraAdapter(lin.in_features, lin.out_features, r, lora.scale)
            lin.adapter.lora_A.data = getattr(lora, f"{proj}_lora_A")[e].detach().clone()
            lin.adapter.lora_B.data = getattr(lora, f"{proj}_lora_B")[e].detach().clone()
        with torch.no_grad():
            assert torch.equal(expert(x, lora, e), ref(x)), f"expert {e}"
            d = lora.delta("gate_proj", e, x).double()
            a, b = lora.gate_proj_lora_A[e].double(), lora.gate_proj_lora_B[e].double()
            want = lora.scale * (x.double() @ a.T) @ b.T
            bound = (x.shape[1] + a.shape[0] + 2) * U32 * lora.scale * (x.double().abs() @ a.abs().T) @ b.abs().T
            assert ((d - want).abs() <= bound).all()


def test_expert_lora_slices_are_independent(moe_with_lora):
    """Perturbing expert e' 's slices changes exactly the tokens routed to e'; the others stay bitwise."""
    moe = copy.deepcopy(moe_with_lora)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(48, moe.gate.weight.shape[1], generator=g)
    with torch.no_grad():
        y0 = moe(x)
        ids = moe_route(x, moe.gate.weight, moe.gate.e_score_correction_bias, moe.top_k, moe.n_group,
                        moe.topk_group, moe.norm_topk_prob, moe.scaling).expert_ids
        for e_prime in (0, 5):
            pert = copy.deepcopy(moe)
            for proj in pert.experts_lora.projs:
                for ab in "AB":
                    t = getattr(pert.experts_lora, f"{proj}_lora_{ab}")
                    t[e_prime] += torch.randn(t[e_prime].shape, generator=g) * 0.1
            y1 = pert(x)
            uses = (ids == e_prime).any(-1)
            assert 0 < int(uses.sum()) < x.shape[0], "need tokens on both sides"
            assert torch.equal(y0[~uses], y1[~uses]), f"tokens not routed to {e_prime} changed"
            assert (y0[uses] != y1[uses]).any(-1).all(), f"tokens routed to {e_prime} did not change"


# ----------------------------------------------------------------------------- config validation
def test_lora_config_validation():
    with pytest.raises(ValueError, match=r"\br\b.*>= 1"):
        LoraConfig(r=0)
    with pytest.raises(ValueError, match="dropout"):
        LoraConfig(dropout=0.1)
    with pytest.raises(ValueError, match="foo_proj"):
        LoraConfig(target_modules=("q_proj", "foo_proj"))
    assert LoraConfig(r=4, alpha=8).scale == 2.0
    assert LoraConfig(target_modules=["q_proj"]).target_modules == ("q_proj",)
