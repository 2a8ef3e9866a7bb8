"""Triton ``mla_attention`` (sparse key lists) and ``mla_attention_dense`` (causal): float64 references,
the bitwise contract on the GPU, FP8 latents, gradients, and the "fast" (SDPA) backend.

The invariance tests are the point (docs/numerics.md, MLA attention): a query's output must be the same
bits alone or inside any batch (any size, order, other sequences), for any page layout and page size,
in the sparse kernel with the full key list 0..t and in the dense kernel, and whether the launch had
one split (a short decode batch: the output is written directly) or several (a long query elsewhere
in the batch: partials + combine). Under TRITON_INTERPRET=1 the split size is lowered to 128 keys so
the split/combine path runs on tiny contexts; on CUDA the real split size runs on contexts up to 32K
at the bench shapes (64 heads, kv_lora 512, rope 64, bf16 cache).
"""
from __future__ import annotations

import pytest
import torch

from tests.kernels.test_mla_attention import (
    make_paged_cache,
    make_q,
    make_queries,
    permute_pages,
    sparse_key_positions,
)
from zmrl.kernels_batch_invariant import current_numerics, kernel_mode, numerics_scope
from zmrl.kernels_batch_invariant.dsa_indexer import dsa_topk
from zmrl.kernels_batch_invariant.fp8 import fake_quant_fp8
from zmrl.kernels_batch_invariant.mla_attention import (
    KEY_BLOCK,
    dense_key_positions,
    mla_attention,
    mla_attention_dense,
    mla_attention_ref,
)
from zmrl.kernels_batch_invariant.triton import triton_impl
from tests.kernels.triton.gemm_launches import count_launches

pytestmark = [pytest.mark.gpu, pytest.mark.triton]

SEQ_LENS = [1, 63, 64, 65, 130, 300]


@pytest.fixture(autouse=True, params=["heads", "keys"])
def mma_rows(request):
    """Every test under both forms of the split kernel (Numerics.mla_mma_rows): each must keep the contract
    and the float64 bounds on its own."""
    with numerics_scope(current_numerics().replace(mla_mma_rows=request.param)):
        yield request.param


@pytest.fixture(autouse=True)
def small_split(interpret, monkeypatch):
    """Under the interpreter contexts are tiny: lower the split size so several splits (and the
    combine kernel) run. On CUDA the real SPLIT_KEYS is tested."""
    if interpret:
        from zmrl.kernels_batch_invariant.triton import mla_attention as tmla
        monkeypatch.setattr(tmla, "SPLIT_KEYS", 128)


def _split_keys() -> int:
    from zmrl.kernels_batch_invariant.triton import mla_attention as tmla
    return tmla.SPLIT_KEYS


def sparse(*args, **kwargs):
    return triton_impl(mla_attention)(*args, **kwargs)


def dense(*args, **kwargs):
    return triton_impl(mla_attention_dense)(*args, **kwargs)


def to(device, *ts):
    return tuple(t.to(device) for t in ts)


def case(lens, h, dc, dr, page_size, dtype, device, seed=0, per_seq=3, q_dtype=torch.float32, fp8=False):
    """Paged cache (NaN in unused slots) + queries on ``device``. With fp8, the c_kv part holds the
    quantise->dequantise values the FP8 latent format gives (the cache keeps them in ``dtype``)."""
    cache, bt, _ = make_paged_cache(lens, page_size, dc + dr, torch.float32, seed=seed)
    if fp8:
        c = cache[..., :dc]
        fin = torch.isfinite(c).all(dim=-1, keepdim=True)
        cache[..., :dc] = torch.where(fin, fake_quant_fp8(c.nan_to_num(0.0), block=min(128, dc)), c)
    cache = cache.to(dtype)
    sidx, qpos = make_queries(lens, per_seq=per_seq, seed=seed + 1)
    q_lat, q_pe = make_q(len(qpos), h, dc, dr, seed=seed + 2, dtype=q_dtype)
    cache, bt, sidx, qpos, q_lat, q_pe = to(device, cache, bt, sidx, qpos, q_lat, q_pe)
    return cache, bt, sidx, qpos, q_lat, q_pe


