"""moe_route / moe_combine: tie rules, group limiting, weights, agreement with the reference,
bitwise row invariance, gradients."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from zmrl.kernels_batch_invariant.moe_router import (
    RouterOutput,
    moe_combine,
    moe_combine_ref,
    moe_route,
    moe_route_ref,
    moe_sort,
)
from zmrl.kernels_batch_invariant.pointwise import sigmoid

from .invariance import assert_rows_invariant

# (E, top_k, n_group, topk_group): Kimi-Linear style (1 group), DeepSeek-V3 style, the tiny preset
CONFIGS = [(64, 8, 1, 1), (64, 6, 8, 4), (8, 2, 4, 2), (16, 4, 4, 1), (6, 6, 1, 1)]


def _router(t: int, d: int, e: int, seed: int, dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, d, generator=g).to(dtype)
    w = (torch.randn(e, d, generator=g) * d**-0.5).to(dtype)
    bias = torch.randn(e, generator=g) * 0.05
    return x, w, bias


def _route_flat(out: RouterOutput) -> torch.Tensor:
    """ids and the weights' bit patterns in one tensor, so one torch.equal checks both."""
    return torch.cat([out.expert_ids, out.weights.float().view(torch.int32).to(torch.int64)], dim=-1)


def _route_with_scores(sb: torch.Tensor, **kw) -> RouterOutput:
    """Route T tokens whose selection scores are exactly ``sb``: x = 0 gives logits 0, s = 0.5 for
    every expert, and the bias then sets s + bias = sb (0.5 + (sb - 0.5) is exact for these sb)."""
    t, e = sb.shape
    out = [moe_route(torch.zeros(1, 4), torch.randn(e, 4), sb[i] - 0.5, **kw) for i in range(t)]
    return RouterOutput(torch.cat([o.expert_ids for o in out]), torch.cat([o.weights for o in out]))


# ----------------------------------------------------------------------------- selection rules


def test_ties_go_to_the_lower_expert_id() -> None:
    kw = dict(n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=1.0)
    # all 8 experts tied (identical gate rows, no bias): experts 0, 1, 2
    x, w = torch.randn(5, 16), torch.randn(1, 16).expand(8, 16).contiguous()
    out = moe_route(x, w, None, top_k=3, **kw)
    assert torch.equal(out.expert_ids, torch.tensor([[0, 1, 2]] * 5))
    torch.testing.assert_close(out.weights, torch.full((5, 3), 1 / 3))
    # ties at the boundary only: expert 6 is best, then 1, 3, 5 tie for the remaining 2 slots
    sb = torch.tensor([[0.5, 0.75, 0.5, 0.75, 0.5, 0.75, 0.875, 0.5]])
    out = _route_with_scores(sb, top_k=3, **kw)
    assert out.expert_ids.tolist() == [[1, 3, 6]]
    # the reference follows the same rule
    ref = moe_route_ref(torch.zeros(1, 4), torch.zeros(8, 4), sb[0] - 0.5, top_k=3, **kw)
    assert ref.expert_ids.tolist() == [[1, 3, 6]]


def test_group_limiting() -> None:
    # 4 groups of 4, keep 2. Group 0 holds the single best expert but a weak second one (group
    # score 0.875 + 0.5 = 1.375); groups 1 (1.5) and 2 (1.4375) win, so expert 0 is never chosen.
    sb = torch.tensor([[0.875, 0.5, 0.5, 0.5,
                        0.75, 0.75, 0.5, 0.5,
                        0.75, 0.6875, 0.5, 0.5,
                        0.625, 0.625, 0.5, 0.5]])
    kw = dict(n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5)
    out = _route_with_scores(sb, top_k=3, **kw)
    assert out.expert_ids.tolist() == [[4, 5, 8]]
    # without group limiting expert 0 wins
    out1 = _route_with_scores(sb, top_k=3, n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5)
    assert out1.expert_ids.tolist() == [[0, 4, 5]]
    # tied group scores: the lower group index is kept (groups 1 and 3 tie at 1.5; 1 is kept)
    sb2 = sb.clone()
    sb2[0, 12:14] = 0.75
    out2 = _route_with_scores(sb2, top_k=4, n_group=4, topk_group=1, norm_topk_prob=True, routed_scaling_factor=1.0)
    assert out2.expert_ids.tolist() == [[4, 5, 6, 7]]


