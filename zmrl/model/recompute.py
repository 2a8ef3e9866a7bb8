"""Activation recompute of the training forward, chosen per run and applied after model construction.

The policy is set on every decoder layer by ``apply_recompute(model, policy)`` (torchtitan style: the
model is built first, then wrapped for training); the layers read it in ``DecoderLayer.forward``.
Module names and parameters are untouched, so checkpoints, LoRA names and the engine see the same
model. Recompute only applies where autograd records a graph and the forward is the trainer's
(no per-sequence engine state); the engine's forward and no-grad forwards run as if the policy were
``none``.

Policies (``trainer.recompute`` in the recipe):

* ``none``: autograd keeps every activation the backward needs (fastest, most memory).
* ``layer``: each decoder layer is one checkpointed region (Megatron's "full" recompute with
  granularity 1, torchtitan's "full" AC): only the layer's input is kept; the backward re-runs the
  layer's forward once. Least memory; about one extra forward of compute.
* ``selective``: the token mixer (input norm + KDA or MLA/DSA) and the channel mixer (post-attention
  norm + dense MLP or MoE) are two checkpointed regions; the residual stream between them is kept.
  The same recompute work as ``layer`` but only one sub-block's internals are alive at a time in the
  backward, so the transient peak is lower; it keeps one more [T, D] tensor per layer.
* ``attention``: only the token mixer is checkpointed (Megatron's "selective" spirit: attention
  internals are large and cheap to redo); the MLP/MoE activations are kept.

Whatever the policy, a training MoE layer on the GPU does not keep its down products' [T * top_k, D] output for
the combine's weight gradient: that region (down product + combine) is checkpointed in ``MoE.forward`` and its
backward recomputes it from the kept GLU activations (one grouped GEMM, ~0.3 ms per layer at 16K tokens on an
H100, against 512 MiB per layer kept).

Why values and gradients are unchanged: the recomputation re-runs the same deterministic ops on the
same inputs, so it reproduces every saved tensor bit for bit, and the backward then runs the same
ops on the same values (``tests/model/test_recompute.py`` checks ``torch.equal`` of logits and of
every gradient against ``none``).
"""
from __future__ import annotations

from typing import Literal

from torch import nn

from .model import DecoderLayer

RecomputePolicy = Literal["none", "layer", "selective", "attention"]
RECOMPUTE_POLICIES: tuple[str, ...] = ("none", "layer", "selective", "attention")


def check_recompute_policy(policy: str, key: str = "trainer.recompute") -> RecomputePolicy:
    """The policy, or a one-line error naming ``key``, the value and what is allowed."""
    if policy not in RECOMPUTE_POLICIES:
        raise ValueError(f"{key}: unknown activation-recompute policy {policy!r} "
                         f"(allowed: {', '.join(RECOMPUTE_POLICIES)})")
    return policy  # type: ignore[return-value]


def apply_recompute(model: nn.Module, policy: str) -> nn.Module:
    """Set ``policy`` on every decoder layer of ``model`` (a HybridForCausalLM); returns the model."""
    policy = check_recompute_policy(policy)
    layers = [m for m in model.modules() if isinstance(m, DecoderLayer)]
    if not layers:
        raise ValueError(f"apply_recompute: {type(model).__name__} has no decoder layers")
    for layer in layers:
        layer.recompute = policy
    return model
