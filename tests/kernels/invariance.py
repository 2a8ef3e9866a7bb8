"""Shared helpers for the bitwise row-invariance tests: a thread-count context manager, the thread
counts and batch sizes the tests sweep, and ``assert_rows_invariant``."""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import pytest
import torch

# Every batch size from 1 to 70: crosses the 16/32/64 boundaries where kernels change blocking.
BATCHES = list(range(1, 71))
# Every op gives the same bits at each of these torch thread counts (4 oversubscribes a 2-core CI box:
# that is fine, the order of a reduction must not depend on the count whatever the cores).
THREAD_COUNTS = (1, 2, 4)
# The subset run with more than 1 thread (2 threads on a loaded 2-core box are slow): sizes around the
# blocking boundaries.
THREAD_BATCHES = [1, 2, 3, 15, 16, 17, 33, 64, 70]


@contextlib.contextmanager
def num_threads(n: int) -> Iterator[None]:
    """Run the body with ``torch.set_num_threads(n)``, restoring the previous count afterwards."""
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def assert_rows_invariant(fn: Callable[..., torch.Tensor], inputs: tuple[torch.Tensor, ...],
                          sizes: list[int] = BATCHES, seed: int = 0, alone_stride: int = 9) -> None:
    """fn's output row for input row i is the same bits alone and inside batches of other rows
    (every size in ``sizes``, random rows in random order, so every position is exercised) with 1
    thread, and with 2 and 4 threads on the sizes of THREAD_BATCHES up to max(sizes).

    inputs: tensors whose dim 0 is the row dim (all the same length n); fn maps row-slices of them
    to a tensor whose dim 0 is the row dim. With 2 threads, every ``alone_stride``-th row is also
    recomputed alone (stride 1 where a lone row is what a stock reduction splits across threads).
    """
    g = torch.Generator().manual_seed(seed)
    n = inputs[0].shape[0]

    def check(batch_sizes: list[int], alone: list[torch.Tensor]) -> None:
        for b in batch_sizes:
            idx = torch.randperm(n, generator=g)[:b]
            out = fn(*(t[idx] for t in inputs))
            if not torch.equal(out, torch.stack([alone[i] for i in idx.tolist()])):
                j = next(j for j, i in enumerate(idx.tolist()) if not torch.equal(out[j], alone[i]))
                pytest.fail(f"row at position {j} of a batch of {b} differs from the row computed alone")

    with num_threads(1):
        alone = [fn(*(t[i:i + 1] for t in inputs))[0] for i in range(n)]
        check(sizes, alone)
    for threads in THREAD_COUNTS[1:]:
        with num_threads(threads):
            for i in range(0, n, alone_stride):
                assert torch.equal(fn(*(t[i:i + 1] for t in inputs))[0], alone[i]), f"{threads} threads vs 1, alone"
            check([b for b in THREAD_BATCHES if b <= max(sizes)], alone)
