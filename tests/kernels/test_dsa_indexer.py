"""DSA indexer: FP8 index scores and exact top-k vs references, batch invariance; Hadamard rotation."""
from __future__ import annotations

import math

import pytest
import torch

from zmrl.kernels_batch_invariant import dsa_indexer as dsa_mod
from zmrl.kernels_batch_invariant.dsa_indexer import (
    dsa_index_scores,
    dsa_index_scores_ref,
    dsa_topk,
    dsa_topk_ref,
)
from zmrl.kernels_batch_invariant.fp8 import quantize_fp8
from zmrl.kernels_batch_invariant.hadamard import hadamard_matrix, hadamard_rotate

from .invariance import THREAD_COUNTS, num_threads

U32 = 2.0 ** -24


# ----------------------------------------------------------------------------- fixtures
def make_indexer_case(seq_lens, page_size, hi, di, seed, per_seq=4, hadamard=False):
    """Quantised queries/keys as the model layer produces them, keys scattered over shuffled pages.

    Unused cache slots hold NaN codes / NaN scales so that any leak of a masked slot is visible.
    """
    g = torch.Generator().manual_seed(seed)
    n = len(seq_lens)
    pages_per_seq = [math.ceil(length / page_size) for length in seq_lens]
    num_pages = sum(pages_per_seq) + 2
    k = torch.randn(n, max(seq_lens), di, generator=g) * torch.rand(n, max(seq_lens), 1, generator=g) * 3
    if hadamard:
        k = hadamard_rotate(k)
    k8, ks = quantize_fp8(k, block=min(128, di))
    k8_cache = torch.full((num_pages, page_size, di), float("nan")).to(torch.float8_e4m3fn)
    ks_cache = torch.full((num_pages, page_size), float("nan"))
    phys = torch.randperm(num_pages, generator=g)
    block_table = torch.full((n, max(pages_per_seq) + 1), -1, dtype=torch.int64)
    c = 0
    for i, length in enumerate(seq_lens):
        for j in range(pages_per_seq[i]):
            page = int(phys[c]); c += 1
            block_table[i, j] = page
            hi_ = min((j + 1) * page_size, length)
            k8_cache[page, : hi_ - j * page_size] = k8[i, j * page_size:hi_]
            ks_cache[page, : hi_ - j * page_size] = ks[i, j * page_size:hi_, 0]
    sidx, qpos = [], []
    for i, length in enumerate(seq_lens):
        pos = {length - 1, 0} | {int(v) for v in torch.randint(0, length, (per_seq,), generator=g)}
        for p in sorted(pos):
            sidx.append(i); qpos.append(p)
    nq = len(qpos)
    q = torch.randn(nq, hi, di, generator=g)
    if hadamard:
        q = hadamard_rotate(q)
    q8, qs = quantize_fp8(q, block=min(128, di))
    w = torch.randn(nq, hi, generator=g) * hi ** -0.5 * di ** -0.5
    return dict(q8=q8, q_scale=qs[..., 0], weights=w, k8_cache=k8_cache, k_scale_cache=ks_cache,
                block_table=block_table, seq_idx=torch.tensor(sidx), query_pos=torch.tensor(qpos))


