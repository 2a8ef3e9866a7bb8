"""``mla_attention_grads`` (the MLA backward as dense GEMMs over each query chunk's unique keys) against
autograd of the float64 reference ``mla_attention_ref``, on CPU.

Covers several sequences with a permuted page table, sparse key lists with -1 padding, a query with
no key at all, and chunk sizes from one query to all of them (including the branch that halves the
chunk when its keys spread wider than expected). fp32 products: ~1e-6 relative measured; 1e-5 of the
largest gradient leaves margin while a wrong term (a dropped key, a missing rescale) is O(1e-1).
"""
from __future__ import annotations

import pytest
import torch

from zmrl.kernels_batch_invariant import current_numerics, numerics_scope
from zmrl.kernels_batch_invariant import mla_attention_grads as M
from zmrl.kernels_batch_invariant.mla_attention import dense_key_positions, mla_attention_ref

from .test_mla_attention import make_paged_cache, make_q, make_queries, permute_pages, sparse_key_positions

H, DC, DR, SCALE = 3, 32, 8, 0.13


@pytest.fixture(scope="module")
def problem():
    lens = [150, 40, 7]
    cache, bt, _ = make_paged_cache(lens, 16, DC + DR, torch.float32, seed=3)
    cache, bt = permute_pages(cache.nan_to_num(0.0), bt, seed=4)
    sidx, qpos = make_queries(lens, per_seq=6, seed=5)
    q_lat, q_pe = make_q(len(qpos), H, DC, DR, seed=6)
    sparse = sparse_key_positions(qpos, width=64, seed=7, keep=0.6)
    sparse[2] = -1  # a query without keys: zero output, zero gradient
    go = torch.randn(len(qpos), H, DC, generator=torch.Generator().manual_seed(8))
    return cache, bt, sidx, qpos, q_lat, q_pe, {"sparse": sparse, "dense": dense_key_positions(qpos)}, go


def _reference(problem, kind):
    cache, bt, sidx, _, q_lat, q_pe, kps, go = problem
    xs = [t.detach().double().requires_grad_() for t in (q_lat, q_pe, cache)]
    out = mla_attention_ref(*xs, bt, sidx, kps[kind], SCALE, DC)
    out.backward(go.double())
    return [x.grad for x in xs]


@pytest.mark.parametrize("kind", ["sparse", "dense"])
@pytest.mark.parametrize("chunk_elems", [1, 3 * 64 * 2 * 5, 1 << 26])
def test_matches_float64(problem, kind, chunk_elems, monkeypatch):
    monkeypatch.setattr(M, "CHUNK_ELEMS", chunk_elems)
    cache, bt, sidx, _, q_lat, q_pe, kps, go = problem
    want = _reference(problem, kind)
    got = M.mla_attention_grads(go, q_lat, q_pe, cache, bt, sidx, kps[kind], SCALE, DC, (True, True, True))
    for name, a, b in zip(("q_lat", "q_pe", "kv_cache"), got, want):
        assert a.dtype == torch.float32
        err = (a.double() - b).abs().max().item()
        assert err <= 1e-5 * b.abs().max().item(), f"{kind} d{name}: {err:.2e}"
    again = M.mla_attention_grads(go, q_lat, q_pe, cache, bt, sidx, kps[kind], SCALE, DC, (True, True, True))
    assert all(torch.equal(a, b) for a, b in zip(got, again))


@pytest.mark.parametrize("kind", ["sparse", "dense"])
def test_delta_from_the_forward_output(problem, kind):
    """Given the forward's output (as the autograd function passes it), delta = rowsum(dO * o) comes from it instead
    of P C: the same bound against float64, and it is really read (a zero output, i.e. delta = 0, is off by O(1))."""
    cache, bt, sidx, _, q_lat, q_pe, kps, go = problem
    want = _reference(problem, kind)
    out = mla_attention_ref(q_lat, q_pe, cache, bt, sidx, kps[kind], SCALE, DC).float()

    def grads(o):
        return M.mla_attention_grads(go, q_lat, q_pe, cache, bt, sidx, kps[kind], SCALE, DC, (True, True, True), o)

    for name, a, b in zip(("q_lat", "q_pe", "kv_cache"), grads(out), want):
        err = (a.double() - b).abs().max().item()
        assert err <= 1e-5 * b.abs().max().item(), f"{kind} d{name}: {err:.2e}"
    wrong = grads(torch.zeros_like(out))
    assert (wrong[0].double() - want[0]).abs().max() > 1e-2 * want[0].abs().max(), "the given output was not read"


@pytest.mark.parametrize("kind", ["sparse", "dense"])
def test_one_sync_for_many_chunks_changes_no_bit(problem, kind, monkeypatch):
    """The chunks' key unions found together (``UNION_ENTRIES``: all chunks in one sort) or one chunk at a time give
    the same gradients bit for bit, with several chunks (a small ``CHUNK_ELEMS``) and with the halving of chunks
    whose keys spread wider than expected (the smallest ``CHUNK_ELEMS``)."""
    cache, bt, sidx, _, q_lat, q_pe, kps, go = problem
    for chunk_elems in (1, 3 * 64 * 2 * 5):
        monkeypatch.setattr(M, "CHUNK_ELEMS", chunk_elems)
        got = {}
        for entries in (1, 1 << 24):
            monkeypatch.setattr(M, "UNION_ENTRIES", entries)
            got[entries] = M.mla_attention_grads(go, q_lat, q_pe, cache, bt, sidx, kps[kind], SCALE, DC,
                                                 (True, True, True))
        assert all(torch.equal(a, b) for a, b in zip(got[1], got[1 << 24])), chunk_elems


