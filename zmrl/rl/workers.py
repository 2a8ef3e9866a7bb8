"""The two sides of the RL loop as plain classes, usable in-process or as Ray actors.

``RolloutWorker`` owns an engine over its own copy of the model; ``TrainerWorker`` owns the trainable
copy (base + LoRA) and its optimiser. They share nothing but tensors passed through method calls,
so the same code runs in one process or as Ray actors on separate CPUs/GPUs (``zmrl.rl.cluster``).
Everything a method returns is on the CPU (log-probs, LoRA state), whatever device the worker computes
on: results cross process boundaries, and a driver without a GPU must be able to unpickle them.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from zmrl.kernels_batch_invariant import NumericsFingerprint, apply_numerics, current_numerics, fingerprint
from zmrl.lora import LoraConfig, apply_lora, load_lora_state_dict, lora_state_dict
from zmrl.model import load_pretrained
from zmrl.parity import ParityReport, compare_logprobs
from zmrl.rollout import EngineConfig, RolloutEngine, SamplingParams
from zmrl.trainer import compute_logprobs, make_optimizer, pack_micro_batches

from .algorithms import pad_rows

log = logging.getLogger(__name__)


@dataclass
class Sample:
    """One rollout: what the trainer needs to reproduce and score it."""

    prompt_ids: list[int]
    response_ids: list[int]
    rollout_logprobs: torch.Tensor
    group: int  # index of the prompt (GRPO group)
    reward: float = 0.0
    finish_reason: str = "length"


def _set_threads(num_threads: int | None) -> None:
    if num_threads:
        apply_numerics(current_numerics().replace(cpu_threads=num_threads))


class RolloutWorker:
    def __init__(self, model_path: str, dtype: str, lora: LoraConfig, engine: EngineConfig,
                 num_threads: int | None = None, device: str = "cpu"):
        _set_threads(num_threads)
        self.model = load_pretrained(model_path, dtype=dtype, device=device)
        apply_lora(self.model, lora)
        self.engine = RolloutEngine(self.model, engine)

    def generate(self, prompts: list[list[int]], sampling: SamplingParams | list[SamplingParams],
                 request_ids: list[str], use_tqdm: bool = False) -> list[dict]:
        params = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
        outs = self.engine.generate(prompts, params, request_ids=request_ids, use_tqdm=use_tqdm)
        return [dict(request_id=o.request_id, prompt_ids=o.prompt_token_ids, response_ids=o.token_ids,
                     logprobs=o.logprobs.cpu(), finish_reason=o.finish_reason, error=o.error) for o in outs]

    def update_weights(self, lora_state: dict[str, torch.Tensor]) -> int:
        return self.engine.update_weights(lora_state)

    def numerics_fingerprint(self) -> NumericsFingerprint:
        """This process's numerics contract, compared with the trainer's before the first step."""
        return fingerprint(self.engine.numerics)


class TrainerWorker:
    def __init__(self, model_path: str, dtype: str, lora: LoraConfig, lr: float, weight_decay: float,
                 micro_batch_tokens: int | None, latent_format: str, num_threads: int | None = None,
                 kernel_mode: str = "bitwise", device: str = "cpu"):
        # The trainer's ops read the process's numerics; the kernel mode must be the engine's
        # (EngineConfig.kernel_mode): the driver compares both sides' fingerprints before the first step.
        apply_numerics(current_numerics().replace(kernel_mode=kernel_mode, cpu_threads=num_threads))
        self.model = load_pretrained(model_path, dtype=dtype, device=device)
        apply_lora(self.model, lora)
        self.optimizer = make_optimizer(self.model, lr=lr, weight_decay=weight_decay)
        self.micro_batch_tokens = micro_batch_tokens
        self.latent_format = latent_format

    def numerics_fingerprint(self) -> NumericsFingerprint:
        return fingerprint()

    def lora_state(self) -> dict[str, torch.Tensor]:
        # a copy on the CPU (bitwise the parameters): what the rollout workers load, from any process
        return {k: v.detach().to("cpu", copy=True) for k, v in lora_state_dict(self.model).items()}

    def load_lora_state(self, state: dict[str, torch.Tensor]) -> None:
        load_lora_state_dict(self.model, state)

    def logprobs(self, samples: list[Sample], temperature: float, grad: bool = False,
                 subset: list[int] | None = None) -> list[torch.Tensor]:
        idx = list(range(len(samples))) if subset is None else subset
        seqs = [samples[i].prompt_ids + samples[i].response_ids for i in idx]
        plens = [len(samples[i].prompt_ids) for i in idx]
        with torch.set_grad_enabled(grad):
            return compute_logprobs(self.model, seqs, plens, temperature, micro_batch_tokens=None,
                                    latent_format=self.latent_format)

    def parity(self, samples: list[Sample], temperature: float) -> ParityReport:
        """Recompute every sampled token's log-prob in an ordinary training forward (packed micro-batches)
        and compare with what the engine recorded."""
        seqs = [s.prompt_ids + s.response_ids for s in samples]
        with torch.no_grad():
            train = compute_logprobs(self.model, seqs, [len(s.prompt_ids) for s in samples], temperature,
                                     micro_batch_tokens=self.micro_batch_tokens, latent_format=self.latent_format)
        return compare_logprobs([s.rollout_logprobs for s in samples], train)

    def update(self, samples: list[Sample], advantages: list[torch.Tensor], temperature: float,
               policy_loss, ref_logprobs: list[torch.Tensor] | None = None, kl_coef: float = 0.0,
               kl_penalty=None) -> dict[str, float]:
        """One optimiser step over all samples, gradients accumulated over packed micro-batches.

        The old policy of the PPO ratio is the rollout policy, whose recorded log-probs are bitwise the
        trainer's: no importance-sampling patch. Losses are token-means over the whole step.
        """
        lengths = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
        total_tokens = max(sum(len(s.response_ids) for s in samples), 1)
        self.optimizer.zero_grad(set_to_none=True)
        stats: dict[str, float] = {"loss/policy": 0.0, "loss/kl_ref": 0.0}
        for batch in pack_micro_batches(lengths, self.micro_batch_tokens):
            batch = [i for i in batch if samples[i].response_ids]
            if not batch:
                continue
            weight = sum(len(samples[i].response_ids) for i in batch) / total_tokens
            lp, mask = pad_rows(self.logprobs(samples, temperature, grad=True, subset=batch))
            old, _ = pad_rows([samples[i].rollout_logprobs.to(lp.device) for i in batch])
            adv, _ = pad_rows([advantages[i].to(lp.device) for i in batch])
            loss, metrics = policy_loss(old, lp, adv, mask)
            stats["loss/policy"] += float(loss.detach()) * weight
            for k, v in metrics.items():
                stats[k] = stats.get(k, 0.0) + v * weight
            if kl_coef and ref_logprobs is not None:
                ref, _ = pad_rows([ref_logprobs[i].to(lp.device) for i in batch])
                kl = kl_penalty(lp, ref, mask)
                stats["loss/kl_ref"] += float(kl.detach()) * weight
                loss = loss + kl_coef * kl
            (loss * weight).backward()
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        stats["train/grad_norm"] = float(torch.nn.utils.clip_grad_norm_(params, float("inf"), foreach=False))
        self.optimizer.step()
        return stats

    def save(self, root: str, step: int) -> str:
        from .checkpoint import save_checkpoint

        return str(save_checkpoint(root, step, self.model, self.optimizer))

    def restore(self, path: str) -> dict:
        from .checkpoint import load_checkpoint

        return load_checkpoint(path, self.model, self.optimizer)

    def reference_logprobs(self, samples: list[Sample], temperature: float) -> list[torch.Tensor]:
        """Log-probs under the base model (LoRA off): the reference policy of the KL term."""
        with lora_disabled(self.model):
            return [t.cpu() for t in self.logprobs(samples, temperature)]


class lora_disabled:
    """Temporarily detach every adapter (the base model is the reference policy)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.saved: list[tuple[torch.nn.Module, str, object]] = []

    def __enter__(self):
        for m in self.model.modules():
            for attr in ("adapter", "experts_lora"):
                if getattr(m, attr, None) is not None:
                    self.saved.append((m, attr, getattr(m, attr)))
                    setattr(m, attr, None)
        return self.model

    def __exit__(self, *exc):
        for m, attr, value in self.saved:
            setattr(m, attr, value)
        self.saved.clear()
