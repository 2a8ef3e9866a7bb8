"""DSA lightning indexer: FP8 index scores over a paged key cache, and the exact top-k selection.

Scores (DeepSeek-V3.2 ``fp8_index``), for query token t and key position s <= t:

    I(t, s) = s_k[s] * tree_sum_h( (w[t, h] * s_q[t, h]) * ReLU(q8[t, h] . k8[s]) )

with the dot in fp32 over fixed 64-key blocks (one fixed-shape ``bmm_fixed`` [Hi, Di] @ [Di, 64] per
query and block) and the head sum as a fixed binary tree. Positions > t are -inf. Keys at position s
live at ``k8_cache[block_table[n, s // page_size], s % page_size]`` (scale in ``k_scale_cache``).

Static key width (CUDA-graph decode): ``dsa_index_scores(..., kv_len=L)`` returns ``[Q, L]`` with the
same -inf past each query's position, reading no device value on the host; the columns up to each
query's position are bitwise those of ``kv_len=None``. ``dsa_topk`` takes its width from the scores'
shape and selects only positions <= query_pos, so its result does not depend on the width either.

Top-k keeps, per query, the first ``min(topk, t + 1)`` positions in (score desc, position asc) order
and returns them ascending, -1 padded: ReLU and FP8 make exact ties common (all-zero scores), so the
tie rule is part of the contract.
"""
from __future__ import annotations

import torch

from ._dispatch import invariant_op
from .matmul import bmm_fixed
from .mla_attention import KEY_BLOCK, cache_slots, key_width
from .reduce import tree_sum

QUERY_GROUP = 256  # queries per inner pass; bounds memory, never changes results


@invariant_op
def dsa_index_scores(q8: torch.Tensor, q_scale: torch.Tensor, weights: torch.Tensor,
                     k8_cache: torch.Tensor, k_scale_cache: torch.Tensor, block_table: torch.Tensor,
                     seq_idx: torch.Tensor, query_pos: torch.Tensor, kv_len: int | None = None) -> torch.Tensor:
    """Causal index scores ``[Q, Lmax]`` fp32 (Lmax = max(query_pos) + 1, or ``kv_len`` when given;
    -inf past query_pos).

    q8 [Q, Hi, Di] float8_e4m3fn, q_scale [Q, Hi] fp32, weights [Q, Hi] fp32 (already scaled by
    Hi^-0.5 * Di^-0.5), k8_cache [num_pages, page_size, Di] float8_e4m3fn, k_scale_cache
    [num_pages, page_size] fp32, block_table [N, max_pages], seq_idx [Q], query_pos [Q].
    """
    nq, hi, di = q8.shape
    num_pages, page_size, dk = k8_cache.shape
    if dk != di:
        raise ValueError(f"dsa_index_scores: q8 head dim {di} != key cache dim {dk}")
    qp = query_pos.to(torch.int64)
    lmax = key_width(qp, kv_len)
    flat_k = k8_cache.reshape(num_pages * page_size, di)
    flat_s = k_scale_cache.reshape(num_pages * page_size)
    # fp8 values are exact in fp32; w * s_q is one rounding per (token, head), as specified.
    qf = q8.to(torch.float32)
    wq = weights.to(torch.float32) * q_scale.to(torch.float32)  # [Q, Hi]
    outs = []
    for g0 in range(0, nq, QUERY_GROUP):
        sl = slice(g0, g0 + QUERY_GROUP)
        g_qp = qp[sl]
        # A static width walks every block (blocks past a query's position are -inf for it): no host read.
        g_lmax = lmax if kv_len is not None else int(g_qp.max().item()) + 1
        blocks = []
        for b0 in range(0, g_lmax, KEY_BLOCK):
            pos = (b0 + torch.arange(KEY_BLOCK, dtype=torch.int64, device=q8.device)).unsqueeze(0)
            pos = torch.where(pos <= g_qp.unsqueeze(-1), pos, torch.full_like(pos, -1))  # [G, 64]
            slots, valid = cache_slots(block_table, seq_idx[sl], pos, page_size)
            k = torch.where(valid.unsqueeze(-1), flat_k[slots].to(torch.float32), 0.0)  # [G, 64, Di]
            ks = flat_s[slots].to(torch.float32)  # [G, 64]
            dot = bmm_fixed(qf[sl], k.transpose(1, 2))  # [G, Hi, 64]
            per_head = wq[sl].unsqueeze(-1) * torch.clamp_min(dot, 0.0)
            score = ks * tree_sum(per_head, dim=1)  # [G, 64]
            blocks.append(torch.where(valid, score, torch.full_like(score, float("-inf"))))
        g_scores = torch.cat(blocks, dim=-1)[:, :g_lmax]
        # Columns past this group's longest query are -inf for all of its rows.
        pad = torch.full((g_scores.shape[0], lmax - g_lmax), float("-inf"), device=q8.device)
        outs.append(torch.cat([g_scores, pad], dim=-1))
    if not outs:
        return torch.empty((0, lmax), dtype=torch.float32, device=q8.device)
    return torch.cat(outs, dim=0)


