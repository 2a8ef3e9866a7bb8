"""Fast mode ("fast" backends: stock torch kernels, not batch-invariant) of the row-wise ops: each
runs on the CPU through the normal dispatch and is close to the float64 reference.

The fast backends are registered by the torch op modules themselves (next to the torch backend), so
these tests need neither triton nor a GPU."""
from __future__ import annotations

import pytest
import torch

from zmrl.kernels_batch_invariant import kernel_mode
from zmrl.kernels_batch_invariant.dsa_indexer import dsa_index_scores, dsa_topk
from zmrl.kernels_batch_invariant.fp8 import quantize_fp8, quantize_fp8_ref
from zmrl.kernels_batch_invariant.glu import situ_glu, situ_glu_ref, swiglu, swiglu_ref
from zmrl.kernels_batch_invariant.kda import kda_chunk
from zmrl.kernels_batch_invariant.kda_gate import kda_gate, kda_gate_ref
from zmrl.kernels_batch_invariant.l2norm import l2_norm, l2_norm_ref
from zmrl.kernels_batch_invariant.logprob import log_softmax, log_softmax_ref, token_logprobs, token_logprobs_ref
from zmrl.kernels_batch_invariant.mla_attention import mla_attention, mla_attention_dense
from zmrl.kernels_batch_invariant.moe_router import moe_combine, moe_combine_ref, moe_route, moe_route_ref
from zmrl.kernels_batch_invariant.norms import (
    layer_norm, layer_norm_ref, rms_norm, rms_norm_gated, rms_norm_gated_ref, rms_norm_ref,
)
from zmrl.kernels_batch_invariant.short_conv import causal_short_conv, causal_short_conv_ref

# stock fp32 kernels: a few ulp per op, plus reductions over <= 300 elements
TOL = dict(rtol=1e-5, atol=1e-5)


def _r(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def _fast(op, *args):
    assert "fast" in op.impls, f"{op.name} has no fast backend"
    with kernel_mode("fast"):
        assert op.backend_for(torch.device("cpu")) == "fast"
        return op(*args)


def test_fast_backends_registered() -> None:
    """The torch op modules register the fast backends, so they exist without triton (CPU installs)."""
    ops = [dsa_index_scores, dsa_topk, quantize_fp8, situ_glu, swiglu, kda_chunk, kda_gate, l2_norm, log_softmax,
           token_logprobs, mla_attention, mla_attention_dense, moe_combine, moe_route, layer_norm, rms_norm,
           rms_norm_gated, causal_short_conv]
    assert [op.name for op in ops if "fast" not in op.impls] == []


def test_kda_chunk_fast_falls_back_on_cpu() -> None:
    # fla-core's chunk_kda is CUDA-only: on the CPU the fast backend is the torch composition, bitwise.
    t, h, dk, dv = 70, 2, 8, 8
    q, k, v = _r(t, h, dk, seed=0), _r(t, h, dk, seed=1, scale=0.3), _r(t, h, dv, seed=2)
    g = -_r(t, h, dk, seed=3).abs() * 0.1
    beta = torch.sigmoid(_r(t, h, seed=4))
    cu = torch.tensor([0, 5, 70])
    got = _fast(kda_chunk, q, k, v, g, beta, cu)
    ref = kda_chunk.impls["torch"](q, k, v, g, beta, cu)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1]) and got[2] is None


def test_norms_fast() -> None:
    x, w, b, g = _r(5, 33, seed=0, scale=3), _r(33, seed=1), _r(33, seed=2), _r(5, 33, seed=3)
    torch.testing.assert_close(_fast(rms_norm, x, w, 1e-6).double(), rms_norm_ref(x, w, 1e-6), **TOL)
    torch.testing.assert_close(_fast(layer_norm, x, w, b, 1e-6).double(), layer_norm_ref(x, w, b, 1e-6), **TOL)
    torch.testing.assert_close(_fast(rms_norm_gated, x, g, w, 1e-6).double(), rms_norm_gated_ref(x, g, w, 1e-6),
                               **TOL)
    assert _fast(rms_norm, x.bfloat16(), w, 1e-6).dtype == torch.bfloat16
    assert _fast(layer_norm, x, None, None, 1e-6, torch.bfloat16).dtype == torch.bfloat16
    torch.testing.assert_close(_fast(l2_norm, x).double(), l2_norm_ref(x), **TOL)


