"""Absorbed MLA over a paged latent cache: float64 reference checks, batch invariance, gradients."""
from __future__ import annotations

import math

import pytest
import torch

from zmrl.kernels_batch_invariant import mla_attention as mla_mod
from zmrl.kernels_batch_invariant.dsa_indexer import dsa_topk
from zmrl.kernels_batch_invariant.mla_attention import (
    dense_key_positions,
    mla_attention,
    mla_attention_dense,
    mla_attention_ref,
)

from .invariance import THREAD_COUNTS, num_threads


# ----------------------------------------------------------------------------- fixtures
def make_paged_cache(seq_lens, page_size, dim, dtype, seed, extra_pages=3):
    """Random per-sequence entries scattered over shuffled physical pages.

    Returns (cache [P, page_size, dim], block_table [N, max_pages] int64, dense [N, Lmax, dim]) where
    dense[n, p] is the entry of sequence n at position p. Unused slots hold NaN so that any read of
    a masked or foreign slot that leaks into a result shows up.
    """
    g = torch.Generator().manual_seed(seed)
    n = len(seq_lens)
    pages_per_seq = [math.ceil(length / page_size) for length in seq_lens]
    num_pages = sum(pages_per_seq) + extra_pages
    max_pages = max(pages_per_seq) + 1
    dense = torch.randn(n, max(seq_lens), dim, generator=g).to(dtype)
    cache = torch.full((num_pages, page_size, dim), float("nan"), dtype=dtype)
    phys = torch.randperm(num_pages, generator=g)
    block_table = torch.full((n, max_pages), -1, dtype=torch.int64)
    k = 0
    for i, length in enumerate(seq_lens):
        for j in range(pages_per_seq[i]):
            page = int(phys[k]); k += 1
            block_table[i, j] = page
            rows = dense[i, j * page_size:min((j + 1) * page_size, length)]
            cache[page, : rows.shape[0]] = rows
    return cache, block_table, dense


def permute_pages(cache, block_table, seed):
    """The same logical cache stored in a different set of physical pages."""
    perm = torch.randperm(cache.shape[0], generator=torch.Generator().manual_seed(seed))
    new_cache = torch.empty_like(cache)
    new_cache[perm] = cache  # physical page p moves to perm[p]
    new_bt = torch.where(block_table >= 0, perm[block_table.clamp_min(0)], block_table)
    return new_cache, new_bt


def make_queries(seq_lens, per_seq, seed):
    """(seq_idx, query_pos): for every sequence its last position, position 0 and a few random ones."""
    g = torch.Generator().manual_seed(seed)
    sidx, qpos = [], []
    for i, length in enumerate(seq_lens):
        pos = {length - 1, 0} | {int(v) for v in torch.randint(0, length, (per_seq,), generator=g)}
        for p in sorted(pos):
            sidx.append(i); qpos.append(p)
    return torch.tensor(sidx, dtype=torch.int64), torch.tensor(qpos, dtype=torch.int64)


