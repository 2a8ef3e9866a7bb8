"""Causal short conv (KDA q/k/v ShortConv): accuracy, state carry and batch invariance."""
from __future__ import annotations

import random

import pytest
import torch

from zmrl.kernels_batch_invariant.short_conv import causal_short_conv, causal_short_conv_pooled, causal_short_conv_ref

from .invariance import THREAD_COUNTS

W = 4


def make(lens: list[int], c: int, dtype=torch.float32, seed: int = 0, with_state: bool = False):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(lens), c, generator=gen).to(dtype)
    weight = (0.5 * torch.randn(c, W, generator=gen)).to(dtype)
    cu = torch.tensor([0, *torch.tensor(lens, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int64)
    state = torch.randn(len(lens), W - 1, c, generator=gen).to(dtype) if with_state else None
    return x, weight, cu, state


@pytest.mark.parametrize("lens", [[1], [3], [64], [1, 3, 17, 64, 100, 2]])
@pytest.mark.parametrize("c", [32, 48])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("activation", ["silu", None])
def test_matches_reference(lens, c, dtype, with_state, activation):
    x, weight, cu, state = make(lens, c, dtype, seed=sum(lens) + c, with_state=with_state)
    y, new_state = causal_short_conv(x, weight, cu, state, activation=activation)
    assert y.shape == x.shape and y.dtype == dtype
    assert new_state.shape == (len(lens), W - 1, c) and new_state.dtype == dtype
    y_ref, st_ref = causal_short_conv_ref(x, weight, cu, state, activation=activation)
    # fp32: a 4-term sum (+ SiLU from exp and a divide) is a few ulp, <= 1e-6 relative for values
    # of order 1; bf16 adds one rounding of y to 8 bits (2^-8 relative). A wrong tap order, a
    # window crossing into the neighbouring sequence or a missing state gives O(1) errors.
    tol = 1e-6 if dtype == torch.float32 else 2**-8
    torch.testing.assert_close(y.double(), y_ref, rtol=tol, atol=tol)
    # The state is a copy of inputs: exact.
    assert torch.equal(new_state.double(), st_ref)


def test_state_carry_is_bitwise():
    """Split sequences at random points (pieces shorter than W-1 included) and carry the state:
    outputs and the final state are bitwise the one-shot result."""
    lens = [1, 5, 70, 33]
    c = 24
    x, weight, cu, _ = make(lens, c, seed=3)
    y_ref, st_ref = causal_short_conv(x, weight, cu)
    rng = random.Random(0)
    for s, n in enumerate(lens):
        xs = x[int(cu[s]) : int(cu[s + 1])]
        for _ in range(5):
            cuts = sorted(rng.sample(range(1, n), k=min(n - 1, rng.randint(1, 6)))) if n > 1 else []
            bounds = [0, *cuts, n]
            state, ys = None, []
            for a, b in zip(bounds[:-1], bounds[1:]):
                y, state = causal_short_conv(xs[a:b], weight, torch.tensor([0, b - a]), state)
                ys.append(y)
            assert torch.equal(torch.cat(ys), y_ref[int(cu[s]) : int(cu[s + 1])])
            assert torch.equal(state[0], st_ref[s])


def test_zero_length_sequence_keeps_state():
    x, weight, cu, state = make([0, 4, 0], 16, seed=4, with_state=True)
    y, new_state = causal_short_conv(x, weight, cu, state)
    assert y.shape == (4, 16)
    assert torch.equal(new_state[0], state[0]) and torch.equal(new_state[2], state[2])


def test_invariant_to_packing_and_threads():
    lens = [37, 1, 64, 5, 101]
    c = 40  # not a multiple of the SIMD width: elements land in both the bulk and the tail
    x, weight, cu, state = make(lens, c, seed=5, with_state=True)
    y_all, st_all = causal_short_conv(x, weight, cu, state)
    rng = random.Random(2)
    prev = torch.get_num_threads()
    try:
        for threads in THREAD_COUNTS:
            torch.set_num_threads(threads)
            for s in range(len(lens)):
                xs = x[int(cu[s]) : int(cu[s + 1])]
                y1, st1 = causal_short_conv(xs, weight, torch.tensor([0, lens[s]]), state[s : s + 1])
                assert torch.equal(y1, y_all[int(cu[s]) : int(cu[s + 1])])
                assert torch.equal(st1[0], st_all[s])
                order = rng.sample(range(len(lens)), k=len(lens))
                x2 = torch.cat([x[int(cu[i]) : int(cu[i + 1])] for i in order])
                cu2 = torch.tensor([0, *torch.tensor([lens[i] for i in order]).cumsum(0).tolist()])
                y2, st2 = causal_short_conv(x2, weight, cu2, state[order])
                p = order.index(s)
                assert torch.equal(y2[int(cu2[p]) : int(cu2[p + 1])], y_all[int(cu[s]) : int(cu[s + 1])])
                assert torch.equal(st2[p], st_all[s])
    finally:
        torch.set_num_threads(prev)


def test_pooled_is_gather_conv_scatter_at_every_thread_count():
    """The decode form (states in a pool at given rows, the weight in channel blocks, x a column slice): the
    bits of causal_short_conv on the gathered states, the pool's rows replaced, the others untouched."""
    lens, c = [1, 1, 3, 1], 40
    x, weight, cu, state = make(lens, c + 6, seed=7, with_state=True)
    x, weight = x[:, 2: 2 + c], weight[:c]
    idx = torch.tensor([4, 0, 2, 5])
    pool0 = torch.randn(6, W - 1, c, generator=torch.Generator().manual_seed(8))
    want_y, want_st = causal_short_conv(x, weight, cu, pool0[idx])
    prev = torch.get_num_threads()
    try:
        for threads in THREAD_COUNTS:
            torch.set_num_threads(threads)
            pool = pool0.clone()
            y = causal_short_conv_pooled(x, [weight[:16], weight[16:24].unsqueeze(1), weight[24:]], cu, pool, idx)
            assert torch.equal(y, want_y) and torch.equal(pool[idx], want_st)
            assert torch.equal(pool[[1, 3]], pool0[[1, 3]])
    finally:
        torch.set_num_threads(prev)
    with pytest.raises(ValueError, match="1 to 3 weight blocks"):
        causal_short_conv_pooled(x, [], cu, pool, idx)


def test_gradcheck():
    x, weight, cu, state = make([5, 2, 9], 6, torch.float64, seed=6, with_state=True)
    inputs = [t.detach().requires_grad_() for t in (x, weight, state)]

    def f(x, w, s):
        return causal_short_conv(x, w, cu, s)

    assert torch.autograd.gradcheck(f, inputs, fast_mode=True)


def test_hf_weight_shape():
    x, weight, cu, state = make([9, 4], 16, seed=7, with_state=True)
    assert all(
        torch.equal(a, b)
        for a, b in zip(causal_short_conv(x, weight[:, None, :], cu, state), causal_short_conv(x, weight, cu, state))
    )
