"""Triton ``dsa_index_scores`` (FP8 lightning-indexer scores) and ``dsa_topk`` (exact top-k):
float64 references, exactness of the tie rule, the bitwise contract on the GPU, the "fast" backend.

Under TRITON_INTERPRET=1 tiny shapes run (the FP8 tiles are upcast to fp32 before the dot, exactly);
on CUDA the bench indexer (32 heads x 128, top-2048) runs on contexts up to 32K.
"""
from __future__ import annotations


import pytest
import torch

from tests.kernels.test_mla_attention import make_paged_cache, make_queries, permute_pages
from zmrl.kernels_batch_invariant import kernel_mode
from zmrl.kernels_batch_invariant.dsa_indexer import (
    dsa_index_scores,
    dsa_index_scores_ref,
    dsa_topk,
    dsa_topk_ref,
)
from zmrl.kernels_batch_invariant.fp8 import quantize_fp8
from zmrl.kernels_batch_invariant.triton import triton_impl

pytestmark = [pytest.mark.gpu, pytest.mark.triton]

SEQ_LENS = [1, 63, 64, 65, 130, 300]


@pytest.fixture(autouse=True)
def topk_kernel_always(monkeypatch):
    """Run the Triton top-k kernel for every batch here (by default a few long rows use torch's stable sort,
    which gives the same result)."""
    from zmrl.kernels_batch_invariant.triton import dsa_indexer as tdsa
    monkeypatch.setattr(tdsa, "TOPK_MIN_ROWS", 0)


def scores_fn(*args):
    return triton_impl(dsa_index_scores)(*args)


def topk_fn(*args):
    return triton_impl(dsa_topk)(*args)


def index_case(lens, hi, di, page_size, device, seed=0, per_seq=2, queries=None):
    """FP8 keys in a paged cache (pages shuffled; zero entries in unused slots) and FP8 queries with
    model-like scales and weights. Returns the 8 op arguments on ``device``."""
    g = torch.Generator().manual_seed(seed)
    cache, bt, _ = make_paged_cache(lens, page_size, di, torch.float32, seed=seed)
    cache = cache.nan_to_num(0.0)  # fp8 has no inf; unused slots are masked anyway
    k8, ks = quantize_fp8(cache, block=di)
    if queries is None:
        sidx, qpos = make_queries(lens, per_seq=per_seq, seed=seed + 1)
    else:
        sidx, qpos = queries
    q = torch.randn(len(qpos), hi, di, generator=g)
    q8, qs = quantize_fp8(q, block=di)
    w = torch.randn(len(qpos), hi, generator=g) * (hi ** -0.5 * di ** -0.5)
    args = (q8, qs.squeeze(-1), w, k8, ks.squeeze(-1), bt, sidx, qpos)
    return tuple(a.to(device) for a in args)


def abs_bound(args):
    """sum_h |w s_q| s_k sum_d |q8 k8|: the magnitude every rounding error of a score is relative to."""
    q8, qs, w, k8, ks, bt, sidx, qpos = [a.cpu() for a in args]
    absf = lambda t: t.to(torch.float32).abs().to(t.dtype)  # noqa: E731 - |fp8| stays fp8-exact
    return dsa_index_scores_ref(absf(q8), qs, w.abs(), absf(k8), ks, bt, sidx, qpos)


def tolerance(device: torch.device) -> float:
    """Relative to ``abs_bound``. fp32 path (interpreter, or the tf32 fallback: products of e4m3 values
    are exact): a score is Di + Hi + 3 <= 163 fp32 roundings, worst case 163 u ~ 1e-5. The FP8 tensor
    core path on Hopper accumulates with ~14 significant bits (DeepSeek-V3 report, §3.3.2), about 6e-5
    per accumulation step over the 128-long dot: bound 1e-3. A wrong head, key or scale is O(1)."""
    return 1e-3 if device.type == "cuda" else 1e-5


def check_scores(out, args, device):
    ref = dsa_index_scores_ref(*[a.cpu() for a in args])
    assert out.dtype == torch.float32 and out.shape == ref.shape
    fin = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(out.cpu()), fin) and (out.cpu()[~fin] == float("-inf")).all()
    err = (out.cpu().double() - ref).abs()[fin]
    bound = abs_bound(args)[fin]
    assert (err <= tolerance(device) * bound + 1e-30).all(), (err.max().item(), bound.max().item())


