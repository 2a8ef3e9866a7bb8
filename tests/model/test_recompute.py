"""Activation recompute (zmrl/model/recompute.py): the forward bits and the gradients do not change.

Each policy is compared against ``none`` on the same LoRA model and batch: the logits of the training
forward must be ``torch.equal`` and every LoRA gradient bitwise equal (the recomputation re-runs the
same deterministic ops, so there is no tolerance to argue about). The model is the small all-paths
config of tests/trainer/test_gradients.py (KDA x3, MLA + DSA with sparse selection, MoE), plus an
AttnRes variant for the depth-mixing path.
"""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from zmrl.lora import LoraConfig, apply_lora
from zmrl.model import RECOMPUTE_POLICIES, apply_recompute, build_model, cu_seqlens_from_lens, forward_packed
from zmrl.trainer import compute_logprobs

from ..trainer.test_gradients import LENS, MBT, PROMPTS, TEMPS, small_cfg


def _model(attn_res: bool):
    cfg = small_cfg()
    if attn_res:
        cfg = dataclasses.replace(cfg, attn_res_block_size=2).validate()
    return apply_lora(build_model(cfg, seed=3), LoraConfig(r=4, alpha=8.0, init_b_std=0.05))


@pytest.fixture(scope="module")
def batch():
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 256, (n,), generator=g) for n in LENS]
    coef = [torch.randn(n - p, generator=g) for n, p in zip(LENS, PROMPTS)]
    return seqs, coef


def _run(model, policy: str, batch):
    m = apply_recompute(copy.deepcopy(model), policy)
    seqs, coef = batch
    lps = compute_logprobs(m, seqs, PROMPTS, temperature=TEMPS, micro_batch_tokens=MBT)
    loss = sum((lp * c).sum() for lp, c in zip(lps, coef))
    loss.backward()
    grads = {n: p.grad for n, p in m.named_parameters() if p.requires_grad}
    return [lp.detach() for lp in lps], grads


@pytest.fixture(scope="module", params=[False, True], ids=["plain", "attn_res"])
def case(request, batch):
    model = _model(request.param)
    return model, _run(model, "none", batch)


@pytest.mark.parametrize("policy", [p for p in RECOMPUTE_POLICIES if p != "none"])
def test_recompute_keeps_forward_bits_and_gradients(case, batch, policy):
    model, (lp_ref, g_ref) = case
    lps, grads = _run(model, policy, batch)
    for i, (a, b) in enumerate(zip(lps, lp_ref)):
        assert torch.equal(a, b), f"policy {policy}: sequence {i} log-probs differ from 'none'"
    assert grads.keys() == g_ref.keys()
    # Some LoRA tensors only move the DSA top-k selection and get no gradient: None on both sides.
    assert sum(g is not None for g in g_ref.values()) > len(g_ref) // 2
    diff = [n for n in grads if not ((grads[n] is None and g_ref[n] is None)
                                      or (grads[n] is not None and g_ref[n] is not None
                                          and torch.equal(grads[n], g_ref[n])))]
    assert not diff, f"policy {policy}: {len(diff)} of {len(grads)} gradients differ, e.g. {diff[:3]}"


def test_recompute_actually_recomputes(batch):
    """``layer`` runs each decoder layer's forward twice under autograd (forward + backward recompute);
    ``none`` once; a no-grad forward never recomputes."""
    model = _model(False)
    calls = {"n": 0}

    def count(*_):
        calls["n"] += 1

    # The layer's own hook fires once per __call__; the recompute re-enters the layer's body, which
    # calls its input norm again.
    model.model.layers[0].input_layernorm.register_forward_hook(count)
    seqs, _ = batch
    ids = torch.cat(seqs[:1])
    cu = cu_seqlens_from_lens([ids.numel()], ids.device)
    for policy, expect in (("none", 1), ("layer", 2)):
        apply_recompute(model, policy)
        calls["n"] = 0
        forward_packed(model, ids, cu).sum().backward()
        assert calls["n"] == expect, f"{policy}: layer 0 ran {calls['n']} times"
    calls["n"] = 0
    with torch.no_grad():
        forward_packed(model, ids, cu)
    assert calls["n"] == 1


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match=r"trainer.recompute: unknown activation-recompute policy 'full' \(allowed"):
        apply_recompute(_model(False), "full")
