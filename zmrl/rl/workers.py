"""The two sides of the RL loop as plain classes, usable in-process or as Ray actors, and the typed
handles the loop drives them through.

``RolloutWorker`` owns an engine over its own copy of the model; ``TrainerWorker`` owns the trainable
copy (base + LoRA) and its ``zmrl.trainer.Trainer``. They share nothing but records passed through
method calls (``Sample``, ``TrainBatch``, LoRA state), so the same code runs in one process or as Ray
actors on separate CPUs/GPUs (``zmrl.rl.cluster``). Everything a method returns is on the CPU
(log-probs, LoRA state), whatever device the worker computes on: results cross process boundaries, and
a driver without a GPU must be able to unpickle them.

``RolloutHandle`` and ``TrainerHandle`` are the only callers of the workers' methods: one typed method
each, over a transport (``LocalHandle`` in this process, ``RayHandle`` in an actor).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from zmrl.kernels_batch_invariant import NumericsFingerprint, apply_numerics, current_numerics, fingerprint
from zmrl.lora import LoraConfig, apply_lora, load_lora_state_dict, lora_state_dict
from zmrl.model import load_pretrained
from zmrl.parity import ParityReport, compare_logprobs
from zmrl.rollout import EngineConfig, RolloutEngine, SamplingParams
from zmrl.trainer import Objective, Sample, TrainBatch, Trainer, TrainerConfig

from .cluster import Pending, WorkerHandle

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelSpec:
    """Which model a worker loads, and where: a checkpoint folder, its dtype, the LoRA to attach."""

    path: str
    dtype: str
    lora: LoraConfig
    device: str = "cpu"

    def load(self) -> torch.nn.Module:
        model = load_pretrained(self.path, dtype=self.dtype, device=self.device)
        apply_lora(model, self.lora)
        return model


@dataclass
class TrainResult:
    """One RL update: the trainer's statistics, and its log-probs compared with the recorded ones."""

    stats: dict[str, float]
    parity: ParityReport


# ---------------------------------------------------------------------------------------- workers
class RolloutWorker:
    def __init__(self, model: ModelSpec, engine: EngineConfig):
        self.model = model.load()
        self.engine = RolloutEngine(self.model, engine)

    def generate(self, prompts: list[list[int]], groups: list[int], sampling: SamplingParams | list[SamplingParams],
                 request_ids: list[str], use_tqdm: bool = False) -> list[Sample]:
        """``sampling[i].n`` samples of prompt i (one SamplingParams: the same for every prompt), in prompt
        order; they have group ``groups[i]``."""
        if isinstance(sampling, SamplingParams):
            sampling = [sampling] * len(prompts)
        if not len(prompts) == len(groups) == len(request_ids) == len(sampling):
            raise ValueError(f"got {len(prompts)} prompts, {len(groups)} groups, {len(sampling)} SamplingParams and "
                             f"{len(request_ids)} request ids")
        outs = self.engine.generate(prompts, sampling, request_ids=request_ids, use_tqdm=use_tqdm)
        # generate returns the outputs in prompt order, the n samples of a prompt together
        owner = [i for i, sp in enumerate(sampling) for _ in range(sp.n)]
        if len(outs) != len(owner):
            raise RuntimeError(f"engine returned {len(outs)} outputs for {len(owner)} requested samples")
        return [Sample.from_output(o, groups[i]) for i, o in zip(owner, outs)]

    def update_weights(self, lora_state: dict[str, torch.Tensor]) -> int:
        return self.engine.update_weights(lora_state)

    def numerics_fingerprint(self) -> NumericsFingerprint:
        """This process's numerics contract, compared with the trainer's before the first step."""
        return fingerprint(self.engine.numerics)