def tolerance(cache_dtype: torch.dtype, device: torch.device) -> float:
    """Elementwise |o - o_ref| bound as a fraction of max|c_kv| (o is a convex combination of c_kv rows).

    fp32 dots (every cache under the interpreter; on CUDA, fp32 caches use tf32x3 with about fp32
    accuracy, bound 2e-5): as the CPU backend's test, each
    score is a <= 576-term fp32 dot (~1e-6 absolute), exp and the rescaling add a few ulp, a score
    error d moves o by <= 2 d max|c|: measured ~1e-6, bound 1e-5.
    bf16 caches on CUDA: q and p enter the MMAs as bf16 hi + lo pairs, i.e. with ~16 significant bits
    (relative 2^-17 ~ 7.6e-6 per operand, keys exact). A float64 emulation at the bench shapes (64
    heads, 576 dims, 4096 keys, |q| ~ 1..4) gives score errors <= 8e-5 and o errors <= 1e-5 max|c|;
    bound 1e-4. (A dropped key or a wrong merge is O(1e-2) or more.)
    """
    if cache_dtype == torch.bfloat16 and device.type == "cuda":
        return 1e-4
    if device.type == "cuda":  # fp32/fp16 caches: tf32x3 dots drop the lo*lo term (2^-22 relative)
        return 2e-5
    return 1e-5


def check_ref(out, q_lat, q_pe, cache, bt, sidx, kp, scale, dc):
    ref = mla_attention_ref(q_lat.cpu(), q_pe.cpu(), cache.cpu(), bt.cpu(), sidx.cpu(), kp.cpu(), scale, dc)
    assert out.dtype == torch.float32 and out.shape == ref.shape
    assert torch.isfinite(out).all()
    c_max = cache[..., :dc].float().nan_to_num(0.0).abs().max().item()
    err = (out.cpu().double() - ref).abs().max().item()
    assert err <= tolerance(cache.dtype, out.device) * c_max, (err, c_max)


# ----------------------------------------------------------------------------- float64 references
def ref_shapes(interpret: bool):
    shapes = [
        # (h, dc, dr, page_size, cache dtype)
        (4, 64, 16, 64, torch.float32),      # tiny preset
        (4, 64, 16, 128, torch.bfloat16),
        (20, 32, 16, 64, torch.float32),     # two head groups, the second partial
        (3, 48, 8, 64, torch.float32),       # non-power-of-two latent and rope dims (padded tiles)
        (2, 200, 32, 64, torch.float32),     # latent in 4 column chunks (as Dc = 512), padded to 256
    ]
    if not interpret:
        shapes += [(64, 512, 64, 64, torch.bfloat16), (64, 512, 64, 128, torch.float32),
                   (16, 512, 64, 256, torch.bfloat16)]
    return shapes


@pytest.mark.parametrize("kind", ["dense", "sparse"])
@pytest.mark.parametrize("shape_idx", range(8))
def test_matches_float64_reference(device, interpret, kind, shape_idx):
    shapes = ref_shapes(interpret)
    if shape_idx >= len(shapes):
        pytest.skip("CUDA-only shape")
    h, dc, dr, ps, dtype = shapes[shape_idx]
    cache, bt, sidx, qpos, q_lat, q_pe = case(SEQ_LENS, h, dc, dr, ps, dtype, device, seed=shape_idx,
                                              per_seq=1 if interpret else 4)
    scale = (dc + dr) ** -0.5 * 2.0
    if kind == "sparse":
        kp = sparse_key_positions(qpos.cpu(), width=150, seed=3).to(device)
        out = sparse(q_lat, q_pe, cache, bt, sidx, kp, scale, dc)
    else:
        kp = dense_key_positions(qpos)
        out = dense(q_lat, q_pe, cache, bt, sidx, qpos, scale, dc)
        assert torch.equal(out, sparse(q_lat, q_pe, cache, bt, sidx, kp, scale, dc))
    check_ref(out, q_lat, q_pe, cache, bt, sidx, kp, scale, dc)


def test_fp8_latents(device, interpret):
    """FP8 latent format: the cache holds dequantised FP8 values in the model dtype (the engine and the
    trainer's fake-quant agree on them); the kernel reads them like any cache."""
    h, dc, dr = 4, 64, 16
    for dtype in (torch.float32, torch.bfloat16):
        cache, bt, sidx, qpos, q_lat, q_pe = case(SEQ_LENS, h, dc, dr, 64, dtype, device, seed=7, fp8=True,
                                                  per_seq=1 if interpret else 4)
        kp = dense_key_positions(qpos)
        out = dense(q_lat, q_pe, cache, bt, sidx, qpos, 0.2, dc)
        check_ref(out, q_lat, q_pe, cache, bt, sidx, kp, 0.2, dc)
        assert torch.equal(out, sparse(q_lat, q_pe, cache, bt, sidx, kp, 0.2, dc))


