"""Static key width (``kv_len``) of the Triton MLA / DSA backends, and CUDA-graph capture of them.

CPU (TRITON_INTERPRET=1, tiny shapes) and CUDA: for every ``kv_len >= max(query_pos) + 1`` the Triton
``dsa_index_scores`` (first columns; -inf beyond), ``dsa_topk`` over the wider scores (both the sort
path and the kernel), sparse ``mla_attention`` over the selection and ``mla_attention_dense`` are
bitwise the ``kv_len=None`` results. The dense kernel then launches ``cdiv(kv_len, SPLIT_KEYS)`` splits
for every query, so this also checks that empty splits and the combine of a single non-empty split
change no bit (the interpreter lowers SPLIT_KEYS to 64 keys so several splits run on tiny contexts).

CUDA only: the ops with ``kv_len`` run eagerly under ``torch.cuda.set_sync_debug_mode("error")`` (no
host sync), are captured in a ``torch.cuda.CUDAGraph`` and replayed on new inputs copied into the
static tensors (other lengths, positions, block tables, cache contents, queries): ``torch.equal`` with
the eager results, up to the bench shape (64 heads, kv_lora 512, rope 64, indexer 32 x 128, top-2048,
8K context). The same for a whole ``MLAAttention`` layer forward (indexer + sparse MLA, and a dense
layer) with ``ForwardContext.static_kv_len`` set, against its eager ``static_kv_len=None`` output.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable, Iterator

import pytest
import torch

from tests.kernels.test_static_kv_len import (
    LAYER_CONFIGS,
    assert_same_as_eager,
    kv_lens,
    make_layer_case,
    make_static_case,
    run_pipeline,
)
from zmrl.kernels_batch_invariant.dsa_indexer import dsa_index_scores, dsa_topk
from zmrl.kernels_batch_invariant.mla_attention import mla_attention, mla_attention_dense
from zmrl.kernels_batch_invariant.triton import triton_impl

pytestmark = [pytest.mark.gpu, pytest.mark.triton]


@pytest.fixture(autouse=True)
def small_split(interpret, monkeypatch):
    """Under the interpreter contexts are tiny: lower the split size so several (and empty) splits run."""
    if interpret:
        from zmrl.kernels_batch_invariant.triton import mla_attention as tmla
        monkeypatch.setattr(tmla, "SPLIT_KEYS", 64)


def set_topk_path(monkeypatch, path: str) -> None:
    """"sort": torch's stable sort (what a few long decode rows use); "kernel": the Triton top-k kernel for
    every batch."""
    from zmrl.kernels_batch_invariant.triton import dsa_indexer as tdsa
    monkeypatch.setattr(tdsa, "TOPK_MIN_ROWS", 0 if path == "kernel" else 1 << 30)
    monkeypatch.setattr(tdsa, "TOPK_SORT_WIDTH", 0)


def triton_ops() -> dict:
    """The Triton implementations, called directly (so that they also run on CPU under the interpreter)."""
    return dict(scores_fn=triton_impl(dsa_index_scores), topk_fn=triton_impl(dsa_topk),
                sparse_fn=triton_impl(mla_attention), dense_fn=triton_impl(mla_attention_dense))


def shapes(interpret: bool) -> dict:
    if interpret:  # tiny: the interpreter is slow
        return dict(lens=[1, 5, 64, 70, 130], short=[1, 5, 40, 64], max_pages=3, page_size=64,
                    dims=dict(h=4, dc=32, dr=16, hi=4, di=32), topks=[8, 256])
    return dict(lens=[1, 100, 1000, 2047, 3000], short=[1, 5, 700, 1024], max_pages=50, page_size=64,
                dims=dict(h=16, dc=512, dr=64, hi=8, di=128), topks=[64, 2048])


# ----------------------------------------------------------------------------- bitwise vs kv_len=None
@pytest.mark.parametrize("topk_path", ["sort", "kernel"])
@pytest.mark.parametrize("latent", ["native", "fp8", "bf16"])
@pytest.mark.parametrize("queries_per_seq", [None, 3], ids=["decode", "prefill"])
def test_static_width_bitwise(device, interpret, monkeypatch, topk_path, latent, queries_per_seq):
    set_topk_path(monkeypatch, topk_path)
    sh = shapes(interpret)
    c = make_static_case(sh["lens"], sh["max_pages"], sh["page_size"], seed=1, queries_per_seq=queries_per_seq,
                         cache_dtype=torch.bfloat16 if latent == "bf16" else torch.float32,
                         fp8_latent=latent == "fp8", **sh["dims"]).to(device)
    ops = triton_ops()
    widths = kv_lens(c)
    if interpret:  # slow: the minimum width, the block table's capacity and a width beyond it
        widths = [widths[0], c.capacity, c.capacity + 77]

    def run(kv_len: int | None) -> dict[int, tuple]:
        scores = ops["scores_fn"](c.q8, c.q_scale, c.weights, c.k8_cache, c.k_scale_cache, c.block_table,
                                  c.seq_idx, c.query_pos, kv_len=kv_len)
        o_dense = ops["dense_fn"](c.q_lat, c.q_pe, c.kv_cache, c.block_table, c.seq_idx, c.query_pos, 0.125, c.dc,
                                  kv_len=kv_len)
        out = {}
        for topk in sh["topks"]:
            sel = ops["topk_fn"](scores, c.query_pos, topk)
            o_sparse = ops["sparse_fn"](c.q_lat, c.q_pe, c.kv_cache, c.block_table, c.seq_idx, sel, 0.125, c.dc,
                                        kv_len=kv_len)
            out[topk] = (scores, sel, o_sparse, o_dense)
        return out

    narrow = run(None)
    for kv_len in widths:
        wide = run(kv_len)
        for topk in sh["topks"]:
            assert_same_as_eager(wide[topk], narrow[topk], c, kv_len)


def test_single_split_equals_static_multi_split(device, interpret):
    """Contexts within one split: kv_len=None writes the output directly (one split); the static width
    has empty splits after it and goes through the combine kernel. Same bits."""
    from zmrl.kernels_batch_invariant.triton import mla_attention as tmla
    sh = shapes(interpret)
    c = make_static_case(sh["short"], sh["max_pages"], sh["page_size"], seed=2, queries_per_seq=2,
                         **sh["dims"]).to(device)
    assert c.min_kv_len <= tmla.SPLIT_KEYS < c.capacity
    dense = triton_ops()["dense_fn"]
    narrow = dense(c.q_lat, c.q_pe, c.kv_cache, c.block_table, c.seq_idx, c.query_pos, 0.125, c.dc)
    for kv_len in kv_lens(c):
        wide = dense(c.q_lat, c.q_pe, c.kv_cache, c.block_table, c.seq_idx, c.query_pos, 0.125, c.dc, kv_len=kv_len)
        assert torch.equal(wide, narrow)


def test_rows_alone_vs_static_batch(device, interpret):
    """Row invariance still holds with a static width: each query alone (kv_len=None) equals its row of
    the static-width batch."""
    sh = shapes(interpret)
    c = make_static_case(sh["lens"], sh["max_pages"], sh["page_size"], seed=3, **sh["dims"]).to(device)
    topk = sh["topks"][0]
    batch = run_pipeline(c, topk, c.capacity, **triton_ops())
    for i in range(c.query_pos.shape[0]):
        one = dataclasses.replace(c, **{k: getattr(c, k)[i:i + 1] for k in
                                        ("q8", "q_scale", "weights", "q_lat", "q_pe", "seq_idx", "query_pos")})
        alone = run_pipeline(one, topk, None, **triton_ops())
        w = alone[0].shape[1]
        assert torch.equal(batch[0][i:i + 1, :w], alone[0])
        for got, want in zip(batch[1:], alone[1:]):
            assert torch.equal(got[i:i + 1], want)


# ----------------------------------------------------------------------------- CUDA graphs (CUDA only)
def _cuda_only(device: torch.device) -> None:
    if device.type != "cuda":
        pytest.skip("CUDA graphs need a CUDA device")


@contextlib.contextmanager
def sync_debug_error() -> Iterator[None]:
    """Any host synchronisation in the block raises (torch.cuda.set_sync_debug_mode)."""
    prev = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(prev)


def capture(fn: Callable[[], object]) -> tuple[torch.cuda.CUDAGraph, object]:
    """Warm ``fn`` up on a side stream (compiles the kernels, fills the allocator), then capture it."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


