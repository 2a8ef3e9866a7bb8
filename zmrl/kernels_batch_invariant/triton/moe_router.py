"""Triton MoE routing (noaux_tc: sigmoid, selection bias, group-limited exact top-k) and the fixed-order
combine of the selected experts' outputs (fast-mode backends: ``moe_router.py``).

``moe_route``: the router logits come from the ``linear`` op (the invariant GEMM; its Triton backend on
CUDA), then one program per token does the rest on the token's E scores, held in one block of
``next_power_of_2(E)`` lanes (E = 64 in the bench preset, 896 in K3; a function of E only):
sigmoid, ``sb = s + bias``, group scores ``top1 + top2`` per group, the ``topk_group`` best groups and
the ``top_k`` best experts, each picked by repeated (max value, then lowest index among equal values),
which is the exact top-k with index tie-break of the torch op. The chosen ids are written in ascending
order (their rank is a prefix count over the lanes), with weights ``s[id]`` normalised (only when
top_k > 1, as the torch op) by one fixed-tree ``tl.sum`` plus the 1e-20 guard, and scaled. Everything is
per token, so a token's experts and weights depend on it alone.
Gradient: the weights are differentiable w.r.t. the logits (hence x and the gate weight, through
``linear``'s own backward); the backward recomputes ``gather(sigmoid(logits))`` (+ normalise, scale) with
torch under autograd. Selection is not differentiable (as in the torch op).

``moe_combine``: one program per (token, feature block), ``acc = acc + w_j * y_j`` in fp32 for j = 0..k-1
in slot order. Backward is hand-written (``dY_j = w_j * g``, ``dw_j = <g, Y_j>``) with stock torch ops.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import moe_router as _ops
from ..matmul import linear
from ._common import cdiv, next_pow2, sigmoid

moe_route = _ops.moe_route
moe_combine = _ops.moe_combine
RouterOutput = _ops.RouterOutput


@triton.jit
def _pick_lowest(v, eligible, lanes, NONE: tl.constexpr):
    """Lane index of the largest ``v`` among ``eligible`` lanes, the lowest index among equal values."""
    mx = tl.max(tl.where(eligible, v, float("-inf")), axis=0)
    return tl.min(tl.where(eligible & (v == mx), lanes, NONE), axis=0)


@triton.jit
def _route_kernel(logits_ptr, bias_ptr, ids_ptr, w_ptr, E, scaling,
                  TOP_K: tl.constexpr, N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, GROUP_SIZE: tl.constexpr,
                  HAS_BIAS: tl.constexpr, NORM: tl.constexpr, RENORM_EPS: tl.constexpr, BLOCK_E: tl.constexpr,
                  BLOCK_G: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    valid = e < E
    s = sigmoid(tl.load(logits_ptr + row * E + e, mask=valid, other=0.0))
    sb = s
    if HAS_BIAS:
        sb = sb + tl.load(bias_ptr + e, mask=valid, other=0.0)
    sb = tl.where(valid, sb, float("-inf"))
    if N_GROUP > 1:
        grp = e // GROUP_SIZE
        gl = tl.arange(0, BLOCK_G)
        gscore = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
        for g in tl.static_range(N_GROUP):
            ing = valid & (grp == g)
            i1 = _pick_lowest(sb, ing, e, BLOCK_E)
            top1 = tl.max(tl.where(e == i1, sb, float("-inf")), axis=0)
            if GROUP_SIZE > 1:
                # the second largest: the group without (one copy of) its maximum
                score = top1 + tl.max(tl.where(ing & (e != i1), sb, float("-inf")), axis=0)
            else:
                score = top1
            gscore = tl.where(gl == g, score, gscore)
        gvalid = gl < N_GROUP
        gkeep = gl < 0
        for _ in tl.static_range(TOPK_GROUP):
            gi = _pick_lowest(gscore, gvalid & (~gkeep), gl, BLOCK_G)
            gkeep = gkeep | (gl == gi)
        keep = e < 0
        for g in tl.static_range(N_GROUP):
            kept = tl.sum(tl.where((gl == g) & gkeep, 1, 0), axis=0) > 0
            keep = keep | ((grp == g) & kept)
        sb = tl.where(keep, sb, float("-inf"))
    chosen = e < 0
    for _ in tl.static_range(TOP_K):
        i = _pick_lowest(sb, valid & (~chosen), e, BLOCK_E)
        chosen = chosen | (e == i)
    rank = tl.cumsum(chosen.to(tl.int32), axis=0) - 1  # ascending expert id order
    w = tl.where(chosen, s, 0.0)
    if NORM:
        w = w / (tl.sum(w, axis=0) + RENORM_EPS)
    w = w * scaling
    tl.store(ids_ptr + row * TOP_K + rank, e.to(tl.int64), mask=chosen)
    tl.store(w_ptr + row * TOP_K + rank, w, mask=chosen)


def _route_launch(logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, n_group: int, topk_group: int,
                  norm: bool, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    t, n_experts = logits.shape
    ids = torch.empty(t, top_k, dtype=torch.int64, device=logits.device)
    w = torch.empty(t, top_k, dtype=torch.float32, device=logits.device)
    if t:
        block_e = next_pow2(n_experts)
        _route_kernel[(t,)](
            logits, bias if bias is not None else logits, ids, w, n_experts, float(scaling),
            TOP_K=top_k, N_GROUP=n_group, TOPK_GROUP=topk_group if n_group > 1 else 1,
            GROUP_SIZE=n_experts // n_group, HAS_BIAS=bias is not None, NORM=_ops.renormalises(norm, top_k),
            RENORM_EPS=_ops.RENORM_EPS, BLOCK_E=block_e,
            BLOCK_G=next_pow2(n_group), num_warps=4 if block_e <= 1024 else 8)
    return ids, w


class _RouteWeights(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, n_group: int,  # type: ignore[override]
                topk_group: int, norm: bool, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
        ids, w = _route_launch(logits, bias, top_k, n_group, topk_group, norm, scaling)
        ctx.save_for_backward(logits, ids)
        ctx.norm, ctx.scaling = _ops.renormalises(norm, top_k), scaling
        ctx.mark_non_differentiable(ids)
        return ids, w

    @staticmethod
    def backward(ctx, _g_ids: torch.Tensor | None, g_w: torch.Tensor) -> tuple:  # type: ignore[override]
        logits, ids = ctx.saved_tensors
        with torch.enable_grad():
            lg = logits.detach().requires_grad_(True)
            w = torch.sigmoid(lg).gather(1, ids)
            if ctx.norm:
                w = w / (w.sum(-1, keepdim=True) + _ops.RENORM_EPS)
            w = w * ctx.scaling
            (g_logits,) = torch.autograd.grad(w, lg, g_w)
        return g_logits, None, None, None, None, None, None


@moe_route.register("triton")
def moe_route_triton(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    correction_bias: torch.Tensor | None,
    top_k: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
) -> RouterOutput:
    _ops._check_route_inputs(x, gate_weight, top_k, n_group, topk_group)
    if x.dtype == torch.float64:  # gradchecks only: the torch backend computes in fp64
        return moe_route.impls["torch"](x, gate_weight, correction_bias, top_k, n_group, topk_group,
                                        norm_topk_prob, routed_scaling_factor)
    logits = linear(x.to(torch.float32), gate_weight.to(torch.float32), out_dtype=torch.float32).contiguous()
    bias = correction_bias.detach().to(torch.float32).contiguous() if correction_bias is not None else None
    args = (top_k, n_group, topk_group, bool(norm_topk_prob), float(routed_scaling_factor))
    if torch.is_grad_enabled() and logits.requires_grad:
        ids, w = _RouteWeights.apply(logits, bias, *args)
    else:
        ids, w = _route_launch(logits.detach(), bias, *args)
    return RouterOutput(expert_ids=ids, weights=w)


@triton.jit
def _combine_kernel(eo_ptr, w_ptr, y_ptr, D, K: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    m = c < D
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for j in tl.static_range(K):  # slot order, one fp32 accumulator
        wj = tl.load(w_ptr + t * K + j).to(tl.float32)
        acc = acc + wj * tl.load(eo_ptr + (t * K + j) * D + c, mask=m, other=0.0).to(tl.float32)
    tl.store(y_ptr + t * D + c, acc.to(y_ptr.dtype.element_ty), mask=m)


def _combine_launch(eo: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    t, k, d = eo.shape
    eo_c, w_c = eo.contiguous(), w.contiguous()
    y = torch.empty(t, d, dtype=out_dtype, device=eo.device)
    if t and d:
        block_d = min(next_pow2(d), 1024)
        _combine_kernel[(t, cdiv(d, block_d))](eo_c, w_c, y, d, K=k, BLOCK_D=block_d, num_warps=4)
    elif t:
        y.zero_()
    return y


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, eo: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(eo, w)
        return _combine_launch(eo, w, out_dtype)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple:  # type: ignore[override]
        eo, w = ctx.saved_tensors
        gf = g.to(torch.float32)
        g_eo = g_w = None
        if ctx.needs_input_grad[0]:
            # fp32 products rounded straight into eo's dtype (one pass; the same values as a product
            # tensor in fp32 cast afterwards)
            g_eo = torch.mul(w.to(torch.float32)[:, :, None], gf[:, None, :], out=torch.empty_like(eo))
        if ctx.needs_input_grad[1]:
            g_w = torch.einsum("td,tkd->tk", gf, eo.to(torch.float32)).to(w.dtype)
        return g_eo, g_w, None


@moe_combine.register("triton")
def moe_combine_triton(
    expert_outputs: torch.Tensor, weights: torch.Tensor, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    t, k, d = expert_outputs.shape
    if weights.shape != (t, k):
        raise ValueError(f"moe_combine: weights {tuple(weights.shape)} do not match outputs {(t, k, d)}")
    if expert_outputs.dtype == torch.float64:  # gradchecks only
        return moe_combine.impls["torch"](expert_outputs, weights, out_dtype)
    od = out_dtype or expert_outputs.dtype
    if torch.is_grad_enabled() and (expert_outputs.requires_grad or weights.requires_grad):
        return _Combine.apply(expert_outputs, weights, od)
    return _combine_launch(expert_outputs, weights, od)
