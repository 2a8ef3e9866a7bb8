"""The HF config adapter for ``glm_moe_dsa`` (zmrl/model/hf_config.py) against transformers' own
``GlmMoeDsaForCausalLM`` (eager attention): tiny random models built and saved by transformers in the test
(no network) load in zmrl with every tensor accounted for, the DSA indexer's top-k sets agree, the fp32
logits agree, and what zmrl saves with ``format="hf"`` reloads in transformers with the same tensors.

The variants cover "shared" indexer layers (they reuse the previous layer's top-k; a shared first layer
computes its own, as in transformers), a dense/sparse MLP pattern that is not a dense prefix, and a
one-head indexer.

Sequences up to ``index_topk`` tokens: every earlier token is selected, so the logits must agree to
``TOL = 1e-5`` relative (max |difference| / max |logit|); as in test_hf_deepseek_v3.py both sides also run in
float64 and the test asserts the tolerance is at least 5x the two fp32-vs-fp64 gaps, so a failure is not
rounding.

Longer sequences: each "full" layer's selection is compared row by row. Both sides score
``Σ_h w_h · ReLU(q_h · k_s)``: a key whose dot products are negative for every head scores exactly 0, so
exact ties are common (with one index head about half the keys), and the two implementations break them
differently (zmrl: lower position first, the bitwise contract's rule; transformers: ``torch.topk``, order
unspecified). A row's sets may therefore differ only when the k-th and (k+1)-th best scores are exactly
equal, and then only within that tie group; the test counts such rows and fails on any other difference.
The logits are compared on the rows before the first tied row (later rows may attend to a token whose
selection, and so whose keys in later layers, legitimately differ).
"""
from __future__ import annotations

import copy

import pytest
import torch

from zmrl.model import (CheckpointError, ModelConfig, cu_seqlens_from_lens, forward_packed,
                        load_pretrained, save_pretrained)
from zmrl.model import mla as zmla
from zmrl.model.checkpoint import check_checkpoint

from .hf_reference import assert_config_error, assert_saves_as_hf, build_hf_model, rel_err, saved_fixture

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "GlmMoeDsaForCausalLM"):
    pytest.skip("this transformers has no GlmMoeDsaForCausalLM (added in 5.x)", allow_module_level=True)

TOL = 1e-5
TOPK = 16
SHORT = (5, TOPK)  # every earlier token selected
LONG = (40, 97)

VARIANTS = {
    "shared_alternate": dict(indexer_types=["full", "shared", "full", "shared"],
                             mlp_layer_types=["dense", "sparse", "sparse", "dense"], n_group=2, topk_group=1),
    "shared_first_one_head": dict(indexer_types=["shared", "full", "shared", "shared"], index_n_heads=1,
                                  mlp_layer_types=["dense", "dense", "sparse", "sparse"], num_experts_per_tok=3),
}


def _hf_model(**over):
    fields = dict(
        vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=2, n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=2,
        kv_lora_rank=32, q_lora_rank=48, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        index_topk=TOPK, index_head_dim=16, index_n_heads=4, max_position_embeddings=256, routed_scaling_factor=2.5)
    return build_hf_model(transformers.GlmMoeDsaForCausalLM, transformers.GlmMoeDsaConfig(**{**fields, **over}))


saved = saved_fixture(_hf_model, VARIANTS)
_rel = rel_err


def test_config_and_every_tensor(saved) -> None:
    hf, path = saved
    cfg = check_checkpoint(path)  # names and shapes from the headers: none missing, none unexpected
    c = hf.config
    assert cfg.model_type == "glm_moe_dsa" and cfg.index_topk == TOPK and not cfg.rope_interleave
    assert cfg.index_quant == "none" and not cfg.index_use_hadamard and not cfg.linear_attn_config.kda_layers
    assert [("sparse" if cfg.is_moe_layer(i) else "dense") for i in range(4)] == c.mlp_layer_types
    assert (cfg.indexer_types or ["full"] * 4) == c.indexer_types
    model = load_pretrained(path, dtype="float32")
    want = hf.state_dict()
    got = {k: v for k, v in model.state_dict().items()}
    # transformers fuses the experts in memory ([E, 2I, D] / [E, D, I]); the file has them per expert
    for i, layer in enumerate(hf.model.layers):
        if c.mlp_layer_types[i] == "sparse":
            gate_up, down = want.pop(f"model.layers.{i}.mlp.experts.gate_up_proj"), want.pop(
                f"model.layers.{i}.mlp.experts.down_proj")
            inter = c.moe_intermediate_size
            for e in range(c.n_routed_experts):
                want[f"model.layers.{i}.mlp.experts.{e}.gate_proj.weight"] = gate_up[e, :inter]
                want[f"model.layers.{i}.mlp.experts.{e}.up_proj.weight"] = gate_up[e, inter:]
                want[f"model.layers.{i}.mlp.experts.{e}.down_proj.weight"] = down[e]
    assert sorted(want) == sorted(got)
    for k in want:
        assert torch.equal(want[k], got[k]), k


