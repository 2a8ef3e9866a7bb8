"""The eager batch-context builder (``paged_context``) builds, with a fixed number of tensor ops, exactly the
tensors the straightforward per-sequence loop builds, and ``SequenceState.page_array`` always equals the
sequence's page list however it grew or was replaced."""
from __future__ import annotations

import random

import torch

from zmrl.model.context import EphemeralLatentStore, SequenceState, cu_seqlens_from_lens, paged_context


def _loop_context(pages, starts, lens, page_size):
    """One sequence at a time, as the builder once was: the reference the vectorised builder must equal."""
    max_pages = max((len(p) for p in pages), default=1) or 1
    block_table = torch.zeros(len(pages), max_pages, dtype=torch.int64)
    positions, seq_idx = [], []
    for i, (p, s, n) in enumerate(zip(pages, starts, lens)):
        block_table[i, : len(p)] = torch.tensor(list(p), dtype=torch.int64)
        positions.append(torch.arange(s, s + n))
        seq_idx.append(torch.full((n,), i, dtype=torch.int64))
    positions_t = torch.cat(positions) if positions else torch.zeros(0, dtype=torch.int64)
    seq_idx_t = torch.cat(seq_idx) if seq_idx else torch.zeros(0, dtype=torch.int64)
    slots = block_table[seq_idx_t, positions_t // page_size] * page_size + positions_t % page_size
    return cu_seqlens_from_lens(list(lens)), positions_t, seq_idx_t, block_table, slots


def _assert_same(got, want) -> None:
    names = ("cu_seqlens", "positions", "seq_idx", "block_table", "slot_mapping")
    for name, w in zip(names, want):
        g = getattr(got, name)
        assert g.dtype == w.dtype and torch.equal(g, w), f"{name} differs: {g} vs {w}"


def test_paged_context_equals_the_per_sequence_loop():
    rng = random.Random(0)
    for trial in range(200):
        page_size = rng.choice([64, 128])
        n = rng.choice([0, 1, 2, 5, 17])
        pages, starts, lens, as_given = [], [], [], []
        for _ in range(n):
            start = rng.randrange(0, 600)
            # every 4th batch a decode batch (one new token per sequence: the builder's shortcut)
            new = 1 if trial % 4 == 0 else rng.choice([0, 1, 1, 1, rng.randrange(1, 300)])
            need = -(-(start + new) // page_size)
            p = rng.sample(range(1000), need + rng.randrange(0, 3))
            pages.append(p)
            starts.append(start)
            lens.append(new)
            kind = rng.randrange(4)  # every form the builder takes: list, range, tensor, array (page_array)
            if kind == 0:
                as_given.append(p)
            elif kind == 1:
                first = rng.randrange(0, 50)
                pages[-1] = p = list(range(first, first + len(p)))
                as_given.append(range(first, first + len(p)))
            elif kind == 2:
                as_given.append(torch.tensor(p, dtype=torch.int32))
            else:
                seq = SequenceState(pages=p[: len(p) // 2])
                seq.page_array()
                seq.pages.extend(p[len(p) // 2:])  # the mirror catches up with the pages appended since
                as_given.append(seq.page_array())
        store = EphemeralLatentStore(1000, page_size)
        got = paged_context(as_given, starts, lens, store)
        _assert_same(got, _loop_context(pages, starts, lens, page_size))


def test_page_array_follows_appends_and_replacements():
    rng = random.Random(1)
    seq = SequenceState()
    for step in range(300):
        op = rng.randrange(10)
        if op == 0:
            seq.pages = rng.sample(range(5000), rng.randrange(0, 40))  # replaced (prefix-cache hit, fork)
        elif op == 1:
            seq.reset()
        elif op == 2:
            seq.pages.extend(rng.sample(range(5000), rng.randrange(1, 70)))  # past the spare room
        else:
            seq.pages.append(rng.randrange(5000))
        if rng.random() < 0.7:  # not every change is seen: several appends between two calls
            a = seq.page_array()
            assert a.typecode == "q" and a.itemsize == 8 and a.tolist() == seq.pages, f"step {step}"
