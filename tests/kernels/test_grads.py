"""Closed-form backwards (zmrl/kernels_batch_invariant/grads.py) against autograd of float64 references.

Each op's gradient is computed three ways on ragged shapes: the closed form on fp32 inputs (what the
GPU path runs after a Triton forward), through ``with_analytic_backward`` around the op's torch
backend (the autograd wiring), and autograd of the op's torch composition in float64. fp32 closed
forms differ from float64 by fp32 rounding of a handful of ops per element plus a row reduction:
~1e-7 relative measured; 1e-5 of the gradient's scale leaves margin, while a wrong formula is O(1).
Determinism: the closed form run twice gives equal bits.
"""
from __future__ import annotations

import pytest
import torch

from zmrl.kernels_batch_invariant import grads as G
from zmrl.kernels_batch_invariant.glu import situ_glu, swiglu
from zmrl.kernels_batch_invariant.kda_gate import kda_gate
from zmrl.kernels_batch_invariant.l2norm import l2_norm
from zmrl.kernels_batch_invariant.norms import layer_norm, rms_norm, rms_norm_gated
from zmrl.kernels_batch_invariant.short_conv import causal_short_conv

pytest.importorskip("triton")
from zmrl.kernels_batch_invariant.triton._autograd import with_analytic_backward  # noqa: E402

GEN = torch.Generator().manual_seed(0)


def rnd(*shape, scale=1.0, dtype=torch.float32):
    return (torch.randn(*shape, generator=GEN) * scale).to(dtype)


CU = torch.tensor([0, 5, 6, 6, 19, 20], dtype=torch.int64)  # lengths 5, 1, 0, 13, 1 (shorter than W-1 too)


def cases():
    """(name, op, grads_fn, kwargs: tensors that get gradients + other args, output index weights)."""
    t, d = 20, 24
    yield "rms_norm", rms_norm, G.rms_norm_grads, dict(x=rnd(t, d), weight=rnd(d, scale=0.5) + 1, eps=1e-5)
    yield "rms_norm_no_w", rms_norm, G.rms_norm_grads, dict(x=rnd(3, t, d), weight=None, eps=1e-6)
    yield "rms_norm_gated", rms_norm_gated, G.rms_norm_gated_grads, dict(
        x=rnd(t, 3, 16), gate=rnd(t, 3, 16), weight=rnd(16) + 1, eps=1e-5)
    yield "layer_norm", layer_norm, G.layer_norm_grads, dict(
        x=rnd(t, d, scale=2.0) + 0.5, weight=rnd(d) + 1, bias=rnd(d), eps=1e-6)
    yield "l2_norm", l2_norm, G.l2_norm_grads, dict(x=rnd(t, 3, 16), eps=1e-6)
    yield "kda_gate", kda_gate, G.kda_gate_grads, dict(
        z=rnd(t, 3 * 8), A_log=rnd(3, scale=0.5), dt_bias=rnd(3 * 8), num_heads=3, lower_bound=None)
    yield "kda_gate_lb", kda_gate, G.kda_gate_grads, dict(
        z=rnd(t, 3 * 8), A_log=rnd(1, 1, 3, 1, scale=0.5), dt_bias=rnd(3 * 8), num_heads=3, lower_bound=-5.0)
    yield "swiglu", swiglu, G.swiglu_grads, dict(gate=rnd(t, d, scale=3.0), up=rnd(t, d))
    yield "situ_glu", situ_glu, G.situ_glu_grads, dict(gate=rnd(t, d, scale=5.0), up=rnd(t, d, scale=30.0))
    for act in ("silu", None):
        yield f"short_conv_{act}", causal_short_conv, G.causal_short_conv_grads, dict(
            x=rnd(20, 12), weight=rnd(12, 1, 4, scale=0.5), cu_seqlens=CU, conv_state=rnd(5, 3, 12), activation=act)
    yield "short_conv_nostate", causal_short_conv, G.causal_short_conv_grads, dict(
        x=rnd(20, 12), weight=rnd(12, 4, scale=0.5), cu_seqlens=CU, conv_state=None, activation="silu")


