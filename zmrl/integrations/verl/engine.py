"""``actor.strategy=zmrl``: verl's training engine interface over zmrl's trainer.

verl hands the engine packed (jagged) sequences; each micro-batch goes through the same packed forward
and log-prob op the zmrl trainer uses (``forward_packed`` + ``token_logprobs``: the ops whose results the
rollout engine records bit for bit), and comes back in verl's layout: per sequence, position ``t`` holds
the log-prob of token ``t + 1`` (the last position 0), with the entropy of the same distribution beside
it. verl's own loss function (its PPO/GRPO policy loss) is applied to that output and back-propagated
into the LoRA parameters, which zmrl's optimiser then updates.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Callable, Generator
from typing import Any

import torch

from verl.utils import tensordict_utils as tu
from verl.utils.device import get_device_name
from verl.workers.engine.base import BaseEngine, BaseEngineCtx
from verl.workers.engine.utils import postprocess_batch_func, prepare_micro_batches

from zmrl.kernels_batch_invariant import apply_numerics, current_numerics, fingerprint
from zmrl.kernels_batch_invariant.logprob import token_logprobs
from zmrl.lora import lora_state_dict
from zmrl.model import cu_seqlens_from_lens, forward_packed
from zmrl.model.checkpoint import check_checkpoint
from zmrl.trainer import Trainer, TrainerConfig, lora_disabled

from .settings import ModelSettings, ZmrlSettingError

log = logging.getLogger(__name__)

ENGINE_NAME = "zmrl"
# The key of the peft config handed to the rollout with every weight update: it says the weights come
# from a zmrl engine and carries that process's numerics fingerprint (the rollout checks both).
PEFT_MARKER = "zmrl"


def _temperatures(micro_batch, n: int) -> list[float]:
    t = micro_batch["temperature"] if "temperature" in micro_batch.keys() else tu.get_non_tensor_data(
        micro_batch, "temperature", 1.0)
    if isinstance(t, torch.Tensor):
        t = t.reshape(-1).tolist()
        return [float(x) for x in (t * n if len(t) == 1 else t)]
    return [float(t)] * n


def _entropy(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    z = logits.float() if temperature == 0 else logits.float() / temperature
    logp = torch.log_softmax(z, dim=-1)
    return -(logp.exp() * logp).sum(-1)


class ZmrlEngine(BaseEngine):
    """One LoRA'd zmrl model and its optimiser, behind verl's ``BaseEngine``."""

    instances_in_process = 0  # read by the rollout adapter built next to it in verl's hybrid worker

    def __init__(self, model_config, engine_config, optimizer_config, checkpoint_config, **_: Any):
        self.model_config = model_config
        self.engine_config = engine_config
        self.optimizer_config = optimizer_config
        self.checkpoint_config = checkpoint_config
        self.settings = ModelSettings.from_model_config(model_config)
        try:
            check_checkpoint(self.settings.path)
        except Exception as e:  # noqa: BLE001 -- one line naming the setting
            raise ZmrlSettingError(f"actor_rollout_ref.model.path={self.settings.path!r}: zmrl cannot load it: "
                                   f"{e}") from None
        ZmrlEngine.instances_in_process += 1
        self.trainer: Trainer | None = None
        self.mode: str | None = None

    # ------------------------------------------------------------------ lifecycle
    def initialize(self) -> None:
        from zmrl.rl.workers import ModelSpec

        apply_numerics(current_numerics().replace(kernel_mode=self.settings.kernel_mode))
        oc = self.optimizer_config
        lr = float(getattr(oc, "lr", 1e-4))
        wd = float(getattr(oc, "weight_decay", 0.0) or 0.0)
        device = "cuda" if get_device_name() == "cuda" and torch.cuda.is_available() else "cpu"
        model = ModelSpec(self.settings.path, None, self.settings.lora, device).load()
        self.trainer = Trainer(model, TrainerConfig(lr=lr, weight_decay=wd, latent_format=self.settings.latent_format))
        self.lr = lr
        log.info("zmrl engine: %s, LoRA r=%d, kernel mode %s", self.settings.path, self.settings.lora.r,
                 self.settings.kernel_mode)

    @property
    def model(self) -> torch.nn.Module:
        assert self.trainer is not None, "ZmrlEngine.initialize() has not run"
        return self.trainer.model

    @property
    def is_param_offload_enabled(self) -> bool:
        return False

    @property
    def is_optimizer_offload_enabled(self) -> bool:
        return False

    def train_mode(self, **kwargs):
        return BaseEngineCtx(self, "train", **kwargs)

    def eval_mode(self, **kwargs):
        return BaseEngineCtx(self, "eval", **kwargs)

    def to(self, device: str, model: bool = True, optimizer: bool = True, grad: bool = True):
        super().to(device, model=model, optimizer=optimizer, grad=grad)  # the model stays where it was loaded

    def numerics_fingerprint(self):
        return fingerprint()

    # ------------------------------------------------------------------ data parallel
    def get_data_parallel_size(self) -> int:
        return torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1

    def get_data_parallel_rank(self) -> int:
        return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0

    def get_data_parallel_group(self):
        return torch.distributed.group.WORLD if torch.distributed.is_initialized() else None

    def is_mp_src_rank_with_outputs(self) -> bool:
        return True

    # ------------------------------------------------------------------ optimisation
    def optimizer_zero_grad(self) -> None:
        self.trainer.optimizer.zero_grad(set_to_none=True)

    def optimizer_step(self) -> float:
        params = [p for g in self.trainer.optimizer.param_groups for p in g["params"]]
        if self.get_data_parallel_size() > 1:  # replicas hold whole models: average the LoRA gradients
            for p in params:
                if p.grad is not None:
                    torch.distributed.all_reduce(p.grad, op=torch.distributed.ReduceOp.AVG)
        clip = getattr(self.optimizer_config, "clip_grad", None)
        norm = torch.nn.utils.clip_grad_norm_(params, float(clip) if clip else float("inf"), foreach=False)
        if not torch.isfinite(norm):
            log.warning("zmrl engine: grad norm is %s, skipping the optimiser step", float(norm))
            self.trainer.optimizer.zero_grad(set_to_none=True)
        else:
            self.trainer.optimizer.step()
        return float(norm)

    def lr_scheduler_step(self) -> float:
        return self.lr  # constant learning rate (zmrl's trainer has no schedule)

    # ------------------------------------------------------------------ forward / backward
    def _forward_micro_batch(self, micro_batch) -> dict[str, torch.Tensor]:
        input_ids = micro_batch["input_ids"]
        if not input_ids.is_nested:
            raise ValueError("actor.strategy=zmrl takes verl's packed batches (pad_mode no_padding, the default of "
                             "verl's RL trainer); got padded input_ids")
        device = self.model.device
        offsets = input_ids.offsets()
        lens = offsets.diff().tolist()
        ids = input_ids.values().to(device)
        temps = _temperatures(micro_batch, len(lens))
        want_entropy = tu.get_non_tensor_data(micro_batch, "calculate_entropy", False)
        logits = forward_packed(self.model, ids, cu_seqlens_from_lens(lens, device),
                                latent_format=self.settings.latent_format)
        lps, ents = [], []
        for rows, seq, t in zip(logits.split(lens), ids.split(lens), temps):
            lp = token_logprobs(rows[:-1], seq[1:], t)
            lps.append(torch.cat([lp, lp.new_zeros(1)]))
            if want_entropy:
                ents.append(_entropy(rows, t))
        cu = offsets.to(device)
        out = {"log_probs": torch.nested.nested_tensor_from_jagged(torch.cat(lps), cu)}
        if want_entropy:
            out["entropy"] = torch.nested.nested_tensor_from_jagged(torch.cat(ents), cu)
        return out

    def forward_backward_batch(self, data, loss_function: Callable | None, forward_only: bool = False) -> Any:
        tu.assign_non_tensor(data, sp_size=1)
        batch_num_tokens = data["loss_mask"].sum() if "loss_mask" in data.keys() else None
        if batch_num_tokens is not None:
            if self.get_data_parallel_size() > 1:
                torch.distributed.all_reduce(batch_num_tokens, op=torch.distributed.ReduceOp.SUM)
            tu.assign_non_tensor(data, batch_num_tokens=batch_num_tokens.item())
        tu.assign_non_tensor(data, dp_size=self.get_data_parallel_size())
        micro_batches, indices = prepare_micro_batches(data=data, dp_group=self.get_data_parallel_group(),
                                                       same_micro_num_in_dp=True)
        outputs = []
        for micro_batch in micro_batches:
            with torch.set_grad_enabled(not forward_only):
                model_output = self._forward_micro_batch(micro_batch)
                if loss_function is not None:
                    loss, metrics = loss_function(model_output=model_output, data=micro_batch,
                                                  dp_group=self.get_data_parallel_group())
                else:
                    loss, metrics = torch.zeros(()), {}
                if not forward_only:
                    loss.backward()
            outputs.append({"model_output": {k: v.detach() for k, v in model_output.items()},
                            "loss": float(loss.detach()), "metrics": metrics})
        return postprocess_batch_func(output_lst=outputs, indices=indices, data=data)

    # ------------------------------------------------------------------ weights out
    def get_per_tensor_param(self, **kwargs: Any) -> tuple[Generator[tuple[str, torch.Tensor], None, None], dict]:
        """The LoRA tensors (zmrl names, on the CPU) and a peft config that marks them as zmrl's and carries
        this process's numerics fingerprint."""
        state = {k: v.detach().to("cpu", copy=True) for k, v in lora_state_dict(self.model).items()}
        lora = self.settings.lora
        peft = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora.r, "lora_alpha": lora.alpha,
                "target_modules": list(lora.target_modules), "lora_dropout": 0.0, "bias": "none",
                PEFT_MARKER: {"numerics": fingerprint()}}
        return (item for item in state.items()), peft

    def disable_adapter(self):
        return lora_disabled(self.model)

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, local_path: str, hdfs_path: str | None = None, global_step: int = 0,
                        max_ckpt_to_keep: int | None = None, **kwargs: Any) -> None:
        from zmrl.rl.checkpoint import save_checkpoint

        if self.get_data_parallel_rank() != 0:
            return
        os.makedirs(local_path, exist_ok=True)
        save_checkpoint(local_path, global_step, self.model, self.trainer.optimizer)

    def load_checkpoint(self, local_path: str, hdfs_path: str | None = None, del_local_after_load: bool = True,
                        **kwargs: Any) -> None:
        from zmrl.rl.checkpoint import latest_checkpoint, load_checkpoint

        path = latest_checkpoint(local_path) or local_path
        load_checkpoint(path, self.model, self.trainer.optimizer)