@pytest.mark.parametrize("e,top_k,n_group,topk_group", [c for c in CONFIGS if c[2] > 1])
def test_experts_in_dropped_groups_are_never_chosen(e: int, top_k: int, n_group: int, topk_group: int) -> None:
    x, w, bias = _router(200, 32, e, seed=e + top_k)
    out = moe_route(x, w, bias, top_k, n_group, topk_group, True, 1.0)
    sb = (sigmoid(torch.nn.functional.linear(x, w)) + bias).view(200, n_group, -1)
    gscore = sb.topk(2, dim=-1).values.sum(-1)
    kept = gscore.topk(topk_group, dim=-1).indices  # random data: no ties, so topk's order is fine
    size = e // n_group
    groups_used = out.expert_ids // size
    for t in range(200):
        assert set(groups_used[t].tolist()) <= set(kept[t].tolist()), t


@pytest.mark.parametrize("e,top_k,n_group,topk_group", CONFIGS)
def test_output_contract(e: int, top_k: int, n_group: int, topk_group: int) -> None:
    x, w, bias = _router(100, 48, e, seed=e)
    rsf = 2.446
    out = moe_route(x, w, bias, top_k, n_group, topk_group, True, rsf)
    assert out.expert_ids.shape == (100, top_k) and out.expert_ids.dtype == torch.int64
    assert out.weights.shape == (100, top_k) and out.weights.dtype == torch.float32
    assert (out.expert_ids[:, 1:] > out.expert_ids[:, :-1]).all()  # strictly ascending, distinct
    assert ((out.expert_ids >= 0) & (out.expert_ids < e)).all()
    # normalised weights sum to the scaling factor: k divisions (u each) and one multiply
    torch.testing.assert_close(out.weights.double().sum(-1), torch.full((100,), rsf, dtype=torch.float64),
                               rtol=(top_k + 2) * 2.0**-24, atol=0)
    # weights come from s (no bias), aligned with the ids: exactly s[ids] / tree_sum * rsf
    s = sigmoid(torch.nn.functional.linear(x, w))  # fp32 logits; rounding may differ, so compare loosely
    raw = s.gather(1, out.expert_ids)
    torch.testing.assert_close(out.weights, raw / raw.sum(-1, keepdim=True) * rsf, rtol=1e-5, atol=0)
    # unnormalised: s[ids] * rsf
    out_u = moe_route(x, w, bias, top_k, n_group, topk_group, False, rsf)
    assert torch.equal(out_u.expert_ids, out.expert_ids)
    torch.testing.assert_close(out_u.weights, raw * rsf, rtol=1e-5, atol=0)


@pytest.mark.parametrize("n_group,topk_group", [(1, 1), (4, 2)])
def test_top1_is_never_renormalised(n_group: int, topk_group: int) -> None:
    """As the released Kimi K3: with one expert per token its weight is its own sigmoid score (times
    the scaling), not 1, even when norm_topk_prob asks for renormalisation."""
    x, w, bias = _router(40, 32, 16, seed=11)
    out = moe_route(x, w, bias, 1, n_group, topk_group, True, 2.5)
    plain = moe_route(x, w, bias, 1, n_group, topk_group, False, 2.5)
    assert torch.equal(out.expert_ids, plain.expert_ids) and torch.equal(out.weights, plain.weights)
    assert bool((out.weights < 2.5).all())  # a score in (0, 1) times 2.5, never the scaling itself
    ref = moe_route_ref(x, w, bias, 1, n_group, topk_group, True, 2.5)
    assert torch.equal(out.expert_ids, ref.expert_ids)
    torch.testing.assert_close(out.weights.double(), ref.weights, rtol=0, atol=1e-5)


def test_renormalisation_guard_keeps_all_zero_scores_finite() -> None:
    """Scores that underflow to exactly 0 (logits < -104): the 1e-20 in the sum keeps 0 / 0 away."""
    x = torch.ones(3, 4)
    w = torch.full((8, 4), -60.0)  # logits -240: sigmoid is exactly 0 in fp32
    for op in (moe_route, moe_route.impls["fast"]):
        out = op(x, w, None, 2, 1, 1, True, 1.0)
        assert torch.equal(out.weights, torch.zeros(3, 2)), op


