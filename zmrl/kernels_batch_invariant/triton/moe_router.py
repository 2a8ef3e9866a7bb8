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
``moe_combine_rows``: the same kernel reading slot (t, j) from row ``slot_rows[t, j]`` of the expert-sorted
rows (the same values in the same order: the same bits); its backward is one Triton pass per token.

``moe_sort``: the pairs grouped by expert (a stable counting sort over chunks of pairs) in two launches for
decode-sized inputs.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import moe_router as _ops
from ..matmul import linear
from ._common import await_previous_kernel, cdiv, next_pow2, pdl, sigmoid

moe_route = _ops.moe_route
moe_combine = _ops.moe_combine
moe_combine_rows = _ops.moe_combine_rows
moe_sort = _ops.moe_sort
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
    await_previous_kernel()
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
            BLOCK_G=next_pow2(n_group), num_warps=4 if block_e <= 1024 else 8, **pdl())
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
    # fp32 logits straight from the stored dtypes (bf16 x bf16 products are exact in fp32): no upcast copies of
    # x and of the [E, D] weight per call, and no split-K pass.
    logits = linear(x, gate_weight, out_dtype=torch.float32).contiguous()
    bias = correction_bias.detach().to(torch.float32).contiguous() if correction_bias is not None else None
    args = (top_k, n_group, topk_group, bool(norm_topk_prob), float(routed_scaling_factor))
    if torch.is_grad_enabled() and logits.requires_grad:
        ids, w = _RouteWeights.apply(logits, bias, *args)
    else:
        ids, w = _route_launch(logits.detach(), bias, *args)
    return RouterOutput(expert_ids=ids, weights=w)


@triton.jit
def _combine_kernel(eo_ptr, rows_ptr, w_ptr, y_ptr, D, K: tl.constexpr, BLOCK_D: tl.constexpr,
                    GATHER: tl.constexpr):
    """y[t] = sum_j w[t, j] * eo[slot (t, j)]: row t*K + j of eo, or row rows[t, j] (GATHER: moe_combine_rows).
    Both read the same values in the same order: the same bits."""
    await_previous_kernel()
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    m = c < D
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for j in tl.static_range(K):  # slot order, one fp32 accumulator
        wj = tl.load(w_ptr + t * K + j).to(tl.float32)
        row = tl.load(rows_ptr + t * K + j).to(tl.int64) if GATHER else t * K + j
        acc = acc + wj * tl.load(eo_ptr + row * D + c, mask=m, other=0.0).to(tl.float32)
    tl.store(y_ptr + t * D + c, acc.to(y_ptr.dtype.element_ty), mask=m)


def _combine_launch(eo: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype,
                    slot_rows: torch.Tensor | None = None) -> torch.Tensor:
    """eo: [T, k, D] in slot order, or (``slot_rows`` [T, k] given) [T*k, D] rows in any order."""
    t, k = w.shape
    d = eo.shape[-1]
    eo_c, w_c = eo.contiguous(), w.contiguous()
    rows = eo_c if slot_rows is None else slot_rows.contiguous()  # any pointer when not gathering
    y = torch.empty(t, d, dtype=out_dtype, device=eo.device)
    if t and d:
        block_d = min(next_pow2(d), 1024)
        _combine_kernel[(t, cdiv(d, block_d))](eo_c, rows, w_c, y, d, K=k, BLOCK_D=block_d,
                                                GATHER=slot_rows is not None, num_warps=4, **pdl())
    elif t:
        y.zero_()
    return y


