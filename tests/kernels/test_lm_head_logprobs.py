"""``lm_head_token_logprobs``: the chunked lm_head + log-prob of the trainer.

* Forward: bitwise equal (``torch.equal``) to the unchunked ops (``linear`` to fp32 logits, then
  ``token_logprobs`` per temperature) and to the engine's one-row-at-a-time calls, for every chunk
  size, on ragged row counts with mixed temperatures (greedy 0, 1, and scaled).
* Backward: against autograd of a float64 reference, with an error bound derived per element (below);
  two backward passes are bitwise equal.

Tolerance of the gradient test. Inputs are fp32 and the kernel computes in fp32 (unit roundoff
u = 2^-24). d hidden[r, :] = sum_v dz[r, v] W[v, :] is a length-V fp32 dot; its rounding error is at
most about V u sum_v |dz[r, v] W[v, :]| (the standard bound for recursive summation; blocked or
pairwise summation is smaller), and the softmax/exp/scale feeding dz adds a few u relative per term,
also covered by that sum. Likewise d W[v, :] = sum_r dz[r, v] hidden[r, :] over R rows. The test
asserts |err| <= 4 (V or R) u (|dz| @ |W| or |dz|^T @ |hidden|) + 1e-12 elementwise: a bound that a
correct fp32 computation meets by construction and that a wrong gradient (O(|dz||W|) errors) misses.
"""
from __future__ import annotations

import pytest
import torch

from zmrl.kernels_batch_invariant import linear
from zmrl.kernels_batch_invariant.lm_head_logprobs import lm_head_token_logprobs, lm_head_token_logprobs_ref
from zmrl.kernels_batch_invariant.logprob import token_logprobs

D, V = 48, 257  # V odd and not a multiple of the GEMM column tile
# (rows, temperature) runs: ragged, a greedy run, runs of equal temperature that merge, an empty one.
SEGMENTS = [(37, 1.0), (5, 0.7), (0, 1.3), (20, 0.0), (1, 0.7), (16, 0.7), (52, 1.3)]
R = sum(n for n, _ in SEGMENTS)


def _inputs(dtype: torch.dtype, seed: int = 0, bias: bool = True):
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(R, D, generator=g) * 2).to(dtype)
    w = (torch.randn(V, D, generator=g) * 0.3).to(dtype)
    b = (torch.randn(V, generator=g) * 0.1).to(dtype) if bias else None
    ids = torch.randint(0, V, (R,), generator=g)
    return h, w, b, ids


def _unchunked(h, w, b, ids, segments):
    logits = linear(h, w, b, out_dtype=torch.float32)
    parts, start = [], 0
    for n, t in segments:
        parts.append(token_logprobs(logits[start:start + n], ids[start:start + n], t))
        start += n
    return torch.cat(parts)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [1, 7, 16, 64, 1000, None])
def test_forward_bitwise_equal_to_unchunked(dtype, chunk):
    h, w, b, ids = _inputs(dtype)
    want = _unchunked(h, w, b, ids, SEGMENTS)
    got = lm_head_token_logprobs(h, w, b, ids, SEGMENTS, chunk)
    assert got.dtype == torch.float32 and got.shape == (R,)
    assert torch.equal(got, want)
    # with autograd recording (the trainer's case): the same bits
    got_grad = lm_head_token_logprobs(h.clone().requires_grad_(True), w, b, ids, SEGMENTS, chunk)
    assert torch.equal(got_grad.detach(), want)


def test_forward_equals_engine_rows():
    """The engine computes logits for the sampled rows only (one row per request at decode)."""
    h, w, b, ids = _inputs(torch.bfloat16, seed=3, bias=False)
    got = lm_head_token_logprobs(h, w, None, ids, SEGMENTS, 16)
    temps = [t for n, t in SEGMENTS for _ in range(n)]
    for r in (0, 36, 37, 41, 42, 61, R - 1):
        one = token_logprobs(linear(h[r:r + 1], w, None, out_dtype=torch.float32), ids[r:r + 1], temps[r])
        assert torch.equal(got[r:r + 1], one), r


