"""An offline rollout engine in the style of vLLM's ``LLM.generate`` / nano-vllm.

Continuous batching with chunked prefill under a token budget, a paged cache shared by every MLA
layer (latent + FP8 index keys per block row) with per-request KDA state, prefix caching by block
hash (latents, index keys and the KDA snapshot at the block end), preemption by recompute, and
``n > 1`` samples forked from the prompt's blocks. Every token runs through the same model modules
and batch-invariant ops as the trainer, and sampling noise depends only on (seed, sample index
within the request, position), so a request's tokens and log-probs do not depend on what else ran
with it or on its request id. A request without a seed gets one drawn here, recorded on its output.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import secrets
from collections.abc import Iterator

import torch

from zmrl.kernels_batch_invariant import Numerics, apply_numerics, current_numerics, get_mode, numerics_scope

from .config import KERNEL_MODES, EngineConfig
from .model_runner import ModelRunner
from .request import Request, RolloutOutput, as_token_list
from .sampler import draw, fetch
from .sampling import SamplingParams
from .scheduler import Scheduler

__all__ = ["KERNEL_MODES", "EngineConfig", "Request", "RolloutEngine", "RolloutOutput"]

log = logging.getLogger(__name__)


class RolloutEngine:
    """Composes the roles: ``Scheduler`` (what runs next), ``ModelRunner`` (the forward), ``draw`` (sampling)."""

    def __init__(self, model, config: EngineConfig | None = None):
        self.model = model.eval()
        self.config = (config or EngineConfig()).validate()
        mcfg = model.config
        self.max_model_len = self.config.max_model_len or mcfg.max_position_embeddings
        if self.max_model_len > mcfg.max_position_embeddings:
            raise ValueError(f"EngineConfig.max_model_len={self.max_model_len} exceeds the model's "
                             f"max_position_embeddings={mcfg.max_position_embeddings}")
        self.block_size = self.config.block_size
        self.runner = ModelRunner(model, self.config, self.max_model_len)
        self.scheduler = Scheduler(self.config, self.max_model_len, self.runner.kda_layers, self.runner)
        self.num_steps = 0
        # The engine's numerics: the process's contract, with the configured kernel mode applied to the
        # whole process (so a trainer in this process follows); None = follow the process at every step.
        self.numerics: Numerics | None = None
        if self.config.kernel_mode is not None:
            self.numerics = current_numerics().replace(kernel_mode=self.config.kernel_mode)
            apply_numerics(self.numerics)
        if get_mode() != "bitwise":
            log.warning("rollout engine in %r kernel mode: rollout/trainer log-probs are not expected to be "
                        "bitwise equal", get_mode())
        self._mode_warned = False

    # the roles' state, under the names callers and tests use
    blocks = property(lambda self: self.scheduler.blocks)
    waiting = property(lambda self: self.scheduler.waiting)
    running = property(lambda self: self.scheduler.running)
    num_preemptions = property(lambda self: self.scheduler.num_preemptions)
    weights_version = property(lambda self: self.scheduler.weights_version)
    graphs = property(lambda self: self.runner.graphs)

    # ------------------------------------------------------------------ requests
    def _validate(self, prompt: list[int], params: SamplingParams) -> None:
        vocab = self.model.config.vocab_size
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling must be a SamplingParams, got {type(params).__name__}")
        if len(prompt) == 0:
            raise ValueError("prompt_token_ids is empty: a request needs at least one prompt token")
        bad = [t for t in prompt if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token id {bad[0]!r} is out of range for vocab_size={vocab} (allowed 0..{vocab - 1})")
        if len(prompt) >= self.max_model_len:
            raise ValueError(f"prompt has {len(prompt)} tokens; the limit is max_model_len - 1 = {self.max_model_len - 1}")

    def add_request(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams | None = None) -> None:
        params = sampling or SamplingParams()
        prompt = as_token_list(prompt_token_ids)
        self._validate(prompt, params)
        if params.seed is None:  # drawn here and recorded on the outputs: replaying with it repeats the tokens
            params = dataclasses.replace(params, seed=secrets.randbits(63))
        self.scheduler.add(request_id, prompt, params)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def generate(self, prompts: list[list[int]], sampling: SamplingParams | list[SamplingParams] | None = None,
                 request_ids: list[str] | None = None, use_tqdm: bool = False) -> list[RolloutOutput]:
        """Run every prompt to completion; outputs in prompt order (n > 1: samples of a prompt together)."""
        params = sampling if isinstance(sampling, list) else [sampling or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        ids = request_ids or [str(i) for i in range(len(prompts))]
        for p, sp in zip(prompts, params):  # validate everything before anything runs
            self._validate(as_token_list(p), sp)
        order: dict[str, int] = {}
        for i, (rid, p, sp) in enumerate(zip(ids, prompts, params)):
            self.add_request(rid, p, sp)
            for j in range(sp.n):
                order[rid if sp.n == 1 else f"{rid}-{j}"] = len(order)
        outs: list[RolloutOutput] = []
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(order), desc="rollout", unit="seq")
        while self.has_unfinished_requests():
            done = self.step()
            outs.extend(done)
            if bar is not None:
                bar.update(len(done))
        if bar is not None:
            bar.close()
        return sorted(outs, key=lambda o: order.get(o.request_id, len(order)))

    def update_weights(self, lora_state: dict[str, torch.Tensor] | None = None) -> int:
        """Push new weights into the live engine without rebuilding it or its cache.

        ``lora_state`` (``zmrl.lora.lora_state_dict`` of the trainer's model) is copied into the
        engine's model; pass None when the trainer updated this very model object in place. Cached
        prefixes are dropped (their values belong to the old weights). Returns the new version."""
        if self.scheduler.waiting or self.scheduler.running:
            raise RuntimeError("update_weights with unfinished requests: their caches hold old-weight values")
        if lora_state is not None:
            from zmrl.lora import load_lora_state_dict

            load_lora_state_dict(self.model, lora_state)
        return self.scheduler.new_weights()

    # ------------------------------------------------------------------ one step
    def step(self) -> list[RolloutOutput]:
        """Schedule and run one forward; returns the requests that finished in this step."""
        batch = self.scheduler.schedule()
        if batch:
            with self._numerics():
                fwd = self.runner.run(batch)
                self.scheduler.register_blocks(fwd.computed)
                if fwd.sampled is not None:  # drawn by the decode graph
                    self.scheduler.apply(*fetch(fwd.ready, fwd.sampled))
                elif fwd.ready:
                    self.scheduler.apply(*draw(self.scheduler.with_forks(fwd.ready), fwd.logits))
            self.num_steps += 1
        return self.scheduler.take_finished()

    @contextlib.contextmanager
    def _numerics(self) -> Iterator[None]:
        """No autograd, and the engine's kernel mode (the process mode when the config leaves it open)."""
        mode = self.config.kernel_mode
        with torch.no_grad():
            if self.numerics is None:  # follow the process's numerics
                yield
                return
            if current_numerics() != self.numerics and not self._mode_warned:
                # someone changed the process numerics after the engine was built: the engine keeps its own,
                # a trainer in this process now runs another one
                log.warning("process numerics are %s (kernel mode %r) but this engine was configured with kernel "
                            "mode %r; the engine keeps %r, a trainer in this process will not match it",
                            current_numerics(), get_mode(), mode, mode)
                self._mode_warned = True
            with numerics_scope(self.numerics):
                yield
