"""The V=4 rollout/trainer parity case of test_parallel_parity.py::test_tp4_parity, in one process.

At V=4 the tiny model's MLA pieces hold one head each, so a decode step of a sequence running alone
computes its attention scores as one one-row product ([1, 80] @ keys^T [80, 64]); the trainer computes
the same product inside a batch. Under MKL's strict CNR mode (the numerics default) torch's batch-of-one
GEMM and its batched GEMM round that product differently, which broke parity at V=4 (on 4 processes
and, as here, on one: TP=1 runs all four pieces locally). No torch.distributed is needed at tp = 1.
"""
from __future__ import annotations

import torch

from zmrl.lora import LoraConfig, apply_lora
from zmrl.model import ModelConfig, build_model
from zmrl.parallel import ParallelConfig, shard_model
from zmrl.rollout import EngineConfig, RolloutEngine, SamplingParams
from zmrl.trainer import compute_logprobs


def test_v4_rollout_alone_equals_trainer_in_a_batch() -> None:
    cfg = ModelConfig.preset("tiny")
    model = build_model(cfg, seed=0)
    apply_lora(model, LoraConfig(r=4, alpha=8, init_b_std=0.02, init_seed=3))
    shard_model(model, ParallelConfig(virtual_shards=4))
    g = torch.Generator().manual_seed(1234)
    # Before the fix both sequences had tokens whose bits differed (1 and 2 of 8).
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in (9, 40)]
    engine = RolloutEngine(model, EngineConfig(block_size=64, num_blocks=8, max_num_seqs=2))
    outs = [engine.generate([p], [SamplingParams(temperature=1.0, max_tokens=8, seed=10)])[0]  # each alone:
            for p in prompts]                                                               # one query per decode step
    seqs = [list(o.prompt_token_ids) + list(o.token_ids) for o in outs]
    with torch.no_grad():  # all packed into one trainer batch: the same products, batched
        lps = compute_logprobs(model, seqs, [len(p) for p in prompts])
    for i, (o, lp) in enumerate(zip(outs, lps)):
        assert len(o.token_ids) == 8
        assert torch.equal(lp, o.logprobs), f"prompt {i}: max |diff| {(lp - o.logprobs).abs().max().item()}"
