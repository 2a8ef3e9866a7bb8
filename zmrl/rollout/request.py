"""A request as the engine tracks it (prompt, sampled tokens, cache pages, KDA state) and the output
it finishes with. Shared by the scheduler, the model runner and the sampler driver."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from zmrl.model.context import SequenceState

from .sampling import SamplingParams


def as_token_list(tokens) -> list:
    return tokens.tolist() if isinstance(tokens, torch.Tensor) else list(tokens)


@dataclass
class RolloutOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    # [len(token_ids)] float32, on the model's device: log_softmax(logits / T)[token] (raw logits at T = 0)
    logprobs: torch.Tensor
    finish_reason: str  # "stop" | "length" | "error"
    temperature: float = 1.0
    seed: int = 0  # the request's seed: the one it gave, or the one the engine drew (replaying with it repeats)
    sample_index: int = 0  # the sampler's key: params.first_sample_index + j for the request's j-th sample
    weights_version: int = 0
    num_preemptions: int = 0
    error: str | None = None


@dataclass
class Request:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    fork_ids: list[str] = field(default_factory=list)  # siblings to fork when the prompt is done (n > 1)
    sample_index: int = 0  # j of the request's n samples (sample_key = params.first_sample_index + j)
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # float32 values of the sampled tokens' log-probs
    seq: SequenceState = field(default_factory=SequenceState)
    hashes: list[int] = field(default_factory=list)  # hashes of this request's computed full blocks
    num_preemptions: int = 0

    @property
    def sample_key(self) -> int:
        """The sampler's key, with params.seed: the sample's index within its group."""
        return self.params.first_sample_index + self.sample_index

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def num_tokens(self) -> int:
        """len(tokens) without building the list (hot path: called for every request every step)."""
        return len(self.prompt) + len(self.output)

    def token_at(self, i: int) -> int:
        n = len(self.prompt)
        return self.prompt[i] if i < n else self.output[i - n]

    def token_slice(self, start: int, end: int) -> list[int]:
        """``tokens[start:end]`` without building the whole token list (0 <= start <= end)."""
        n = len(self.prompt)
        if end <= n:
            return self.prompt[start:end]
        if start >= n:
            return self.output[start - n:end - n]
        return self.prompt[start:] + self.output[:end - n]

    @property
    def num_computed(self) -> int:
        return self.seq.num_tokens

    def finish(self, reason: str, weights_version: int, device: torch.device,
               error: str | None = None) -> RolloutOutput:
        # log-probs on the model's device, like the trainer's (torch.equal needs one device)
        lp = torch.tensor(self.logprobs, dtype=torch.float32, device=device)  # exact: each value was a float32
        return RolloutOutput(
            request_id=self.request_id, prompt_token_ids=list(self.prompt), token_ids=list(self.output), logprobs=lp,
            finish_reason=reason, temperature=self.params.temperature, seed=self.params.seed,
            sample_index=self.sample_key,
            weights_version=weights_version, num_preemptions=self.num_preemptions, error=error,
        )