def relayout(case, seq_lens, page_size):
    """The case's logical keys copied into fresh pages of another size (sequence n -> pages in order)."""
    old_ps, di = case["k8_cache"].shape[1:]
    pages = [math.ceil(length / page_size) for length in seq_lens]
    k8 = torch.full((sum(pages), page_size, di), float("nan")).to(torch.float8_e4m3fn)
    ks = torch.full((sum(pages), page_size), float("nan"))
    bt = torch.full((len(seq_lens), max(pages)), -1, dtype=torch.int64)
    first = 0
    for n, length in enumerate(seq_lens):
        bt[n, : pages[n]] = torch.arange(first, first + pages[n])
        first += pages[n]
        for pos in range(length):
            src_page, src_off = int(case["block_table"][n, pos // old_ps]), pos % old_ps
            dst_page, dst_off = int(bt[n, pos // page_size]), pos % page_size
            k8.view(torch.uint8)[dst_page, dst_off] = case["k8_cache"].view(torch.uint8)[src_page, src_off]
            ks[dst_page, dst_off] = case["k_scale_cache"][src_page, src_off]
    return dict(case, k8_cache=k8, k_scale_cache=ks, block_table=bt)


def _select(case, idx):
    out = dict(case)
    for key in ("q8", "q_scale", "weights", "seq_idx", "query_pos"):
        out[key] = case[key][idx]
    return out


def _error_scale(case):
    """M[t, s] = s_k[s] * sum_h |w s_q|[t,h] * sum_d |q8 k8| (float64): the sum of |terms|."""
    num_pages, page_size, di = case["k8_cache"].shape
    nq = case["q8"].shape[0]
    lmax = int(case["query_pos"].max()) + 1
    pos = torch.arange(lmax).expand(nq, lmax)
    pos = torch.where(pos <= case["query_pos"][:, None], pos, torch.zeros_like(pos))
    pages = case["block_table"][case["seq_idx"][:, None], pos // page_size]
    slots = pages * page_size + pos % page_size
    k8 = case["k8_cache"].reshape(-1, di).double()[slots]
    ks = case["k_scale_cache"].reshape(-1).double()[slots]
    absdot = torch.einsum("qhd,qld->qhl", case["q8"].double().abs(), k8.abs())
    wq = (case["weights"].double() * case["q_scale"].double()).abs()
    return ks * torch.einsum("qh,qhl->ql", wq, absdot)


# ----------------------------------------------------------------------------- index scores
@pytest.mark.parametrize(
    "seq_lens,page_size,hi,di,hadamard",
    [
        ([1, 63, 64, 65, 130, 300], 64, 4, 32, False),
        ([1, 63, 64, 65, 130, 300], 128, 4, 32, True),
        ([5, 200, 129], 64, 16, 128, True),
        ([70, 257], 128, 32, 64, False),
    ],
)
def test_index_scores_match_reference(seq_lens, page_size, hi, di, hadamard):
    """Tolerance: |I - I_ref| <= 1.01 (Di + log2 Hi + 4) u M, u = 2^-24, M = the sum of |terms|.

    fp8 values have 4 significant bits, so each q8*k8 product is exact in fp32; the Di-term dot,
    the w*s_q product, the ReLU'd product with it, the log2(Hi)-level head tree and the final s_k
    multiply are all fp32 roundings, and the standard bound for n sequential roundings in any
    summation order is gamma_n <= 1.01 n u relative to the sum of |terms| (FMA only tightens it).
    The reference computes the same formula from dequantised values in float64. A missing ReLU, a
    wrong scale or a wrong key changes a score by O(M / (Hi sqrt(Di))), ~1e4x above the bound.
    """
    case = make_indexer_case(seq_lens, page_size, hi, di, seed=hi + di, hadamard=hadamard)
    got = dsa_index_scores(**case)
    ref = dsa_index_scores_ref(**case)
    lmax = int(case["query_pos"].max()) + 1
    assert got.dtype == torch.float32 and got.shape == (len(case["query_pos"]), lmax)
    causal = torch.arange(lmax)[None, :] <= case["query_pos"][:, None]
    assert torch.equal(torch.isfinite(got), causal)
    assert torch.equal(torch.isneginf(got), ~causal)
    n_round = di + math.ceil(math.log2(hi)) + 4
    bound = 1.01 * n_round * U32 * _error_scale(case)
    err = (got.double() - ref).abs()
    assert (err[causal] <= bound[causal]).all()
    # ReLU'd and negative weights: plenty of exact zeros and negative scores are exercised.
    assert (got[causal] < 0).any() and (got[causal] > 0).any()


def test_index_scores_invariance(monkeypatch):
    case = make_indexer_case([1, 63, 64, 65, 130, 300], 64, 8, 64, seed=5, per_seq=6)
    full = dsa_index_scores(**case)
    nq = len(case["query_pos"])
    # alone: a row's values over 0..t are the same; its width is then t + 1
    for i in [0, 2, nq // 2, nq - 1]:
        alone = dsa_index_scores(**_select(case, slice(i, i + 1)))
        t = int(case["query_pos"][i])
        assert alone.shape == (1, t + 1)
        assert torch.equal(alone[0], full[i, : t + 1])
    # batch permutation
    perm = torch.randperm(nq, generator=torch.Generator().manual_seed(1))
    assert torch.equal(dsa_index_scores(**_select(case, perm)), full[perm])
    # physical page layout
    p = torch.randperm(case["k8_cache"].shape[0], generator=torch.Generator().manual_seed(2))
    moved = dict(case)
    moved["k8_cache"] = torch.empty_like(case["k8_cache"])
    moved["k8_cache"].view(torch.uint8)[p] = case["k8_cache"].view(torch.uint8)
    moved["k_scale_cache"] = torch.empty_like(case["k_scale_cache"])
    moved["k_scale_cache"][p] = case["k_scale_cache"]
    bt = case["block_table"]
    moved["block_table"] = torch.where(bt >= 0, p[bt.clamp_min(0)], bt)
    assert torch.equal(dsa_index_scores(**moved), full)
    # page size: the same logical keys in pages of 128, and in one page per sequence
    for ps in (128, 320):
        assert torch.equal(dsa_index_scores(**relayout(case, [1, 63, 64, 65, 130, 300], ps)), full)
    # query grouping and thread count
    for group in (1, 7):
        monkeypatch.setattr(dsa_mod, "QUERY_GROUP", group)
        assert torch.equal(dsa_index_scores(**case), full)
    monkeypatch.undo()
    for threads in THREAD_COUNTS:
        with num_threads(threads):
            assert torch.equal(dsa_index_scores(**case), full), threads


# ----------------------------------------------------------------------------- top-k
def test_topk_ties_lowest_positions_win():
    scores = torch.zeros(3, 200)
    qpos = torch.tensor([199, 10, 150])
    out = dsa_topk(scores, qpos, 16)
    assert torch.equal(out[0], torch.arange(16))
    assert torch.equal(out[1], torch.cat([torch.arange(11), torch.full((5,), -1)]))  # t + 1 <= k: all
    assert torch.equal(out[2], torch.arange(16))
    # a few distinct winners plus ties: the ties fill up from the lowest position
    scores[0, [150, 7, 99]] = torch.tensor([1.0, 2.0, 1.0])
    out = dsa_topk(scores, qpos, 6)
    assert out[0].tolist() == [0, 1, 2, 7, 99, 150]


def test_topk_ignores_columns_past_query_pos():
    scores = torch.full((2, 50), -5.0)
    scores[:, 20:] = 100.0  # garbage to the right of query_pos must never be picked
    scores[1, 3] = float("-inf")  # a -inf candidate is still a candidate when the row is short
    out = dsa_topk(scores, torch.tensor([19, 5]), 8)
    assert out[0].tolist() == list(range(8))
    assert out[1].tolist() == [0, 1, 2, 3, 4, 5, -1, -1]


def test_topk_narrow_scores_and_dtype():
    out = dsa_topk(torch.randn(2, 3), torch.tensor([2, 0]), 5)
    assert out.dtype == torch.int64 and out.shape == (2, 5)
    assert out.tolist() == [[0, 1, 2, -1, -1], [0, -1, -1, -1, -1]]


@pytest.mark.parametrize("topk", [1, 7, 64])
def test_topk_matches_reference_with_duplicates(topk):
    g = torch.Generator().manual_seed(topk)
    scores = torch.randint(-3, 4, (40, 300), generator=g).float() * 0.5  # heavy duplication
    scores[::3] = torch.randn(14, 300, generator=g)
    scores[1::5, :] = scores[1::5, :].clamp_min(0.0)  # ReLU-style zero ties, incl. -0.0 vs 0.0
    scores[2, 5] = -0.0
    qpos = torch.randint(0, 300, (40,), generator=g)
    qpos[:4] = torch.tensor([0, 1, topk - 1, topk])
    out = dsa_topk(scores, qpos, topk)
    assert torch.equal(out, dsa_topk_ref(scores, qpos, topk))
    valid = out >= 0
    assert torch.equal(valid.sum(-1), torch.minimum(qpos + 1, torch.tensor(topk)))
    assert (out[:, 1:][valid[:, 1:]] > out[:, :-1][valid[:, 1:]]).all()  # strictly ascending


def test_topk_invariance():
    g = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 5, (30, 257), generator=g).float()
    qpos = torch.randint(0, 257, (30,), generator=g)
    full = dsa_topk(scores, qpos, 32)
    for i in range(30):
        t = int(qpos[i])
        # alone, with only its own columns, and with extra garbage columns
        assert torch.equal(dsa_topk(scores[i:i + 1, : t + 1], qpos[i:i + 1], 32)[0], full[i])
        wide = torch.cat([scores[i:i + 1], torch.full((1, 100), 9.0)], dim=1)
        assert torch.equal(dsa_topk(wide, qpos[i:i + 1], 32)[0], full[i])
    perm = torch.randperm(30, generator=g)
    assert torch.equal(dsa_topk(scores[perm], qpos[perm], 32), full[perm])


def test_scores_to_topk_pipeline_alone_vs_batch():
    """End to end indexer: the selection of a query does not depend on its batch."""
    case = make_indexer_case([300, 90, 17], 64, 4, 32, seed=9, per_seq=5, hadamard=True)
    full = dsa_topk(dsa_index_scores(**case), case["query_pos"], 64)
    for i in range(len(case["query_pos"])):
        one = _select(case, slice(i, i + 1))
        assert torch.equal(dsa_topk(dsa_index_scores(**one), one["query_pos"], 64)[0], full[i])


# ----------------------------------------------------------------------------- hadamard
@pytest.mark.parametrize("n", [1, 2, 32, 128])
def test_hadamard_matrix(n):
    h = hadamard_matrix(n)
    assert h.shape == (n, n) and torch.equal(h.abs(), torch.ones(n, n))
    assert torch.equal(h @ h.T, n * torch.eye(n))  # small integers: exact in fp32
    assert torch.equal(h, h.T)
    with pytest.raises(ValueError):
        hadamard_matrix(n + 3 if n > 1 else 3)


@pytest.mark.parametrize("n", [32, 128])
def test_hadamard_rotate(n):
    x = torch.randn(50, n, generator=torch.Generator().manual_seed(n))
    y = hadamard_rotate(x)
    ref = x.double() @ hadamard_matrix(n, torch.float64) * n ** -0.5
    # one length-n fp32 dot of +-x values and one scale multiply: error <= (n + 1) u sum|x|.
    assert ((y.double() - ref).abs() <= (n + 1) * U32 * x.double().abs().sum(-1, keepdim=True)).all()
    # orthonormal: the norm is preserved up to fp32 rounding (relative ~n u); a missing or wrong
    # scale (e.g. 1/n) changes it by a factor >= 2.
    ratio = y.double().norm(dim=-1) / x.double().norm(dim=-1)
    assert ((ratio - 1).abs() < 1e-5).all()
    # rotating twice is the identity (H H^T = n I)
    assert (hadamard_rotate(y).double() - x.double()).abs().max() < 1e-5
    # row-invariant: a row alone equals the row in the batch
    for i in (0, 17, 49):
        assert torch.equal(hadamard_rotate(x[i:i + 1])[0], y[i])
    assert hadamard_rotate(x.bfloat16()).dtype == torch.bfloat16