@triton.jit
def _combine_rows_bwd_kernel(g_ptr, rows_ptr, w_ptr, eo_ptr, geo_ptr, gw_ptr, D,
                             K: tl.constexpr, K_P: tl.constexpr, BLOCK_D: tl.constexpr,
                             NEED_GEO: tl.constexpr, NEED_GW: tl.constexpr):
    """One program per token t, its k slots as the rows of a [K_P, BLOCK_D] tile walking D in ascending
    blocks: d eo[rows[t, j]] = w[t, j] * g[t] (each row written once: rows is a permutation) and
    d w[t, j] = sum_d g[t, d] * eo[rows[t, j], d] in fp32."""
    await_previous_kernel()
    t = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, K_P)
    jm = j < K
    row = tl.load(rows_ptr + t * K + j, mask=jm, other=0).to(tl.int64)
    wj = tl.load(w_ptr + t * K + j, mask=jm, other=0.0).to(tl.float32)
    dot = tl.zeros([K_P], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        c = d0 + tl.arange(0, BLOCK_D)
        cm = c < D
        g = tl.load(g_ptr + t * D + c, mask=cm, other=0.0).to(tl.float32)
        tile = jm[:, None] & cm[None, :]
        if NEED_GEO:
            tl.store(geo_ptr + row[:, None] * D + c[None, :], (wj[:, None] * g[None, :]).to(geo_ptr.dtype.element_ty),
                     mask=tile)
        if NEED_GW:
            eo = tl.load(eo_ptr + row[:, None] * D + c[None, :], mask=tile, other=0.0).to(tl.float32)
            dot += tl.sum(eo * g[None, :], axis=1)
    if NEED_GW:
        tl.store(gw_ptr + t * K + j, dot.to(gw_ptr.dtype.element_ty), mask=jm)


class _CombineRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows: torch.Tensor, slot_rows: torch.Tensor, w: torch.Tensor,  # type: ignore[override]
                out_dtype: torch.dtype) -> torch.Tensor:
        ctx.save_for_backward(rows, slot_rows, w)
        return _combine_launch(rows, w, out_dtype, slot_rows)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple:  # type: ignore[override]
        rows, slot_rows, w = ctx.saved_tensors
        need_geo, need_gw = ctx.needs_input_grad[0], ctx.needs_input_grad[2]
        t, k = w.shape
        d = rows.shape[1]
        # every row is one slot's (slot_rows is a permutation): each gradient row is written once
        g_rows = torch.empty_like(rows) if need_geo else None
        g_w = torch.empty_like(w) if need_gw else None
        if t and d and (need_geo or need_gw):
            rows_c = rows.contiguous()
            _combine_rows_bwd_kernel[(t,)](
                g.contiguous(), slot_rows.contiguous(), w.contiguous(), rows_c,
                rows_c if g_rows is None else g_rows, w if g_w is None else g_w, d,
                K=k, K_P=next_pow2(k), BLOCK_D=min(next_pow2(d), 512), NEED_GEO=need_geo, NEED_GW=need_gw,
                num_warps=4, **pdl())
        elif need_gw:
            g_w.zero_()
        return g_rows, None, g_w, None


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


# ``moe_sort`` runs the counting-sort kernels up to SORT_MAX_PAIRS pairs (a decode step's T * k; 256 tokens x 8 =
# 2048) and SORT_MAX_EXPERTS experts; beyond, torch's sort (many-program radix passes), with the same result.
SORT_MAX_PAIRS = 8192
SORT_MAX_EXPERTS = 256
SORT_CHUNK = 256  # pairs per program


@triton.jit(do_not_specialize=["P"])
def _moe_sort_count_kernel(ids_ptr, counts_ptr, P, E_P: tl.constexpr, CHUNK: tl.constexpr):
    """Program c: how many of pairs [c * CHUNK, (c + 1) * CHUNK) each expert has ([CHUNK, E_P] one-hot summed)."""
    await_previous_kernel()
    c = tl.program_id(0)
    lanes = tl.arange(0, E_P)
    i = c * CHUNK + tl.arange(0, CHUNK)
    ids = tl.load(ids_ptr + i, mask=i < P, other=E_P)  # past the end: no expert's lane
    tl.store(counts_ptr + c * E_P + lanes, tl.sum((ids[:, None] == lanes[None, :]).to(tl.int32), axis=0))