def _record_selections(model) -> dict[int, list[torch.Tensor]]:
    """zmrl: the top-k of every layer that computes one, per forward (wrapping Indexer.select)."""
    seen: dict[int, list[torch.Tensor]] = {}
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        if attn.indexer is not None and attn.index_source == i:
            def select(*args, _orig=attn.indexer.select, _i=i, **kw):
                out = _orig(*args, **kw)
                seen.setdefault(_i, []).append(out)
                return out
            attn.indexer.select = select
    return seen


def _record_scores(monkeypatch) -> list[torch.Tensor]:
    """zmrl's index scores [T, T] in layer order (wrapping the op the Indexer calls)."""
    scores: list[torch.Tensor] = []

    def wrapped(*args, _orig=zmla.dsa_index_scores, **kw):
        out = _orig(*args, **kw)
        scores.append(out)
        return out
    monkeypatch.setattr(zmla, "dsa_index_scores", wrapped)
    return scores


def _hf_selections(hf) -> dict[int, list[torch.Tensor]]:
    seen: dict[int, list[torch.Tensor]] = {}
    for i, layer in enumerate(hf.model.layers):
        def hook(mod, args, out, _i=i):
            seen.setdefault(_i, []).append(out[0])
        layer.self_attn.indexer.register_forward_hook(hook)
    return seen


def _compare_logits(hf, hf64, z32, z64, ids: torch.Tensor, rows: int) -> None:
    n = ids.numel()
    with torch.no_grad():
        h32, h64 = hf(ids[None]).logits[0].double()[:rows], hf64(ids[None]).logits[0][:rows]
        l32 = forward_packed(z32, ids, cu_seqlens_from_lens([n])).double()[:rows]
        l64 = forward_packed(z64, ids, cu_seqlens_from_lens([n])).double()[:rows]
    gap_h, gap_z, diff, diff64 = _rel(h32, h64), _rel(l32, l64), _rel(l32, h32), _rel(l64, h64)
    info = f"T={n} rows<{rows}: zmrl vs HF fp32 {diff:.1e}, fp64 {diff64:.1e}; gaps HF {gap_h:.1e}, zmrl {gap_z:.1e}"
    assert 5 * (gap_h + gap_z) <= TOL, info
    assert diff <= TOL, info
    assert diff64 <= TOL, info


def test_logits_agree_up_to_index_topk(saved) -> None:
    hf, path = saved
    z32, z64 = load_pretrained(path, dtype="float32"), load_pretrained(path, dtype="float64")
    hf64 = copy.deepcopy(hf).double()
    g = torch.Generator().manual_seed(2)
    for n in SHORT:
        _compare_logits(hf, hf64, z32, z64, torch.randint(0, 128, (n,), generator=g), n)


def test_topk_sets_and_logits_beyond_index_topk(saved, monkeypatch) -> None:
    hf, path = saved
    z32, z64 = load_pretrained(path, dtype="float32"), load_pretrained(path, dtype="float64")
    hf64 = copy.deepcopy(hf).double()
    full = [i for i, t in enumerate(hf.config.indexer_types) if t == "full" or i == 0]
    g = torch.Generator().manual_seed(3)
    ties = compared = skipped = 0
    for n in LONG:
        ids = torch.randint(0, 128, (n,), generator=g)
        hf_sel, z_sel = _hf_selections(hf64), _record_selections(z64)
        z_scores = _record_scores(monkeypatch)
        with torch.no_grad():
            hf64(ids[None])
            forward_packed(z64, ids, cu_seqlens_from_lens([n]))
        for hk in hf64.model.layers:  # drop the hooks before the next sequence
            hk.self_attn.indexer._forward_hooks.clear()
        assert sorted(z_sel) == full and len(z_scores) == len(full)
        first_tie = n  # rows from here on may differ in every later layer
        for layer, scores in zip(full, z_scores):
            mine, theirs = z_sel[layer][0], hf_sel[layer][0]
            tie_rows = []
            for t in range(TOPK, first_tie):  # rows with more candidates than index_topk, unaffected so far
                compared += 1
                a = set(mine[t][mine[t] >= 0].tolist())
                b = set(x for x in theirs[t].tolist() if x <= t)
                ranked = scores[t, : t + 1].sort(descending=True).values
                kth, nxt = float(ranked[TOPK - 1]), float(ranked[TOPK])
                if kth == nxt:  # an exact tie at the boundary: the two tie rules may pick different members
                    tie_rows.append(t)
                    tied = {int(s) for s in (scores[t, : t + 1] == kth).nonzero().flatten()}
                    assert a ^ b <= tied, f"T={n} layer {layer} row {t}: sets differ outside the tie group"
                else:
                    assert a == b, (f"T={n} layer {layer} row {t}: top-{TOPK} sets differ without a tie "
                                    f"(k-th score {kth}, next {nxt}): only zmrl {sorted(a - b)}, "
                                    f"only HF {sorted(b - a)}")
            ties += len(tie_rows)
            skipped += sum(1 for t in range(max(TOPK, first_tie), n))
            # a tied row's attention may differ from here on, and through its keys every later row's
            # inputs to the next layers: later layers are compared on the rows before it
            first_tie = min([first_tie, *tie_rows])
        _compare_logits(hf, hf64, z32, z64, ids, first_tie)
        # undo the wrappers before the next sequence
        for layer in z64.model.layers:
            if layer.self_attn.indexer is not None:
                layer.self_attn.indexer.__dict__.pop("select", None)
        monkeypatch.undo()
    assert compared >= 50, f"too few rows compared: {compared}, ties {ties}, after a tie {skipped}"
    print(f"glm_moe_dsa top-k: {compared} rows compared, {ties} with an exact boundary tie, {skipped} after one")


