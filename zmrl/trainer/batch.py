"""Typed records between the rollout and the trainer: one ``Sample`` per sampled response, one
``TrainBatch`` per optimiser step.

The trainer does not import the engine: ``Sample.from_output`` reads the fields of a
``zmrl.rollout.RolloutOutput`` by name, so the two stay on separate floors and a sample built by hand
(tests, offline data) is the same record.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class Sample:
    """One sampled response: what the trainer needs to reproduce its log-probs and score it.

    ``logprobs`` are what the engine recorded at sampling time (float32, one per response token, on the
    CPU once they left the rollout worker); the trainer's recomputation must equal them bitwise.
    ``temperature`` is the one the token was sampled at (the trainer's ``log_softmax(logits / T)`` uses
    it); ``group`` is the index of the prompt it answers (the GRPO group); ``seed`` and
    ``weights_version`` say which sampling noise and which weights produced it.
    """

    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: torch.Tensor
    temperature: float
    group: int
    seed: int
    weights_version: int
    finish_reason: str = "length"  # "stop" | "length" | "error"
    request_id: str = ""
    error: str | None = None
    reward: float = 0.0  # set by the RL loop once the response is scored

    @classmethod
    def from_output(cls, output: Any, group: int) -> "Sample":
        """The record of one engine output (a ``zmrl.rollout.RolloutOutput``), its log-probs moved to the
        CPU: samples cross process boundaries and a driver without a GPU must be able to read them."""
        return cls(prompt_ids=list(output.prompt_token_ids), response_ids=list(output.token_ids),
                   logprobs=output.logprobs.detach().cpu(), temperature=float(output.temperature), group=group,
                   seed=int(output.seed), weights_version=int(output.weights_version),
                   finish_reason=output.finish_reason, request_id=output.request_id, error=output.error)

    @property
    def sequence(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)


@dataclass
class TrainBatch:
    """The samples of one RL step with their per-token advantages (and, for a KL term, the reference
    policy's log-probs), index-aligned with ``samples``."""

    samples: list[Sample]
    advantages: list[torch.Tensor]
    ref_logprobs: list[torch.Tensor] | None = None

    def __post_init__(self) -> None:
        n = len(self.samples)
        for name in ("advantages", "ref_logprobs"):
            rows = getattr(self, name)
            if rows is None:
                continue
            if len(rows) != n:
                raise ValueError(f"TrainBatch.{name} has {len(rows)} rows for {n} samples")
            for i, (row, s) in enumerate(zip(rows, self.samples)):
                if row.numel() != len(s.response_ids):
                    raise ValueError(f"TrainBatch.{name}[{i}] has {row.numel()} values for "
                                     f"{len(s.response_ids)} response tokens")


def pad_rows(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence 1-D tensors -> ([B, L] float32 values, [B, L] response mask) on the CPU, L = the
    longest row (the loss is computed on the CPU whatever device the forward ran on)."""
    width = max((r.numel() for r in rows), default=1) or 1
    out = torch.zeros(len(rows), width, dtype=torch.float32)
    mask = torch.zeros(len(rows), width, dtype=torch.float32)
    for i, r in enumerate(rows):
        out[i, : r.numel()] = r
        mask[i, : r.numel()] = 1.0
    return out, mask