def test_edge_cases(device, interpret):
    """A query without keys returns zeros; a single key gives exactly that latent (weight 1)."""
    cache, bt, _ = make_paged_cache([10], 64, 80, torch.float32, seed=0)
    q_lat, q_pe = make_q(2, 2, 64, 16, seed=1)
    kp = torch.tensor([[-1, -1], [0, -1]])
    cache, bt, q_lat, q_pe, kp = to(device, cache, bt, q_lat, q_pe, kp)
    out = sparse(q_lat, q_pe, cache, bt, torch.tensor([0, 0], device=device), kp, 0.1, 64)
    assert torch.equal(out[0], torch.zeros(2, 64, device=device))
    # Weight exactly 1 on one fp32 latent. The fp32-cache kernel multiplies p @ c_kv with tf32x3 dots,
    # which keep about 21 of fp32's 24 significant bits (the lo*lo term is dropped): the H200 gives the
    # latent to within 2^-20 relative, not bitwise (measured 2026-11-29). A wrong weight or a wrong
    # key would be off by O(1).
    want = cache[bt[0, 0], 0, :64].expand(2, 64)
    if interpret:
        assert torch.equal(out[1], want)
    else:
        torch.testing.assert_close(out[1], want, rtol=2.0**-20, atol=0.0)
    empty = sparse(q_lat[:0], q_pe[:0], cache, bt, torch.zeros(0, dtype=torch.int64, device=device),
                   kp[:0], 0.1, 64)
    assert empty.shape == (0, 2, 64)


# ----------------------------------------------------------------------------- invariance
@pytest.fixture(scope="module")
def inv(device, interpret):
    """Queries of several sequences, some needing several splits (decode rows and prefill rows)."""
    split = 128 if interpret else 1024
    # (the interpreter runs one Python program at a time: few queries, one head group)
    lens = [1, 70, split + 22, split, 2 * split + 64] if interpret else [1, 70, 3000, 1024, 4100]
    h, dc, dr = (4, 32, 16) if interpret else (64, 512, 64)
    dtype = torch.float32 if interpret else torch.bfloat16
    cache, bt, sidx, qpos, q_lat, q_pe = case(lens, h, dc, dr, 64, dtype, device, seed=11,
                                              per_seq=1 if interpret else 3)
    scale = (dc + dr) ** -0.5
    return dict(cache=cache, bt=bt, sidx=sidx, qpos=qpos, q_lat=q_lat, q_pe=q_pe, scale=scale, dc=dc,
                lens=lens, split=split)


def _rows(c, idx, **over):
    d = dict(c, **over)
    return (d["q_lat"][idx], d["q_pe"][idx], d["cache"], d["bt"], d["sidx"][idx])


def test_dense_alone_vs_batch(inv, small_split):
    """Every query alone (a decode step: one query, possibly a single-split launch) equals its row in
    the full batch (multi-split launch) and in shuffled sub-batches of several sizes."""
    c = inv
    assert _split_keys() == c["split"]
    n = len(c["qpos"])
    full = dense(*_rows(c, slice(None)), c["qpos"], c["scale"], c["dc"])
    for i in range(n):
        alone = dense(*_rows(c, slice(i, i + 1)), c["qpos"][i:i + 1], c["scale"], c["dc"])
        assert torch.equal(alone[0], full[i]), f"query {i} (pos {int(c['qpos'][i])}) alone != in batch"
    g = torch.Generator().manual_seed(0)
    for b in (2, 5, n):
        idx = torch.randperm(n, generator=g)[:b].to(c["qpos"].device)
        out = dense(*_rows(c, idx), c["qpos"][idx], c["scale"], c["dc"])
        assert torch.equal(out, full[idx])


