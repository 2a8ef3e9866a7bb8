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
    logprob: torch.Tensor  # [1] float32, on the model's device


def draw(rows: list[tuple[Request, int]], logits: torch.Tensor) -> tuple[list[tuple[Request, str]], list[Draw]]:
    """Sample each request's next token from its row of ``logits`` (several requests may share a row: forked
    siblings). Returns (request, error) for rows with non-finite logits, and the draws of the others."""
    finite = torch.isfinite(logits).all(dim=-1).tolist()
    errors = [(r, f"non-finite logits for request {r.request_id!r} at position {len(r.tokens)}")
              for r, row in rows if not finite[row]]
    ok = [(r, row) for r, row in rows if finite[row]]
    if not ok:
        return errors, []
    tokens, lps = sample(logits[[row for _, row in ok]], [r.params for r, _ in ok], [r.sample_key for r, _ in ok],
                         [r.num_tokens for r, _ in ok])
    return errors, [Draw(r, t, lp.reshape(1)) for (r, _), t, lp in zip(ok, tokens.tolist(), lps)]
