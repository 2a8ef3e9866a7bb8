"""verl's algorithms (advantage estimators, policy losses, KL penalties) adapted to per-sequence tensors.

verl works on padded [batch, response_len] tensors with a response mask; zmrl's trainer returns one
1-D log-prob tensor per sequence. These helpers pad, call verl's registered functions, and unpad.
"""
from __future__ import annotations

import numpy as np
import torch

from zmrl.extras import require
from zmrl.trainer import pad_rows


def compute_advantages(rewards: list[float], lengths: list[int], groups: list[int], estimator: str = "grpo",
                       norm_adv_by_std_in_grpo: bool = True) -> list[torch.Tensor]:
    """Outcome rewards -> per-token advantages through verl's registered estimator."""
    core_algos = require("verl.trainer.ppo.core_algos", "rl", "the RL algorithms (verl)")

    width = max(max(lengths, default=1), 1)
    token_rewards = torch.zeros(len(rewards), width)
    for i, (r, n) in enumerate(zip(rewards, lengths)):
        if n:
            token_rewards[i, n - 1] = r
    _, mask = pad_rows([torch.zeros(n) for n in lengths])  # the response mask, [B, width]
    fn = core_algos.get_adv_estimator_fn(estimator)
    kwargs = dict(token_level_rewards=token_rewards, response_mask=mask, index=np.array(groups))
    if estimator == "grpo":
        kwargs["norm_adv_by_std_in_grpo"] = norm_adv_by_std_in_grpo
    adv, _ = fn(**kwargs)
    return [adv[i, :n].clone() for i, n in enumerate(lengths)]


class PolicyLoss:
    """verl's registered policy loss (``vanilla`` = PPO clip), token-mean over a micro-batch."""

    def __init__(self, name: str = "vanilla", clip_ratio: float = 0.2):
        OmegaConf = require("omegaconf", "rl", "verl's algorithm config").OmegaConf
        core_algos = require("verl.trainer.ppo.core_algos", "rl", "the RL algorithms (verl)")

        self.fn = core_algos.get_policy_loss_fn(name)
        self.config = OmegaConf.create({"clip_ratio": clip_ratio, "clip_ratio_low": clip_ratio,
                                        "clip_ratio_high": clip_ratio, "clip_ratio_c": 3.0,
                                        "global_batch_info": {}})

    def __call__(self, old_lp: torch.Tensor, lp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor
                 ) -> tuple[torch.Tensor, dict[str, float]]:
        out = self.fn(old_log_prob=old_lp, log_prob=lp, advantages=adv, response_mask=mask,
                      loss_agg_mode="token-mean", config=self.config)
        loss, metrics = out if isinstance(out, tuple) else (out, {})
        return loss, {k: float(v) for k, v in dict(metrics).items()}


class KLPenalty:
    """KL to the reference policy through verl's ``kl_penalty`` (k1/k2/k3 = "kl"/"mse"/"low_var_kl")."""

    def __init__(self, name: str = "low_var_kl"):
        core_algos = require("verl.trainer.ppo.core_algos", "rl", "the RL algorithms (verl)")

        self.core, self.name = core_algos, name

    def __call__(self, lp: torch.Tensor, ref_lp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        kl = self.core.kl_penalty(lp, ref_lp, kl_penalty=self.name)
        return self.core.agg_loss(loss_mat=kl, loss_mask=mask, loss_agg_mode="token-mean")