@invariant_op
def dsa_topk(scores: torch.Tensor, query_pos: torch.Tensor, topk: int) -> torch.Tensor:
    """Exact per-row top-k over positions 0..query_pos[i] of ``scores [Q, L]``.

    Order is (score desc, position asc); keeps the first ``min(topk, query_pos + 1)`` and returns
    them sorted ascending, padded with -1: ``[Q, topk]`` int64. NaN scores are not supported.
    """
    nq, width = scores.shape
    qp = query_pos.to(torch.int64).unsqueeze(-1)
    cols = torch.arange(width, dtype=torch.int64, device=scores.device).unsqueeze(0)
    in_range = cols <= qp
    masked = torch.where(in_range, scores.detach(), torch.full_like(scores, float("-inf")))
    if width < topk:
        masked = torch.cat([masked, masked.new_full((nq, topk - width), float("-inf"))], dim=-1)
    # A stable descending sort orders equal scores by ascending position. Out-of-range columns are
    # -inf and lie at positions > query_pos, so they sort after every candidate, ties included.
    order = torch.sort(masked, dim=-1, descending=True, stable=True).indices[:, :topk]
    chosen = order <= qp
    sentinel = torch.iinfo(torch.int64).max
    asc = torch.sort(torch.where(chosen, order, torch.full_like(order, sentinel)), dim=-1).values
    return torch.where(asc == sentinel, torch.full_like(asc, -1), asc)


def dsa_index_scores_ref(q8: torch.Tensor, q_scale: torch.Tensor, weights: torch.Tensor,
                         k8_cache: torch.Tensor, k_scale_cache: torch.Tensor, block_table: torch.Tensor,
                         seq_idx: torch.Tensor, query_pos: torch.Tensor) -> torch.Tensor:
    """float64 reference from dequantised values: I(t,s) = sum_h w[t,h] ReLU(q[t,h] . k[s]), s <= t."""
    nq = q8.shape[0]
    num_pages, page_size, di = k8_cache.shape
    qp = query_pos.to(torch.int64)
    lmax = int(qp.max().item()) + 1 if nq else 0
    q = q8.double() * q_scale.double().unsqueeze(-1)  # [Q, Hi, Di]
    k_all = k8_cache.double() * k_scale_cache.double().unsqueeze(-1)  # [P, ps, Di]
    pos = torch.arange(lmax, dtype=torch.int64).unsqueeze(0).expand(nq, lmax)
    pos = torch.where(pos <= qp.unsqueeze(-1), pos, torch.full_like(pos, -1))
    slots, valid = cache_slots(block_table, seq_idx, pos, page_size)
    k = k_all.reshape(-1, di)[slots]  # [Q, L, Di]
    dots = torch.einsum("qhd,qld->qhl", q, k)
    scores = torch.einsum("qh,qhl->ql", weights.double(), dots.clamp_min(0.0))
    return torch.where(valid, scores, torch.full_like(scores, float("-inf")))


def dsa_topk_ref(scores: torch.Tensor, query_pos: torch.Tensor, topk: int) -> torch.Tensor:
    """Plain-python reference with the same tie rule: sort candidates by (-score, position)."""
    out = torch.full((scores.shape[0], topk), -1, dtype=torch.int64)
    rows = scores.tolist()
    for i, t in enumerate(query_pos.tolist()):
        cand = sorted(range(t + 1), key=lambda s: (-rows[i][s], s))[:topk]
        cand.sort()
        out[i, :len(cand)] = torch.tensor(cand, dtype=torch.int64)
    return out


# ----------------------------------------------------------------------------- fast (stock) kernels
# A plain fp32 matmul for the scores and ``torch.topk`` (not tie-stable) for the selection.
FAST_QUERY_CHUNK = 256
# With a static kv_len the fast scores gather [C, kv_len, Di] keys per chunk of C queries: C is bounded
# by this many gathered elements (a function of host shapes only).
FAST_GATHER_ELEMS = 1 << 27