def test_decode_equals_prefill(inv, small_split):
    """A sequence's last token decoded alone equals the same token inside the whole-sequence prefill
    (every position 0..T-1 of that sequence in one call)."""
    c = inv
    n = 2  # the longest-but-one sequence: several splits
    t = c["lens"][n]
    dev = c["qpos"].device
    qpos = torch.arange(t, device=dev)
    sidx = torch.full((t,), n, dtype=torch.int64, device=dev)
    q_lat, q_pe = make_q(t, c["q_lat"].shape[1], c["dc"], c["q_pe"].shape[2], seed=5)
    q_lat, q_pe = q_lat.to(dev), q_pe.to(dev)
    prefill = dense(q_lat, q_pe, c["cache"], c["bt"], sidx, qpos, c["scale"], c["dc"])
    for p in (0, 63, 64, c["split"] - 1, c["split"], t - 1):
        dec = dense(q_lat[p:p + 1], q_pe[p:p + 1], c["cache"], c["bt"], sidx[p:p + 1], qpos[p:p + 1],
                    c["scale"], c["dc"])
        assert torch.equal(dec[0], prefill[p]), f"position {p}"


def test_sparse_full_list_equals_dense(inv, small_split):
    """The sparse kernel over the key list 0..t (from dsa_topk with topk >= t + 1, padded with -1 to
    any width) gives the dense kernel's bits."""
    c = inv
    d = dense(*_rows(c, slice(None)), c["qpos"], c["scale"], c["dc"])
    width = int(c["qpos"].max()) + 1
    for extra in (0, c["split"] + 3):
        kp = dense_key_positions(c["qpos"], width + extra)
        s = sparse(*_rows(c, slice(None)), kp, c["scale"], c["dc"])
        assert torch.equal(s, d), f"extra padding {extra}"
    scores = torch.randn(len(c["qpos"]), width, device=c["qpos"].device)
    sel = dsa_topk(scores, c["qpos"], width)
    assert torch.equal(sparse(*_rows(c, slice(None)), sel, c["scale"], c["dc"]), d)


def test_sparse_alone_vs_batch(inv, small_split):
    """Random sparse lists: each query alone (its list trimmed to its own length, hence possibly a
    one-split launch) equals its row of the batch; order does not matter."""
    c = inv
    width = 2 * c["split"] + 40
    kp = sparse_key_positions(c["qpos"].cpu(), width=width, seed=4, keep=0.7).to(c["qpos"].device)
    full = sparse(*_rows(c, slice(None)), kp, c["scale"], c["dc"])
    for i in range(len(c["qpos"])):
        n_valid = int((kp[i] >= 0).sum())
        alone = sparse(*_rows(c, slice(i, i + 1)), kp[i:i + 1, :max(n_valid, 1)], c["scale"], c["dc"])
        assert torch.equal(alone[0], full[i]), f"query {i}"
    perm = torch.randperm(len(c["qpos"]), generator=torch.Generator().manual_seed(1)).to(kp.device)
    assert torch.equal(sparse(*_rows(c, perm), kp[perm], c["scale"], c["dc"]), full[perm])


def test_fused_combine_equals_the_combine_launch(inv, small_split, monkeypatch):
    """The splits combined by their last program in the split kernel's launch (FUSED_COMBINE) give the bits of the
    separate combine launch, dense and sparse, the launch repeated gives them again (the arrival counters are
    left at zero for the next launch), and a launch without counters (as inside a first CUDA-graph capture)
    takes the separate combine."""
    from zmrl.kernels_batch_invariant.triton import _common
    from zmrl.kernels_batch_invariant.triton import mla_attention as tmla
    c = inv
    assert int(c["qpos"].max()) + 1 > _split_keys(), "the case must need several splits"
    width = 2 * c["split"] + 40
    kp = sparse_key_positions(c["qpos"].cpu(), width=width, seed=9, keep=0.8).to(c["qpos"].device)

    def both():
        return (dense(*_rows(c, slice(None)), c["qpos"], c["scale"], c["dc"]),
                sparse(*_rows(c, slice(None)), kp, c["scale"], c["dc"]))

    combines = count_launches(monkeypatch, tmla, "_mla_combine_kernel")
    monkeypatch.setattr(tmla, "FUSED_COMBINE", False)
    separate = both()
    assert len(combines) >= 2, "the case must take the combine launch (several splits, dense and sparse)"
    monkeypatch.setattr(tmla, "FUSED_COMBINE", True)
    combines.clear()
    fused, again = both(), both()
    assert not combines, "the fused path fell back to the combine launch"
    for name, a, b, r in zip(("dense", "sparse"), fused, again, separate):
        assert torch.equal(a, r), f"{name}: the fused combine differs from the combine launch"
        assert torch.equal(a, b), f"{name}: a repeated launch differs"
    assert all(int(buf.abs().sum()) == 0 for buf, _ in _common._COUNTERS.values()), "arrival counters left non-zero"
    monkeypatch.setattr(tmla, "arrival_counters", lambda device, n: None)
    for a, b in zip(both(), separate):
        assert torch.equal(a, b)
    assert combines, "without counters the combine must be its own launch"


