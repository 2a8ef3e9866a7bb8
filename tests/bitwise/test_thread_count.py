"""The whole model (every op it calls: MLA with the DSA indexer, KDA, MoE, short conv, norms,
log-probs, sampling) gives the same bits at 1, 2 and 4 torch threads, in the trainer's log-prob
forward and in the engine. Processes with different thread counts (e.g. Ray actors given different
CPU bundles) stay bitwise equal. (Gradients are not covered: autograd's weight-gradient reductions over
tokens depend on the thread count, see docs/numerics.md.)"""
from __future__ import annotations

import pytest
import torch

from zmrl.model import ModelConfig, build_model
from zmrl.rollout import EngineConfig, RolloutEngine, SamplingParams
from zmrl.trainer.logprobs import compute_logprobs

from tests.kernels.invariance import THREAD_COUNTS, num_threads


def test_trainer_and_engine_bits_do_not_depend_on_threads() -> None:
    model = build_model(ModelConfig.preset("tiny"), seed=0, dtype="bfloat16")
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist() for n in (5, 70)]
    prompts = [s[:4] for s in seqs]
    results = {}
    for threads in THREAD_COUNTS:
        with num_threads(threads):
            with torch.no_grad():
                lps = compute_logprobs(model, seqs, [2, 10], 0.7)
            engine = RolloutEngine(model, EngineConfig(num_blocks=8, decode_graphs="off"))
            outs = engine.generate(prompts, SamplingParams(max_tokens=3, temperature=0.8, seed=3))
            results[threads] = (lps, [(o.token_ids, o.logprobs) for o in outs])
    ref_lps, ref_outs = results[1]
    for threads in THREAD_COUNTS[1:]:
        lps, outs = results[threads]
        assert all(torch.equal(a, b) for a, b in zip(lps, ref_lps)), f"log-probs at {threads} threads"
        for (toks, lp), (rtoks, rlp) in zip(outs, ref_outs):
            assert toks == rtoks and torch.equal(lp, rlp), f"engine at {threads} threads"
