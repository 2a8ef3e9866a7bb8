"""Trainer: the log-prob forward (packed varlen, autograd), the typed samples it trains on, the
training step (loss, backward, optimiser) and the LoRA optimiser."""
from .batch import Sample, TrainBatch, pad_rows
from .logprobs import compute_logprobs, pack_micro_batches
from .optim import make_optimizer
from .step import KLPenaltyFn, Objective, PolicyLossFn, StepResult, Trainer, TrainerConfig, lora_disabled

__all__ = ["KLPenaltyFn", "Objective", "PolicyLossFn", "Sample", "StepResult", "TrainBatch", "Trainer",
           "TrainerConfig", "compute_logprobs", "lora_disabled", "make_optimizer", "pack_micro_batches", "pad_rows"]