def test_slot_list_equals_the_block_table_walk(inv, monkeypatch):
    """The key lists turned into cache slots before the launch (SLOT_LIST: one load per block in the key loop)
    give the bits of the kernel that looks up each entry's page itself, on permuted pages and with -1 holes;
    ``key_slots`` gives the slots the block table says (-1 for -1)."""
    from zmrl.kernels_batch_invariant.triton import mla_attention as tmla
    c = inv
    cache, bt = permute_pages(c["cache"].cpu(), c["bt"].cpu(), seed=7)
    cache, bt = cache.to(c["cache"].device), bt.to(c["bt"].device)
    width = 2 * c["split"] + 40
    kp = sparse_key_positions(c["qpos"].cpu(), width=width, seed=12, keep=0.6).to(c["qpos"].device)
    args = (c["q_lat"], c["q_pe"], cache, bt, c["sidx"], kp, c["scale"], c["dc"])
    calls = count_launches(monkeypatch, tmla, "_key_slots_kernel")
    monkeypatch.setattr(tmla, "SLOT_LIST", False)
    walk = sparse(*args)
    assert not calls
    monkeypatch.setattr(tmla, "SLOT_LIST", True)
    assert torch.equal(sparse(*args), walk)
    assert calls, "SLOT_LIST must take the slot-list path"
    page_size = cache.shape[1]
    slots = tmla.key_slots(kp, bt, c["sidx"], page_size)
    pos = kp.clamp(min=0)
    want = bt[c["sidx"].unsqueeze(1), pos // page_size] * page_size + pos % page_size
    assert slots.dtype == torch.int32
    assert torch.equal(slots.long(), torch.where(kp >= 0, want, -1))


def test_sparse_hole_blocks_are_no_ops(inv, interpret, monkeypatch):
    """A whole block of -1 entries inside a split (before or between valid blocks; trailing ones are never
    visited) changes no bit: the kernel runs it (its loop has no branch) as an exact no-op (alpha = 1, p = 0)."""
    c = inv
    if interpret:  # three blocks in one split (the other tests' 128-key split holds two)
        from zmrl.kernels_batch_invariant.triton import mla_attention as tmla
        monkeypatch.setattr(tmla, "SPLIT_KEYS", 4 * KEY_BLOCK)
    rows = (c["qpos"] + 1 >= 2 * KEY_BLOCK).nonzero().flatten()[:2]
    assert len(rows) > 0
    kp = dense_key_positions(c["qpos"][rows], 2 * KEY_BLOCK)
    a, b = kp[:, :KEY_BLOCK], kp[:, KEY_BLOCK:]
    hole = torch.full_like(a, -1)
    want_a = sparse(*_rows(c, rows), a, c["scale"], c["dc"])
    assert torch.equal(sparse(*_rows(c, rows), torch.cat([hole, a], 1), c["scale"], c["dc"]), want_a)
    assert torch.equal(sparse(*_rows(c, rows), torch.cat([a, hole], 1), c["scale"], c["dc"]), want_a)
    # a hole between two valid blocks (the maximum already finite: alpha must be exactly 1), all in one split
    want_ab = sparse(*_rows(c, rows), torch.cat([a, b], 1), c["scale"], c["dc"])
    assert torch.equal(sparse(*_rows(c, rows), torch.cat([a, hole, b], 1), c["scale"], c["dc"]), want_ab)
    assert torch.equal(sparse(*_rows(c, rows), torch.cat([hole, a, hole, b], 1), c["scale"], c["dc"]), want_ab)


@pytest.fixture
def bf16_operands():
    """The contract's MLA operands as bf16 (Numerics.mla_operands), on top of the form the autouse fixture set."""
    with numerics_scope(current_numerics().replace(mla_operands="bf16")):
        yield


def test_bf16_operands_round_q_and_p(inv, interpret, bf16_operands):
    """mla_operands = "bf16": q and p enter their products rounded to bf16 once (one MMA each on a bf16 cache), the
    keys as they are. So the output is the float64 attention of bf16(q) up to p's rounding: each weight p_j is off
    by at most one bf16 rounding (2^-8 relative, round to nearest; 2^-7 under the interpreter, which truncates) and
    o = sum_j p_j c_j / l (l from the unrounded p), so o moves by at most that times max|c|, plus the fp32 error of
    the kernel (tolerance()). Whether q and p were rounded at all is asserted bitwise below."""
    c = inv
    width = 2 * c["split"] + 40
    kp = sparse_key_positions(c["qpos"].cpu(), width=width, seed=13, keep=0.7).to(c["qpos"].device)
    args = (c["cache"], c["bt"], c["sidx"], kp, c["scale"], c["dc"])
    out = sparse(c["q_lat"], c["q_pe"], *args)
    q_lat_b, q_pe_b = (t.to(torch.bfloat16).to(torch.float32) for t in (c["q_lat"], c["q_pe"]))
    ref = mla_attention_ref(q_lat_b.cpu(), q_pe_b.cpu(), *(t.cpu() if torch.is_tensor(t) else t for t in args))
    c_max = c["cache"][..., :c["dc"]].float().nan_to_num(0.0).abs().max().item()
    err = (out.cpu().double() - ref).abs().max().item()
    bf16_rounding = 2.0**-7 if interpret else 2.0**-8
    assert err <= (bf16_rounding + tolerance(c["cache"].dtype, out.device)) * c_max, (err, c_max)
    with numerics_scope(current_numerics().replace(mla_operands="hi_lo")):
        hi_lo = sparse(c["q_lat"], c["q_pe"], *args)
        hi_lo_of_bf16_q = sparse(q_lat_b, q_pe_b, *args)
    assert not torch.equal(out, hi_lo), "mla_operands='bf16' changed nothing"
    # already-bf16 queries: the rounding of q is the identity (the same bits as rounding them in the kernel), so
    # only p's rounding separates the two operand modes
    assert torch.equal(sparse(q_lat_b, q_pe_b, *args), out)
    assert not torch.equal(out, hi_lo_of_bf16_q), "p was not rounded to bf16"


@pytest.mark.parametrize("test", [test_dense_alone_vs_batch, test_decode_equals_prefill, test_sparse_alone_vs_batch,
                                  test_sparse_full_list_equals_dense])
def test_bf16_operands_keep_the_contract(inv, small_split, bf16_operands, test):
    """The invariance tests above under mla_operands = "bf16": a query's bits depend on its q, its list and the
    keys alone, whatever the batch, the splits or the dense / sparse path."""
    test(inv, small_split)


def test_page_layout_and_size(device, interpret):
    """Physical pages (a permutation) and the page size (64, 128, one page per sequence) do not
    change a bit: blocks follow positions / list entries, not pages."""
    h, dc, dr = (4, 64, 16) if interpret else (64, 512, 64)
    dtype = torch.float32 if interpret else torch.bfloat16
    lens = SEQ_LENS if interpret else [1, 700, 2100, 5000]
    sidx, qpos = make_queries(lens, per_seq=1 if interpret else 3, seed=51)
    q_lat, q_pe = make_q(len(qpos), h, dc, dr, seed=52)
    sidx, qpos, q_lat, q_pe = to(device, sidx, qpos, q_lat, q_pe)
    kp = sparse_key_positions(qpos.cpu(), width=90 if interpret else 2048, seed=53).to(device)
    outs_d, outs_s = [], []
    for ps in ((64, max(lens)) if interpret else (64, 128, max(lens))):
        cache, bt, _ = make_paged_cache(lens, ps, dc + dr, dtype, seed=50)  # same logical content
        for variant in range(2):
            if variant:
                cache, bt = permute_pages(cache, bt, seed=ps)
            cache_d, bt_d = cache.to(device), bt.to(device)
            outs_d.append(dense(q_lat, q_pe, cache_d, bt_d, sidx, qpos, 0.1, dc))
            outs_s.append(sparse(q_lat, q_pe, cache_d, bt_d, sidx, kp, 0.1, dc))
    for o in outs_d[1:]:
        assert torch.equal(o, outs_d[0])
    for o in outs_s[1:]:
        assert torch.equal(o, outs_s[0])


# ----------------------------------------------------------------------------- gradients
@pytest.mark.parametrize("kind", ["dense", "sparse"])
def test_grads_match_float64_reference(device, kind):
    """Gradients w.r.t. q_lat, q_pe and the cache (the trainer differentiates all three) against
    autograd through the float64 reference. The backward is fp32 torch (exact softmax recompute):
    fp32 rounding (~1e-6 relative per op, a few hundred terms) against O(1) gradients; 1e-4 of the
    max gradient leaves margin while a wrong term (a missing rescale, a dropped key) is O(1e-1).
    Two backward passes must give the same bits (the cache gradient lands on unique slots).
    The bound is for IEEE fp32 GEMMs; on CUDA the trainer's default runs them at TF32 (2^-11 per
    product), so this test asks for "ieee" to check the math, not the TF32 rounding."""
    with numerics_scope(current_numerics().replace(backward_matmul_precision="ieee")):
        _check_grads_match_float64_reference(device, kind)


def _check_grads_match_float64_reference(device, kind):
    h, dc, dr = 4, 64, 16
    lens = [150, 40]
    cache, bt, _ = make_paged_cache(lens, 64, dc + dr, torch.float32, seed=41)
    cache = cache.nan_to_num(0.0)
    sidx, qpos = make_queries(lens, per_seq=3, seed=42)
    q_lat, q_pe = make_q(len(qpos), h, dc, dr, seed=43)
    kp = (sparse_key_positions(qpos, width=100, seed=44, keep=0.8) if kind == "sparse"
          else dense_key_positions(qpos))
    g = torch.randn(len(qpos), h, dc, generator=torch.Generator().manual_seed(44))

    def grads(fn, dtype, dev, last):
        xs = [t.detach().to(dtype=dtype, device=dev).requires_grad_() for t in (q_lat, q_pe, cache)]
        out = fn(*xs, bt.to(dev), sidx.to(dev), last.to(dev), 0.11, dc)
        out.backward(g.to(device=dev, dtype=out.dtype))
        return out, [x.grad.double().cpu() for x in xs]

    fn, last = (sparse, kp) if kind == "sparse" else (dense, qpos)
    out, got = grads(fn, torch.float32, device, last)
    _, want = grads(mla_attention_ref, torch.float64, "cpu", kp)
    # The forward under autograd is the kernel's (same bits as without autograd).
    with torch.no_grad():
        plain = fn(q_lat.to(device), q_pe.to(device), cache.to(device), bt.to(device), sidx.to(device),
                   last.to(device), 0.11, dc)
    assert torch.equal(out.detach(), plain)
    for name, a, b in zip(("q_lat", "q_pe", "kv_cache"), got, want):
        assert (a - b).abs().max() <= 1e-4 * b.abs().max(), name
    _, again = grads(fn, torch.float32, device, last)
    assert all(torch.equal(a, b) for a, b in zip(got, again)), "backward is not deterministic"


# ----------------------------------------------------------------------------- bench shapes (CUDA)
def test_bench_decode_32k(device, interpret):
    """Bench MLA (64 heads, kv_lora 512, rope 64, bf16 cache, page 64): decode at 32K context alone
    and in a batch with shorter requests; sparse top-2048 lists over 32K; float64 reference."""
    if interpret:
        pytest.skip("bench shapes only on CUDA")
    h, dc, dr = 64, 512, 64
    lens = [32768, 5000, 300, 17]
    cache, bt, _ = make_paged_cache(lens, 64, dc + dr, torch.bfloat16, seed=61, extra_pages=1)
    sidx = torch.tensor([0, 0, 1, 2, 3, 0])
    qpos = torch.tensor([32767, 20000, 4999, 299, 16, 1023])
    q_lat, q_pe = make_q(len(qpos), h, dc, dr, seed=62)
    cache, bt, sidx, qpos, q_lat, q_pe = to(device, cache, bt, sidx, qpos, q_lat, q_pe)
    scale = 192 ** -0.5
    full = dense(q_lat, q_pe, cache, bt, sidx, qpos, scale, dc)
    for i in range(len(qpos)):
        alone = dense(q_lat[i:i + 1], q_pe[i:i + 1], cache, bt, sidx[i:i + 1], qpos[i:i + 1], scale, dc)
        assert torch.equal(alone[0], full[i])
    for i in (0, 3):
        kp_i = dense_key_positions(qpos[i:i + 1])
        check_ref(full[i:i + 1], q_lat[i:i + 1], q_pe[i:i + 1], cache, bt, sidx[i:i + 1], kp_i, scale, dc)
    # sparse top-2048 over the 32K context
    g = torch.Generator().manual_seed(63)
    rows = []
    for t in qpos.tolist():
        n = min(2048, t + 1)
        sel = torch.sort(torch.randperm(t + 1, generator=g)[:n]).values
        rows.append(torch.cat([sel, torch.full((2048 - n,), -1, dtype=torch.int64)]))
    kp = torch.stack(rows).to(device)
    sp = sparse(q_lat, q_pe, cache, bt, sidx, kp, scale, dc)
    for i in range(len(qpos)):
        alone = sparse(q_lat[i:i + 1], q_pe[i:i + 1], cache, bt, sidx[i:i + 1], kp[i:i + 1], scale, dc)
        assert torch.equal(alone[0], sp[i])
    check_ref(sp[:2], q_lat[:2], q_pe[:2], cache, bt, sidx[:2], kp[:2], scale, dc)
    # queries 4 (pos 16) and 5 (pos 1023 < 2048) select every position: the dense bits
    assert torch.equal(sp[4:], full[4:])


# ----------------------------------------------------------------------------- fast backend
# The two tests below never run the split kernel: one form of ``mma_rows`` (indirect: overrides its params).
@pytest.mark.parametrize("mma_rows", ["heads"], indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fast_backend(device, dtype):
    """Stock SDPA over gathered keys: close to float64 (not invariant). bf16 caches run SDPA in bf16
    (q rounded to bf16: relative 2^-9 on scores of size ~10 -> ~1e-2 of max|c|); fp32: 1e-4."""
    h, dc, dr = 4, 64, 16
    cache, bt, sidx, qpos, q_lat, q_pe = case(SEQ_LENS, h, dc, dr, 64, dtype, device, seed=71)
    kp_dense = dense_key_positions(qpos)
    kp_sparse = sparse_key_positions(qpos.cpu(), width=150, seed=72).to(device)
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-4
    c_max = cache[..., :dc].float().nan_to_num(0.0).abs().max().item()
    with kernel_mode("fast"):
        od = mla_attention_dense(q_lat, q_pe, cache, bt, sidx, qpos, 0.2, dc)
        osp = mla_attention(q_lat, q_pe, cache, bt, sidx, kp_sparse, 0.2, dc)
    for out, kp in ((od, kp_dense), (osp, kp_sparse)):
        ref = mla_attention_ref(q_lat.cpu(), q_pe.cpu(), cache.cpu(), bt.cpu(), sidx.cpu(), kp.cpu(), 0.2, dc)
        assert out.dtype == torch.float32
        assert (out.cpu().double() - ref).abs().max().item() <= tol * c_max


@pytest.mark.parametrize("mma_rows", ["heads"], indirect=True)
def test_split_query_equals_the_torch_roundings(device, interpret):
    """The fused query split (bf16 hi / lo halves of [q_lat | q_pe] in fp32) is bitwise the torch composition
    it replaced, on strided views like the model's (q_lat is a transposed GEMM output, q_pe a column slice)."""
    if interpret:
        pytest.skip("Triton's interpreter truncates fp32 -> bf16 (the GPU rounds to nearest even, as torch does)")
    from zmrl.kernels_batch_invariant.triton.mla_attention import split_query

    g = torch.Generator().manual_seed(0)
    t, h, dc, dr = 37, 8, 40, 16
    base = (torch.randn(h, t, dc, generator=g) * torch.logspace(-6, 6, dc)).to(device)
    q_lat = base.transpose(0, 1)  # [T, H, Dc], not contiguous
    q_full = torch.randn(t, h, 24 + dr, generator=g).to(device)
    for q_pe in (q_full[..., 24:], q_full[..., 24:].to(torch.bfloat16), q_full[..., 24:].contiguous()):
        hi, lo = split_query(q_lat, q_pe)
        q = torch.cat([q_lat.to(torch.float32), q_pe.to(torch.float32)], dim=-1)
        want_hi = q.to(torch.bfloat16)
        want_lo = (q - want_hi.to(torch.float32)).to(torch.bfloat16)
        assert hi.is_contiguous() and torch.equal(hi, want_hi) and torch.equal(lo, want_lo)
