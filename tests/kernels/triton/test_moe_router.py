"""Triton moe_route / moe_combine: against the torch op and the float64 reference (incl. exact ties and
group limiting), row invariance, gradients."""
from __future__ import annotations

import pytest
import torch

from zmrl.kernels_batch_invariant import current_numerics, numerics_scope
from zmrl.kernels_batch_invariant.moe_router import (moe_combine, moe_combine_ref, moe_combine_rows, moe_route,
                                                    moe_route_ref, moe_sort)
from zmrl.kernels_batch_invariant.triton import triton_impl

from .rowwise_helpers import assert_rows_invariant, batch_sizes, randn

pytestmark = [pytest.mark.gpu, pytest.mark.triton]

# (E, top_k, n_group, topk_group): tiny, group-limited, one expert per group, bench (64/8), K3 (896/16)
# top-1 (never renormalised, as the released K3) with and without groups
CONFIGS_INTERP = [(10, 2, 1, 1), (24, 3, 4, 2), (16, 4, 16, 4), (64, 8, 1, 1), (64, 8, 8, 3), (10, 1, 1, 1),
                  (24, 1, 4, 2)]
CONFIGS_CUDA = CONFIGS_INTERP + [(256, 8, 8, 4), (896, 16, 1, 1)]


def _route(*args):
    return triton_impl(moe_route)(*args)


def _inputs(t: int, e: int, d: int, device, seed: int):
    x = randn(t, d, device=device, seed=seed)
    w = randn(e, d, device=device, seed=seed + 1, scale=d ** -0.5)
    bias = randn(e, device=device, seed=seed + 2, scale=0.05)
    return x, w, bias


@pytest.mark.parametrize("norm", [True, False])
def test_route_matches_torch_op_and_reference(device, interpret, norm) -> None:
    for e, k, ng, tg in (CONFIGS_INTERP if interpret else CONFIGS_CUDA):
        x, w, bias = _inputs(7 if interpret else 65, e, 32, device, seed=e + k)
        for b in (None, bias):
            got = _route(x, w, b, k, ng, tg, norm, 2.5)
            assert got.expert_ids.dtype == torch.int64 and got.expert_ids.shape == (x.shape[0], k)
            assert got.weights.dtype == torch.float32 and got.weights.shape == (x.shape[0], k)
            assert bool((got.expert_ids.diff(dim=-1) > 0).all())  # ascending, distinct
            ref = moe_route_ref(x.cpu(), w.cpu(), None if b is None else b.cpu(), k, ng, tg, norm, 2.5)
            # random scores are never within fp32 rounding of each other here: same selection
            assert torch.equal(got.expert_ids.cpu(), ref.expert_ids)
            # sigmoid of an fp32 logit and one division: ~1e-6 relative (logits via `linear`: fp32)
            torch.testing.assert_close(got.weights.double().cpu(), ref.weights, rtol=2e-5, atol=1e-6)
            op = moe_route.impls["torch"](x, w, b, k, ng, tg, norm, 2.5)
            assert torch.equal(got.expert_ids, op.expert_ids)


def test_route_exact_ties_and_errors(device, interpret) -> None:
    # duplicated gate rows give bit-identical scores: ties go to the lower expert / group index
    d = 16
    base = randn(4, d, device=device, seed=0)
    w = base.repeat(4, 1)  # experts e and e + 4j have identical scores; groups of 4 are identical
    x = randn(5, d, device=device, seed=1)
    got = _route(x, w, None, 3, 1, 1, True, 1.0)
    ref = moe_route_ref(x.cpu(), w.cpu(), None, 3, 1, 1, True, 1.0)
    assert torch.equal(got.expert_ids.cpu(), ref.expert_ids)
    assert torch.equal(got.expert_ids, moe_route.impls["torch"](x, w, None, 3, 1, 1, True, 1.0).expert_ids)
    got = _route(x, w, None, 4, 4, 2, True, 1.0)  # 4 identical groups: keep groups 0 and 1
    assert bool((got.expert_ids < 8).all())
    assert torch.equal(got.expert_ids, moe_route.impls["torch"](x, w, None, 4, 4, 2, True, 1.0).expert_ids)
    with pytest.raises(ValueError, match="cannot be split into n_group=3 groups"):
        _route(x, w, None, 2, 3, 1, True, 1.0)
    with pytest.raises(ValueError, match="top_k=9 must be in"):
        _route(x, w, None, 9, 4, 2, True, 1.0)
    with pytest.raises(ValueError, match="x must be"):
        _route(x[None], w, None, 2, 1, 1, True, 1.0)


