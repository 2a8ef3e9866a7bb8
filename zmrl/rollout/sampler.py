"""The sampler driver: one step's logits rows -> one token and its log-prob per sampling request
(the sampling arithmetic itself is in sampling.py)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .request import Request
from .sampling import sample


@dataclass
class Draw:
    request: Request
    token: int
    logprob: float  # the float32 log-prob, exactly (Request.finish makes the float32 tensor on the model's device)


def draw(rows: list[tuple[Request, int]], logits: torch.Tensor) -> tuple[list[tuple[Request, str]], list[Draw]]:
    """Sample each request's next token from its row of ``logits`` (several requests may share a row: forked
    siblings). Returns (request, error) for rows with non-finite logits, and the draws of the others."""
    finite = torch.isfinite(logits).all(dim=-1).tolist()
    errors = [(r, f"non-finite logits for request {r.request_id!r} at position {len(r.tokens)}")
              for r, row in rows if not finite[row]]
    ok = [(r, row) for r, row in rows if finite[row]] if errors else rows
    if not ok:
        return errors, []
    picked = [row for _, row in ok]
    # the usual step samples every row once, in order: no gathered copy of the logits (rows are independent,
    # a row's bits are the same in either tensor)
    x = logits if logits.is_contiguous() and picked == list(range(logits.shape[0])) else logits[picked]
    reqs = [r for r, _ in ok]
    tokens, lps = sample(x, [r.params for r in reqs], [r.sample_key for r in reqs], [r.num_tokens for r in reqs])
    if lps.dtype != torch.float32:
        raise TypeError(f"draw: the engine's logits must be float32 (compute_logits), got {logits.dtype}")
    # Python floats (fp32 -> float64 -> fp32 is exact), fetched with the tokens: no tensor view per row per step
    return errors, list(map(Draw, reqs, tokens.tolist(), lps.tolist()))