def test_only_requested_gradients(problem):
    cache, bt, sidx, _, q_lat, q_pe, kps, go = problem
    full = M.mla_attention_grads(go, q_lat, q_pe, cache, bt, sidx, kps["sparse"], SCALE, DC, (True, True, True))
    part = M.mla_attention_grads(go, q_lat, q_pe, cache, bt, sidx, kps["sparse"], SCALE, DC, (False, False, True))
    assert part[0] is None and part[1] is None and torch.equal(part[2], full[2])
    assert not full[0][2].any() and not full[1][2].any()


@pytest.mark.parametrize("kind", ["sparse", "dense"])
def test_bf16_operands(problem, kind, monkeypatch):
    """backward_matmul_precision="bf16" (FlashAttention's practice: the GEMMs take bf16 operands, the softmax and
    every accumulation stay fp32), its elementwise stages as the torch compositions (the Triton ones:
    tests/kernels/triton/test_mla_attention_bwd.py). See ``check_bf16_grads`` for the bound."""
    monkeypatch.setattr(M, "_bf16_kernels", None)
    assert M._bf16_stages(torch.device("cpu")) is M.TORCH_STAGES
    check_bf16_grads(problem, kind, torch.device("cpu"))


def check_bf16_grads(problem, kind, device):
    """The bf16 path on ``device`` against float64, with delta = rowsum(dO * o) from the forward's output (as the
    autograd function passes it) and from o formed of the bf16 probabilities (a caller without the output). Each
    product's operands round to bf16, 2^-8 relative each; the gradients sum hundreds of such terms whose errors
    partly cancel, and dS = P (dP - delta) subtracts two rounded quantities, so the error is bounded relative to
    the largest gradient: 2^-5 (measured up to 8e-3 here; leaving delta out gives ~2, scaling it by 0.9 ~0.2).
    The bf16 path must differ from the fp32 one (it was taken) and repeat bitwise."""
    cache, bt, sidx, _, q_lat, q_pe, kps, go = (t.to(device) if isinstance(t, torch.Tensor) else
                                                {k: v.to(device) for k, v in t.items()} for t in problem)
    want = _reference(problem, kind)
    out = mla_attention_ref(q_lat.cpu(), q_pe.cpu(), cache.cpu(), bt.cpu(), sidx.cpu(), kps[kind].cpu(), SCALE,
                            DC).to(device, torch.float32)

    def grads(o=None):
        return M.mla_attention_grads(go, q_lat, q_pe, cache, bt, sidx, kps[kind], SCALE, DC, (True, True, True), o)

    with numerics_scope(current_numerics().replace(backward_matmul_precision="ieee")):
        exact = grads()
    with numerics_scope(current_numerics().replace(backward_matmul_precision="bf16")):
        got, again, with_out = grads(), grads(), grads(out)
    for name, a, o, b, e in zip(("q_lat", "q_pe", "kv_cache"), got, with_out, want, exact):
        assert a.dtype == torch.float32 and not torch.equal(a, e)
        for label, x in (("o formed", a), ("o given", o)):
            err = (x.double().cpu() - b).abs().max().item()
            assert err <= 2.0 ** -5 * b.abs().max().item(), f"{kind} d{name} ({label}): {err:.2e}"
    assert all(torch.equal(a, b) for a, b in zip(got, again))
    assert not all(torch.equal(a, b) for a, b in zip(got, with_out)), "the given output was not used"


@pytest.mark.parametrize("rows,width,chunk", [(10, 7, 3), (8, 5, 8), (9, 4, 2), (5, 6, 10)])
def test_chunk_unions_are_each_chunks_unique(rows, width, chunk):
    """``chunk_unions`` (all chunks' key unions from one sort and one host sync) gives every chunk the
    ``torch.unique(sorted=True, return_inverse=True)`` of its entries plus the sentinel, which the chunk-by-chunk
    backward used: the same unions, so the same gradients bit for bit. Chunks with a row without keys, a chunk
    without any key, a partial last chunk, one chunk for all rows."""
    from zmrl.kernels_batch_invariant.mla_attention_grads import chunk_unions

    sentinel = 40
    g = torch.Generator().manual_seed(rows * 100 + chunk)
    keyed = torch.randint(0, sentinel, (rows, width), generator=g)
    keyed[torch.rand(rows, width, generator=g) < 0.3] = sentinel
    keyed[1] = sentinel
    if rows > chunk:
        keyed[(rows - 1) // chunk * chunk:] = sentinel  # the last chunk has no key
    out = chunk_unions(keyed, chunk, sentinel)
    assert len(out) == -(-rows // chunk)
    for i, (u, inv) in enumerate(out):
        part = keyed[i * chunk:(i + 1) * chunk]
        want_u, want_inv = torch.unique(torch.cat([part.reshape(-1), part.new_full((1,), sentinel)]), sorted=True,
                                        return_inverse=True)
        assert torch.equal(u, want_u), i
        assert torch.equal(inv, want_inv[:-1].view(part.shape)), i
