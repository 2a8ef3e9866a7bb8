"""Static key width (``kv_len``) of the MLA / DSA ops, the CUDA-graph decode form: torch and fast backends.

With ``kv_len`` given, ``dsa_index_scores`` returns ``[Q, kv_len]`` (-inf past each query's position),
the dense MLA key lists have width ``kv_len``, and no op reads a tensor value on the host. The bits
must be those of ``kv_len=None`` for every ``kv_len >= max(query_pos) + 1``: the scores' first columns,
the top-k selection over the wider scores, and the sparse / dense attention outputs. The builder here
(``make_static_case``) is shared with tests/kernels/triton/test_static_kv_len.py.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
from dataclasses import dataclass, fields, replace
from typing import Iterator

import pytest
import torch

from zmrl.kernels_batch_invariant import kernel_mode
from zmrl.kernels_batch_invariant.dsa_indexer import dsa_index_scores, dsa_topk
from zmrl.kernels_batch_invariant.fp8 import fake_quant_fp8, quantize_fp8
from zmrl.kernels_batch_invariant.mla_attention import (
    dense_key_positions,
    mla_attention,
    mla_attention_dense,
    mla_attention_ref,
)


# ----------------------------------------------------------------------------- the shared builder
@dataclass
class StaticCase:
    """Inputs of one indexer + MLA call over a paged cache with a fixed-width block table."""

    q8: torch.Tensor  # [Q, Hi, Di] float8_e4m3fn
    q_scale: torch.Tensor  # [Q, Hi]
    weights: torch.Tensor  # [Q, Hi]
    k8_cache: torch.Tensor  # [P, ps, Di] float8_e4m3fn
    k_scale_cache: torch.Tensor  # [P, ps]
    q_lat: torch.Tensor  # [Q, H, Dc] fp32
    q_pe: torch.Tensor  # [Q, H, Dr] fp32
    kv_cache: torch.Tensor  # [P, ps, Dc + Dr]
    block_table: torch.Tensor  # [N, max_pages] int64
    seq_idx: torch.Tensor  # [Q] int64
    query_pos: torch.Tensor  # [Q] int64

    @property
    def page_size(self) -> int:
        return self.kv_cache.shape[1]

    @property
    def capacity(self) -> int:
        """The CUDA-graph runner's kv_len: block_table.shape[1] * page_size."""
        return self.block_table.shape[1] * self.page_size

    @property
    def min_kv_len(self) -> int:
        return int(self.query_pos.max()) + 1

    @property
    def dc(self) -> int:
        return self.q_lat.shape[-1]

    def to(self, device: torch.device | str) -> "StaticCase":
        return replace(self, **{f.name: getattr(self, f.name).to(device) for f in fields(self)})

    def tensors(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def copy_into(self, static: "StaticCase") -> None:
        """Write this case's values into ``static``'s tensors in place (CUDA-graph replay inputs)."""
        for name, t in self.tensors().items():
            dst = getattr(static, name)
            if dst.shape != t.shape or dst.dtype != t.dtype:
                raise ValueError(f"copy_into: {name} {tuple(t.shape)}/{t.dtype} vs {tuple(dst.shape)}/{dst.dtype}")
            if t.dtype == torch.float8_e4m3fn:  # copy fp8 as bytes (no fp8 copy kernel needed)
                dst.view(torch.uint8).copy_(t.view(torch.uint8))
            else:
                dst.copy_(t)


def make_static_case(lens: list[int], max_pages: int, page_size: int, h: int, dc: int, dr: int, hi: int, di: int,
                     seed: int, queries_per_seq: int | None = None, cache_dtype: torch.dtype = torch.float32,
                     fp8_latent: bool = False, pad_pages_valid: bool = False) -> StaticCase:
    """Random case on CPU. Sequence n has ``lens[n]`` cached tokens (<= max_pages * page_size) on shuffled
    physical pages; unused cache slots hold NaN so that a leak of a masked slot shows. Queries: one per
    sequence at its last position (``queries_per_seq=None``: decode) or that many per sequence, random
    positions plus the last (prefill-like). ``pad_pages_valid``: block-table entries past a sequence's
    pages point at real (foreign) pages instead of -1. ``fp8_latent``: c_kv holds the FP8
    quantise->dequantise values the engine's FP8 latent format stores."""
    g = torch.Generator().manual_seed(seed)
    n = len(lens)
    cap = max_pages * page_size
    if max(lens) > cap:
        raise ValueError(f"sequence of {max(lens)} tokens does not fit {max_pages} pages of {page_size}")
    num_pages = n * max_pages + 2
    phys = torch.randperm(num_pages, generator=g)
    bt = torch.full((n, max_pages), -1, dtype=torch.int64)
    d = dc + dr
    latent = torch.randn(n, cap, d, generator=g)
    if fp8_latent:
        latent[..., :dc] = fake_quant_fp8(latent[..., :dc], block=min(128, dc))
    kv = torch.full((num_pages, page_size, d), float("nan"))
    idx_k = torch.randn(n, cap, di, generator=g) * torch.rand(n, cap, 1, generator=g) * 3
    k8, ks = quantize_fp8(idx_k, block=min(128, di))
    k8_cache = torch.full((num_pages, page_size, di), float("nan")).to(torch.float8_e4m3fn)
    ks_cache = torch.full((num_pages, page_size), float("nan"))
    for i, length in enumerate(lens):
        used = math.ceil(length / page_size)
        for j in range(max_pages):
            page = int(phys[i * max_pages + j])
            if j < used:
                bt[i, j] = page
                lo, hi_ = j * page_size, min((j + 1) * page_size, length)
                kv[page, : hi_ - lo] = latent[i, lo:hi_]
                k8_cache[page, : hi_ - lo] = k8[i, lo:hi_]
                ks_cache[page, : hi_ - lo] = ks[i, lo:hi_, 0]
            elif pad_pages_valid:
                bt[i, j] = page
    sidx, qpos = [], []
    for i, length in enumerate(lens):
        if queries_per_seq is None:
            pos = [length - 1]
        else:
            pos = sorted(torch.randint(0, length, (queries_per_seq - 1,), generator=g).tolist() + [length - 1])
        sidx += [i] * len(pos)
        qpos += pos
    nq = len(qpos)
    q8, qs = quantize_fp8(torch.randn(nq, hi, di, generator=g), block=min(128, di))
    w = torch.randn(nq, hi, generator=g) * (hi ** -0.5 * di ** -0.5)
    q_lat = torch.randn(nq, h, dc, generator=g) * 2
    q_pe = torch.randn(nq, h, dr, generator=g) * 2
    return StaticCase(q8=q8, q_scale=qs[..., 0], weights=w, k8_cache=k8_cache, k_scale_cache=ks_cache,
                      q_lat=q_lat, q_pe=q_pe, kv_cache=kv.to(cache_dtype), block_table=bt,
                      seq_idx=torch.tensor(sidx, dtype=torch.int64), query_pos=torch.tensor(qpos, dtype=torch.int64))


SCALE = 0.125


def run_pipeline(c: StaticCase, topk: int, kv_len: int | None, scores_fn=dsa_index_scores, topk_fn=dsa_topk,
                 sparse_fn=mla_attention, dense_fn=mla_attention_dense
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(scores, selected positions, sparse MLA over them, dense MLA): one decode step of an MLA layer."""
    scores = scores_fn(c.q8, c.q_scale, c.weights, c.k8_cache, c.k_scale_cache, c.block_table, c.seq_idx,
                       c.query_pos, kv_len=kv_len)
    sel = topk_fn(scores, c.query_pos, topk)
    o_sparse = sparse_fn(c.q_lat, c.q_pe, c.kv_cache, c.block_table, c.seq_idx, sel, SCALE, c.dc, kv_len=kv_len)
    o_dense = dense_fn(c.q_lat, c.q_pe, c.kv_cache, c.block_table, c.seq_idx, c.query_pos, SCALE, c.dc,
                       kv_len=kv_len)
    return scores, sel, o_sparse, o_dense


def kv_lens(c: StaticCase) -> list[int]:
    """Widths to try: the minimum, rounded up to a page, the block table's capacity, and beyond it."""
    w = c.min_kv_len
    return sorted({w, -(-w // c.page_size) * c.page_size, c.capacity, c.capacity + 77})


def assert_same_as_eager(wide: tuple, narrow: tuple, c: StaticCase, kv_len: int) -> None:
    """``wide`` (kv_len given) against ``narrow`` (kv_len=None), bit for bit."""
    s_w, sel_w, sp_w, de_w = wide
    s_n, sel_n, sp_n, de_n = narrow
    w = s_n.shape[1]
    assert s_w.shape == (s_n.shape[0], kv_len)
    assert torch.equal(s_w[:, :w], s_n)
    cols = torch.arange(kv_len, device=s_w.device).unsqueeze(0)
    past = cols > c.query_pos.unsqueeze(-1)
    assert bool(torch.isneginf(s_w[past]).all()), "columns past a query's position must be -inf"
    assert torch.equal(sel_w, sel_n)
    assert torch.equal(sp_w, sp_n)
    assert torch.equal(de_w, de_n)


# ----------------------------------------------------------------------------- a whole MLA layer
LAYER_CONFIGS = {
    # tiny dims with rope and the Hadamard indexer; a dense layer (no indexer); the bench layer.
    "tiny_rope_dsa": dict(preset="tiny", over=dict(mla_use_nope=False, index_use_hadamard=True, index_topk=64),
                          lens=[1, 70, 300, 500], new_lens=[499, 2, 64, 65], max_pages=8),
    "tiny_dense": dict(preset="tiny", over=dict(mla_use_nope=False, index_topk=None),
                       lens=[1, 70, 300, 500], new_lens=[499, 2, 64, 65], max_pages=8),
    "bench": dict(preset="bench", over={}, lens=[8192, 3000, 100, 1], new_lens=[1, 8191, 2049, 4000], max_pages=128),
}


def make_layer_case(device: torch.device, name: str, latent_format: str):
    """An ``MLAAttention`` (bf16, random weights) over a ``PagedLatentStore`` of random earlier tokens, and
    one decode step (one new token per sequence). Returns ``(layer, buf, new, ctx, kv_len)``: ``buf`` the
    static input tensors (x, positions, seq_idx, block_table, slot_mapping, cu_seqlens), ``new`` the
    next step's values for them (other lengths / pages), ``ctx(static_kv_len)`` a ForwardContext over
    ``buf`` and ``kv_len`` the block table's capacity."""
    from zmrl.model.config import ModelConfig
    from zmrl.model.context import ForwardContext, PagedLatentStore
    from zmrl.model.mla import MLAAttention

    spec = LAYER_CONFIGS[name]
    cfg = dataclasses.replace(ModelConfig.preset(spec["preset"]), **spec["over"]).validate()
    dtype = torch.bfloat16
    layer_idx, page_size = 0, 64
    torch.manual_seed(0)
    layer = MLAAttention(cfg, layer_idx, dtype=dtype).to(device).eval()
    with torch.no_grad():
        for p in layer.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.02)
    n, max_pages = len(spec["lens"]), spec["max_pages"]
    num_pages = n * max_pages + 1
    index_dim = cfg.index_head_dim if cfg.has_indexer else None
    store = PagedLatentStore([layer_idx], num_pages, page_size, cfg.kv_lora_rank + cfg.qk_rope_head_dim,
                             index_dim, dtype, device)
    # Earlier tokens: random cache contents everywhere (slots past a position are never read).
    g = torch.Generator(device="cpu").manual_seed(1)
    with torch.no_grad():
        store.kv[layer_idx].copy_(torch.randn(store.kv[layer_idx].shape, generator=g).to(dtype))
        if index_dim is not None:
            from zmrl.kernels_batch_invariant.fp8 import quantize_fp8
            k8, ks = quantize_fp8(torch.randn(num_pages, page_size, index_dim, generator=g), block=min(128, index_dim))
            store.k8[layer_idx].view(torch.uint8).copy_(k8.view(torch.uint8))
            store.kscale[layer_idx].copy_(ks[..., 0])

    def inputs(lens: list[int], seed: int) -> dict[str, torch.Tensor]:
        gg = torch.Generator(device="cpu").manual_seed(seed)
        perm = torch.randperm(num_pages, generator=gg)[: n * max_pages].view(n, max_pages)
        pos = torch.tensor([length - 1 for length in lens], dtype=torch.int64)  # the new token's position
        slots = perm[torch.arange(n), pos // page_size] * page_size + pos % page_size
        return dict(x=torch.randn(n, cfg.hidden_size, generator=gg).to(dtype), positions=pos,
                    seq_idx=torch.arange(n, dtype=torch.int64), block_table=perm.clone(), slot_mapping=slots,
                    cu_seqlens=torch.arange(n + 1, dtype=torch.int64))

    buf = {k: v.to(device) for k, v in inputs(spec["lens"], 2).items()}
    new = {k: v.to(device) for k, v in inputs(spec["new_lens"], 3).items()}

    def ctx(static_kv_len: int | None) -> ForwardContext:
        return ForwardContext(cu_seqlens=buf["cu_seqlens"], positions=buf["positions"], seq_idx=buf["seq_idx"],
                              block_table=buf["block_table"], slot_mapping=buf["slot_mapping"], store=store,
                              latent_format=latent_format, static_kv_len=static_kv_len)

    return layer, buf, new, ctx, max_pages * page_size


# ----------------------------------------------------------------------------- torch backend (CPU)
DIMS = dict(h=4, dc=64, dr=16, hi=4, di=32)
LENS = [1, 5, 63, 64, 65, 130, 200]


@pytest.mark.parametrize("queries_per_seq", [None, 4], ids=["decode", "prefill"])
@pytest.mark.parametrize("topk", [8, 64, 512], ids=["topk8", "topk64", "topk512"])
@pytest.mark.parametrize("latent", ["native", "fp8", "bf16"])
def test_torch_static_width_bitwise(queries_per_seq, topk, latent):
    """Every kv_len >= max(pos)+1 gives the kv_len=None bits: scores prefix, top-k (incl. contexts shorter
    than top-k, and the many exact ties ReLU+FP8 produce), sparse and dense MLA."""
    c = make_static_case(LENS, max_pages=4, page_size=64, seed=1, queries_per_seq=queries_per_seq,
                         cache_dtype=torch.bfloat16 if latent == "bf16" else torch.float32,
                         fp8_latent=latent == "fp8", **DIMS)
    narrow = run_pipeline(c, topk, None)
    for kv_len in kv_lens(c):
        assert_same_as_eager(run_pipeline(c, topk, kv_len), narrow, c, kv_len)


def test_torch_static_width_page_size_and_valid_padding():
    """Page size 128 and block-table padding pointing at foreign pages (never read past a position)."""
    c = make_static_case([3, 100, 250, 256], max_pages=2, page_size=128, seed=2, queries_per_seq=3,
                         pad_pages_valid=True, **DIMS)
    narrow = run_pipeline(c, 16, None)
    for kv_len in kv_lens(c):
        assert_same_as_eager(run_pipeline(c, 16, kv_len), narrow, c, kv_len)


def test_torch_static_width_matches_float64_reference():
    """Sanity: the static-width results are the right numbers too (not only equal to the eager ones)."""
    c = make_static_case(LENS, max_pages=4, page_size=64, seed=3, queries_per_seq=2, **DIMS)
    out = mla_attention_dense(c.q_lat, c.q_pe, c.kv_cache, c.block_table, c.seq_idx, c.query_pos, SCALE, c.dc,
                              kv_len=c.capacity)
    ref = mla_attention_ref(c.q_lat, c.q_pe, c.kv_cache, c.block_table, c.seq_idx,
                            dense_key_positions(c.query_pos), SCALE, c.dc)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)  # fp32 accumulation


def test_empty_batch_static_width():
    c = make_static_case([10], max_pages=1, page_size=64, seed=4, **DIMS)
    e = slice(0, 0)
    s = dsa_index_scores(c.q8[e], c.q_scale[e], c.weights[e], c.k8_cache, c.k_scale_cache, c.block_table,
                         c.seq_idx[e], c.query_pos[e], kv_len=64)
    assert s.shape == (0, 64)
    o = mla_attention_dense(c.q_lat[e], c.q_pe[e], c.kv_cache, c.block_table, c.seq_idx[e], c.query_pos[e],
                            SCALE, c.dc, kv_len=64)
    assert o.shape == (0, DIMS["h"], DIMS["dc"])


def test_kv_len_smaller_than_a_position_raises():
    c = make_static_case([10, 70], max_pages=2, page_size=64, seed=5, **DIMS)
    with pytest.raises(RuntimeError, match="kv_len"):
        dsa_index_scores(c.q8, c.q_scale, c.weights, c.k8_cache, c.k_scale_cache, c.block_table, c.seq_idx,
                         c.query_pos, kv_len=69)
    with pytest.raises(RuntimeError, match="kv_len"):
        mla_attention_dense(c.q_lat, c.q_pe, c.kv_cache, c.block_table, c.seq_idx, c.query_pos, SCALE, c.dc,
                            kv_len=69)


# ----------------------------------------------------------------------------- no host reads
@contextlib.contextmanager
def no_host_reads() -> Iterator[None]:
    """Make every Python-level read of a tensor's value on the host raise (``.item()``, ``.tolist()``,
    ``bool``/``int``/``float``/``index`` conversions, ``.cpu()``, ``.numpy()``): the CPU stand-in for
    ``torch.cuda.set_sync_debug_mode("error")`` (the GPU tests use that)."""
    names = ["item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy"]
    saved = {name: getattr(torch.Tensor, name) for name in names}

    def forbidden(name: str):
        def f(self, *args, **kwargs):
            raise AssertionError(f"host read of a tensor value (Tensor.{name}) with a static kv_len")
        return f

    for name in names:
        setattr(torch.Tensor, name, forbidden(name))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)


def test_guard_catches_host_reads():
    t = torch.tensor([1, 2])
    with no_host_reads(), pytest.raises(AssertionError, match="host read"):
        t.max().item()
    assert t.max().item() == 2


@pytest.mark.parametrize("mode", ["bitwise", "fast"])
def test_no_host_reads_with_static_width(mode):
    """With kv_len, the torch and fast backends of all four ops never read a tensor value on the host;
    with kv_len=None they do (which is why the CUDA-graph runner must pass it)."""
    c = make_static_case([5, 64, 130], max_pages=3, page_size=64, seed=6, **DIMS)
    with kernel_mode(mode):
        eager = run_pipeline(c, 32, None)
        with no_host_reads():
            static = run_pipeline(c, 32, c.capacity)
        with pytest.raises(AssertionError, match="host read"), no_host_reads():
            run_pipeline(c, 32, None)
    if mode == "bitwise":
        assert_same_as_eager(static, eager, c, c.capacity)
    else:
        # The fast backends are not bitwise; the static-width path must give the same numbers.
        s_w, sel_w, sp_w, de_w = static
        s_n, sel_n, sp_n, de_n = eager
        w = s_n.shape[1]
        torch.testing.assert_close(s_w[:, :w], s_n, rtol=1e-5, atol=1e-5)
        assert bool(torch.isneginf(s_w[:, w:]).all())
        torch.testing.assert_close(de_w, de_n, rtol=1e-5, atol=1e-5)
        # fast top-k breaks ties arbitrarily (the selections may differ): compare the sparse path on
        # one selection.
        with kernel_mode(mode):
            sp_same = mla_attention(c.q_lat, c.q_pe, c.kv_cache, c.block_table, c.seq_idx, sel_n, SCALE, c.dc,
                                    kv_len=c.capacity)
        torch.testing.assert_close(sp_same, sp_n, rtol=1e-5, atol=1e-5)


def test_fast_dense_static_width_matches_reference():
    c = make_static_case(LENS, max_pages=4, page_size=64, seed=7, queries_per_seq=3, **DIMS)
    with kernel_mode("fast"):
        out = mla_attention_dense(c.q_lat, c.q_pe, c.kv_cache, c.block_table, c.seq_idx, c.query_pos, SCALE, c.dc,
                                  kv_len=c.capacity + 5)
    ref = mla_attention_ref(c.q_lat, c.q_pe, c.kv_cache, c.block_table, c.seq_idx,
                            dense_key_positions(c.query_pos), SCALE, c.dc)
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-4)  # stock SDPA in fp32


@pytest.mark.parametrize("latent_format", ["native", "fp8"])
@pytest.mark.parametrize("name", ["tiny_rope_dsa", "tiny_dense"])
def test_mla_layer_static_kv_len_bitwise(name, latent_format):
    """MLAAttention.forward passes ForwardContext.static_kv_len to the ops: same bits as without it."""
    layer, buf, new, ctx, kv_len = make_layer_case(torch.device("cpu"), name, latent_format)
    with torch.no_grad():
        for step in (None, new):
            if step is not None:
                for k, v in step.items():
                    buf[k].copy_(v)
            assert torch.equal(layer(buf["x"], ctx(kv_len)), layer(buf["x"], ctx(None)))