def test_route_top1_and_zero_sum_guard(device, interpret) -> None:
    # top-1: the weight is the expert's score times the scaling whatever norm_topk_prob says
    x, w, bias = _inputs(7, 16, 32, device, seed=9)
    norm, plain = _route(x, w, bias, 1, 1, 1, True, 2.5), _route(x, w, bias, 1, 1, 1, False, 2.5)
    assert torch.equal(norm.expert_ids, plain.expert_ids) and torch.equal(norm.weights, plain.weights)
    # the torch op: the same selection, the same weight up to the backends' sigmoid rounding
    op = moe_route.impls["torch"](x, w, bias, 1, 1, 1, True, 2.5)
    assert torch.equal(norm.expert_ids, op.expert_ids)
    torch.testing.assert_close(norm.weights, op.weights, rtol=1e-6, atol=0)
    # scores underflowing to exactly 0: the 1e-20 guard gives 0 weights, not 0 / 0
    x, w = torch.ones(3, 4, device=device), torch.full((8, 4), -60.0, device=device)
    assert torch.equal(_route(x, w, None, 2, 1, 1, True, 1.0).weights, torch.zeros(3, 2, device=device))


def test_route_rows_invariant(device, interpret) -> None:
    e, k, ng, tg = (64, 8, 8, 3)
    x, w, bias = _inputs(6 if interpret else 64, e, 32 if interpret else 2048, device, seed=3)
    x = x.to(torch.bfloat16)
    assert_rows_invariant(lambda a: _route(a, w, bias, k, ng, tg, True, 2.5), [x], batch_sizes(interpret))
    if not interpret:
        x, w, bias = _inputs(64, 896, 256, device, seed=4)
        assert_rows_invariant(lambda a: _route(a, w, bias, 16, 1, 1, True, 2.5), [x], batch_sizes(interpret))