def test_saved_as_hf_reloads_in_transformers(saved, tmp_path) -> None:
    hf, path = saved
    model, again = assert_saves_as_hf(hf, path, tmp_path, transformers.GlmMoeDsaForCausalLM)
    assert again.config.indexer_types == hf.config.indexer_types
    assert again.config.mlp_layer_types == hf.config.mlp_layer_types
    # zmrl's own format of the same model reloads to the same config
    save_pretrained(model, tmp_path / "zmrl")
    assert load_pretrained(tmp_path / "zmrl").config == model.config


@pytest.mark.parametrize("over,needle", [
    ({"brand_new": 1}, "unknown config field(s) ['brand_new']"),
    ({"indexer_types": ["full", "sometimes", "full", "full"]}, "'indexer_types': entries must be one of"),
    ({"mlp_layer_types": ["dense"]}, "'mlp_layer_types': must list one entry per layer (4)"),
    ({"first_k_dense_replace": 3}, "'first_k_dense_replace' = 3 is inconsistent"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}}, "known but not supported"),
    ({"attention_bias": True}, "'attention_bias' = True is known but not supported"),
    ({"use_sliding_window": True}, "'use_sliding_window' = True is known but not supported"),
])
def test_config_errors_name_the_field(saved, over: dict, needle: str) -> None:
    assert_config_error(saved[1], over, needle)


def test_defaults_follow_transformers() -> None:
    """Fields a file leaves out take GlmMoeDsaConfig's defaults (index pattern from index_topk_freq)."""
    data = {"model_type": "glm_moe_dsa", "num_hidden_layers": 5, "index_topk_freq": 2}
    cfg = ModelConfig.from_dict(data)
    ref = transformers.GlmMoeDsaConfig(num_hidden_layers=5, index_topk_freq=2)
    assert cfg.indexer_types == ref.indexer_types
    assert [("sparse" if cfg.is_moe_layer(i) else "dense") for i in range(5)] == ref.mlp_layer_types
    for z, h in (("hidden_size", "hidden_size"), ("q_lora_rank", "q_lora_rank"), ("index_topk", "index_topk"),
                 ("v_head_dim", "v_head_dim"), ("rms_norm_eps", "rms_norm_eps"), ("n_group", "n_group")):
        assert getattr(cfg, z) == getattr(ref, h), z
    assert cfg.rope_theta == ref.rope_parameters["rope_theta"]


def test_fused_expert_layout_loads(saved, tmp_path) -> None:
    """A file holding transformers' in-memory fused experts (``mlp.experts.gate_up_proj`` [E, 2I, D],
    ``mlp.experts.down_proj`` [E, D, I]) loads to the same model as the per-expert file; a fused tensor
    with another number of experts is named."""
    from safetensors.torch import save_file

    hf, path = saved
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    fused = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in fused)
    save_file(fused, str(tmp_path / "model.safetensors"))
    want = load_pretrained(path, dtype="float32").state_dict()
    assert check_checkpoint(tmp_path) == load_pretrained(path).config
    got = load_pretrained(tmp_path, dtype="float32").state_dict()
    assert want.keys() == got.keys()
    for k in want:
        assert torch.equal(want[k], got[k]), k
    # zmrl convert: the fused tensors are a layout change; the copy holds per-expert tensors, same values
    from zmrl.model.convert import convert_checkpoint, inspect_checkpoint

    report = inspect_checkpoint(tmp_path)
    assert any("(fused_gate)" in c for c in report.changes) and any("(fused_down)" in c for c in report.changes)
    _, written = convert_checkpoint(tmp_path, tmp_path / "converted", report=report)
    assert written
    again = load_pretrained(tmp_path / "converted", dtype="float32").state_dict()
    for k in want:
        assert torch.equal(want[k], again[k]), k
    name = next(k for k in fused if k.endswith("mlp.experts.down_proj"))
    fused[name] = fused[name][:-1].contiguous()
    save_file(fused, str(tmp_path / "model.safetensors"))
    for fn in (check_checkpoint, load_pretrained):
        with pytest.raises(CheckpointError, match=f"mis-shaped tensors: {name}: checkpoint") as ei:
            fn(tmp_path)
        assert "\n" not in str(ei.value)
