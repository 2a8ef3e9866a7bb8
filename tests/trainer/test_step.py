"""zmrl.trainer.step: one RL update is one training forward per micro-batch and epoch, and the
log-probs of that forward (taken for the parity check) are bitwise the ones the engine recorded; the
typed records (Sample from an engine output, TrainBatch) carry what the trainer needs."""
from __future__ import annotations

import copy

import pytest
import torch

from zmrl.lora import LoraConfig, apply_lora, lora_parameters, lora_state_dict
from zmrl.model import ModelConfig, build_model
from zmrl.rollout import EngineConfig, RolloutEngine, SamplingParams
from zmrl.trainer import Objective, Sample, TrainBatch, Trainer, TrainerConfig, compute_logprobs, pack_micro_batches


def _policy_gradient_loss(old_lp, lp, adv, mask):
    """A plain policy-gradient loss (token-mean of -A * logp): any differentiable function of lp will do."""
    loss = -(adv * lp * mask).sum() / mask.sum().clamp(min=1)
    return loss, {"pg/ratio_mean": float(((lp.detach() - old_lp).exp() * mask).sum() / mask.sum().clamp(min=1))}


@pytest.fixture(scope="module")
def rollout():
    """A LoRA'd tiny model with non-zero adapters, and what an engine over a copy of it sampled."""
    model = build_model(ModelConfig.preset("tiny"), seed=0, dtype="float32")
    apply_lora(model, LoraConfig(r=4, alpha=8))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in lora_parameters(model):
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    engine_model = copy.deepcopy(model)
    engine = RolloutEngine(engine_model, EngineConfig(num_blocks=16, enable_prefix_caching=False))
    prompts = [torch.randint(0, 2048, (n,), generator=gen).tolist() for n in (9, 70, 3)]
    params = [SamplingParams(temperature=1.0, max_tokens=6, n=2, seed=3),
              SamplingParams(temperature=0.7, top_p=0.9, max_tokens=5, seed=4),
              SamplingParams(temperature=1.3, max_tokens=4, n=2, seed=5)]
    outs = engine.generate(prompts, params, request_ids=["a", "b", "c"])
    groups = [0, 0, 1, 2, 2]
    samples = [Sample.from_output(o, g) for o, g in zip(outs, groups)]
    # one sample with an empty response: it is compared (0 tokens) but contributes no loss term
    samples.append(Sample(prompt_ids=prompts[1][:5], response_ids=[], logprobs=torch.zeros(0), temperature=1.0,
                          group=3, seed=0, weights_version=0))
    return model, samples, outs


def test_sample_from_output_carries_the_rollout(rollout):
    _, samples, outs = rollout
    for s, o in zip(samples, outs):
        assert s.prompt_ids == o.prompt_token_ids and s.response_ids == o.token_ids
        assert torch.equal(s.logprobs, o.logprobs.cpu()) and s.logprobs.device.type == "cpu"
        assert (s.temperature, s.seed, s.weights_version) == (o.temperature, o.seed, o.weights_version)
        assert s.request_id == o.request_id and s.finish_reason == o.finish_reason
    assert [s.temperature for s in samples[:5]] == [1.0, 1.0, 0.7, 1.3, 1.3]
    assert [s.group for s in samples] == [0, 0, 1, 2, 2, 3]