def test_route_gradient(device, interpret) -> None:
    x, w, bias = _inputs(5, 24, 16, device, seed=5)
    x.requires_grad_(True)
    w.requires_grad_(True)
    # The logits' backward is linear's (its fp32 products at the contract's backward_matmul_precision, TF32 on
    # CUDA by default: ~1e-3 relative, tested with linear). Here it runs in IEEE fp32, so that what is checked
    # at fp32 tolerance is the router's own gradient (sigmoid, gather, normalise, scale).
    with numerics_scope(current_numerics().replace(backward_matmul_precision="ieee")):
        got = _route(x, w, bias, 3, 4, 2, True, 2.5)
        gw = randn(5, 3, device=device, seed=6)
        gx, gW = torch.autograd.grad(got.weights, (x, w), gw)
    xd, wd = x.detach().double().requires_grad_(True), w.detach().double().requires_grad_(True)
    s = torch.sigmoid(xd @ wd.t()).gather(1, got.expert_ids)
    ref = s / s.sum(-1, keepdim=True) * 2.5
    rx, rW = torch.autograd.grad(ref, (xd, wd), gw.double())
    torch.testing.assert_close(gx.double(), rx, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(gW.double(), rW, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_combine(device, interpret, dtype) -> None:
    for t, k, d in ([(3, 1, 5), (4, 8, 70), (2, 3, 1100)] if interpret else [(3, 1, 5), (64, 8, 2048), (9, 16, 7168)]):
        eo = randn(t, k, d, device=device, seed=d, dtype=dtype)
        w = randn(t, k, device=device, seed=d + 1).abs()
        y = triton_impl(moe_combine)(eo, w, torch.float32)
        assert y.dtype == torch.float32 and y.shape == (t, d)
        # k fp32 products and adds: ~k u relative to sum |w y|
        torch.testing.assert_close(y.double(), moe_combine_ref(eo, w), rtol=1e-5, atol=1e-5)
        assert triton_impl(moe_combine)(eo, w).dtype == dtype
    with pytest.raises(ValueError, match="do not match outputs"):
        triton_impl(moe_combine)(eo, w[:, :-1])
    eo = randn(6 if interpret else 64, 8, 256 if interpret else 2048, device=device, seed=0, dtype=torch.bfloat16)
    w = randn(eo.shape[0], 8, device=device, seed=1)
    assert_rows_invariant(lambda a, b: triton_impl(moe_combine)(a, b, torch.float32), [eo, w], batch_sizes(interpret))


def test_combine_gradient(device, interpret) -> None:
    eo = randn(4, 3, 20, device=device, seed=0).requires_grad_(True)
    w = randn(4, 3, device=device, seed=1).requires_grad_(True)
    gy = randn(4, 20, device=device, seed=2)
    got = torch.autograd.grad(triton_impl(moe_combine)(eo, w), (eo, w), gy)
    eod, wd = eo.detach().double().requires_grad_(True), w.detach().double().requires_grad_(True)
    want = torch.autograd.grad(moe_combine_ref(eod, wd), (eod, wd), gy.double())
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-6)


def _permuted(t: int, k: int, d: int, device, dtype, seed: int):
    """Slot-order outputs eo [T, k, D], the same rows stored in a random order (rows [T*k, D]) and each
    slot's row (slot_rows [T, k]), as the MoE layer holds its expert-sorted rows."""
    eo = randn(t, k, d, device=device, seed=seed, dtype=dtype)
    order = torch.randperm(t * k, generator=torch.Generator().manual_seed(seed)).to(device)
    rows = eo.reshape(t * k, d)[order]  # sorted row i holds slot order[i]
    slot_rows = torch.empty_like(order).scatter_(0, order, torch.arange(t * k, device=device)).view(t, k)
    return eo, rows, slot_rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_combine_rows_is_the_combine_of_the_unsorted_rows(device, interpret, dtype) -> None:
    """moe_combine_rows reads each slot's row where it is: bitwise moe_combine of the rows put in slot
    order (the same values summed in the same order), on both backends; shape errors are one line."""
    for t, k, d in ([(3, 1, 5), (4, 8, 70), (2, 3, 1100)] if interpret else [(3, 1, 5), (64, 8, 2048), (9, 16, 7168)]):
        eo, rows, slot_rows = _permuted(t, k, d, device, dtype, seed=d)
        w = randn(t, k, device=device, seed=d + 1).abs()
        for out_dtype in (torch.float32, dtype):
            want = triton_impl(moe_combine)(eo, w, out_dtype)
            assert torch.equal(triton_impl(moe_combine_rows)(rows, slot_rows, w, out_dtype), want)
            # the torch backend gathers the rows and calls the moe_combine op (the Triton one on CUDA, whose
            # fused multiply-adds differ from the torch composition's roundings)
            assert torch.equal(moe_combine_rows.impls["torch"](rows, slot_rows, w, out_dtype),
                               moe_combine(eo, w, out_dtype))
    with pytest.raises(ValueError, match="must be \\[T\\*k, D\\]"):
        triton_impl(moe_combine_rows)(rows[1:], slot_rows, w)


def test_combine_rows_gradient(device, interpret) -> None:
    """The hand-written backward (one program per token) against autograd of the torch op: each row's gradient
    is w * g rounded once to the rows' dtype, bitwise the torch op's (the same product and rounding); the
    weight gradient sums D products in another order (fp32: ~D ulps of sum |g y| apart); twice the same bits."""
    t, k, d = (5, 3, 40) if interpret else (64, 8, 2048)
    for dtype in (torch.float32, torch.bfloat16):
        _, rows, slot_rows = _permuted(t, k, d, device, dtype, seed=7)
        rows.requires_grad_(True)
        w = randn(t, k, device=device, seed=8).requires_grad_(True)
        gy = randn(t, d, device=device, seed=9)
        got = torch.autograd.grad(triton_impl(moe_combine_rows)(rows, slot_rows, w, torch.float32), (rows, w), gy)
        again = torch.autograd.grad(triton_impl(moe_combine_rows)(rows, slot_rows, w, torch.float32), (rows, w), gy)
        assert all(torch.equal(a, b) for a, b in zip(got, again))
        want = torch.autograd.grad(moe_combine_rows.impls["torch"](rows, slot_rows, w, torch.float32), (rows, w), gy)
        assert got[0].dtype == dtype
        if interpret and dtype == torch.bfloat16:  # the interpreter truncates fp32 -> bf16 (the GPU rounds to nearest)
            assert bool(((got[0].float() - want[0].float()).abs() <= 2.0 ** -7 * want[0].float().abs()).all())
        else:
            assert torch.equal(got[0], want[0])
        bound = d * 2.0 ** -23 * torch.einsum("td,tkd->tk", gy.abs(), rows.detach().float()[slot_rows].abs())
        assert bool(((got[1] - want[1]).abs() <= bound + 1e-30).all())


@pytest.mark.parametrize("pairs,e", [(1, 64), (24, 64), (1000, 128), (2048, 64), (4096, 896), (9000, 64)])
def test_sort_matches_torch_op(device, interpret, pairs, e) -> None:
    """The counting-sort program (and, past SORT_MAX_PAIRS, the torch fallback) gives the torch op's exact
    permutation, offsets and inverse, skewed routing and empty experts included."""
    if interpret and pairs > 2048:
        pytest.skip("long sorts: on the GPU")
    g = torch.Generator().manual_seed(pairs)
    ids = torch.randint(0, e, (pairs,), generator=g)
    ids[: pairs // 3] = torch.randint(0, 3, (pairs // 3,), generator=g)  # a few hot experts
    got = triton_impl(moe_sort)(ids.to(device).view(-1, 1), e)
    want = moe_sort.impls["torch"](ids.view(-1, 1), e)
    for f in ("order", "offsets", "slot_rows"):
        a, b = getattr(got, f), getattr(want, f)
        assert a.dtype == b.dtype and torch.equal(a.cpu(), b), f
