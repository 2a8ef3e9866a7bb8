"""LoRA adapters: ``delta(x) = scale * B(A(x))`` in fp32 through the invariant ``linear``.

They are never merged into base weights: engine and trainer both add the unfused delta, so the
two sides stay bitwise equal (docs/model.md, LoRA; docs/numerics.md).
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from zmrl.kernels_batch_invariant import linear
from zmrl.kernels_batch_invariant.matmul import LoraUp, LoraUpConcat, lora_delta
from zmrl.kernels_batch_invariant.moe_gemm import ExpertLoraFactors, expert_lora_delta


class LoraAdapter(nn.Module):
    """Adapter of one Linear: lora_A [r, in], lora_B [out, r] (PEFT layout), fp32."""

    def __init__(self, in_features: int, out_features: int, r: int, scale: float):
        super().__init__()
        self.scale = scale
        self.lora_A = nn.Parameter(torch.zeros(r, in_features))
        self.lora_B = nn.Parameter(torch.zeros(out_features, r))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return lora_delta(self.factors(x))

    def factors(self, x: torch.Tensor) -> LoraUp:
        """The delta of x as its up factors (``t = x @ lora_A^T`` in fp32, lora_B, the scale): what
        ``Linear.forward`` hands to the GEMM, which adds ``forward(x)`` in its epilogue."""
        return LoraUp(linear(x, self.lora_A, out_dtype=torch.float32), self.lora_B, self.scale)

    def up(self, t: torch.Tensor) -> torch.Tensor:
        """The delta from ``t = x @ lora_A^T`` (fp32): ``model.layers.project`` computes the A products
        of several adapters of one input in one GEMM and finishes each delta here."""
        return lora_delta(LoraUp(t, self.lora_B, self.scale))

    @staticmethod
    def factors_concat(adapters: Sequence[nn.Module], t_all: torch.Tensor) -> LoraUpConcat | None:
        """The deltas of several adapters of one input side by side as their up factors, from their A products
        side by side (``t_all`` [..., sum r], fp32): ``lora_concat_delta`` of it is bitwise
        ``torch.cat([a.up(t_a) for ...], -1)``, and ``linear_concat(..., lora=)`` computes it in the GEMM's
        epilogue. None (the caller then calls ``up`` per adapter) unless every adapter is a LoraAdapter and all
        share one scale."""
        scale = getattr(adapters[0], "scale", None)
        if any(type(a) is not LoraAdapter or a.scale != scale for a in adapters):
            return None
        return LoraUpConcat(t_all, tuple(a.lora_B for a in adapters), scale)


class ExpertLoRA(nn.Module):
    """Batched adapters of all routed experts of one MoE layer: ``<proj>_lora_A`` [E, r, in] and
    ``<proj>_lora_B`` [E, out, r] for gate/up/down — three tensor pairs, not hundreds of modules."""

    def __init__(self, num_experts: int, dim: int, inter: int, r: int, scale: float, projs: tuple[str, ...]):
        super().__init__()
        self.scale = scale
        self.projs = projs
        shapes = {"gate_proj": (dim, inter), "up_proj": (dim, inter), "down_proj": (inter, dim)}
        for p in projs:
            fan_in, fan_out = shapes[p]
            setattr(self, f"{p}_lora_A", nn.Parameter(torch.zeros(num_experts, r, fan_in)))
            setattr(self, f"{p}_lora_B", nn.Parameter(torch.zeros(num_experts, fan_out, r)))

    def delta(self, proj: str, expert: int, x: torch.Tensor) -> torch.Tensor | None:
        if proj not in self.projs:
            return None
        a = getattr(self, f"{proj}_lora_A")[expert]
        return lora_delta(LoraUp(linear(x, a, out_dtype=torch.float32), getattr(self, f"{proj}_lora_B")[expert],
                                 self.scale))

    def grouped_delta(self, proj: str, x: torch.Tensor, offsets: list[int] | torch.Tensor) -> torch.Tensor | None:
        """``delta`` of every expert at once for expert-sorted rows (rows ``offsets[e]:offsets[e+1]``
        belong to expert e): bitwise ``delta(proj, e, rows)`` per expert, via ``expert_linear``.

        ``offsets``: a host list, or an int tensor [E+1] on x's device, which is passed through
        unread (no host sync on CUDA: the batched expert LoRA is CUDA-graph capturable)."""
        factors = self.factors(proj)
        return None if factors is None else expert_lora_delta(factors.up(x, offsets), offsets)

    def factors(self, proj: str) -> ExpertLoraFactors | None:
        """``proj``'s factors of every expert (None where ``proj`` has no adapter): what the MoE hands to
        ``expert_gate_up``."""
        if proj not in self.projs:
            return None
        return ExpertLoraFactors(getattr(self, f"{proj}_lora_A"), getattr(self, f"{proj}_lora_B"), self.scale)