@pytest.mark.parametrize("micro_batch_tokens, epochs, chunk", [(None, 1, 1024), (80, 2, 3)])
def test_one_forward_per_update_and_its_logprobs_are_the_engines(rollout, micro_batch_tokens, epochs, chunk):
    """``chunk``: rows per lm_head + log-prob chunk (3: every micro-batch's logits in many chunks)."""
    base, samples, _ = rollout
    model = copy.deepcopy(base)
    trainer = Trainer(model, TrainerConfig(lr=1e-2, micro_batch_tokens=micro_batch_tokens,
                                           logprob_chunk_tokens=chunk))
    before = {k: v.clone() for k, v in lora_state_dict(model).items()}
    gen = torch.Generator().manual_seed(2)
    batch = TrainBatch(samples, [torch.randn(len(s.response_ids), generator=gen) for s in samples])
    forwards = []
    hook = model.register_forward_hook(lambda m, args, out: forwards.append(torch.is_grad_enabled()))
    try:
        result = trainer.step(batch, Objective(_policy_gradient_loss, epochs=epochs))
    finally:
        hook.remove()

    micro = [[i for i in b if samples[i].response_ids]
             for b in pack_micro_batches([s.num_tokens for s in samples], micro_batch_tokens)]
    n_micro = sum(1 for b in micro if b)
    assert n_micro >= (2 if micro_batch_tokens else 1)
    # one forward per micro-batch and epoch, every one with autograd: no separate no-grad parity pass
    assert forwards == [True] * (n_micro * epochs)
    # the first epoch's training-forward log-probs are bitwise what the engine recorded (taken before any
    # optimiser step, even when a second epoch follows)
    assert len(result.logprobs) == len(samples)
    for i, (s, lp) in enumerate(zip(samples, result.logprobs)):
        assert lp.device.type == "cpu" and not lp.requires_grad
        assert torch.equal(lp, s.logprobs), f"sample {i}: training forward != engine"
    # the update happened
    after = lora_state_dict(model)
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert result.stats["train/grad_norm"] > 0 and "pg/ratio_mean" in result.stats
    # ... and the plain recompute after it no longer matches (the parity numbers are the sampling policy's)
    fresh = trainer.logprobs(samples)
    assert not all(torch.equal(a, s.logprobs) for a, s in zip(fresh, samples) if s.response_ids)


def test_step_gradient_equals_a_separate_forward(rollout):
    """The loss of the single forward is the loss of an ordinary compute_logprobs forward (same bits, same
    gradient): one step from the same start gives the same adapters either way."""
    base, samples, _ = rollout
    gen = torch.Generator().manual_seed(3)
    adv = [torch.randn(len(s.response_ids), generator=gen) for s in samples]
    model_a = copy.deepcopy(base)
    Trainer(model_a, TrainerConfig(lr=1e-2)).step(TrainBatch(samples, adv), Objective(_policy_gradient_loss))

    model_b = copy.deepcopy(base)
    trainer_b = Trainer(model_b, TrainerConfig(lr=1e-2))
    live = [i for i, s in enumerate(samples) if s.response_ids]
    lps = compute_logprobs(model_b, [samples[i].sequence for i in live], [len(samples[i].prompt_ids) for i in live],
                           [samples[i].temperature for i in live])
    from zmrl.trainer import pad_rows

    lp, mask = pad_rows(lps)
    loss, _ = _policy_gradient_loss(pad_rows([samples[i].logprobs for i in live])[0], lp,
                                    pad_rows([adv[i] for i in live])[0], mask)
    trainer_b.optimizer.zero_grad(set_to_none=True)
    loss.backward()
    trainer_b.optimizer.step()
    a, b = lora_state_dict(model_a), lora_state_dict(model_b)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_train_batch_checks_alignment(rollout):
    _, samples, _ = rollout
    with pytest.raises(ValueError, match=r"TrainBatch.advantages has 1 rows for 6 samples"):
        TrainBatch(samples, [torch.zeros(3)])
    bad = [torch.zeros(len(s.response_ids)) for s in samples]
    bad[1] = torch.zeros(len(samples[1].response_ids) + 1)
    with pytest.raises(ValueError, match=r"TrainBatch.advantages\[1\] has \d+ values for \d+ response tokens"):
        TrainBatch(samples, bad)
    with pytest.raises(ValueError, match="Objective.epochs must be >= 1"):
        Objective(_policy_gradient_loss, epochs=0)


@pytest.mark.parametrize("chunk", [0, -4])
def test_logprob_chunk_tokens_checked(chunk):
    with pytest.raises(ValueError, match="trainer.logprob_chunk_tokens"):
        TrainerConfig(logprob_chunk_tokens=chunk)
