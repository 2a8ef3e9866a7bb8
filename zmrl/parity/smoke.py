"""Smoke run of the tiny model: decode with the incremental (engine) path, recompute with the packed
(trainer) path, and check that every generated token's log-prob is bitwise equal."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from zmrl.kernels_batch_invariant.logprob import token_logprobs
from zmrl.model import ModelCache, ModelConfig, SequenceState, build_model, forward_incremental
from .metric import compare_logprobs
from zmrl.trainer import compute_logprobs

log = logging.getLogger(__name__)


@dataclass
class SmokeResult:
    tokens_compared: int
    tokens_equal: int
    max_abs_diff: float
    decode_tokens_per_s: float

    @property
    def ok(self) -> bool:
        return self.tokens_compared > 0 and self.tokens_equal == self.tokens_compared


def run_smoke(preset: str = "tiny", dtype: str = "float32", num_prompts: int = 4, max_new_tokens: int = 16,
              seed: int = 0) -> SmokeResult:
    cfg = ModelConfig.preset(preset)
    model = build_model(cfg, seed=seed, dtype=dtype).eval()
    gen = torch.Generator().manual_seed(seed)
    # Prompt lengths straddle a KDA chunk and exceed index_topk, so sparse selection is active.
    lens = [1 + (37 * i + 70) % 200 for i in range(num_prompts)]
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=gen) for n in lens]
    cache = ModelCache(cfg, num_pages=sum(-(-(n + max_new_tokens) // 64) for n in lens), dtype=model.dtype)
    seqs = [SequenceState() for _ in prompts]
    generated: list[list[int]] = [[] for _ in prompts]
    recorded: list[list[torch.Tensor]] = [[] for _ in prompts]
    t0 = time.perf_counter()
    step_inputs = prompts
    for _ in range(max_new_tokens):
        logits = forward_incremental(model, cache, seqs, step_inputs, logits_rows="last")
        nxt = logits.argmax(dim=-1)  # greedy: the recorded log-prob is of the raw logits
        lp = token_logprobs(logits, nxt, temperature=0.0)
        for i in range(len(prompts)):
            generated[i].append(int(nxt[i]))
            recorded[i].append(lp[i : i + 1])
        step_inputs = [nxt[i : i + 1] for i in range(len(prompts))]
    elapsed = time.perf_counter() - t0

    # The trainer path: one packed forward through compute_logprobs, compared token by token.
    with torch.no_grad():
        train = compute_logprobs(model, [torch.cat([p, torch.tensor(g)]) for p, g in zip(prompts, generated)],
                                 [p.numel() for p in prompts], temperature=0.0)
    report = compare_logprobs([torch.cat(rec) for rec in recorded], train)
    return SmokeResult(report.tokens_compared, report.tokens_equal, report.max_abs_dlogp,
                       len(prompts) * max_new_tokens / elapsed)