CASES = list(cases())


def _loss(out, weights):
    outs = out if isinstance(out, tuple) else (out,)
    return sum((o.double() * w).sum() for o, w in zip(outs, weights))


def _grads_via(fn, kwargs, weights, dtype):
    leaves = {k: (v.detach().to(dtype).requires_grad_(True) if isinstance(v, torch.Tensor) and v.is_floating_point()
                  else v) for k, v in kwargs.items()}
    _loss(fn(**leaves), weights).backward()
    return {k: v.grad for k, v in leaves.items() if isinstance(v, torch.Tensor) and v.requires_grad}


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_closed_form_matches_float64(case):
    name, op, grads_fn, kwargs = case
    ref_impl = op.impls["torch"]
    out = ref_impl(**kwargs)
    outs = out if isinstance(out, tuple) else (out,)
    weights = [torch.randn(o.shape, generator=GEN, dtype=torch.float64) for o in outs]
    g64 = _grads_via(ref_impl, kwargs, weights, torch.float64)
    wrapped = with_analytic_backward(ref_impl, grads_fn)(ref_impl)
    g_wrapped = _grads_via(wrapped, kwargs, weights, torch.float32)
    needs = {k: isinstance(v, torch.Tensor) and v.is_floating_point() for k, v in kwargs.items()}
    direct = grads_fn(tuple(w.float() for w in weights), needs, kwargs)
    again = grads_fn(tuple(w.float() for w in weights), needs, kwargs)
    assert g64.keys() == g_wrapped.keys()
    for k, ref in g64.items():
        for label, got in (("wrapped", g_wrapped[k]), ("direct", direct[k])):
            assert got is not None and got.shape == kwargs[k].shape and got.dtype == kwargs[k].dtype, (label, k)
            err = (got.double() - ref).abs().max().item()
            assert err <= 1e-5 * max(ref.abs().max().item(), 1e-3), f"{name} d{k} ({label}): {err:.2e}"
        assert torch.equal(direct[k], again[k])


def test_bf16_inputs_get_bf16_gradients():
    x, gate = rnd(6, 16, dtype=torch.bfloat16), rnd(6, 16, dtype=torch.bfloat16)
    w = rnd(16).to(torch.bfloat16)
    out = G.rms_norm_gated_grads((torch.ones(6, 16),), {"x": True, "gate": True, "weight": True},
                                 dict(x=x, gate=gate, weight=w, eps=1e-5))
    assert all(out[k].dtype == torch.bfloat16 for k in ("x", "gate", "weight"))


def test_short_conv_state_gradient():
    """A gradient into the returned conv state (the engine's carry) flows back to x and the old state."""
    kwargs = dict(x=rnd(20, 12), weight=rnd(12, 4), cu_seqlens=CU, conv_state=rnd(5, 3, 12), activation="silu")
    ref_impl = causal_short_conv.impls["torch"]
    weights = [torch.zeros(20, 12, dtype=torch.float64), torch.randn(5, 3, 12, generator=GEN, dtype=torch.float64)]
    g64 = _grads_via(ref_impl, kwargs, weights, torch.float64)
    got = _grads_via(with_analytic_backward(ref_impl, G.causal_short_conv_grads)(ref_impl), kwargs, weights,
                     torch.float32)
    for k in ("x", "conv_state"):
        torch.testing.assert_close(got[k].double(), g64[k], rtol=0, atol=1e-6)


def test_short_conv_device_window_index_matches_host():
    """The short conv's backward builds its window indices on the GPU with ``_device_window_index``;
    they must be ``_window_index``'s (ragged sequences, one shorter than the window)."""
    from zmrl.kernels_batch_invariant.short_conv import _device_window_index, _window_index

    cu = torch.tensor([0, 5, 7, 20, 21])
    for w in (2, 4):
        host, dev = _window_index(cu, 21, w), _device_window_index(cu, 21, w)
        assert all(torch.equal(a, b) for a, b in zip(host, dev))
