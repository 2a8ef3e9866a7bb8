"""The trainer's side of the rollout/trainer contract in tests: the packed forward's log-prob of every sampled
token of some finished requests (what the RL step's parity check recomputes)."""
from __future__ import annotations

import torch

from zmrl.kernels_batch_invariant.logprob import token_logprobs
from zmrl.model import cu_seqlens_from_lens, forward_packed


def assert_trainer_logprobs_equal(model, outs, device) -> None:
    """One packed forward over every request's prompt + sampled tokens; each sampled token's log-prob must be
    the engine's, bit for bit."""
    seqs = [torch.tensor(o.prompt_token_ids + o.token_ids[:-1], device=device) for o in outs]
    with torch.no_grad():
        logits = forward_packed(model, torch.cat(seqs), cu_seqlens_from_lens([s.numel() for s in seqs], device))
    for o, rows in zip(outs, logits.split([s.numel() for s in seqs])):
        lp = token_logprobs(rows[len(o.prompt_token_ids) - 1:], torch.tensor(o.token_ids, device=device),
                            o.temperature)
        assert torch.equal(lp, o.logprobs), f"request {o.request_id}: {lp} vs {o.logprobs}"