class TrainerWorker:
    def __init__(self, model: ModelSpec, trainer: TrainerConfig, objective: Objective, kernel_mode: str = "bitwise"):
        # The trainer's ops read the process's numerics; the kernel mode must be the engine's
        # (EngineConfig.kernel_mode): the driver compares both sides' fingerprints before the first step.
        apply_numerics(current_numerics().replace(kernel_mode=kernel_mode))
        self.trainer = Trainer(model.load(), trainer)
        self.objective = objective

    @property
    def model(self) -> torch.nn.Module:
        return self.trainer.model

    def numerics_fingerprint(self) -> NumericsFingerprint:
        return fingerprint()

    def lora_state(self) -> dict[str, torch.Tensor]:
        # a copy on the CPU (bitwise the parameters): what the rollout workers load, from any process
        return {k: v.detach().to("cpu", copy=True) for k, v in lora_state_dict(self.model).items()}

    def load_lora_state(self, state: dict[str, torch.Tensor]) -> None:
        load_lora_state_dict(self.model, state)

    def train(self, batch: TrainBatch) -> TrainResult:
        """One update (``objective.epochs`` optimiser steps). Its first training forward also gives the
        parity numbers: every sampled token's log-prob recomputed in an ordinary packed training forward,
        compared with what the engine recorded."""
        result = self.trainer.step(batch, self.objective)
        return TrainResult(result.stats, compare_logprobs([s.logprobs for s in batch.samples], result.logprobs))

    def reference_logprobs(self, samples: list[Sample]) -> list[torch.Tensor]:
        return self.trainer.reference_logprobs(samples)

    def parity(self, samples: list[Sample]) -> ParityReport:
        """The parity numbers without an update (a step that stops before its update, e.g. too many
        rollout errors): the samples' log-probs in a no-grad training forward vs the recorded ones."""
        with torch.no_grad():
            return compare_logprobs([s.logprobs for s in samples], [t.cpu() for t in self.trainer.logprobs(samples)])

    def save(self, root: str, step: int) -> str:
        from .checkpoint import save_checkpoint

        return str(save_checkpoint(root, step, self.model, self.trainer.optimizer))

    def restore(self, path: str) -> dict:
        from .checkpoint import load_checkpoint

        return load_checkpoint(path, self.model, self.trainer.optimizer)


# ---------------------------------------------------------------------------------------- typed handles
def _raw(value: Any) -> Any:
    """A pending result is handed to the transport as is (through Ray: an ObjectRef, never fetched by the
    driver); anything else is a plain argument."""
    return value.raw if isinstance(value, Pending) else value


class RolloutHandle:
    """The loop's view of one ``RolloutWorker``: calls start at once and return a ``Pending`` (resolve
    several with ``gather``: workers in actors run in parallel)."""

    def __init__(self, transport: WorkerHandle):
        self.transport = transport

    def generate(self, prompts: list[list[int]], groups: list[int], sampling: SamplingParams | list[SamplingParams],
                 request_ids: list[str], use_tqdm: bool = False) -> Pending[list[Sample]]:
        return Pending(self.transport.submit("generate", prompts, groups, sampling, request_ids, use_tqdm=use_tqdm))

    def numerics_fingerprint(self) -> NumericsFingerprint:
        return self.transport.call("numerics_fingerprint")

    def update_weights(self, lora_state: Pending[dict[str, torch.Tensor]] | dict[str, torch.Tensor]) -> Pending[int]:
        return Pending(self.transport.submit("update_weights", _raw(lora_state)))


class TrainerHandle:
    """The loop's view of the ``TrainerWorker``. ``lora_state`` stays pending (through Ray it goes from the
    trainer's actor to the rollout actors via the object store); the other calls wait for their result."""

    def __init__(self, transport: WorkerHandle):
        self.transport = transport

    def lora_state(self) -> Pending[dict[str, torch.Tensor]]:
        return Pending(self.transport.submit("lora_state"))

    def load_lora_state(self, state: dict[str, torch.Tensor]) -> None:
        self.transport.call("load_lora_state", state)

    def numerics_fingerprint(self) -> NumericsFingerprint:
        return self.transport.call("numerics_fingerprint")

    def train(self, batch: TrainBatch) -> TrainResult:
        return self.transport.call("train", batch)

    def reference_logprobs(self, samples: list[Sample]) -> list[torch.Tensor]:
        return self.transport.call("reference_logprobs", samples)

    def parity(self, samples: list[Sample]) -> ParityReport:
        return self.transport.call("parity", samples)

    def save(self, root: str, step: int) -> str:
        return self.transport.call("save", root, step)

    def restore(self, path: str) -> dict:
        return self.transport.call("restore", path)
