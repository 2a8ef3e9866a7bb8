"""MoE router ("noaux_tc": sigmoid scores, correction bias for selection only, optional group
limiting) and the fixed-order combine of the selected experts' outputs.

Invariance: the router logits come from the row-invariant ``linear``; every other step is per row
and exact (sorting moves values, it does not round them), with every tie broken by the lower index,
so a token's experts and weights are a function of that token alone. Stock ``topk`` breaks ties
arbitrarily and is avoided. Fixed semantics (docs/model.md, MoE):

    logits = linear(x, W_gate) in fp32;  s = sigmoid(logits);  sb = s + bias   (bias: selection only)
    n_group > 1: group score = top1 + top2 of sb in the group (one rounding); keep the topk_group
                 best groups (ties: lower group index); sb of the other groups = -inf
    chosen = top_k experts by (sb desc, expert id asc), then reordered by ascending expert id
    w = s[chosen] (ascending id order);
    if norm_topk_prob and top_k > 1: w = w / (tree_sum(w) + 1e-20)   (as the released Kimi K3: a single
                                     expert keeps its sigmoid score; 1e-20 guards an all-zero sum);
    w = w * routed_scaling_factor

The normalising sum runs over the weights in ascending expert-id order (the order returned), so
weights are a function of the chosen set only, not of the ranking.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ._dispatch import invariant_op
from .matmul import linear
from .pointwise import sigmoid
from .reduce import tree_sum


@dataclass(frozen=True)
class RouterOutput:
    """expert_ids: [T, k] int64, ascending per token; weights: [T, k] fp32, aligned with expert_ids."""

    expert_ids: torch.Tensor
    weights: torch.Tensor


def _cdt(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _check_route_inputs(x: torch.Tensor, gate_weight: torch.Tensor, top_k: int, n_group: int,
                        topk_group: int) -> int:
    """Validate a ``moe_route`` call (every backend); returns the number of experts."""
    if x.dim() != 2:
        raise ValueError(f"moe_route: x must be [T, D], got {tuple(x.shape)}")
    n_experts = gate_weight.shape[0]
    _check_route_args(n_experts, top_k, n_group, topk_group)
    return n_experts


def _check_route_args(n_experts: int, top_k: int, n_group: int, topk_group: int) -> None:
    if n_group < 1 or n_experts % n_group != 0:
        raise ValueError(f"moe_route: {n_experts} experts cannot be split into n_group={n_group} groups")
    groups_kept = topk_group if n_group > 1 else 1
    if n_group > 1 and not 1 <= topk_group <= n_group:
        raise ValueError(f"moe_route: topk_group={topk_group} must be in [1, n_group={n_group}]")
    if not 1 <= top_k <= groups_kept * (n_experts // n_group):
        raise ValueError(
            f"moe_route: top_k={top_k} must be in [1, {groups_kept * (n_experts // n_group)}] "
            f"(experts in the {groups_kept} kept group(s))"
        )


RENORM_EPS = 1e-20  # added to the top-k sum before renormalising (exact no-op unless the sum is ~0)


def renormalises(norm_topk_prob: bool, top_k: int) -> bool:
    """Whether the top-k weights are divided by their sum: asked for, and more than one expert."""
    return bool(norm_topk_prob) and top_k > 1


def _desc_order(v: torch.Tensor) -> torch.Tensor:
    """Indices sorting the last dim by (value desc, index asc): a stable descending sort."""
    return torch.sort(v, dim=-1, descending=True, stable=True).indices


@invariant_op
def moe_route(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    correction_bias: torch.Tensor | None,
    top_k: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
) -> RouterOutput:
    """Route each token to ``top_k`` experts.

    x: [T, D] (any float dtype); gate_weight: [E, D]; correction_bias: [E] or None.
    Returns RouterOutput(expert_ids [T, top_k] int64 ascending, weights [T, top_k] fp32).
    The weights are differentiable w.r.t. x and gate_weight (through s); selection is not.
    """
    n_experts = _check_route_inputs(x, gate_weight, top_k, n_group, topk_group)
    cdt = _cdt(x.dtype)
    logits = linear(x.to(cdt), gate_weight.to(cdt), out_dtype=cdt)  # [T, E]
    s = sigmoid(logits)
    sb = s.detach()
    if correction_bias is not None:
        sb = sb + correction_bias.to(cdt)
    if n_group > 1:
        t = sb.shape[0]
        grouped = sb.reshape(t, n_group, n_experts // n_group)
        top = torch.sort(grouped, dim=-1, descending=True).values
        group_score = top[..., 0] + top[..., 1] if top.shape[-1] > 1 else top[..., 0]  # [T, G]
        kept = _desc_order(group_score)[:, :topk_group]
        keep = torch.zeros(t, n_group, dtype=torch.bool, device=sb.device)
        keep.scatter_(1, kept, True)
        sb = torch.where(keep[:, :, None], grouped, float("-inf")).reshape(t, n_experts)
    chosen = _desc_order(sb)[:, :top_k]
    expert_ids = torch.sort(chosen, dim=-1).values  # ascending expert id (ids are distinct)
    w = s.gather(1, expert_ids)
    if renormalises(norm_topk_prob, top_k):
        w = w / (tree_sum(w, dim=-1, keepdim=True) + RENORM_EPS)
    w = w * routed_scaling_factor
    return RouterOutput(expert_ids=expert_ids, weights=w)


@invariant_op
def moe_combine(
    expert_outputs: torch.Tensor, weights: torch.Tensor, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """``sum_j weights[:, j] * expert_outputs[:, j]`` accumulated in fp32 in slot order j = 0..k-1.

    expert_outputs: [T, k, D] in RouterOutput order (ascending expert id); weights: [T, k].
    Returns [T, D] in ``out_dtype`` (default expert_outputs.dtype). Add the shared expert after.
    """
    t, k, d = expert_outputs.shape
    if weights.shape != (t, k):
        raise ValueError(f"moe_combine: weights {tuple(weights.shape)} do not match outputs {(t, k, d)}")
    cdt = _cdt(expert_outputs.dtype)
    eo, w = expert_outputs.to(cdt), weights.to(cdt)
    acc = torch.zeros(t, d, dtype=cdt, device=expert_outputs.device)
    for j in range(k):  # one rounding per product and per add, in this order: no FMA, no tree
        acc = acc + w[:, j, None] * eo[:, j]
    return acc.to(out_dtype or expert_outputs.dtype)


@invariant_op
def moe_combine_rows(
    rows: torch.Tensor, slot_rows: torch.Tensor, weights: torch.Tensor, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """``moe_combine`` of expert outputs stored as rows in another order (the MoE's expert-sorted rows):
    ``sum_j weights[:, j] * rows[slot_rows[:, j]]``, bitwise ``moe_combine(rows[slot_rows], weights, out_dtype)``.

    rows: [N, D]; slot_rows: [T, k] integer, the row holding slot (t, j), a permutation of range(N) with
    N = T * k (each row is one slot; the backward writes each row's gradient once); weights: [T, k].
    Saves the un-sort of the rows into slot order (a full read and write of [T * k, D]) and, in the
    backward, its gather.
    """
    return moe_combine(in_slot_order(rows, slot_rows, weights), weights, out_dtype)


@dataclass(frozen=True)
class ExpertOrder:
    """The MoE's (token, slot) pairs grouped by expert, stably (pair order kept within an expert).

    order: [P] int64, sorted row r holds pair ``order[r]`` (pair i = token i // k, slot i % k);
    offsets: [E+1] int32, rows ``offsets[e]:offsets[e+1]`` are expert e's; slot_rows: [P] int64, pair i sits
    at sorted row ``slot_rows[i]`` (the inverse permutation of ``order``)."""

    order: torch.Tensor
    offsets: torch.Tensor
    slot_rows: torch.Tensor


@invariant_op
def moe_sort(expert_ids: torch.Tensor, num_experts: int) -> ExpertOrder:
    """Group the pairs of ``expert_ids`` ([T, k] or [P] integer ids in [0, num_experts)) by expert: the order
    of a stable sort by id, the experts' row offsets and the inverse permutation. Integer work only (no
    rounding): every backend gives the same result, and the shapes follow from the input's alone (no host
    read: CUDA-graph capturable)."""
    flat = expert_ids.reshape(-1)
    sorted_ids, order = torch.sort(flat, stable=True)
    bounds = torch.arange(num_experts + 1, device=flat.device, dtype=flat.dtype)
    offsets = torch.searchsorted(sorted_ids, bounds, out_int32=True)
    slot_rows = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    return ExpertOrder(order, offsets, slot_rows)


def check_combine_rows(rows: torch.Tensor, slot_rows: torch.Tensor, weights: torch.Tensor) -> None:
    """``moe_combine_rows``' shapes: rows [T*k, D], slot_rows [T, k], weights [T, k]."""
    t, k = weights.shape
    if slot_rows.shape != (t, k) or rows.dim() != 2 or rows.shape[0] != t * k:
        raise ValueError(f"moe_combine_rows: rows {tuple(rows.shape)}, slot_rows {tuple(slot_rows.shape)} and "
                         f"weights {tuple(weights.shape)} must be [T*k, D], [T, k], [T, k]")


def in_slot_order(rows: torch.Tensor, slot_rows: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The rows gathered into slot order [T, k, D] (shapes checked): what ``moe_combine`` takes."""
    check_combine_rows(rows, slot_rows, weights)
    return rows[slot_rows.reshape(-1)].view(*weights.shape, -1)


# ----------------------------------------------------------------------------- fast mode (stock kernels)


@moe_route.register("fast")
def moe_route_fast(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    correction_bias: torch.Tensor | None,
    top_k: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
) -> RouterOutput:
    """Stock ``torch.topk`` (ties broken arbitrarily) and ``torch.sigmoid``; same output contract."""
    n_experts = _check_route_inputs(x, gate_weight, top_k, n_group, topk_group)
    cdt = torch.float64 if x.dtype == torch.float64 else torch.float32
    s = torch.sigmoid(linear(x.to(cdt), gate_weight.to(cdt), out_dtype=cdt))
    sb = s.detach() if correction_bias is None else s.detach() + correction_bias.to(cdt)
    if n_group > 1:
        t = sb.shape[0]
        grouped = sb.view(t, n_group, n_experts // n_group)
        k2 = min(2, grouped.shape[-1])
        group_score = grouped.topk(k2, dim=-1).values.sum(-1)
        kept = group_score.topk(topk_group, dim=-1).indices
        keep = torch.zeros(t, n_group, dtype=torch.bool, device=sb.device).scatter_(1, kept, True)
        sb = grouped.masked_fill(~keep[:, :, None], float("-inf")).view(t, n_experts)
    ids = sb.topk(top_k, dim=-1).indices.sort(dim=-1).values
    w = s.gather(1, ids)
    if renormalises(norm_topk_prob, top_k):
        w = w / (w.sum(-1, keepdim=True) + RENORM_EPS)
    return RouterOutput(expert_ids=ids, weights=w * routed_scaling_factor)


@moe_combine.register("fast")
def moe_combine_fast(
    expert_outputs: torch.Tensor, weights: torch.Tensor, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """One batched matmul: ``weights[:, None, :] @ expert_outputs`` in fp32."""
    t, k, d = expert_outputs.shape
    if weights.shape != (t, k):
        raise ValueError(f"moe_combine: weights {tuple(weights.shape)} do not match outputs {(t, k, d)}")
    cdt = torch.float64 if expert_outputs.dtype == torch.float64 else torch.float32
    y = torch.bmm(weights.to(cdt)[:, None, :], expert_outputs.to(cdt))[:, 0]
    return y.to(out_dtype or expert_outputs.dtype)


@moe_combine_rows.register("fast")
def moe_combine_rows_fast(
    rows: torch.Tensor, slot_rows: torch.Tensor, weights: torch.Tensor, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    return moe_combine_fast(in_slot_order(rows, slot_rows, weights), weights, out_dtype)


# ----------------------------------------------------------------------------- references


def moe_route_ref(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    correction_bias: torch.Tensor | None,
    top_k: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
) -> RouterOutput:
    """Reference: scores in float64, selection written as plain Python with the same tie rules.

    Returns float64 weights. Selection agrees with ``moe_route`` unless two candidates are closer
    than fp32 rounding (or exactly tied in one precision but not the other).
    """
    n_experts = gate_weight.shape[0]
    _check_route_args(n_experts, top_k, n_group, topk_group)
    s = torch.sigmoid(x.double() @ gate_weight.double().t())
    sb = s + (correction_bias.double() if correction_bias is not None else 0.0)
    size = n_experts // n_group
    ids_rows, w_rows = [], []
    for row_s, row_sb in zip(s.tolist(), sb.tolist()):
        allowed = range(n_experts)
        if n_group > 1:
            scores = []
            for g in range(n_group):
                vals = sorted(row_sb[g * size:(g + 1) * size], reverse=True)
                scores.append(sum(vals[:2]))
            groups = sorted(range(n_group), key=lambda g: (-scores[g], g))[:topk_group]
            allowed = [e for g in sorted(groups) for e in range(g * size, (g + 1) * size)]
        picked = sorted(sorted(allowed, key=lambda e: (-row_sb[e], e))[:top_k])
        w = [row_s[e] for e in picked]
        if renormalises(norm_topk_prob, top_k):
            total = sum(w) + RENORM_EPS
            w = [v / total for v in w]
        ids_rows.append(picked)
        w_rows.append([v * routed_scaling_factor for v in w])
    return RouterOutput(
        expert_ids=torch.tensor(ids_rows, dtype=torch.int64).view(-1, top_k),
        weights=torch.tensor(w_rows, dtype=torch.float64).view(-1, top_k),
    )


def moe_combine_ref(expert_outputs: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """float64 reference for ``moe_combine``."""
    return (weights.double()[:, :, None] * expert_outputs.double()).sum(1)
