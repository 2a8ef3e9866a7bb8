"""The chunked lm_head + log-prob on the GPU (Triton ``linear`` and ``token_logprobs``) at the bench
preset's vocabulary: bitwise equal to the unchunked call and to one-row (decode-shaped) calls, gradient
against float64, determinism, and the memory it saves.

Gradient tolerance. On CUDA with bf16 hidden states and weight the backward rounds the logit gradient
dz to bf16 (relative error <= 2^-9 per element) and runs bf16 cuBLAS GEMMs with fp32 accumulation
(rounding of the fp32 sum over V terms: <= V 2^-24 relative to sum |dz W|, about 1 % at V = 163840 in
the worst case, typically sqrt(V) 2^-24). Elementwise, |d hidden - ref| <= (2^-7 + V 2^-24) (|dz| @ |W|)
therefore holds for a correct gradient even in the worst case; a wrong one (a missing softmax term, a
wrong temperature) breaks it by orders of magnitude. The float64 reference uses the same bf16-valued inputs, so input rounding is not
part of the error.
"""
from __future__ import annotations

import pytest
import torch

from zmrl.kernels_batch_invariant import linear
from zmrl.kernels_batch_invariant.lm_head_logprobs import lm_head_token_logprobs, lm_head_token_logprobs_ref
from zmrl.kernels_batch_invariant.logprob import token_logprobs

# CUDA only, also under TRITON_INTERPRET=1 (bench-size shapes; the interpreter would take hours)
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

D, V = 2048, 163840
SEGMENTS = [(1500, 1.0), (3, 0.7), (2047, 0.7), (1, 0.0), (650, 1.0), (4000, 0.6)]
R = sum(n for n, _ in SEGMENTS)


@pytest.fixture(scope="module")
def inputs():
    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(R, D, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(V, D, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
    ids = torch.randint(0, V, (R,), device="cuda", generator=g)
    return h, w, ids


def _unchunked(h, w, ids):
    logits = linear(h, w, None, out_dtype=torch.float32)
    parts, start = [], 0
    for n, t in SEGMENTS:
        parts.append(token_logprobs(logits[start:start + n], ids[start:start + n], t))
        start += n
    return torch.cat(parts)


@pytest.mark.parametrize("chunk", [1000, 1024, 4096])
def test_bitwise_equal_to_unchunked_and_decode_rows(inputs, chunk):
    h, w, ids = inputs
    with torch.no_grad():
        want = _unchunked(h, w, ids)
        got = lm_head_token_logprobs(h, w, None, ids, SEGMENTS, chunk)
    assert torch.equal(got, want)
    temps = [t for n, t in SEGMENTS for _ in range(n)]
    with torch.no_grad():
        for r in (0, 1499, 1500, 1503, 3550, R - 1):
            one = token_logprobs(linear(h[r:r + 1], w, None, out_dtype=torch.float32), ids[r:r + 1], temps[r])
            assert torch.equal(got[r:r + 1], one), r
    got_grad = lm_head_token_logprobs(h.clone().requires_grad_(True), w, None, ids, SEGMENTS, chunk)
    assert torch.equal(got_grad.detach(), want)


def test_gradient_vs_float64_and_deterministic(inputs):
    h, w, ids = inputs
    rows = 1600  # first two segments and part of the third: a float64 [rows, V] reference fits easily
    segs = [(1500, 1.0), (3, 0.7), (97, 0.7)]
    g_out = torch.randn(rows, device="cuda", generator=torch.Generator(device="cuda").manual_seed(1))
    grads = []
    for _ in range(2):
        x = h[:rows].clone().requires_grad_(True)
        lm_head_token_logprobs(x, w, None, ids[:rows], segs, 512).backward(g_out)
        grads.append(x.grad)
    assert torch.equal(grads[0], grads[1]), "backward not deterministic"
    xr = h[:rows].double().requires_grad_(True)
    lm_head_token_logprobs_ref(xr, w, None, ids[:rows], segs).backward(g_out.double())
    with torch.no_grad():
        z = xr.detach() @ w.double().t()
        temps = torch.tensor([t for n, t in segs for _ in range(n)], dtype=torch.float64, device="cuda")
        p = torch.softmax(z / temps[:, None], -1)
        p[torch.arange(rows, device="cuda"), ids[:rows]] -= 1.0
        bound = (2.0 ** -7 + V * 2.0 ** -24) * ((p * (g_out.double() / temps)[:, None]).abs() @ w.double().abs())
        err = (grads[0].double() - xr.grad).abs()
    assert bool((err <= bound).all()), f"max err/bound {float((err / bound).max()):.3f}"
    print(f"d hidden: max err/bound {float((err / bound).max()):.3e}")


def test_memory_is_chunk_bounded(inputs):
    h, w, ids = inputs
    chunk = 1024
    x = h.clone().requires_grad_(True)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    lm_head_token_logprobs(x, w, None, ids, SEGMENTS, chunk).sum().backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    chunk_logits = chunk * V * 4
    full_logits = R * V * 4
    print(f"peak above inputs {peak / 2**30:.2f} GiB; one chunk of logits {chunk_logits / 2**30:.2f} GiB, "
          f"all {R} rows {full_logits / 2**30:.2f} GiB")
    assert peak <= 4 * chunk_logits + 4 * R * D * 2, peak
    assert peak < full_logits / 2
