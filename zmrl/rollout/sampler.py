"""The sampler driver: one step's logits rows -> one token and its log-prob per sampling request
(the sampling arithmetic itself is in sampling.py)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .request import Request
from .sampling import pack_sampled, sample_async


@dataclass
class Draw:
    request: Request
    token: int
    logprob: float  # the float32 log-prob, exactly (Request.finish makes the float32 tensor on the model's device)


def draw(rows: list[tuple[Request, int]], logits: torch.Tensor) -> tuple[list[tuple[Request, str]], list[Draw]]:
    """Sample each request's next token from its row of ``logits`` (several requests may share a row: forked
    siblings). Returns (request, error) for rows with non-finite logits, and the draws of the others."""
    if not rows:
        return [], []
    picked = [row for _, row in rows]
    # the usual step samples every row once, in order: no gathered copy of the logits (rows are independent,
    # a row's bits are the same in either tensor)
    x = logits if logits.is_contiguous() and picked == list(range(logits.shape[0])) else logits[picked]
    reqs = [r for r, _ in rows]
    tokens, lps, finite = sample_async(x, [r.params for r in reqs], [r.sample_key for r in reqs],
                                       [r.num_tokens for r in reqs])
    if lps.dtype != torch.float32:
        raise TypeError(f"draw: the engine's logits must be float32 (compute_logits), got {logits.dtype}")
    return fetch(reqs, pack_sampled(tokens, lps, finite))


def fetch(reqs: list[Request], sampled: torch.Tensor) -> tuple[list[tuple[Request, str]], list[Draw]]:
    """The step's one device->host transfer: ``sampled`` [3, len(reqs)] (``sampling.pack_sampled``) holds each
    request's token id, float32 log-prob and finite flag, queued behind the forward and the draw
    (nothing before this reads the device). Returns (request, error) for rows with non-finite logits, and the
    draws of the others."""
    host_tokens, host_lps, host_finite = sampled.tolist()
    if all(host_finite):
        return [], list(map(Draw, reqs, map(int, host_tokens), host_lps))
    errors: list[tuple[Request, str]] = []
    draws: list[Draw] = []
    for r, token, lp, ok in zip(reqs, host_tokens, host_lps, host_finite):
        if ok:
            draws.append(Draw(r, int(token), lp))
        else:
            errors.append((r, f"non-finite logits for request {r.request_id!r} at position {r.num_tokens} "
                              f"(NaN/Inf, or an overflow when divided by temperature {r.params.temperature})"))
    return errors, draws