def test_bias_is_for_selection_only() -> None:
    x, w, _ = _router(50, 32, 16, seed=5)
    bias = torch.zeros(16)
    bias[3] = 10.0  # expert 3 is always chosen, but its weight is still its own sigmoid score
    out = moe_route(x, w, bias, 2, 1, 1, False, 1.0)
    assert (out.expert_ids == 3).any(-1).all()
    s = moe_route(x, w, None, 16, 1, 1, False, 1.0).weights  # all experts: weights = s in id order
    assert torch.equal(out.weights, s.gather(1, out.expert_ids))


@pytest.mark.parametrize("e,top_k,n_group,topk_group", CONFIGS)
@pytest.mark.parametrize("norm", [True, False])
def test_agrees_with_reference(e: int, top_k: int, n_group: int, topk_group: int, norm: bool) -> None:
    x, w, bias = _router(300, 64, e, seed=e * 3 + top_k)
    out = moe_route(x, w, bias, top_k, n_group, topk_group, norm, 2.5)
    ref = moe_route_ref(x, w, bias, top_k, n_group, topk_group, norm, 2.5)
    # Selection is exact on both sides; it can only differ where two candidates are within fp32
    # rounding of each other (~1e-7), which random data at these sizes does not produce.
    assert torch.equal(out.expert_ids, ref.expert_ids)
    # weights: fp32 logits (K = 64, |logit| ~ 1: error ~ 1e-6), sigmoid (slope <= 1/4, a few ulp),
    # normalisation (k + 2 roundings): ~1e-6 absolute on values ~0.5 * 2.5. 1e-5 gives margin; a
    # weight from the wrong expert or with the bias added is off by >= 1e-3.
    torch.testing.assert_close(out.weights.double(), ref.weights, rtol=0, atol=1e-5)


def test_bad_arguments() -> None:
    x, w, bias = _router(3, 8, 16, seed=0)
    with pytest.raises(ValueError):
        moe_route(x, w, bias, 4, 3, 1, True, 1.0)  # 16 experts do not split into 3 groups
    with pytest.raises(ValueError):
        moe_route(x, w, bias, 5, 4, 1, True, 1.0)  # one kept group of 4 cannot supply 5 experts
    with pytest.raises(ValueError):
        moe_route(x, w, bias, 2, 4, 5, True, 1.0)  # topk_group > n_group
    with pytest.raises(ValueError):
        moe_route(x, w, bias, 0, 1, 1, True, 1.0)
    with pytest.raises(ValueError):
        moe_route(x[None], w, bias, 2, 1, 1, True, 1.0)  # x must be [T, D]


# ----------------------------------------------------------------------------- invariance