def test_pointwise_fast() -> None:
    g, u = _r(4, 40, seed=0, scale=4), _r(4, 40, seed=1, scale=30)
    torch.testing.assert_close(_fast(swiglu, g, u).double(), swiglu_ref(g, u), **TOL)
    torch.testing.assert_close(_fast(situ_glu, g, u).double(), situ_glu_ref(g, u), **TOL)
    z, a, dt = _r(3, 4 * 8, seed=2, scale=5), _r(4, seed=3, scale=0.5), _r(32, seed=4)
    for lb in (None, -5.0):
        torch.testing.assert_close(_fast(kda_gate, z, a, dt, 4, lb).double(), kda_gate_ref(z, a, dt, 4, lb), **TOL)


def test_logprob_fast() -> None:
    logits = _r(3, 300, seed=0, scale=4)
    tok = torch.tensor([0, 17, 299])
    for t in (0.0, 1.0, 0.6):
        torch.testing.assert_close(_fast(token_logprobs, logits, tok, t).double(),
                                   token_logprobs_ref(logits, tok, t), rtol=0, atol=2e-5)
        torch.testing.assert_close(_fast(log_softmax, logits, t).double(), log_softmax_ref(logits, t),
                                   rtol=0, atol=2e-5)
    with pytest.raises(ValueError, match="token id 300 at position 0 is outside the vocabulary"):
        _fast(token_logprobs, logits, torch.tensor([300, 0, 0]))
    with pytest.raises(ValueError, match="temperature must be finite"):
        _fast(log_softmax, logits, -1.0)


def test_short_conv_fast() -> None:
    lens = [1, 4, 6]
    cu = torch.tensor([0, 1, 5, 11])
    x, w, st = _r(11, 10, seed=0), _r(10, 4, seed=1), _r(3, 3, 10, seed=2)
    for state in (None, st):
        y, ns = _fast(causal_short_conv, x, w, cu, state, "silu")
        yr, nr = causal_short_conv_ref(x, w, cu, state, "silu")
        torch.testing.assert_close(y.double(), yr, **TOL)
        assert torch.equal(ns.double(), nr) and y.shape == (sum(lens), 10)


def test_fp8_fast() -> None:
    x = _r(3, 256, seed=0) * torch.logspace(-6, 3, 256)
    x8, scale = _fast(quantize_fp8, x, 128)
    v, rscale = quantize_fp8_ref(x, 128)
    assert x8.dtype == torch.float8_e4m3fn and torch.equal(scale, rscale)
    # x * (1/s) instead of x / s: at most one e4m3 step (2^-3 relative) where the quotient sits on a tie
    torch.testing.assert_close(x8.double(), v, rtol=0.13, atol=2 ** -9)


def test_moe_fast() -> None:
    x, gw, bias = _r(6, 16, seed=0), _r(24, 16, seed=1, scale=0.25), _r(24, seed=2, scale=0.05)
    for ng, tg in ((1, 1), (4, 2)):
        got = _fast(moe_route, x, gw, bias, 3, ng, tg, True, 2.5)
        ref = moe_route_ref(x, gw, bias, 3, ng, tg, True, 2.5)
        assert torch.equal(got.expert_ids, ref.expert_ids)  # no exact ties among random scores
        torch.testing.assert_close(got.weights.double(), ref.weights, **TOL)
    eo, w = _r(5, 3, 20, seed=3), _r(5, 3, seed=4)
    torch.testing.assert_close(_fast(moe_combine, eo, w).double(), moe_combine_ref(eo, w), **TOL)