def test_empty_rows():
    h, w, b, ids = _inputs(torch.float32)
    out = lm_head_token_logprobs(h[:0].requires_grad_(True), w, b, ids[:0], [(0, 1.0)], 8)
    assert out.shape == (0,)
    out.sum().backward()


def _bound(dz: torch.Tensor, other: torch.Tensor, n: int) -> torch.Tensor:
    return 4 * n * 2.0 ** -24 * (dz.abs() @ other.abs()) + 1e-12


@pytest.mark.parametrize("chunk", [1, 13, 64, None])
def test_gradient_vs_float64(chunk):
    h, w, b, ids = _inputs(torch.float32, seed=1)
    g_out = torch.randn(R, generator=torch.Generator().manual_seed(5))
    leaves = [x.clone().requires_grad_(True) for x in (h, w, b)]
    lp = lm_head_token_logprobs(*leaves, ids, SEGMENTS, chunk)
    lp.backward(g_out)
    ref_leaves = [x.double().requires_grad_(True) for x in (h, w, b)]
    ref = lm_head_token_logprobs_ref(*ref_leaves, ids, SEGMENTS)
    ref.backward(g_out.double())
    # the reference's logit gradient, for the elementwise bound
    z = h.double() @ w.double().t() + b.double()
    temps = torch.tensor([t if t > 0 else 1.0 for n, t in SEGMENTS for _ in range(n)], dtype=torch.float64)
    p = torch.softmax(z / temps[:, None], -1)
    dz = (torch.nn.functional.one_hot(ids, V).double() - p) * g_out.double()[:, None] / temps[:, None]
    dh, dw, db = (x.grad.double() for x in leaves)
    assert torch.allclose(ref, lp.double(), rtol=0, atol=1e-4)
    assert bool(((dh - ref_leaves[0].grad).abs() <= _bound(dz, w.double(), V)).all())
    assert bool(((dw - ref_leaves[1].grad).abs() <= _bound(dz.t(), h.double(), R)).all())
    assert bool(((db - ref_leaves[2].grad).abs() <= 4 * R * 2.0 ** -24 * dz.abs().sum(0) + 1e-12).all())
    # and the bound is not vacuous: a gradient that drops the softmax term violates it
    wrong = (torch.nn.functional.one_hot(ids, V).double() * g_out.double()[:, None] / temps[:, None]) @ w.double()
    assert not bool(((wrong - ref_leaves[0].grad).abs() <= _bound(dz, w.double(), V)).all())


def test_gradient_float64_gradcheck():
    h, w, b, ids = _inputs(torch.float64, seed=2)
    segs = [(3, 0.7), (2, 0.0), (4, 1.0)]
    h, ids = h[:9], ids[:9]
    args = [x[:, :6].clone().requires_grad_(True) for x in (h, w)] + [b.clone().requires_grad_(True)]
    assert torch.autograd.gradcheck(lambda a, c, d: lm_head_token_logprobs(a, c, d, ids, segs, 4), args)


def test_backward_deterministic():
    h, w, b, ids = _inputs(torch.bfloat16, seed=4)
    grads = []
    for _ in range(2):
        leaves = [x.clone().requires_grad_(True) for x in (h, w, b)]
        lm_head_token_logprobs(*leaves, ids, SEGMENTS, 16).sum().backward()
        grads.append([x.grad for x in leaves])
    for a, c in zip(*grads):
        assert torch.equal(a, c)


@pytest.mark.parametrize("segments, chunk, match", [
    ([(R - 1, 1.0)], 8, "segments"),
    ([(R + 1, 1.0), (-1, 1.0)], 8, "segments"),
    ([(R, -0.5)], 8, "temperature"),
    ([(R, 1.0)], 0, "chunk_rows"),
])
def test_bad_arguments(segments, chunk, match):
    h, w, b, ids = _inputs(torch.float32)
    with pytest.raises(ValueError, match=match):
        lm_head_token_logprobs(h, w, b, ids, segments, chunk)


def test_bad_token_id():
    h, w, b, ids = _inputs(torch.float32)
    ids = ids.clone()
    ids[3] = V
    with pytest.raises(ValueError, match=f"token id {V} at position 3"):
        lm_head_token_logprobs(h, w, b, ids, SEGMENTS, 8)