# ----------------------------------------------------------------------------- scores
def score_shapes(interpret):
    shapes = [(4, 32, 64), (8, 64, 128), (3, 48, 64)]  # tiny preset; more heads; non-pow2 dims
    if not interpret:
        shapes += [(32, 128, 64), (32, 128, 256)]  # bench
    return shapes


@pytest.mark.parametrize("shape_idx", range(5))
def test_scores_match_float64_reference(device, interpret, shape_idx):
    shapes = score_shapes(interpret)
    if shape_idx >= len(shapes):
        pytest.skip("CUDA-only shape")
    hi, di, ps = shapes[shape_idx]
    lens = SEQ_LENS if interpret else SEQ_LENS + [3000]
    args = index_case(lens, hi, di, ps, device, seed=shape_idx, per_seq=1 if interpret else 4)
    check_scores(scores_fn(*args), args, device)


def test_scores_row_invariance(device, interpret):
    """A query's scores alone (its own width) equal its row in the batch, in any order and any page
    layout / page size; columns past its position are -inf."""
    hi, di = (4, 32) if interpret else (32, 128)
    lens = [1, 70, 200] if interpret else [1, 70, 3000, 9000]
    args = index_case(lens, hi, di, 64, device, seed=3, per_seq=2)
    q8, qs, w, k8, ks, bt, sidx, qpos = args
    full = scores_fn(*args)
    for i in range(len(qpos)):
        alone = scores_fn(q8[i:i + 1], qs[i:i + 1], w[i:i + 1], k8, ks, bt, sidx[i:i + 1], qpos[i:i + 1])
        t = int(qpos[i]) + 1
        assert torch.equal(alone[0], full[i, :t]), f"query {i}"
        assert (full[i, t:] == float("-inf")).all()
    perm = torch.randperm(len(qpos), generator=torch.Generator().manual_seed(0)).to(device)
    assert torch.equal(scores_fn(q8[perm], qs[perm], w[perm], k8, ks, bt, sidx[perm], qpos[perm]), full[perm])
    # Same logical keys in permuted physical pages, and with another page size.
    k8p, btp = permute_pages(k8.cpu().view(torch.uint8), bt.cpu(), seed=9)
    ksp, _ = permute_pages(ks.cpu().unsqueeze(-1), bt.cpu(), seed=9)
    out = scores_fn(q8, qs, w, k8p.view(torch.float8_e4m3fn).to(device), ksp.squeeze(-1).to(device),
                    btp.to(device), sidx, qpos)
    assert torch.equal(out, full)
    args128 = index_case(lens, hi, di, 128, device, seed=3, per_seq=2)
    assert torch.equal(args128[0], q8) and torch.equal(args128[7], qpos)
    assert torch.equal(scores_fn(*args128), full)


# ----------------------------------------------------------------------------- top-k
def tie_scores(nq, width, seed, levels=4):
    """Scores with many exact ties (few distinct values), -0.0 next to +0.0, and some -inf."""
    g = torch.Generator().manual_seed(seed)
    s = torch.randint(-levels, levels + 1, (nq, width), generator=g).float() * 0.5
    s[s == 0] = torch.where(torch.rand(int((s == 0).sum()), generator=g) < 0.5, 0.0, -0.0)
    s[torch.rand(nq, width, generator=g) < 0.05] = float("-inf")
    return s


@pytest.mark.parametrize("kind", ["ties", "distinct"])
def test_topk_exact(device, interpret, kind):
    """Exactly the reference's selection (score desc, position asc; ascending; -1 padded), including
    rows with fewer than k candidates, k > width, and heavy ties."""
    width = 300 if interpret else 5000
    qpos = torch.tensor([0, 1, 5, 63, 64, 130, width - 1, width - 1, 77])
    nq = len(qpos)
    if kind == "ties":
        s = tie_scores(nq, width, seed=1)
    else:
        s = torch.randn(nq, width, generator=torch.Generator().manual_seed(2))
    ks = (1, 7, 64, 129, 400) if interpret else (1, 64, 2048, 6000)
    for k in ks:
        want = dsa_topk_ref(s, qpos, k)
        got = topk_fn(s.to(device), qpos.to(device), k)
        assert got.dtype == torch.int64 and got.shape == (nq, k)
        assert torch.equal(got.cpu(), want), f"k={k}"