def sparse_key_positions(query_pos, width, seed, keep=0.5):
    """Random ascending subsets of 0..t that always contain t, -1 padded to `width`."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for t in query_pos.tolist():
        chosen = (torch.rand(t + 1, generator=g) < keep).nonzero().flatten().tolist()
        chosen = sorted(set(chosen[: width - 1]) | {t})
        rows.append(chosen + [-1] * (width - len(chosen)))
    return torch.tensor(rows, dtype=torch.int64)


def make_q(nq, h, dc, dr, seed, dtype=torch.float32, amp=2.0):
    g = torch.Generator().manual_seed(seed)
    q_lat = (torch.randn(nq, h, dc, generator=g) * amp).to(dtype)
    q_pe = (torch.randn(nq, h, dr, generator=g) * amp).to(dtype)
    return q_lat, q_pe


SEQ_LENS = [1, 63, 64, 65, 130, 300]


# ----------------------------------------------------------------------------- reference checks
@pytest.mark.parametrize(
    "h,dc,dr,page_size,dtype",
    [
        (1, 64, 16, 64, torch.float32),
        (4, 64, 16, 128, torch.bfloat16),
        (16, 64, 64, 64, torch.float32),
        (4, 512, 64, 128, torch.float32),
        (16, 512, 64, 64, torch.bfloat16),
    ],
)
@pytest.mark.parametrize("sparse", [False, True])
def test_matches_float64_reference(h, dc, dr, page_size, dtype, sparse):
    """Tolerance: |o - o_ref| <= 1e-5 * max|c_kv| elementwise.

    o is a convex combination of the c_kv rows, so max|c_kv| (about 4.5 here) is its natural scale.
    fp32 error sources: each score is a length-(Dc+Dr) dot (<= 576 terms, error <= ~576 u sum|q||k|,
    about 1e-5 absolute on scores of size ~10 in the worst case, typically ~sqrt(576) u ~ 1e-6), exp
    and the online rescaling add a few ulp; a softmax score error d perturbs o by <= 2 d max|c|.
    Measured errors are 2e-7 .. 1.5e-6 of max|c|. bf16 caches are compared against the same bf16
    values upcast, so bf16 adds no error of its own. A dropped/duplicated key, a wrong block merge or
    a wrong scale changes o by O(1e-2 .. 1) of max|c|, far above the tolerance.
    """
    cache, bt, _ = make_paged_cache(SEQ_LENS, page_size, dc + dr, dtype, seed=h * 7 + dc)
    sidx, qpos = make_queries(SEQ_LENS, per_seq=4, seed=1)
    q_lat, q_pe = make_q(len(qpos), h, dc, dr, seed=2, dtype=dtype)
    scale = (dc + dr) ** -0.5 * 2.0
    if sparse:
        kp = sparse_key_positions(qpos, width=150, seed=3)
    else:
        kp = dense_key_positions(qpos)
    out = mla_attention(q_lat, q_pe, cache, bt, sidx, kp, scale, dc)
    ref = mla_attention_ref(q_lat, q_pe, cache, bt, sidx, kp, scale, dc)
    assert out.dtype == torch.float32 and out.shape == (len(qpos), h, dc)
    assert torch.isfinite(out).all()
    c_max = cache[..., :dc].float().nan_to_num(0.0).abs().max().item()
    err = (out.double() - ref).abs().max().item()
    assert err <= 1e-5 * c_max, err
    if not sparse:
        dense = mla_attention_dense(q_lat, q_pe, cache, bt, sidx, qpos, scale, dc)
        assert torch.equal(dense, out)


def test_reference_is_sensitive():
    """Sanity of the tolerance: dropping one key (the last) moves outputs well beyond 1e-5."""
    lens = [130]
    cache, bt, _ = make_paged_cache(lens, 64, 80, torch.float32, seed=0)
    sidx, qpos = torch.tensor([0]), torch.tensor([129])
    q_lat, q_pe = make_q(1, 4, 64, 16, seed=1)
    kp = dense_key_positions(qpos)
    out = mla_attention(q_lat, q_pe, cache, bt, sidx, kp, 0.25, 64)
    kp_drop = kp.clone(); kp_drop[0, -1] = -1
    ref_drop = mla_attention_ref(q_lat, q_pe, cache, bt, sidx, kp_drop, 0.25, 64)
    assert (out.double() - ref_drop).abs().max().item() > 1e-3


# ----------------------------------------------------------------------------- invariance
@pytest.fixture(scope="module")
def inv_case():
    h, dc, dr = 4, 64, 16
    cache, bt, _ = make_paged_cache(SEQ_LENS, 64, dc + dr, torch.float32, seed=11)
    sidx, qpos = make_queries(SEQ_LENS, per_seq=6, seed=12)
    q_lat, q_pe = make_q(len(qpos), h, dc, dr, seed=13)
    kp = dense_key_positions(qpos)
    args = dict(softmax_scale=(dc + dr) ** -0.5, kv_lora_rank=dc)
    full = mla_attention(q_lat, q_pe, cache, bt, sidx, kp, **args)
    return dict(cache=cache, bt=bt, sidx=sidx, qpos=qpos, q_lat=q_lat, q_pe=q_pe, kp=kp, args=args, full=full)


def test_alone_vs_batch(inv_case):
    c = inv_case
    for i in [0, 3, len(c["qpos"]) // 2, len(c["qpos"]) - 1]:
        alone = mla_attention(c["q_lat"][i:i + 1], c["q_pe"][i:i + 1], c["cache"], c["bt"],
                              c["sidx"][i:i + 1], c["kp"][i:i + 1, : int(c["qpos"][i]) + 1], **c["args"])
        assert torch.equal(alone[0], c["full"][i])
    # Any permutation of the batch (a short query among long ones and vice versa).
    perm = torch.randperm(len(c["qpos"]), generator=torch.Generator().manual_seed(0))
    shuffled = mla_attention(c["q_lat"][perm], c["q_pe"][perm], c["cache"], c["bt"], c["sidx"][perm],
                             c["kp"][perm], **c["args"])
    assert torch.equal(shuffled, c["full"][perm])


@pytest.mark.parametrize("group", [1, 5, 1000])
def test_query_grouping(inv_case, monkeypatch, group):
    c = inv_case
    monkeypatch.setattr(mla_mod, "QUERY_GROUP", group)
    out = mla_attention(c["q_lat"], c["q_pe"], c["cache"], c["bt"], c["sidx"], c["kp"], **c["args"])
    assert torch.equal(out, c["full"])


def test_thread_count(inv_case):
    c = inv_case
    for threads in THREAD_COUNTS:
        with num_threads(threads):
            out = mla_attention(c["q_lat"], c["q_pe"], c["cache"], c["bt"], c["sidx"], c["kp"], **c["args"])
        assert torch.equal(out, c["full"]), threads


def test_physical_pages_do_not_matter(inv_case):
    c = inv_case
    cache2, bt2 = permute_pages(c["cache"], c["bt"], seed=5)
    out = mla_attention(c["q_lat"], c["q_pe"], cache2, bt2, c["sidx"], c["kp"], **c["args"])
    assert torch.equal(out, c["full"])


@pytest.mark.parametrize("extra", [1, 64, 129])
def test_trailing_padding_is_noop(inv_case, extra):
    c = inv_case
    kp = torch.cat([c["kp"], torch.full((c["kp"].shape[0], extra), -1, dtype=torch.int64)], dim=1)
    out = mla_attention(c["q_lat"], c["q_pe"], c["cache"], c["bt"], c["sidx"], kp, **c["args"])
    assert torch.equal(out, c["full"])


def test_dense_equals_sparse_with_full_selection(inv_case):
    """A top-k selection that keeps every position (t + 1 <= topk) gives the dense result bitwise."""
    c = inv_case
    topk = 320
    scores = torch.randn(len(c["qpos"]), int(c["qpos"].max()) + 1)
    sel = dsa_topk(scores, c["qpos"], topk)
    assert sel.shape[1] == topk
    sparse = mla_attention(c["q_lat"], c["q_pe"], c["cache"], c["bt"], c["sidx"], sel, **c["args"])
    dense = mla_attention_dense(c["q_lat"], c["q_pe"], c["cache"], c["bt"], c["sidx"], c["qpos"], **c["args"])
    assert torch.equal(sparse, c["full"]) and torch.equal(dense, c["full"])


def test_sparse_alone_vs_batch_and_foreign_sequences():
    """Sparse lists: same query alone, among other sequences' queries, and with another cache layout."""
    h, dc, dr = 16, 64, 16
    lens = [300, 5, 200, 77]
    cache, bt, _ = make_paged_cache(lens, 128, dc + dr, torch.bfloat16, seed=21)
    sidx, qpos = make_queries(lens, per_seq=3, seed=22)
    q_lat, q_pe = make_q(len(qpos), h, dc, dr, seed=23, dtype=torch.bfloat16)
    kp = sparse_key_positions(qpos, width=100, seed=24)
    args = dict(softmax_scale=0.1, kv_lora_rank=dc)
    full = mla_attention(q_lat, q_pe, cache, bt, sidx, kp, **args)
    for i in range(len(qpos)):
        alone = mla_attention(q_lat[i:i + 1], q_pe[i:i + 1], cache, bt, sidx[i:i + 1], kp[i:i + 1], **args)
        assert torch.equal(alone[0], full[i])
    # The sequence alone in its own cache/block table (other sequences absent entirely).
    i = int((sidx == 2).nonzero()[-1])
    own_cache, own_bt, _ = make_paged_cache([lens[2]], 128, dc + dr, torch.bfloat16, seed=99)
    # copy sequence 2's logical entries into the fresh layout
    for p in range(lens[2]):
        own_cache[own_bt[0, p // 128], p % 128] = cache[bt[2, p // 128], p % 128]
    alone = mla_attention(q_lat[i:i + 1], q_pe[i:i + 1], own_cache, own_bt, torch.tensor([0]), kp[i:i + 1], **args)
    assert torch.equal(alone[0], full[i])


def test_fully_masked_query_returns_zeros():
    cache, bt, _ = make_paged_cache([10], 64, 80, torch.float32, seed=0)
    q_lat, q_pe = make_q(2, 2, 64, 16, seed=1)
    kp = torch.tensor([[-1, -1], [0, -1]])
    out = mla_attention(q_lat, q_pe, cache, bt, torch.tensor([0, 0]), kp, 0.1, 64)
    assert torch.equal(out[0], torch.zeros(2, 64))
    # a single key: softmax weight exactly 1, output exactly that latent
    assert torch.equal(out[1], cache[bt[0, 0], 0, :64].expand(2, 64))


# ----------------------------------------------------------------------------- gradients
@pytest.mark.parametrize("sparse", [False, True])
def test_gradcheck_float64(sparse):
    """float64 gradcheck w.r.t. q_lat, q_pe and the cache; 70..80 keys so two key blocks are merged.

    Full Jacobian check for the queries; for the cache (hundreds of entries, one forward each under
    the full check) gradcheck's fast mode, which compares v^T J u for random u, v over every entry.
    test_fp32_grad_matches_reference_autograd compares the full cache gradient elementwise.
    """
    h, dc, dr, ps = 2, 4, 2, 64
    lens = [80, 3]
    cache, bt, _ = make_paged_cache(lens, ps, dc + dr, torch.float64, seed=31, extra_pages=0)
    cache = cache.nan_to_num(0.0)  # finite differences perturb every slot
    sidx = torch.tensor([0, 1, 0])
    qpos = torch.tensor([79, 2, 66])
    kp = sparse_key_positions(qpos, width=76, seed=3, keep=0.9) if sparse else dense_key_positions(qpos)
    assert int((kp[0] >= 0).sum()) > 64
    q_lat, q_pe = make_q(3, h, dc, dr, seed=32, dtype=torch.float64, amp=1.0)
    q_lat.requires_grad_(); q_pe.requires_grad_(); cache.requires_grad_()

    def f(a, b, c):
        return mla_attention(a, b, c, bt, sidx, kp, 0.7, dc)

    assert torch.autograd.gradcheck(lambda a, b: f(a, b, cache.detach()), (q_lat, q_pe),
                                    eps=1e-6, atol=1e-7, rtol=1e-5)
    assert torch.autograd.gradcheck(f, (q_lat, q_pe, cache), eps=1e-6, atol=1e-7, rtol=1e-5,
                                    fast_mode=True)


def test_fp32_grad_matches_reference_autograd():
    """The fp32 backward agrees with autograd through the float64 reference (relative 1e-4)."""
    h, dc, dr = 4, 64, 16
    lens = [150, 40]
    cache, bt, _ = make_paged_cache(lens, 64, dc + dr, torch.float32, seed=41)
    cache = cache.nan_to_num(0.0)
    sidx, qpos = make_queries(lens, per_seq=3, seed=42)
    q_lat, q_pe = make_q(len(qpos), h, dc, dr, seed=43)
    kp = dense_key_positions(qpos)
    g = torch.randn(len(qpos), h, dc, generator=torch.Generator().manual_seed(44))

    def grads(fn, dtype):
        xs = [t.detach().to(dtype).requires_grad_() for t in (q_lat, q_pe, cache)]
        out = fn(*xs, bt, sidx, kp, 0.11, dc)
        out.backward(g.to(out.dtype))
        return [x.grad.double() for x in xs]

    got = grads(mla_attention, torch.float32)
    want = grads(mla_attention_ref, torch.float64)
    for a, b in zip(got, want):
        # fp32 forward/backward rounding (~1e-6 relative per op, a few hundred terms) vs a gradient
        # norm of O(1): 1e-4 of the max gradient leaves a wide margin while a wrong term (e.g. a
        # missing alpha rescale) shows up at O(1e-1).
        assert (a - b).abs().max() <= 1e-4 * b.abs().max()


def test_page_size_does_not_matter():
    """The key blocks follow the key list, not the pages: page size 64, 128 or one page per
    sequence (e.g. a trainer's padded layout) give the same bits."""
    h, dc, dr = 4, 64, 16
    sidx, qpos = make_queries(SEQ_LENS, per_seq=3, seed=51)
    q_lat, q_pe = make_q(len(qpos), h, dc, dr, seed=52)
    kp = sparse_key_positions(qpos, width=90, seed=53)
    outs = []
    for ps in (64, 128, 320):
        cache, bt, _ = make_paged_cache(SEQ_LENS, ps, dc + dr, torch.float32, seed=50)  # same content
        outs.append(mla_attention(q_lat, q_pe, cache, bt, sidx, kp, 0.1, dc))
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
