"""``kda_chunk``'s GPU autograd (zmrl/kernels_batch_invariant/triton/kda_chunk_bwd.py), on the CPU.

fla-core's kernels need a GPU, so here its ``chunk_kda`` is replaced by a stand-in with fla's calling
convention ([1, T, H, d] inputs, ``cu_seqlens`` + ``cu_seqlens_cpu``, fp32 ``initial_state`` with one
row per non-empty sequence, returns ``(o, final)``) that computes zmrl's torch composition. That checks
the glue (layout, casts, empty sequences, initial-state gradients, the fallback rules) exactly; the
GPU test (tests/kernels/triton/test_kda_chunk_bwd_gpu.py) checks fla's real gradients against float64.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from zmrl.kernels_batch_invariant.kda import kda_chunk  # noqa: E402
from zmrl.kernels_batch_invariant.triton import kda_chunk_bwd  # noqa: E402

from .triton.test_kda_chunk import make_inputs  # noqa: E402

REF = kda_chunk.impls["torch"]
op = kda_chunk_bwd.with_fla_backward(REF)(REF)  # the decorator as kda_chunk.py applies it, CPU forward


class FakeFla:
    """fla's ``chunk_kda`` calling convention around zmrl's torch composition; records its calls."""

    def __init__(self):
        self.calls = []

    def __call__(self, q, k, v, g, beta, *, scale, initial_state, output_final_state, cu_seqlens,
                 cu_seqlens_cpu, disable_recompute):
        assert q.dim() == 4 and q.shape[0] == 1 and k.shape == q.shape and g.shape == q.shape
        assert beta.shape == q.shape[:3] and v.shape[:3] == q.shape[:3]
        assert g.dtype == torch.float32 and q.dtype == k.dtype == v.dtype == beta.dtype
        assert cu_seqlens_cpu.device.type == "cpu" and torch.equal(cu_seqlens.cpu(), cu_seqlens_cpu)
        assert bool((cu_seqlens_cpu[1:] > cu_seqlens_cpu[:-1]).all()), "empty sequences reach fla"
        n = cu_seqlens_cpu.numel() - 1
        assert initial_state is None or (initial_state.dtype == torch.float32 and initial_state.shape[0] == n)
        assert not output_final_state and disable_recompute
        self.calls.append(dict(dtype=q.dtype, n=n, scale=scale))
        o, _, _ = REF(q[0], k[0], v[0], g[0], beta[0], cu_seqlens, initial_state, scale)
        return o[None], None


@pytest.fixture
def fake(monkeypatch):
    f = FakeFla()
    monkeypatch.setattr(kda_chunk_bwd, "fla_backend_for", lambda q: f)
    return f


def _grads(fn, leaves, cu, w_o, w_s=None, scale=None):
    leaves = [x.detach().clone().requires_grad_(True) if x is not None else None for x in leaves]
    o, st, _ = fn(*leaves[:5], cu, leaves[5], scale)
    loss = (o.float() * w_o).sum() + (0.0 if w_s is None else (st * w_s).sum())
    loss.backward()
    return [None if x is None else x.grad for x in leaves]


LENS = [70, 0, 5, 64, 1]  # a partial chunk after a full one, an empty sequence, exact chunk, one row


@pytest.mark.parametrize("with_state", [True, False])
def test_fla_path_glue_equals_reference_gradients(fake, with_state):
    q, k, v, g, beta, cu, s0 = make_inputs(LENS, 2, 16, 8, torch.device("cpu"), seed=3, with_state=with_state)
    w_o = torch.randn(v.shape, generator=torch.Generator().manual_seed(0))
    ref = _grads(REF, [q, k, v, g, beta, s0], cu, w_o, scale=0.3)
    got = _grads(op, [q, k, v, g, beta, s0], cu, w_o, scale=0.3)
    assert fake.calls == [dict(dtype=torch.float32, n=4, scale=0.3)]
    for name, a, b in zip(("q", "k", "v", "g", "beta", "initial_state"), got, ref):
        if b is None:
            assert a is None
            continue
        assert a.dtype == b.dtype and a.shape == b.shape
        # Same math, same fp32 composition; dropping the empty sequence changes only batch layout.
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=f"d{name}")
    if with_state:
        assert torch.equal(got[5][1], torch.zeros_like(got[5][1])), "empty sequence's state got a gradient"


def test_bf16_values_run_fla_in_bf16(fake):
    """With bf16 v (the model's dtype) q, k, beta go to fla in bf16 too, g stays fp32, and the gradients
    come back in the inputs' dtypes."""
    q, k, v, g, beta, cu, s0 = make_inputs([70, 5], 2, 16, 16, torch.device("cpu"), seed=4,
                                           v_dtype=torch.bfloat16)
    w_o = torch.randn(v.shape, generator=torch.Generator().manual_seed(0))
    got = _grads(op, [q, k, v, g, beta, s0], cu, w_o)
    ref = _grads(REF, [q, k, v, g, beta, s0], cu, w_o)
    assert fake.calls[0]["dtype"] == torch.bfloat16
    for name, a, b in zip(("q", "k", "v", "g", "beta", "initial_state"), got, ref):
        assert a.dtype == b.dtype, name
        # bf16 operands: a few units of 2^-8 relative to the gradient's scale
        err = (a.float() - b.float()).abs().max().item()
        assert err <= 5e-2 * b.float().abs().max().item(), f"d{name}: {err:.3e}"


def test_state_gradient_falls_back_to_reference(fake):
    """zmrl's final state (after the last complete chunk) is not fla's: a gradient into it must take the
    torch-composition backward, which is exactly autograd of the reference."""
    q, k, v, g, beta, cu, s0 = make_inputs(LENS, 2, 16, 8, torch.device("cpu"), seed=5)
    gen = torch.Generator().manual_seed(1)
    w_o, w_s = torch.randn(v.shape, generator=gen), torch.randn(s0.shape, generator=gen)
    ref = _grads(REF, [q, k, v, g, beta, s0], cu, w_o, w_s)
    got = _grads(op, [q, k, v, g, beta, s0], cu, w_o, w_s)
    assert fake.calls == []
    for name, a, b in zip(("q", "k", "v", "g", "beta", "initial_state"), got, ref):
        assert torch.equal(a, b), f"d{name}"


def test_cpu_and_float64_use_the_reference():
    """No fla on CPU or for float64 (gradcheck): the backward is autograd of the torch composition."""
    assert kda_chunk_bwd.fla_backend_for(torch.zeros(1)) is None
    q, k, v, g, beta, cu, s0 = make_inputs([9, 3], 1, 4, 4, torch.device("cpu"), seed=6)
    leaves = [x.double().requires_grad_(True) for x in (q, k, v, g, beta, s0)]

    def f(q, k, v, g, beta, s0):
        o, st, _ = op(q, k, v, g, beta, cu, s0)
        return o, st

    assert torch.autograd.gradcheck(f, leaves, eps=1e-6, atol=1e-6)


def test_no_grad_runs_the_forward_only(fake):
    q, k, v, g, beta, cu, s0 = make_inputs([9], 1, 4, 4, torch.device("cpu"), seed=7)
    o, st, cs = op(q, k, v, g, beta, cu, s0, output_chunk_states=True)
    o2, st2, cs2 = REF(q, k, v, g, beta, cu, s0, output_chunk_states=True)
    assert torch.equal(o, o2) and torch.equal(st, st2) and torch.equal(cs, cs2)
    assert not o.requires_grad


def test_all_sequences_empty(fake):
    q, k, v, g, beta, cu, s0 = make_inputs([0, 0], 1, 4, 4, torch.device("cpu"), seed=8)
    got = _grads(op, [q, k, v, g, beta, s0], cu, torch.zeros(v.shape))
    assert fake.calls == []
    assert all(x is None or not x.any() for x in got)
