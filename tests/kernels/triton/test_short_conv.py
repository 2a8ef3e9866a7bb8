"""Triton causal_short_conv: float64 reference (packed varlen, with and without decode state),
invariance to the other sequences of the pack and to chunking, gradients."""
from __future__ import annotations

import pytest
import torch

from zmrl.kernels_batch_invariant.short_conv import causal_short_conv, causal_short_conv_pooled, causal_short_conv_ref
from zmrl.kernels_batch_invariant.triton import triton_impl

from .rowwise_helpers import randn

pytestmark = [pytest.mark.gpu, pytest.mark.triton]

# W = 4 fp32 products and adds (<= 4 roundings of the window's magnitude), then SiLU (exp: few ulp):
# ~1e-6 relative to sum|w x|; atol 1e-5 at unit-scale inputs, rtol 1e-5.
RTOL, ATOL = 1e-5, 1e-5
W = 4


def _cu(lens: list[int], device) -> torch.Tensor:
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int64, device=device)


def _conv(*args, **kwargs):
    return triton_impl(causal_short_conv)(*args, **kwargs)


@pytest.mark.parametrize("activation", [None, "silu"])
@pytest.mark.parametrize("with_state", [False, True])
def test_matches_float64(device, interpret, activation, with_state) -> None:
    c = 37 if interpret else 3 * 2048  # bench: q/k/v of 16 heads x 128, convolved together
    for lens in ([1, 5, 2, 9], [3], [1, 1, 1]):
        x = randn(sum(lens), c, device=device, seed=sum(lens))
        w = randn(c, W, device=device, seed=1, scale=0.5)
        st = randn(len(lens), W - 1, c, device=device, seed=2) if with_state else None
        y, ns = _conv(x, w, _cu(lens, device), st, activation)
        yr, nr = causal_short_conv_ref(x, w, _cu(lens, device), st, activation)
        assert y.dtype == x.dtype and y.shape == x.shape and ns.shape == (len(lens), W - 1, c)
        torch.testing.assert_close(y.double(), yr, rtol=RTOL, atol=ATOL)
        assert torch.equal(ns.double(), nr)  # the state is a copy of inputs
    # bf16 activations, HF weight layout [C, 1, W]
    x = randn(8, c, device=device, seed=3, dtype=torch.bfloat16)
    w = randn(c, 1, W, device=device, seed=4, scale=0.5)
    y, ns = _conv(x, w, _cu([3, 5], device), None, activation)
    assert y.dtype == torch.bfloat16 and ns.dtype == torch.bfloat16
    yr, _ = causal_short_conv_ref(x, w, _cu([3, 5], device), None, activation)
    torch.testing.assert_close(y.double(), yr, rtol=1e-2, atol=1e-2)  # bf16 output: 2^-8 relative


def test_empty_sequences_and_errors(device, interpret) -> None:
    c = 9
    lens = [2, 0, 3, 0]
    x = randn(5, c, device=device, seed=0)
    w = randn(c, W, device=device, seed=1)
    st = randn(4, W - 1, c, device=device, seed=2)
    y, ns = _conv(x, w, _cu(lens, device), st)
    yt, nt = causal_short_conv.impls["torch"](x, w, _cu(lens, device), st)
    torch.testing.assert_close(y, yt, rtol=RTOL, atol=ATOL)
    assert torch.equal(ns, nt)  # an empty sequence keeps its state
    with pytest.raises(ValueError, match="unsupported activation 'relu'"):
        _conv(x, w, _cu(lens, device), None, "relu")


def test_pack_and_chunk_invariance(device, interpret) -> None:
    """A sequence's outputs are the same bits alone, inside packs of other sequences (any order,
    any count), and when fed in chunks carrying the state (prefill in pieces, then decode)."""
    c = 40 if interpret else 3 * 2048
    lens = [1, 2, 5, 9, 3, 17] if interpret else [1, 2, 5, 9, 3, 17, 64, 129, 300]
    xs = [randn(n, c, device=device, seed=10 + i, dtype=torch.bfloat16) for i, n in enumerate(lens)]
    w = randn(c, W, device=device, seed=1, scale=0.5)
    alone = [_conv(x, w, _cu([x.shape[0]], device)) for x in xs]
    g = torch.Generator().manual_seed(0)
    for count in ([2, 3, 6] if interpret else [2, 3, 9, 9]):
        order = torch.randperm(len(lens), generator=g)[:count].tolist()
        y, ns = _conv(torch.cat([xs[i] for i in order]), w, _cu([lens[i] for i in order], device))
        ys = y.split([lens[i] for i in order])
        for k, i in enumerate(order):
            assert torch.equal(ys[k], alone[i][0]), f"sequence {i} changed inside a pack"
            assert torch.equal(ns[k], alone[i][1][0])
    # chunked: pieces of 3, then tokens one at a time, carrying the state
    for i in range(len(lens)):
        x, pos, st, outs = xs[i], 0, None, []
        while pos < x.shape[0]:
            step = 3 if pos == 0 else 1
            y, st = _conv(x[pos:pos + step], w, _cu([min(step, x.shape[0] - pos)], device), st)
            outs.append(y)
            pos += step
        assert torch.equal(torch.cat(outs), alone[i][0]) and torch.equal(st, alone[i][1])