GRAPH_SHAPES = {
    # lens: the captured inputs; new_lens: the replayed ones (same batch, same block-table width).
    "small": dict(lens=[1, 100, 1000, 2047, 3000], new_lens=[3000, 64, 5, 1500, 2999], max_pages=50, page_size=64,
                  dims=dict(h=16, dc=512, dr=64, hi=8, di=128), topk=256),
    "bench": dict(lens=[8192, 5000, 2047, 100, 1], new_lens=[17, 8191, 4096, 2048, 7000], max_pages=128,
                  page_size=64, dims=dict(h=64, dc=512, dr=64, hi=32, di=128), topk=2048),
}


@pytest.mark.parametrize("topk_path", ["sort", "kernel"])
@pytest.mark.parametrize("queries_per_seq", [None, 3], ids=["decode", "prefill"])
@pytest.mark.parametrize("latent", ["bf16", "fp8"])
@pytest.mark.parametrize("shape", ["small", "bench"])
def test_cuda_graph_capture_and_replay(device, monkeypatch, shape, latent, queries_per_seq, topk_path):
    _cuda_only(device)
    set_topk_path(monkeypatch, topk_path)
    cfg = GRAPH_SHAPES[shape]
    build = dict(max_pages=cfg["max_pages"], page_size=cfg["page_size"], queries_per_seq=queries_per_seq,
                 cache_dtype=torch.bfloat16, fp8_latent=latent == "fp8", **cfg["dims"])
    static = make_static_case(cfg["lens"], seed=10, **build).to(device)
    new = make_static_case(cfg["new_lens"], seed=11, pad_pages_valid=True, **build).to(device)
    kv_len, topk = static.capacity, cfg["topk"]

    def step() -> tuple[torch.Tensor, ...]:
        # Through the dispatching ops, as the model calls them (CUDA tensors -> Triton backends).
        return run_pipeline(static, topk, kv_len)

    with torch.no_grad():
        step()  # compile every kernel outside the sync check
        torch.cuda.synchronize()
        with sync_debug_error():
            eager_static = step()
        eager = run_pipeline(static, topk, None)
        assert_same_as_eager(eager_static, eager, static, kv_len)

        graph, out = capture(step)
        graph.replay()
        torch.cuda.synchronize()
        for got, want in zip(out, eager_static):
            assert torch.equal(got, want)

        new.copy_into(static)  # new lengths, positions, block tables, caches and queries
        graph.replay()
        torch.cuda.synchronize()
        want_static = run_pipeline(static, topk, kv_len)
        want = run_pipeline(static, topk, None)
        for got, w in zip(out, want_static):
            assert torch.equal(got, w)
        assert_same_as_eager(tuple(out), want, static, kv_len)


