"""Optimiser over the LoRA parameters."""
from __future__ import annotations

import torch

from zmrl.lora import lora_parameters


def make_optimizer(model: torch.nn.Module, lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.999),
                   weight_decay: float = 0.0, eps: float = 1e-8) -> torch.optim.AdamW:
    params = lora_parameters(model)
    if not params:
        raise ValueError("the model has no LoRA parameters: call zmrl.lora.apply_lora(model, cfg) first")
    # foreach=False: the single-tensor path is run-to-run deterministic on CPU
    return torch.optim.AdamW(params, lr=lr, betas=betas, weight_decay=weight_decay, eps=eps, foreach=False)