@triton.jit(do_not_specialize=["P"])
def _moe_sort_place_kernel(ids_ptr, counts_ptr, order_ptr, offsets_ptr, slot_ptr, P, N_CHUNKS,
                           E: tl.constexpr, E_P: tl.constexpr, C_P: tl.constexpr, CHUNK: tl.constexpr):
    """Program c places its chunk's pairs: pair i goes to row ``first[id] + (pairs of that expert in earlier
    chunks) + (earlier pairs of that expert in this chunk)``, a stable counting sort; program 0 also writes the
    offsets."""
    await_previous_kernel()
    c = tl.program_id(0)
    lanes = tl.arange(0, E_P)
    chunks = tl.arange(0, C_P)
    counts = tl.load(counts_ptr + chunks[:, None] * E_P + lanes[None, :], mask=(chunks < N_CHUNKS)[:, None], other=0)
    total = tl.sum(counts, axis=0)
    first = tl.cumsum(total, axis=0) - total  # expert e's first row
    if c == 0:
        tl.store(offsets_ptr + lanes, first, mask=lanes < E)
        tl.store(offsets_ptr + E, tl.sum(total, axis=0))
    seen = first + tl.sum(tl.where((chunks < c)[:, None], counts, 0), axis=0)
    i = c * CHUNK + tl.arange(0, CHUNK)
    m = i < P
    ids = tl.load(ids_ptr + i, mask=m, other=E_P)
    hit = (ids[:, None] == lanes[None, :]).to(tl.int32)
    before = tl.cumsum(hit, axis=0) - hit  # pairs of the same expert earlier in this chunk
    row = tl.sum(hit * (seen[None, :] + before), axis=1)
    tl.store(slot_ptr + i, row.to(tl.int64), mask=m)
    tl.store(order_ptr + row, i.to(tl.int64), mask=m)


@moe_sort.register("triton")
def moe_sort_triton(expert_ids: torch.Tensor, num_experts: int) -> _ops.ExpertOrder:
    """Triton ``moe_sort``: up to ``SORT_MAX_PAIRS`` pairs and ``SORT_MAX_EXPERTS`` experts two counting-sort
    launches (per-chunk expert counts, then every chunk placed) instead of a sort, a search and a scatter;
    else the torch composition. Both give the same permutation."""
    flat = expert_ids.reshape(-1)
    p = flat.numel()
    if p > SORT_MAX_PAIRS or p == 0 or num_experts > SORT_MAX_EXPERTS:
        return moe_sort.impls["torch"](expert_ids, num_experts)
    flat = flat.contiguous()
    dev = flat.device
    e_p = next_pow2(num_experts)
    n_chunks = cdiv(p, SORT_CHUNK)
    counts = torch.empty((n_chunks, e_p), dtype=torch.int32, device=dev)
    order = torch.empty(p, dtype=torch.int64, device=dev)
    slot_rows = torch.empty_like(order)
    offsets = torch.empty(num_experts + 1, dtype=torch.int32, device=dev)
    _moe_sort_count_kernel[(n_chunks,)](flat, counts, p, E_P=e_p, CHUNK=SORT_CHUNK, num_warps=4, **pdl())
    _moe_sort_place_kernel[(n_chunks,)](flat, counts, order, offsets, slot_rows, p, n_chunks, E=num_experts,
                                        E_P=e_p, C_P=max(2, next_pow2(n_chunks)), CHUNK=SORT_CHUNK, num_warps=4,
                                           **pdl(),
                                       )
    return _ops.ExpertOrder(order, offsets, slot_rows)


@moe_combine_rows.register("triton")
def moe_combine_rows_triton(
    rows: torch.Tensor, slot_rows: torch.Tensor, weights: torch.Tensor, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Triton ``moe_combine_rows``: the combine kernel reading slot (t, j) from row ``slot_rows[t, j]``;
    hand-written backward (one program per token: its rows' gradients and its weights' gradients)."""
    _ops.check_combine_rows(rows, slot_rows, weights)
    if rows.dtype == torch.float64:  # gradchecks only
        return moe_combine_rows.impls["torch"](rows, slot_rows, weights, out_dtype)
    od = out_dtype or rows.dtype
    if torch.is_grad_enabled() and (rows.requires_grad or weights.requires_grad):
        return _CombineRows.apply(rows, slot_rows, weights, od)
    return _combine_launch(rows, weights, od, slot_rows)


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
