"""The trainer's log-prob forward: packed varlen micro-batches through the same modules and ops
as the engine, with autograd enabled."""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from zmrl.kernels_batch_invariant.lm_head_logprobs import DEFAULT_CHUNK_ROWS
from zmrl.model import cu_seqlens_from_lens, forward_packed_hidden


def pack_micro_batches(lengths: Sequence[int], micro_batch_tokens: int | None,
                       order: Sequence[int] | None = None) -> list[list[int]]:
    """Greedy packing in ``order``: a micro-batch holds whole sequences and at most
    ``micro_batch_tokens`` tokens (a longer sequence gets a micro-batch of its own)."""
    order = list(range(len(lengths))) if order is None else list(order)
    if sorted(order) != list(range(len(lengths))):
        raise ValueError(f"order must be a permutation of range({len(lengths)})")
    if micro_batch_tokens is None:
        return [order] if order else []
    if micro_batch_tokens < 1:
        raise ValueError(f"micro_batch_tokens must be >= 1 or None, got {micro_batch_tokens}")
    batches: list[list[int]] = []
    cur: list[int] = []
    used = 0
    for i in order:
        if cur and used + lengths[i] > micro_batch_tokens:
            batches.append(cur)
            cur, used = [], 0
        cur.append(i)
        used += lengths[i]
    if cur:
        batches.append(cur)
    return batches


def compute_logprobs(model, sequences: Sequence[torch.Tensor | Sequence[int]], prompt_lens: Sequence[int],
                     temperature: float | Sequence[float] = 1.0, micro_batch_tokens: int | None = None,
                     order: Sequence[int] | None = None, latent_format: str = "native",
                     logprob_chunk_tokens: int | None = DEFAULT_CHUNK_ROWS) -> list[torch.Tensor]:
    """Response-token log-probs (float32, autograd enabled) of each ``prompt ++ response`` sequence.

    ``lp[i][j] = log_softmax(logits / T)[response_j]`` (raw logits when T = 0): the exact quantity the
    engine records when it samples, so ``torch.equal`` holds token by token. ``latent_format`` must be
    the engine's (``"fp8"`` quantises latents here too, with a straight-through gradient).

    Only the rows that predict a response token go through ``lm_head``, ``logprob_chunk_tokens`` rows at a
    time (``HybridForCausalLM.compute_token_logprobs``: the same ops as the engine's, per row, so the
    same bits; None = all rows of a micro-batch at once): the [T, V] logits of a micro-batch are never
    materialised, in the forward or the backward.
    """
    seqs = [torch.as_tensor(s, dtype=torch.int64).reshape(-1) for s in sequences]
    if len(prompt_lens) != len(seqs):
        raise ValueError(f"got {len(prompt_lens)} prompt_lens for {len(seqs)} sequences")
    temps = list(temperature) if isinstance(temperature, Sequence) else [temperature] * len(seqs)
    if len(temps) != len(seqs):
        raise ValueError(f"got {len(temps)} temperatures for {len(seqs)} sequences")
    for i, t in enumerate(temps):
        # checked before any forward: token_logprobs would reject it only after the micro-batch ran
        if not math.isfinite(t) or t < 0:
            raise ValueError(f"sequence {i}: temperature must be finite and >= 0 (0 means greedy), got {t}")
    for i, (s, p) in enumerate(zip(seqs, prompt_lens)):
        if not 1 <= p <= s.numel():
            raise ValueError(f"sequence {i}: prompt_len {p} must be in [1, {s.numel()}]")
    if logprob_chunk_tokens is not None and logprob_chunk_tokens < 1:
        raise ValueError(f"logprob_chunk_tokens must be >= 1 or None, got {logprob_chunk_tokens}")
    out: list[torch.Tensor | None] = [None] * len(seqs)
    device = model.device
    for batch in pack_micro_batches([s.numel() for s in seqs], micro_batch_tokens, order):
        lens = [seqs[i].numel() for i in batch]
        ids = torch.cat([seqs[i] for i in batch]).to(device)
        hidden = forward_packed_hidden(model, ids, cu_seqlens_from_lens(lens, device), latent_format=latent_format)
        # Row t predicts token t + 1: a sequence's response tokens are predicted by its rows p-1 .. n-2.
        rows, targets, segments, start = [], [], [], 0
        for i, n in zip(batch, lens):
            p = prompt_lens[i]
            rows.append(hidden[start + p - 1:start + n - 1])
            targets.append(seqs[i][p:])
            segments.append((n - p, float(temps[i])))
            start += n
        lp = model.compute_token_logprobs(torch.cat(rows), torch.cat(targets).to(device), segments,
                                          logprob_chunk_tokens)
        for i, part in zip(batch, lp.split([n for n, _ in segments])):
            out[i] = part
    return out  # type: ignore[return-value]