# ----------------------------------------------------------------------------- a whole MLA layer (CUDA only)
@pytest.mark.parametrize("latent_format", ["native", "fp8"])
@pytest.mark.parametrize("name", list(LAYER_CONFIGS))
def test_mla_layer_forward_no_host_sync(device, name, latent_format):
    """MLAAttention.forward with ForwardContext.static_kv_len runs without a host sync (sync debug mode
    "error": a failure's traceback names the op that still syncs) and equals the static_kv_len=None
    forward bit for bit."""
    _cuda_only(device)
    layer, buf, _, ctx, kv_len = make_layer_case(device, name, latent_format)
    with torch.no_grad():
        layer(buf["x"], ctx(kv_len))  # compile / allocate / fill the per-device caches outside the check
        torch.cuda.synchronize()
        with sync_debug_error():
            eager_static = layer(buf["x"], ctx(kv_len))
        assert torch.equal(eager_static, layer(buf["x"], ctx(None)))


@pytest.mark.parametrize("latent_format", ["native", "fp8"])
@pytest.mark.parametrize("name", list(LAYER_CONFIGS))
def test_mla_layer_cuda_graph(device, name, latent_format):
    """A captured MLAAttention.forward (static_kv_len set) replayed on new decode inputs copied into its
    static tensors equals the eager static_kv_len=None forward bit for bit (the graph writes the new
    token's latent into the cache and attends to it)."""
    _cuda_only(device)
    layer, buf, new, ctx, kv_len = make_layer_case(device, name, latent_format)
    with torch.no_grad():
        eager = layer(buf["x"], ctx(None))
        graph, out = capture(lambda: layer(buf["x"], ctx(kv_len)))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)

        for k, v in new.items():
            buf[k].copy_(v)
        graph.replay()
        torch.cuda.synchronize()
        replayed = out.clone()
        assert torch.equal(replayed, layer(buf["x"], ctx(None)))
