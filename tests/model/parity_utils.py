"""Shared drivers for model-level parity tests: run the same sequences through the trainer path
and through the engine path under different batchings, and collect per-token logits.

Device-agnostic: inputs may live on the CPU; everything runs on ``model.device`` (the caches too),
so a model built on ``tests.device.TEST_DEVICE`` runs these drivers on the GPU."""
from __future__ import annotations

import random

import torch

from zmrl.model import ModelCache, SequenceState, cu_seqlens_from_lens, forward_incremental, forward_packed


def make_sequences(vocab: int, lens: list[int], seed: int = 0, shared_prefix: tuple[int, int, int] | None = None):
    """Random sequences; ``shared_prefix=(src, n, extra)`` appends a sequence sharing ``n`` tokens of ``src``."""
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, vocab, (n,), generator=g) for n in lens]
    if shared_prefix is not None:
        src, n, extra = shared_prefix
        seqs.append(torch.cat([seqs[src][:n], torch.randint(0, vocab, (extra,), generator=g)]))
    return seqs


@torch.no_grad()
def packed_logits(model, seqs: list[torch.Tensor], order: list[int] | None = None, **kw) -> list[torch.Tensor]:
    """Logits of every token of every sequence from one packed trainer forward (in ``order``)."""
    order = list(range(len(seqs))) if order is None else order
    lens = [seqs[i].numel() for i in order]
    ids = torch.cat([seqs[i] for i in order]).to(model.device)
    logits = forward_packed(model, ids, cu_seqlens_from_lens(lens, model.device), **kw)
    out: list[torch.Tensor] = [None] * len(seqs)  # type: ignore[list-item]
    for j, part in zip(order, logits.split(lens)):
        out[j] = part
    return out


def incremental_logits(model, seqs: list[torch.Tensor], chunk_sizes, arrivals: list[int] | None = None,
                       page_size: int = 64, latent_format: str = "native") -> list[torch.Tensor]:
    """Engine path: every step, each active sequence feeds its next ``chunk_sizes(seq, step)`` tokens;
    sequence i joins at step ``arrivals[i]``. Returns the logits of every token of every sequence."""
    cfg = model.config
    pages = sum(-(-s.numel() // page_size) for s in seqs) + 1
    cache = ModelCache(cfg, num_pages=pages, page_size=page_size, dtype=model.dtype, device=model.device,
                       latent_format=latent_format)
    states = [SequenceState() for _ in seqs]
    done = [0] * len(seqs)
    rows: list[list[torch.Tensor]] = [[] for _ in seqs]
    arrivals = arrivals or [0] * len(seqs)
    step = 0
    while any(d < s.numel() for d, s in zip(done, seqs)):
        active = [i for i, s in enumerate(seqs) if arrivals[i] <= step and done[i] < s.numel()]
        if active:
            sizes = [min(chunk_sizes(i, step), seqs[i].numel() - done[i]) for i in active]
            logits = forward_incremental(model, cache, [states[i] for i in active],
                                         [seqs[i][done[i]:done[i] + n] for i, n in zip(active, sizes)])
            for i, part in zip(active, logits.split(sizes)):
                rows[i].append(part)
            for i, n in zip(active, sizes):
                done[i] += n
        step += 1
    return [torch.cat(r) for r in rows]


def random_chunks(seed: int, lo: int = 1, hi: int = 97):
    rng = random.Random(seed)
    table: dict[tuple[int, int], int] = {}

    def size(i: int, step: int) -> int:
        return table.setdefault((i, step), rng.randint(lo, hi))

    return size


def assert_all_equal(a: list[torch.Tensor], b: list[torch.Tensor], what: str) -> None:
    for i, (x, y) in enumerate(zip(a, b)):
        assert x.shape == y.shape, f"{what}: sequence {i} shapes {tuple(x.shape)} vs {tuple(y.shape)}"
        if not torch.equal(x, y):
            bad = (x != y).any(dim=-1).nonzero().flatten().tolist()
            raise AssertionError(f"{what}: sequence {i} differs at token rows {bad[:10]} "
                                 f"(max |diff| {float((x - y).abs().max()):.3e})")
