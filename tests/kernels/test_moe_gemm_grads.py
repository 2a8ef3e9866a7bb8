"""The grouped torch backward of ``expert_linear`` (moe_gemm_grads.py): against autograd of the float64
reference and against the per-expert loop it replaces (autograd through one ``linear`` per expert),
on ragged expert counts (empty experts, counts in several size classes, one expert taking everything),
for per-expert and stacked weights; determinism; the size-class buckets.

Tolerance. Inputs are fp32 and the GEMMs accumulate in fp32 (u = 2^-24). dx[r] = sum_n gy[r, n] W_e[n]
is a length-N dot, dW_e = sum over the expert's rows r of gy[r]^T x[r] a length-count dot; the rounding
error of a length-L fp32 dot is at most about L u sum |terms| (recursive summation; blocked orders
are smaller). Asserted elementwise: |err| <= 2 L u (|gy| @ |W| resp. |gy|^T @ |x|) + 1e-30, which a
correct fp32 computation meets and a wrong expert assignment (O(|gy||W|) errors) does not.
"""
from __future__ import annotations

import itertools

import pytest
import torch

from zmrl.kernels_batch_invariant import moe_gemm_grads
from zmrl.kernels_batch_invariant.moe_gemm import _per_expert_linear, expert_linear, expert_linear_ref
from zmrl.kernels_batch_invariant.moe_gemm_grads import expert_linear_grads, size_buckets

U = 2.0 ** -24
N, K = 24, 40
COUNTS = [
    [3, 0, 21, 1, 8, 9, 0, 2],  # empty experts, several size classes, one-row experts
    [0, 0, 50, 0],  # one expert takes every row
    [5, 5, 5],  # one class
]


@pytest.fixture(autouse=True)
def _torch_path(monkeypatch):
    """This file tests the torch path. Under TRITON_INTERPRET=1 CPU tensors would take the Triton kernels
    (triton/expert_grads.py), whose own tests are tests/kernels/triton/test_expert_grads.py."""
    monkeypatch.setattr(moe_gemm_grads, "_kernel_grads", None)


def _offsets(counts):
    return [0, *itertools.accumulate(counts)]


def _case(counts, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    ws = [torch.randn(N, K, generator=g).to(dtype) for _ in counts]
    x = torch.randn(sum(counts), K, generator=g).to(dtype)
    gy = torch.randn(sum(counts), N, generator=g)
    return ws, x, gy


def _grads(fn, x, weights, off, gy, out_dtype):
    xl = x.clone().requires_grad_(True)
    if isinstance(weights, torch.Tensor):
        wl = [weights.clone().requires_grad_(True)]
        y = fn(xl, wl[0], off, out_dtype)
    else:
        wl = [w.clone().requires_grad_(True) for w in weights]
        y = fn(xl, wl, off, out_dtype)
    y.backward(gy.to(y.dtype))
    return xl.grad, [w.grad for w in wl]


@pytest.mark.parametrize("counts", COUNTS)
@pytest.mark.parametrize("stacked", [False, True])
def test_matches_float64_and_per_expert_loop(counts, stacked):
    ws, x, gy = _case(counts, torch.float32)
    off = _offsets(counts)
    weights = torch.stack(ws) if stacked else ws
    dx, dws = _grads(lambda a, w, o, d: expert_linear(a, w, o, out_dtype=d), x, weights, off, gy, torch.float32)
    # the implementation it replaces: autograd through one invariant linear per expert
    dx_old, dws_old = _grads(_per_expert_linear, x, weights, off, gy, torch.float32)
    # float64 reference
    x64 = x.double().requires_grad_(True)
    w64 = [w.double().requires_grad_(True) for w in ws]
    expert_linear_ref(x64, w64, off).backward(gy.double())
    dw64 = torch.stack([torch.zeros_like(w) if w.grad is None else w.grad for w in w64])
    dw = dws[0] if stacked else torch.stack([torch.zeros(N, K) if d is None else d for d in dws])
    dw_old = dws_old[0] if stacked else torch.stack([torch.zeros(N, K) if d is None else d for d in dws_old])
    for e, (a, b) in enumerate(zip(off, off[1:])):
        bx = 2 * N * U * (gy[a:b].double().abs() @ ws[e].double().abs()) + 1e-30
        bw = 2 * max(b - a, 1) * U * (gy[a:b].double().abs().t() @ x[a:b].double().abs()) + 1e-30
        for got_x, got_w in ((dx, dw), (dx_old, dw_old)):
            assert bool(((got_x[a:b].double() - x64.grad[a:b]).abs() <= bx).all()), e
            assert bool(((got_w[e].double() - dw64[e]).abs() <= bw).all()), e
        if a == b and stacked:
            assert not dw[e].any(), "an expert without rows gets a zero gradient"
        if a == b and not stacked:
            assert dws[e] is None and dws_old[e] is None, "an expert without rows gets no gradient, as in autograd"
    # and the bound is not vacuous: a gradient through the wrong expert's weight breaks it
    if len(counts) > 1 and counts[0] and counts[2]:
        wrong = gy[: off[1]].double() @ ws[2].double()
        bx = 2 * N * U * (gy[: off[1]].double().abs() @ ws[0].double().abs())
        assert not bool(((wrong - x64.grad[: off[1]]).abs() <= bx).all())


@pytest.mark.parametrize("stacked", [False, True])
def test_bf16_close_to_per_expert_loop(stacked):
    counts = COUNTS[0]
    ws, x, gy = _case(counts, torch.bfloat16, seed=3)
    off = _offsets(counts)
    weights = torch.stack(ws) if stacked else ws
    new = _grads(lambda a, w, o, d: expert_linear(a, w, o, out_dtype=d), x, weights, off, gy, torch.float32)
    old = _grads(_per_expert_linear, x, weights, off, gy, torch.float32)
    # both compute in fp32 on the CPU and round once to bf16: at most one bf16 ulp apart
    for a, b in zip([new[0], *new[1]], [old[0], *old[1]]):
        assert (a is None) == (b is None)
        if a is None:
            continue
        assert torch.allclose(a.float(), b.float(), rtol=2 ** -7, atol=1e-6)


def test_deterministic():
    counts = COUNTS[0]
    ws, x, gy = _case(counts, torch.float32, seed=5)
    off = _offsets(counts)
    runs = [expert_linear_grads(gy, x, torch.stack(ws), off, True, [True], torch.float32) for _ in range(2)]
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1][0], runs[1][1][0])


def test_only_requested_gradients():
    counts = COUNTS[2]
    ws, x, gy = _case(counts, torch.float32)
    dx, dws = expert_linear_grads(gy, None, ws, _offsets(counts), True, [False] * 3, torch.float32)
    assert dx is not None and dws == [None, None, None]
    dx, dws = expert_linear_grads(gy, x, ws, _offsets(counts), False, [True, False, True], torch.float32)
    assert dx is None and dws[1] is None and dws[0] is not None and dws[2] is not None


def test_size_buckets():
    counts = [0, 1, 2, 3, 4, 5, 8, 9, 1000, 0, 513, 512]
    buckets = size_buckets(counts)
    assert sorted(e for b in buckets for e in b) == [e for e, c in enumerate(counts) if c]
    for b in buckets:
        cs = [counts[e] for e in b]
        assert max(cs) < 2 * min(cs) or max(cs) == 1
    assert len(buckets) <= (max(counts) - 1).bit_length() + 1
    assert size_buckets([0, 0]) == []