@pytest.mark.parametrize("e,top_k,n_group,topk_group", CONFIGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_route_row_invariance(e: int, top_k: int, n_group: int, topk_group: int, dtype: torch.dtype) -> None:
    x, w, bias = _router(80, 100, e, seed=e + top_k, dtype=dtype)
    x[5] = x[6]  # duplicate rows must route identically too
    fn = lambda x: _route_flat(moe_route(x, w, bias, top_k, n_group, topk_group, True, 2.5))  # noqa: E731
    assert_rows_invariant(fn, (x,), seed=e)


def test_route_invariance_near_ties() -> None:
    """Near-tied experts (gate rows equal up to ~1e-7): their logits differ by about the logits'
    own rounding error, so the selection flips on an ulp of difference and any batch-dependent
    rounding of the logits would show up as a different choice of experts."""
    g = torch.Generator().manual_seed(0)
    base = torch.randn(1, 64, generator=g)
    w = base.expand(16, 64) + torch.randn(16, 64, generator=g) * 1e-7
    x = torch.randn(80, 64, generator=g)
    fn = lambda x: _route_flat(moe_route(x, w, None, 4, 4, 2, True, 1.0))  # noqa: E731
    assert_rows_invariant(fn, (x,), sizes=[1, 2, 15, 16, 17, 33, 70])


# ----------------------------------------------------------------------------- combine


@pytest.mark.parametrize("t,k,d", [(1, 1, 1), (7, 2, 5), (33, 8, 64), (5, 16, 1000)])
def test_combine_matches_float64(t: int, k: int, d: int) -> None:
    g = torch.Generator().manual_seed(k * d)
    eo = torch.randn(t, k, d, generator=g)
    w = torch.rand(t, k, generator=g)
    got = moe_combine(eo, w)
    assert got.shape == (t, d) and got.dtype == torch.float32
    # k products and k sequential adds: |error| <= (k + 1) u sum_j |w_j e_j|; a missing or
    # double-counted expert is off by a whole term.
    bound = (k + 1) * 2.0**-24 * (w.double()[:, :, None] * eo.double()).abs().sum(1)
    assert ((got.double() - moe_combine_ref(eo, w)).abs() <= bound + 1e-30).all()
    # bf16 expert outputs: computed in fp32, rounded once
    eo16 = eo.bfloat16()
    got16 = moe_combine(eo16, w)
    assert got16.dtype == torch.bfloat16
    assert torch.equal(moe_combine(eo16, w, out_dtype=torch.float32).bfloat16(), got16)


def test_combine_order_is_fixed() -> None:
    """acc = 0; acc = acc + w_j * e_j for j = 0..k-1, each op rounded to fp32 (checked against
    scalar numpy float32 arithmetic, which has no FMA and no reassociation)."""
    g = torch.Generator().manual_seed(1)
    eo = torch.randn(3, 8, 5, generator=g) * torch.logspace(-3, 3, 8)[None, :, None]
    w = torch.rand(3, 8, generator=g)
    got = moe_combine(eo, w)
    e_np, w_np = eo.numpy(), w.numpy()
    for t in range(3):
        for c in range(5):
            acc = np.float32(0.0)
            for j in range(8):
                acc = np.float32(acc + np.float32(w_np[t, j] * e_np[t, j, c]))
            assert got[t, c].item() == float(acc), (t, c)


def test_combine_row_invariance() -> None:
    g = torch.Generator().manual_seed(2)
    eo = torch.randn(80, 8, 257, generator=g)
    w = torch.rand(80, 8, generator=g)
    assert_rows_invariant(lambda e, ww: moe_combine(e, ww), (eo, w))
    assert_rows_invariant(lambda e, ww: moe_combine(e, ww), (eo.bfloat16(), w), sizes=[1, 16, 17, 70])


# ----------------------------------------------------------------------------- autograd


def test_gradients() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 8, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(16, 8, generator=g, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(16, generator=g, dtype=torch.float64) * 0.1
    # the selection is piecewise constant; within a piece the weights are smooth in x and W
    for norm in (True, False):
        assert torch.autograd.gradcheck(lambda x, w: moe_route(x, w, bias, 4, 4, 2, norm, 2.5).weights, (x, w))
    eo = torch.randn(5, 4, 6, generator=g, dtype=torch.float64, requires_grad=True)
    ww = torch.rand(5, 4, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(moe_combine, (eo, ww))
    # end to end in fp32: route + combine backpropagates into x, W and the expert outputs
    x32, w32 = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    r = moe_route(x32, w32, bias.float(), 4, 4, 2, True, 2.5)
    eo32 = torch.randn(5, 4, 6, generator=g, requires_grad=True)
    moe_combine(eo32, r.weights).sum().backward()
    assert x32.grad is not None and w32.grad is not None and eo32.grad is not None
    assert torch.isfinite(w32.grad).all() and w32.grad.abs().sum() > 0


@pytest.mark.parametrize("t,k,e", [(1, 1, 4), (5, 3, 8), (64, 8, 64), (7, 2, 896)])
def test_sort_groups_pairs_by_expert_stably(t: int, k: int, e: int) -> None:
    """``moe_sort``: the order of a stable sort by expert id (pairs of one expert in pair order), offsets that
    bound each expert's rows (empty experts included) and the inverse permutation."""
    ids = torch.randint(0, min(e, 6) if t < 8 else e, (t, k), generator=torch.Generator().manual_seed(t * k))
    got = moe_sort(ids, e)
    flat = ids.reshape(-1)
    want_order = torch.tensor(sorted(range(flat.numel()), key=lambda i: (int(flat[i]), i)))
    assert torch.equal(got.order, want_order)
    assert got.offsets.dtype == torch.int32 and got.offsets.shape == (e + 1,)
    assert torch.equal(got.offsets.long(), torch.cat([torch.zeros(1, dtype=torch.long),
                                                      torch.bincount(flat, minlength=e).cumsum(0)]))
    assert torch.equal(got.order[got.slot_rows], torch.arange(flat.numel()))
