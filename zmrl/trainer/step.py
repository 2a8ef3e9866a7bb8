"""The training step: log-probs in a packed forward with autograd, the policy loss (+ an optional KL
term to a reference policy), backward over micro-batches, and the optimiser step.

One forward per update: the log-probs the loss is computed from are also the ones compared with what
the engine recorded (parity). A forward with autograd enabled runs the same ops on the same values as
one without, so these are the same bits a separate no-grad pass would give, and that pass is not run.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from zmrl.kernels_batch_invariant.lm_head_logprobs import DEFAULT_CHUNK_ROWS
from zmrl.model import apply_recompute

from .batch import Sample, TrainBatch, pad_rows
from .logprobs import compute_logprobs, pack_micro_batches
from .optim import make_optimizer


class PolicyLossFn(Protocol):
    """``(old_lp, lp, advantages, mask)`` as padded [B, L] tensors -> (token-mean loss, scalar metrics)."""

    def __call__(self, old_lp: torch.Tensor, lp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor
                 ) -> tuple[torch.Tensor, dict[str, float]]: ...


class KLPenaltyFn(Protocol):
    """``(lp, ref_lp, mask)`` as padded [B, L] tensors -> token-mean KL estimate."""

    def __call__(self, lp: torch.Tensor, ref_lp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor: ...


@dataclass
class TrainerConfig:
    lr: float = 1e-4
    weight_decay: float = 0.0
    micro_batch_tokens: int | None = None  # tokens per packed micro-batch; None = one micro-batch
    latent_format: str = "native"  # the engine's EngineConfig.latent_format ("fp8" quantises here too)
    # Activation recompute of the training forward (zmrl/model/recompute.py: none | layer | selective |
    # attention); changes memory and time, never the forward bits or the gradients.
    recompute: str = "none"
    # Rows per lm_head + log-prob chunk (zmrl/kernels_batch_invariant/lm_head_logprobs.py): bounds the
    # logits memory to chunk x vocab fp32 in the forward and the backward; None = a micro-batch at once.
    logprob_chunk_tokens: int | None = DEFAULT_CHUNK_ROWS

    def __post_init__(self) -> None:
        if self.logprob_chunk_tokens is not None and self.logprob_chunk_tokens < 1:
            raise ValueError(f"trainer.logprob_chunk_tokens must be >= 1 or null, got {self.logprob_chunk_tokens}")


@dataclass
class Objective:
    """What one update minimises: the policy loss, plus ``kl_coef`` x the KL to the reference policy
    (``TrainBatch.ref_logprobs``), over ``epochs`` passes of the same batch."""

    policy_loss: PolicyLossFn
    kl_coef: float = 0.0
    kl_penalty: KLPenaltyFn | None = None
    epochs: int = 1

    def __post_init__(self) -> None:
        if self.epochs < 1:
            raise ValueError(f"Objective.epochs must be >= 1, got {self.epochs}")
        if self.kl_coef and self.kl_penalty is None:
            raise ValueError("Objective.kl_coef is set but kl_penalty is None")


@dataclass
class StepResult:
    """Scalar statistics of the last epoch, and the log-probs of the first epoch's forward (before any
    optimiser step: the policy that sampled), detached, on the CPU, one tensor per sample."""

    stats: dict[str, float]
    logprobs: list[torch.Tensor] = field(default_factory=list)


class Trainer:
    """A LoRA'd model and its optimiser. ``step`` is one RL update; ``logprobs`` the plain recompute."""

    def __init__(self, model: torch.nn.Module, config: TrainerConfig | None = None):
        self.model = model
        self.config = config or TrainerConfig()
        apply_recompute(model, self.config.recompute)  # after construction and LoRA, as torchtitan applies AC
        self.optimizer = make_optimizer(model, lr=self.config.lr, weight_decay=self.config.weight_decay)

    def logprobs(self, samples: list[Sample], grad: bool = False, subset: list[int] | None = None
                 ) -> list[torch.Tensor]:
        """Response log-probs of ``samples`` (or of ``subset`` of them) at each sample's temperature, in
        packed micro-batches of ``micro_batch_tokens`` (one micro-batch for a subset: the caller packed it)."""
        idx = list(range(len(samples))) if subset is None else subset
        with torch.set_grad_enabled(grad):
            return compute_logprobs(self.model, [samples[i].sequence for i in idx],
                                    [len(samples[i].prompt_ids) for i in idx],
                                    [samples[i].temperature for i in idx],
                                    micro_batch_tokens=self.config.micro_batch_tokens if subset is None else None,
                                    latent_format=self.config.latent_format,
                                    logprob_chunk_tokens=self.config.logprob_chunk_tokens)

    def reference_logprobs(self, samples: list[Sample]) -> list[torch.Tensor]:
        """Log-probs under the base model (LoRA off), on the CPU: the reference policy of the KL term."""
        with torch.no_grad(), lora_disabled(self.model):
            return [t.cpu() for t in self.logprobs(samples)]

    def step(self, batch: TrainBatch, objective: Objective) -> StepResult:
        """``objective.epochs`` optimiser steps over the batch, gradients accumulated over packed
        micro-batches; losses are token-means over the whole batch.

        The old policy of the PPO ratio is the rollout policy, whose recorded log-probs are bitwise the
        trainer's: no importance-sampling correction.
        """
        samples = batch.samples
        first: list[torch.Tensor] = [torch.zeros(0, dtype=torch.float32) for _ in samples]
        stats: dict[str, float] = {}
        for epoch in range(objective.epochs):
            stats = self._epoch(batch, objective, first if epoch == 0 else None)
        return StepResult(stats, first)

    def _epoch(self, batch: TrainBatch, objective: Objective, keep: list[torch.Tensor] | None) -> dict[str, float]:
        samples, advantages = batch.samples, batch.advantages
        total_tokens = max(sum(len(s.response_ids) for s in samples), 1)
        self.optimizer.zero_grad(set_to_none=True)
        stats: dict[str, float] = {"loss/policy": 0.0, "loss/kl_ref": 0.0}
        for micro in pack_micro_batches([s.num_tokens for s in samples], self.config.micro_batch_tokens):
            micro = [i for i in micro if samples[i].response_ids]
            if not micro:
                continue
            weight = sum(len(samples[i].response_ids) for i in micro) / total_tokens
            rows = self.logprobs(samples, grad=True, subset=micro)
            if keep is not None:
                for i, row in zip(micro, rows):
                    keep[i] = row.detach().cpu()
            lp, mask = pad_rows(rows)
            old, _ = pad_rows([samples[i].logprobs for i in micro])
            adv, _ = pad_rows([advantages[i] for i in micro])
            loss, metrics = objective.policy_loss(old, lp, adv, mask)
            stats["loss/policy"] += float(loss.detach()) * weight
            for k, v in metrics.items():
                stats[k] = stats.get(k, 0.0) + v * weight
            if objective.kl_coef and batch.ref_logprobs is not None:
                ref, _ = pad_rows([batch.ref_logprobs[i] for i in micro])
                kl = objective.kl_penalty(lp, ref, mask)  # type: ignore[misc]
                stats["loss/kl_ref"] += float(kl.detach()) * weight
                loss = loss + objective.kl_coef * kl
            (loss * weight).backward()
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        stats["train/grad_norm"] = float(torch.nn.utils.clip_grad_norm_(params, float("inf"), foreach=False))
        self.optimizer.step()
        return stats


class lora_disabled:
    """Temporarily detach every adapter (the base model is the reference policy)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.saved: list[tuple[torch.nn.Module, str, object]] = []

    def __enter__(self) -> torch.nn.Module:
        for m in self.model.modules():
            for attr in ("adapter", "experts_lora"):
                if getattr(m, attr, None) is not None:
                    self.saved.append((m, attr, getattr(m, attr)))
                    setattr(m, attr, None)
        return self.model

    def __exit__(self, *exc: object) -> None:
        for m, attr, value in self.saved:
            setattr(m, attr, value)
        self.saved.clear()
