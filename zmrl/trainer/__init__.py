"""Trainer: the log-prob forward (packed varlen, autograd) and the LoRA optimiser."""
from .logprobs import compute_logprobs, pack_micro_batches
from .optim import make_optimizer

__all__ = ["compute_logprobs", "make_optimizer", "pack_micro_batches"]