def test_rows_in_place_and_given_sequence_index(device, interpret) -> None:
    """x as a column slice of a wider tensor (q|k|v inside the fused projection output) and the caller's
    token -> sequence map: the bits of a contiguous x with the kernel's own lookup."""
    lens, c = [3, 1, 5], 24
    cu = _cu(lens, device)
    wide = randn(sum(lens), c + 10, device=device, seed=31, dtype=torch.bfloat16)
    x = wide[:, :c]
    w = randn(c, W, device=device, seed=32, dtype=torch.bfloat16)
    st = randn(len(lens), W - 1, c, device=device, seed=33, dtype=torch.bfloat16)
    seq = torch.repeat_interleave(torch.arange(len(lens), device=device), torch.tensor(lens, device=device))
    y0, s0 = _conv(x.contiguous(), w, cu, st)
    y1, s1 = _conv(x, w, cu, st, "silu", seq)
    assert torch.equal(y0, y1) and torch.equal(s0, s1)


@pytest.mark.parametrize("blocks", [1, 2, 3])
def test_pooled_is_gather_conv_scatter(device, interpret, blocks) -> None:
    """The engine's decode form: states in a pool at shuffled rows (one token per sequence, and a longer
    sequence), the weight as up to three channel blocks, x a column slice: y and the pool's rows are the bits
    of causal_short_conv on the gathered states with the concatenated weight; other pool rows untouched."""
    c = 24
    for lens in ([1, 1, 1, 1], [1, 2, 0, 5]):
        n = len(lens)
        cu = _cu(lens, device)
        x = randn(sum(lens), c + 8, device=device, seed=41, dtype=torch.bfloat16)[:, 4: 4 + c]
        split = {1: [c], 2: [8, 16], 3: [8, 8, 8]}[blocks]
        ws = [randn(k, 1, W, device=device, seed=42 + i, dtype=torch.bfloat16) for i, k in enumerate(split)]
        pool = randn(n + 3, W - 1, c, device=device, seed=45, dtype=torch.bfloat16)
        idx = torch.tensor([5, 0, 3, 1][:n], dtype=torch.int64, device=device)
        want_y, want_st = _conv(x, torch.cat(ws).squeeze(1), cu, pool[idx].clone())
        before = pool.clone()
        y = triton_impl(causal_short_conv_pooled)(x, ws, cu, pool, idx)
        assert torch.equal(y, want_y) and torch.equal(pool[idx], want_st)
        rest = [r for r in range(n + 3) if r not in idx.tolist()]
        assert torch.equal(pool[rest], before[rest])
    with pytest.raises(ValueError, match="do not fit"):
        triton_impl(causal_short_conv_pooled)(x, ws, cu, pool[:, :, :-1].contiguous(), idx)


def test_gradients(device, interpret) -> None:
    c = 6
    lens = [2, 5]
    x = randn(7, c, device=device, seed=0).requires_grad_(True)
    w = randn(c, W, device=device, seed=1).requires_grad_(True)
    st = randn(2, W - 1, c, device=device, seed=2).requires_grad_(True)
    gy = randn(7, c, device=device, seed=3)
    gs = randn(2, W - 1, c, device=device, seed=4)
    y, ns = _conv(x, w, _cu(lens, device), st)
    got = torch.autograd.grad([y, ns], [x, w, st], [gy, gs])
    leaves = [t.detach().double().requires_grad_(True) for t in (x, w, st)]
    yr, nr = causal_short_conv_ref(leaves[0], leaves[1], _cu(lens, device), leaves[2])
    want = torch.autograd.grad([yr, nr], leaves, [gy.double(), gs.double()])
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-5)
