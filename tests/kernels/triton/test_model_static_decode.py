"""The whole model on the Triton backend: the engine's static decode step (the code a CUDA graph captures:
KDA states in the pool, the pooled short conv, rows read in place, the one-launch pointwise ops, the fused
LoRA projections) gives every sampled token the log-prob the trainer's packed forward gives it, bit for bit.

Under TRITON_INTERPRET=1 every op that has a Triton backend runs it on the CPU (the dispatcher is told to pick
it there); on CUDA the dispatcher picks it anyway.
"""
from __future__ import annotations

import pytest
import torch

from zmrl.kernels_batch_invariant.triton import triton_everywhere
from zmrl.lora import LoraConfig, apply_lora
from zmrl.model import ModelConfig, build_model
from zmrl.rollout import EngineConfig, RolloutEngine, SamplingParams

from tests.rollout.trainer_recompute import assert_trainer_logprobs_equal

pytestmark = [pytest.mark.gpu, pytest.mark.triton]


@pytest.fixture
def triton_backend(interpret):
    if not interpret:  # on CUDA the dispatcher picks the Triton backend anyway
        yield
        return
    with triton_everywhere():
        yield


def test_static_decode_logprobs_equal_packed_forward(device, interpret, triton_backend):
    cfg = ModelConfig.preset("tiny")
    model = build_model(cfg, seed=0, dtype="bfloat16", device=device).eval()
    apply_lora(model, LoraConfig(r=4, alpha=4.0, init_b_std=0.02, init_seed=1))
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in (3, 6)]
    # the first request finishes first: the second then decodes alone at batch row 0 from pool slot 1
    params = [SamplingParams(max_tokens=m, seed=7 + i, temperature=1.0) for i, m in enumerate((2, 4))]
    engine = RolloutEngine(model, EngineConfig(num_blocks=8, decode_graphs="cuda" if device.type == "cuda" else "static"))
    outs = engine.generate(prompts, params)
    assert [len(o.token_ids) for o in outs] == [2, 4]
    assert_trainer_logprobs_equal(model, outs, device)