@dsa_index_scores.register("fast")
def dsa_index_scores_fast(q8: torch.Tensor, q_scale: torch.Tensor, weights: torch.Tensor,
                          k8_cache: torch.Tensor, k_scale_cache: torch.Tensor, block_table: torch.Tensor,
                          seq_idx: torch.Tensor, query_pos: torch.Tensor, kv_len: int | None = None) -> torch.Tensor:
    """Plain fp32 matmuls per sequence over its gathered keys (not invariant). With ``kv_len``: no
    per-sequence host loop; each query's causal keys are gathered into ``[C, kv_len, Di]`` chunks."""
    nq, hi, di = q8.shape
    num_pages, page_size, _ = k8_cache.shape
    qp = query_pos.to(torch.int64)
    width = key_width(qp, kv_len)
    out = torch.full((nq, width), float("-inf"), dtype=torch.float32, device=q8.device)
    flat_k = k8_cache.reshape(num_pages * page_size, di)
    flat_s = k_scale_cache.reshape(num_pages * page_size)
    wq = weights.to(torch.float32) * q_scale.to(torch.float32)
    if kv_len is not None:
        cols = torch.arange(width, dtype=torch.int64, device=q8.device).unsqueeze(0)
        chunk = max(1, FAST_GATHER_ELEMS // max(1, width * di))
        for c0 in range(0, nq, chunk):
            sl = slice(c0, c0 + chunk)
            pos = torch.where(cols <= qp[sl].unsqueeze(-1), cols, torch.full_like(cols, -1))
            slots, valid = cache_slots(block_table, seq_idx[sl], pos, page_size)
            k = flat_k[slots].to(torch.float32)  # [C, L, Di]
            ks = flat_s[slots].to(torch.float32)
            dots = torch.bmm(q8[sl].to(torch.float32), k.transpose(1, 2))  # [C, Hi, L]
            sc = (wq[sl].unsqueeze(-1) * dots.clamp_min(0.0)).sum(dim=1) * ks
            out[sl] = torch.where(valid, sc, float("-inf"))
        return out
    for n in torch.unique(seq_idx).tolist():
        idx = (seq_idx == n).nonzero().flatten()
        w_n = int(qp[idx].max().item()) + 1
        pos = torch.arange(w_n, dtype=torch.int64, device=q8.device).unsqueeze(0)
        slots, _ = cache_slots(block_table, seq_idx[idx[:1]], pos, page_size)
        k = flat_k[slots[0]].to(torch.float32)  # [L, Di]
        ks = flat_s[slots[0]].to(torch.float32)
        for c0 in range(0, idx.numel(), FAST_QUERY_CHUNK):
            ci = idx[c0:c0 + FAST_QUERY_CHUNK]
            dots = (q8[ci].to(torch.float32).reshape(-1, di) @ k.t()).view(ci.numel(), hi, w_n)
            sc = (wq[ci].unsqueeze(-1) * dots.clamp_min(0.0)).sum(dim=1) * ks
            sc = torch.where(pos <= qp[ci].unsqueeze(-1), sc, float("-inf"))
            out[ci, :w_n] = sc
    return out


@dsa_topk.register("fast")
def dsa_topk_fast(scores: torch.Tensor, query_pos: torch.Tensor, topk: int) -> torch.Tensor:
    """``torch.topk`` (ties broken arbitrarily), then ascending, -1 padded."""
    nq, width = scores.shape
    qp = query_pos.to(torch.int64).unsqueeze(-1)
    cols = torch.arange(width, dtype=torch.int64, device=scores.device).unsqueeze(0)
    masked = torch.where(cols <= qp, scores.detach(), float("-inf"))
    if width < topk:
        masked = torch.cat([masked, masked.new_full((nq, topk - width), float("-inf"))], dim=-1)
    idx = torch.topk(masked, topk, dim=-1).indices
    n_cand = torch.clamp(qp + 1, max=width)
    # Which of the k slots hold a real candidate: the first min(k, n) of the descending order, which
    # may be any in-range positions (an in-range -inf could tie with out-of-range ones); keep those
    # in range, up to n of them.
    valid = idx < n_cand
    sentinel = torch.iinfo(torch.int64).max
    asc = torch.sort(torch.where(valid, idx, torch.full_like(idx, sentinel)), dim=-1).values
    return torch.where(asc == sentinel, torch.full_like(asc, -1), asc)
