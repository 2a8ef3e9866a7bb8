"""zmrl.rl.workers without Ray: the typed handles call real worker methods, the recipe sections build the
components the workers use (nothing copied field by field in the loop), a rollout worker returns typed
samples with their GRPO group, and a trainer worker's update reports parity from its training forward."""
from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path

import pytest
import torch

from zmrl.lora import LoraConfig
from zmrl.model import ModelConfig, build_model, save_pretrained
from zmrl.rl.cluster import LocalHandle, gather
from zmrl.rl.config import AlgorithmSection, load_recipe
from zmrl.rl.workers import ModelSpec, RolloutHandle, RolloutWorker, TrainerHandle, TrainerWorker
from zmrl.rollout import EngineConfig, SamplingParams
from zmrl.trainer import Objective, TrainBatch, TrainerConfig

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "aime_lora.yaml"


def _public(cls) -> list[str]:
    return [n for n, v in vars(cls).items() if callable(v) and not n.startswith("_")]


@pytest.mark.parametrize("handle, worker", [(RolloutHandle, RolloutWorker), (TrainerHandle, TrainerWorker)])
def test_every_handle_method_is_a_worker_method(handle, worker):
    for name in _public(handle):
        assert callable(getattr(worker, name, None)), f"{handle.__name__}.{name} has no {worker.__name__}.{name}"
        theirs = list(inspect.signature(getattr(worker, name)).parameters)
        ours = list(inspect.signature(getattr(handle, name)).parameters)
        assert theirs[: len(ours)] == ours, f"{handle.__name__}.{name}{ours} vs {worker.__name__}.{name}{theirs}"


def _forwarded(section, built, own: set[str]) -> None:
    """Every field of the built config comes from the section field of the same name, except ``own``."""
    names = {f.name for f in dataclasses.fields(built)}
    missing = names - own - {f.name for f in dataclasses.fields(section)}
    assert not missing, f"{type(built).__name__} fields {sorted(missing)} are not set from {type(section).__name__}"
    for name in names - own:
        assert getattr(built, name) == getattr(section, name), name


def test_recipe_sections_build_their_components():
    cfg = load_recipe(str(RECIPE), ["rollout.block_size=128", "rollout.num_blocks=77", "rollout.max_num_seqs=5",
                                    "rollout.max_num_batched_tokens=999", "rollout.enable_prefix_caching=false",
                                    "rollout.latent_format=fp8", "rollout.decode_graphs=static", "rollout.n=3",
                                    "rollout.temperature=0.5", "rollout.top_p=0.8", "rollout.top_k=7",
                                    "rollout.prefix_cache_kda_gib=1.5",
                                    "trainer.lr=0.5", "trainer.weight_decay=0.1", "trainer.micro_batch_tokens=33",
                                    "lora.r=4", "lora.alpha=2", "algorithm.ppo_epochs=2", "algorithm.kl_coef=0.1"])
    engine = cfg.rollout.engine_config("fast")
    assert isinstance(engine, EngineConfig) and engine.kernel_mode == "fast"
    _forwarded(cfg.rollout, engine, own={"kernel_mode", "max_model_len"})
    sampling = cfg.rollout.sampling(11, (2,))
    assert isinstance(sampling, SamplingParams) and (sampling.seed, sampling.stop_token_ids) == (11, (2,))
    _forwarded(cfg.rollout, sampling, own={"seed", "stop_token_ids", "first_sample_index"})  # the last two: per prompt
    trainer = cfg.trainer.trainer_config("fp8")
    assert isinstance(trainer, TrainerConfig) and trainer.latent_format == "fp8"
    _forwarded(cfg.trainer, trainer, own={"latent_format"})
    lora = cfg.lora.lora_config()
    assert isinstance(lora, LoraConfig) and (lora.r, lora.alpha) == (4, 2)
    objective = cfg.algorithm.objective()
    assert isinstance(objective, Objective) and (objective.epochs, objective.kl_coef) == (2, 0.1)
    ev = cfg.eval.sampling(5, (1,))
    assert (ev.n, ev.max_tokens, ev.temperature, ev.seed) == (cfg.eval.n, cfg.eval.max_tokens, cfg.eval.temperature, 5)


@pytest.fixture(scope="module")
def model_spec(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    save_pretrained(build_model(ModelConfig.preset("tiny"), seed=0, dtype="float32"), path)
    return ModelSpec(str(path), "float32", LoraConfig(r=4, alpha=8))


def test_local_workers_through_their_handles(model_spec):
    rollout = RolloutHandle(LocalHandle(RolloutWorker(model_spec, EngineConfig(num_blocks=16))))
    trainer = TrainerHandle(LocalHandle(TrainerWorker(model_spec, TrainerConfig(lr=1e-2, micro_batch_tokens=40),
                                                      AlgorithmSection().objective())))
    # non-zero adapters on both sides, pushed as in the loop
    state = trainer.lora_state().result()
    gen = torch.Generator().manual_seed(0)
    trainer.load_lora_state({k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in sorted(state.items())})
    assert gather([rollout.update_weights(trainer.lora_state())]) == [1]

    prompts = [[5, 6, 7], [9] * 20, [1, 2]]
    sampling = SamplingParams(temperature=0.8, max_tokens=5, n=2, seed=7)
    samples = rollout.generate(prompts, [4, 5, 6], sampling, ["x-0", "x-1", "x-2"]).result()
    assert [s.group for s in samples] == [4, 4, 5, 5, 6, 6]
    assert [s.prompt_ids for s in samples] == [p for p in prompts for _ in range(2)]
    assert all(s.temperature == 0.8 and s.seed == 7 and s.weights_version == 1 for s in samples)
    with pytest.raises(ValueError, match="got 3 prompts, 2 groups, 3 SamplingParams and 3 request ids"):
        rollout.generate(prompts, [0, 1], sampling, ["y-0", "y-1", "y-2"]).result()

    advantages = [torch.linspace(-1, 1, len(s.response_ids)) for s in samples]
    result = trainer.train(TrainBatch(samples, advantages))
    assert result.parity.ok and result.parity.tokens_compared == sum(len(s.response_ids) for s in samples)
    assert result.stats["train/grad_norm"] > 0
