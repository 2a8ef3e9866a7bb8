"""tree_sum / tree_mean: accuracy against float64, batch invariance, dim/keepdim handling."""
from __future__ import annotations

import pytest
import torch

from zmrl.kernels_batch_invariant.reduce import tree_mean, tree_sum

from .invariance import BATCHES, THREAD_BATCHES, THREAD_COUNTS, num_threads

U32 = 2.0**-24  # unit roundoff of fp32


def _depth(n: int) -> int:
    return max(n - 1, 0).bit_length()


@pytest.mark.parametrize("n", [1, 2, 3, 5, 7, 64, 100, 1000, 2048, 50257])
def test_tree_sum_matches_float64(n: int) -> None:
    g = torch.Generator().manual_seed(n)
    x = torch.randn(4, n, generator=g) * 3 + 1
    got = tree_sum(x).double()
    ref = x.double().sum(-1)
    # A pairwise tree of depth d has |error| <= d * u * sum|x| (each element passes through d adds).
    # A wrong tree (dropped tail, double-counted padding) is off by whole elements, i.e. O(1).
    bound = _depth(n) * U32 * x.double().abs().sum(-1) + 1e-30
    assert ((got - ref).abs() <= bound).all(), (got - ref).abs().max()
    torch.testing.assert_close(tree_mean(x).double(), ref / n, rtol=_depth(n) * 4 * U32 + 1e-7, atol=1e-6)


def test_tree_sum_is_exact_on_integers() -> None:
    x = torch.arange(1, 1001, dtype=torch.float32).view(1, -1)
    assert tree_sum(x).item() == 500500.0  # every partial sum is an integer < 2^24: exact


def test_empty_and_single() -> None:
    assert torch.equal(tree_sum(torch.zeros(3, 0)), torch.zeros(3))
    x = torch.randn(4, 1)
    assert torch.equal(tree_sum(x), x[:, 0])
    assert torch.equal(tree_mean(x), x[:, 0])


@pytest.mark.parametrize("dim", [0, 1, 2, -1, -2, -3])
@pytest.mark.parametrize("keepdim", [False, True])
def test_dim_and_keepdim(dim: int, keepdim: bool) -> None:
    x = torch.randn(5, 6, 7, dtype=torch.float64)
    got = tree_sum(x, dim=dim, keepdim=keepdim)
    ref = x.sum(dim=dim, keepdim=keepdim)
    assert got.shape == ref.shape
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(tree_mean(x, dim=dim, keepdim=keepdim), x.mean(dim=dim, keepdim=keepdim))


def test_layout_does_not_change_bits() -> None:
    """Same values, different memory layout (transposed / sliced views) -> the same bits."""
    x = torch.randn(37, 301)
    want = tree_sum(x, dim=-1)
    assert torch.equal(tree_sum(x.t(), dim=0), want)
    assert torch.equal(tree_sum(x.t().contiguous(), dim=0), want)
    big = torch.randn(50, 400)
    big[5:42, 50:351] = x
    assert torch.equal(tree_sum(big[5:42, 50:351], dim=-1), want)


@pytest.mark.parametrize("n", [5, 64, 1000, 50257])
def test_batch_invariance(n: int) -> None:
    """Each row's sum is the same bits alone and in batches of 1..70 at every position, with 1 or
    2 or 4 threads. torch.sum fails this for n = 50257 with 2 threads on this CPU (it splits a long row
    across threads when there are few rows)."""
    g = torch.Generator().manual_seed(n)
    pool = torch.randn(80, n, generator=g) * 4
    sizes = BATCHES if n <= 1000 else [1, 2, 3, 15, 16, 17, 33, 70]

    def check(batch_sizes: list[int], alone: torch.Tensor) -> None:
        for b in batch_sizes:
            idx = torch.randperm(len(pool), generator=g)[:b]
            assert torch.equal(tree_sum(pool[idx]), alone[idx]), (n, b)

    with num_threads(1):
        alone = torch.stack([tree_sum(pool[i:i + 1])[0] for i in range(len(pool))])
        check(sizes, alone)
    for threads in THREAD_COUNTS[1:]:
        with num_threads(threads):  # fewer calls: more threads on a loaded 2-core box are slow
            stride = 1 if n > 1000 else 9  # a lone long row is what a stock sum splits across threads
            assert all(torch.equal(tree_sum(pool[i:i + 1])[0], alone[i]) for i in range(0, len(pool), stride))
            check(THREAD_BATCHES, alone)


def test_invariance_over_other_dims() -> None:
    """Reducing dim 1 of [B, n, C]: element (b, c) does not depend on B or C."""
    x = torch.randn(40, 77, 30)
    full = tree_sum(x, dim=1)
    assert torch.equal(tree_sum(x[3:4], dim=1)[0], full[3])
    assert torch.equal(tree_sum(x[:, :, 7:8], dim=1)[:, 0], full[:, 7])
    assert torch.equal(tree_sum(x[10:17, :, 2:29], dim=1), full[10:17, 2:29])