def test_topk_row_invariance(device, interpret):
    width = 260 if interpret else 20000
    k = 64 if interpret else 2048
    g = torch.Generator().manual_seed(5)
    qpos = torch.randint(0, width, (6,), generator=g)
    s = tie_scores(len(qpos), width, seed=6, levels=2).to(device)
    qpos = qpos.to(device)
    full = topk_fn(s, qpos, k)
    for i in range(len(qpos)):
        t = int(qpos[i]) + 1
        assert torch.equal(topk_fn(s[i:i + 1, :t], qpos[i:i + 1], k)[0], full[i])
    perm = torch.randperm(len(qpos), generator=g).to(device)
    assert torch.equal(topk_fn(s[perm], qpos[perm], k), full[perm])


def test_bench_indexer_32k(device, interpret):
    """Bench indexer (32 heads x 128, FP8, top-2048) over a 32K context: scores against float64 for a
    few rows, decode alone == in batch, and top-k equal to the (exact, stable-sort) torch backend."""
    if interpret:
        pytest.skip("bench shapes only on CUDA")
    hi, di = 32, 128
    lens = [32768, 4000]
    queries = (torch.tensor([0, 0, 0, 1, 1]), torch.tensor([32767, 16000, 2047, 3999, 100]))
    args = index_case(lens, hi, di, 64, device, seed=8, queries=queries)
    q8, qs, w, k8, ks, bt, sidx, qpos = args
    full = scores_fn(*args)
    idx = torch.tensor([1, 3], device=device)
    sub_args = (q8[idx], qs[idx], w[idx], k8, ks, bt, sidx[idx], qpos[idx])
    sub = scores_fn(*sub_args)
    check_scores(sub, sub_args, device)
    assert torch.equal(sub, full[idx, :sub.shape[1]])
    alone = scores_fn(q8[:1], qs[:1], w[:1], k8, ks, bt, sidx[:1], qpos[:1])
    assert torch.equal(alone, full[:1])
    sel = topk_fn(full, qpos, 2048)
    assert torch.equal(sel, dsa_topk.impls["torch"](full, qpos, 2048))
    assert torch.equal(sel[0], topk_fn(full[:1], qpos[:1], 2048)[0])
    # rows with <= 2048 candidates select all of them
    assert torch.equal(sel[2], torch.arange(2048, device=device))


def test_topk_small_batches_use_sort_with_same_result(device, monkeypatch):
    """Below TOPK_MIN_ROWS rows wider than TOPK_SORT_WIDTH the dispatcher uses the stable sort: the same
    selection as the kernel."""
    from zmrl.kernels_batch_invariant.triton import dsa_indexer as tdsa
    monkeypatch.setattr(tdsa, "TOPK_MIN_ROWS", 4)
    monkeypatch.setattr(tdsa, "TOPK_SORT_WIDTH", 100)
    qpos = torch.tensor([5, 100, 150, 199, 0, 64]).to(device)
    s = tie_scores(len(qpos), 200, seed=9).to(device)
    small = topk_fn(s[:3], qpos[:3], 32)  # 3 rows: sort
    big = topk_fn(s, qpos, 32)  # 6 rows: kernel
    assert torch.equal(small, big[:3])
    assert torch.equal(big.cpu(), dsa_topk_ref(s.cpu(), qpos.cpu(), 32))


# ----------------------------------------------------------------------------- fast backend
def test_fast_backend(device):
    """fp32 matmul scores (close to float64) and torch.topk (same set when scores are distinct)."""
    args = index_case(SEQ_LENS, 4, 32, 64, device, seed=12, per_seq=1)
    with kernel_mode("fast"):
        sc = dsa_index_scores(*args)
        fin = torch.isfinite(sc)
        # distinct scores (ties are common only at 0 from the ReLU): add a tiny position ramp
        ramp = torch.arange(sc.shape[1], device=device, dtype=torch.float32) * 1e-7
        distinct = torch.where(fin, sc + ramp, sc)
        sel = dsa_topk(distinct, args[7], 16)
    ref = dsa_index_scores_ref(*[a.cpu() for a in args])
    fr = torch.isfinite(ref)
    assert torch.equal(fin.cpu(), fr)
    assert ((sc.cpu().double() - ref).abs()[fr] <= 1e-5 * abs_bound(args)[fr] + 1e-30).all()
    assert torch.equal(sel.cpu(), dsa_topk_ref(distinct.cpu(), args[7].cpu(), 16))
