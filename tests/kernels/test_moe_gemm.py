"""expert_linear (torch backend): bitwise the per-expert ``linear`` calls the MoE used to make,
invariant to how many tokens each expert got; plus the fast backends of the matmul ops."""
from __future__ import annotations

import itertools

import pytest
import torch

from zmrl.kernels_batch_invariant import kernel_mode
from zmrl.kernels_batch_invariant.matmul import bmm_fixed, grouped_linear, linear
from zmrl.kernels_batch_invariant.moe_gemm import RowGather, expert_linear, expert_linear_ref

from .invariance import THREAD_COUNTS, num_threads

U32 = 2.0**-24


def _offsets(counts: list[int]) -> list[int]:
    return [0, *itertools.accumulate(counts)]


def _experts(e: int, n: int, k: int, dtype: torch.dtype, seed: int) -> tuple[torch.Generator, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return g, [torch.randn(n, k, generator=g).to(dtype) for _ in range(e)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("e,n,k,counts", [(4, 24, 40, [3, 0, 21, 1]), (3, 7, 33, [0, 5, 0]), (2, 16, 1, [1, 1])])
def test_expert_linear_is_per_expert_linear(dtype, e, n, k, counts):
    g, ws = _experts(e, n, k, dtype, seed=n + k)
    off = _offsets(counts)
    x = torch.randn(off[-1], k, generator=g).to(dtype)
    for weights in (ws, torch.stack(ws)):
        for out_dtype in (None, torch.float32):
            y = expert_linear(x, weights, off, out_dtype=out_dtype)
            assert y.shape == (off[-1], n) and y.dtype == (out_dtype or dtype)
            for i in range(e):
                a, b = off[i], off[i + 1]
                assert torch.equal(y[a:b], linear(x[a:b], weights[i], out_dtype=out_dtype))
    # offsets as a tensor; accuracy against float64 (fp32 accumulation bound, any order)
    y = expert_linear(x, ws, torch.tensor(off), out_dtype=torch.float32)
    ref = expert_linear_ref(x, ws, off)
    for i in range(e):
        a, b = off[i], off[i + 1]
        bound = (k * U32 / (1 - k * U32)) * (x[a:b].double().abs() @ ws[i].double().abs().t())
        assert ((y[a:b].double() - ref[a:b]).abs() <= bound + 1e-30).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_expert_linear_invariant_to_token_counts(dtype):
    """A (row, expert) pair has the same bits whatever the token counts of all experts are, with 1
    or 2 threads."""
    E, N, K = 6, 20, 48
    g, ws = _experts(E, N, K, dtype, seed=1)
    pool = torch.randn(20, K, generator=g).to(dtype)
    with num_threads(1):
        alone = {(e, i): expert_linear(pool[i:i + 1], ws, _offsets([int(j == e) for j in range(E)]))[0]
                 for e in range(E) for i in range(pool.shape[0])}
    pairs = list(alone)
    for threads in THREAD_COUNTS:
        with num_threads(threads):
            for total in (1, 2, 15, 16, 17, 40, 70):
                pick = torch.randint(0, len(pairs), (total,), generator=g).tolist()
                chosen = sorted((pairs[p] for p in pick), key=lambda t: t[0])
                counts = [sum(1 for e, _ in chosen if e == j) for j in range(E)]
                y = expert_linear(pool[[i for _, i in chosen]], ws, _offsets(counts))
                assert torch.equal(y, torch.stack([alone[p] for p in chosen])), (threads, total)


def test_gather_is_the_product_of_the_gathered_rows():
    """``gather`` (the MoE dispatch read in place on the GPU): the bits of the product over x[index // div],
    with and without autograd (whose gradient reaches the source rows)."""
    g = torch.Generator().manual_seed(4)
    h = torch.randn(5, 40, generator=g, requires_grad=True)
    order = torch.randperm(10, generator=g)
    w = torch.randn(3, 24, 40, generator=g)
    off = [0, 4, 4, 10]
    y = expert_linear(h, w, off, gather=RowGather(order, 2))
    rows = h[order // 2]
    assert torch.equal(y, expert_linear(rows, w, off))
    y.sum().backward()
    assert torch.equal(h.grad, torch.autograd.grad(expert_linear(rows, w, off).sum(), h)[0])
    with pytest.raises(ValueError, match="gather needs"):
        expert_linear(h, w, off, gather=RowGather(order, 0))


def test_expert_linear_grads_and_errors():
    g, ws = _experts(3, 8, 12, torch.float64, seed=2)
    ws = [w.requires_grad_(True) for w in ws]
    x = torch.randn(7, 12, generator=g, dtype=torch.float64, requires_grad=True)
    off = [0, 2, 2, 7]
    assert torch.autograd.gradcheck(lambda x_, *w_: expert_linear(x_, list(w_), off), (x, *ws))
    assert expert_linear(torch.randn(0, 12), [w.detach().float() for w in ws], [0, 0, 0, 0]).shape == (0, 8)
    for bad_off in ([0, 2, 7], [1, 2, 2, 7], [0, 3, 2, 7], [0, 2, 2, 6]):
        with pytest.raises(ValueError):
            expert_linear(x.detach(), [w.detach() for w in ws], bad_off)
    with pytest.raises(ValueError):
        expert_linear(x.detach(), [w.detach()[:, :5] for w in ws], off)


def test_fast_backends_close_to_invariant_ops():
    g = torch.Generator().manual_seed(3)
    E, N, K = 3, 16, 32
    ws = torch.randn(E, N, K, generator=g)
    off = _offsets([4, 0, 5])
    x = torch.randn(off[-1], K, generator=g)
    a, b = torch.randn(4, 8, K, generator=g), torch.randn(K, 5, generator=g)
    xg = torch.randn(E, 6, K, generator=g)
    want = (expert_linear(x, ws, off), expert_linear(x, list(ws), off), bmm_fixed(a, b), grouped_linear(xg, ws))
    with kernel_mode("fast"):
        assert expert_linear.backend_for(x.device) == "fast"
        got = (expert_linear(x, ws, off), expert_linear(x, list(ws), off), bmm_fixed(a, b), grouped_linear(xg, ws))
        assert bmm_fixed(a.bfloat16(), b.bfloat16()).dtype == torch.float32
        assert grouped_linear(xg.bfloat16(), ws.bfloat16(), out_dtype=torch.float32).dtype == torch.float32
    for w_, g_ in zip(want, got):
        assert g_.dtype == w_.dtype and g_.shape == w_.shape
        torch.testing.assert_close(g_, w_, rtol=1e-4, atol=1e-4)
