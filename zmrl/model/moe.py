"""Dense GLU MLP and the routed mixture of experts (optionally in a K3-style latent)."""
from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from zmrl.kernels_batch_invariant.glu import situ_glu, swiglu
from zmrl.kernels_batch_invariant.moe_gemm import ExpertLoraFactors, RowGather, expert_gate_up, expert_linear
from zmrl.kernels_batch_invariant.pointwise import add_cast
from zmrl.kernels_batch_invariant.moe_router import moe_combine_rows, moe_route, moe_sort

from .config import ModelConfig
from .layers import Linear, RMSNorm, Weight, project


def glu_of(cfg: ModelConfig) -> Callable[..., torch.Tensor]:
    """The GLU op ``cfg`` asks for (``moe_glu``), with its SiTU betas bound."""
    if cfg.moe_glu == "situ":
        return functools.partial(situ_glu, beta=cfg.activation_situ_beta, linear_beta=cfg.activation_situ_linear_beta)
    return swiglu


class MLP(nn.Module):
    """``down(act(gate(x)) * up(x))``; act is SiLU (SwiGLU) or K3's SiTU-GLU (``glu_of``)."""

    def __init__(self, dim: int, inter: int, glu: Callable[..., torch.Tensor] = swiglu,
                 dtype: torch.dtype | None = None):
        super().__init__()
        self.gate_proj = Linear(dim, inter, dtype=dtype)
        self.up_proj = Linear(dim, inter, dtype=dtype)
        self.down_proj = Linear(inter, dim, dtype=dtype)
        self.glu = glu

    def forward(self, x: torch.Tensor, lora: "nn.Module | None" = None, expert: int = 0) -> torch.Tensor:
        """``lora`` (an ExpertLoRA holding batched [E, ...] tensors) adds expert ``expert``'s deltas."""
        if lora is None:
            return self.down_proj(self.glu(*project(x, [self.gate_proj, self.up_proj])))
        h = self.glu(self.gate_proj(x, extra=lora.delta("gate_proj", expert, x)),
                     self.up_proj(x, extra=lora.delta("up_proj", expert, x)))
        return self.down_proj(h, extra=lora.delta("down_proj", expert, h))


class Router(Weight):
    """``mlp.gate``: router weight [E, D] plus the selection-only correction bias [E] (fp32)."""

    def __init__(self, num_experts: int, dim: int, dtype: torch.dtype | None = None):
        super().__init__(num_experts, dim, dtype=dtype)
        self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts, dtype=torch.float32))


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype | None = None):
        super().__init__()
        d = cfg.hidden_size
        self.latent = cfg.moe_latent_size
        expert_dim = self.latent or d
        self.top_k, self.n_group, self.topk_group = cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group
        self.norm_topk_prob, self.scaling = cfg.norm_topk_prob, cfg.routed_scaling_factor
        self.gate = Router(cfg.n_routed_experts, d, dtype=dtype)
        glu = glu_of(cfg)
        self.experts = nn.ModuleList(
            MLP(expert_dim, cfg.moe_intermediate_size, glu, dtype=dtype) for _ in range(cfg.n_routed_experts)
        )
        self.shared_experts = (
            MLP(d, cfg.n_shared_experts * cfg.moe_intermediate_size, glu, dtype=dtype)
            if cfg.n_shared_experts else None
        )
        self.latent_norm: RMSNorm | None = None
        if self.latent:
            self.latent_down_proj = Linear(d, self.latent, dtype=dtype)
            if cfg.latent_moe_use_norm:
                self.latent_norm = RMSNorm(self.latent, eps=cfg.rms_norm_eps, dtype=dtype)
            self.latent_up_proj = Linear(self.latent, d, dtype=dtype)
        self.experts_lora: nn.Module | None = None  # set by zmrl.lora.apply_lora

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        T = x.shape[0]
        route = moe_route(x, self.gate.weight, self.gate.e_score_correction_bias, self.top_k, self.n_group,
                          self.topk_group, self.norm_topk_prob, self.scaling)
        h = self.latent_down_proj(x) if self.latent else x
        # Every (token, slot) pair is computed by its expert's invariant linears; a token's result does
        # not depend on how many other tokens chose the same expert.
        # grouped over every routed expert (the router's rows): an expert-parallel rank holds only its slice
        pairs = moe_sort(route.expert_ids, self.gate.weight.shape[0])
        training = torch.is_grad_enabled() and h.requires_grad
        # slot (t, j) is row t * top_k + j of the unsorted pairs, held at sorted row slot_rows[t, j]: the
        # combine reads the expert-sorted rows where they are (bitwise moe_combine of the un-sorted rows)
        slot_rows = pairs.slot_rows.view(T, self.top_k)
        dispatch = RowGather(pairs.order, self.top_k, slot_rows)  # sorted row r = token order[r] // top_k
        parts = None
        if self._own_routed_experts() and (not training or self._device_dispatch(x)):
            # The gate and up products read each pair's token row where it is (the dispatch gather) instead of a
            # [T * top_k, D] copy: the same values, a copy and launches fewer, and under autograd the products keep
            # h, not the copy, for their backward, which sums each token's slot gradients where they lie (the
            # gather's slots). CUDA: the expert offsets stay on the device (no host sync, CUDA-graph capturable).
            offsets = pairs.offsets if x.is_cuda else pairs.offsets.tolist()  # CUDA: never read on the host
            parts = self._expert_products(h, offsets, dispatch)
            if parts is None:  # an adapter or bias on an expert's Linear: per expert
                y_sorted = self._per_expert(h, offsets, dispatch)
        else:
            y_sorted = self._routed_experts(dispatch.rows(h), pairs.offsets.diff().tolist())

        def down_and_combine(act: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
            return moe_combine_rows(parts.down(act), slot_rows, weights, out_dtype=torch.float32)

        if parts is None:
            routed = moe_combine_rows(y_sorted, slot_rows, route.weights, out_dtype=torch.float32)
        elif training:
            # The combine's weight gradient needs the down products' [T * top_k, D] output (512 MiB per layer at 16K
            # tokens, top-8): the backward recomputes it from the kept activations (one down GEMM, the same bits)
            # instead of keeping it.
            routed = checkpoint(down_and_combine, parts.act, route.weights, use_reentrant=False,
                                preserve_rng_state=False)
        else:
            routed = down_and_combine(parts.act, route.weights)
        if self.latent:
            # fp32 combine -> (norm ->) one rounding to the model dtype -> up-projection
            h = routed.to(x.dtype) if self.latent_norm is None else self.latent_norm(routed, out_dtype=x.dtype)
            routed = self.latent_up_proj(h, out_dtype=torch.float32)
        if self.shared_experts is not None:
            return add_cast(routed, self.shared_experts(x), x.dtype)  # fp32 sum, one rounding
        return routed.to(x.dtype)

    def _device_dispatch(self, x: torch.Tensor) -> bool:
        """Route with device offsets (no host sync) instead of host counts: on CUDA, unless a
        subclass replaces ``_routed_experts`` (expert parallelism slices host offsets per rank)."""
        return x.is_cuda and self._own_routed_experts()

    def _own_routed_experts(self) -> bool:
        """Whether this class runs ``MoE._routed_experts`` (expert parallelism overrides it with host offsets)."""
        return type(self)._routed_experts is MoE._routed_experts

    def _routed_experts(self, hs: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
        """Expert MLPs of the expert-sorted rows ``hs`` (``counts[e]`` rows for expert e, in order);
        see ``_grouped_experts``. Host counts: the CPU path and the hook expert parallelism overrides."""
        return self._grouped_experts(hs, [0, *itertools.accumulate(counts)])

    def _grouped_experts(self, hs: torch.Tensor, offsets: list[int] | torch.Tensor,
                         gather: RowGather | None = None) -> torch.Tensor:
        """Expert MLPs of the expert-sorted rows ``hs`` (rows ``offsets[e]:offsets[e+1]`` for expert e), or with
        ``gather`` of the rows ``gather.rows(hs)`` (read where they are by the gate and up products).

        One grouped ``expert_linear`` per projection for all experts (one launch on the GPU), bitwise
        equal to running ``self.experts[e]`` on its rows (which the torch backend literally does): a
        row's result never depends on how many rows each expert received. The experts' weights stay
        in their own Linear modules (per-expert checkpoint names); the op takes them as a list.

        ``offsets``: a host list, or an int tensor [E+1] on hs's device; the latter is never read on
        the host by the grouped path (with or without expert LoRA), so that path can be captured in a
        CUDA graph. The per-expert fallback below (an adapter or bias on an expert's Linear) reads
        the offsets back (a host sync): it is not capture-safe.
        """
        parts = self._expert_products(hs, offsets, gather)
        return parts.down(parts.act) if parts is not None else self._per_expert(hs, offsets, gather)

    def _per_expert(self, hs: torch.Tensor, offsets: list[int] | torch.Tensor,
                    gather: RowGather | None = None) -> torch.Tensor:
        """``_grouped_experts`` outside the model's own layout (an adapter or bias on an expert's Linear): each
        expert's module on its rows (reads device offsets back: a host sync)."""
        offs = [int(o) for o in offsets.tolist()] if isinstance(offsets, torch.Tensor) else offsets
        hs = hs if gather is None else gather.rows(hs)
        outs = [self.experts[e](hs[a:b], self.experts_lora, e) for e, (a, b) in enumerate(zip(offs, offs[1:])) if b > a]
        return torch.cat(outs) if outs else hs.new_zeros(0, hs.shape[-1])

    def _expert_products(self, hs: torch.Tensor, offsets: list[int] | torch.Tensor,
                         gather: RowGather | None = None) -> "_ExpertProducts | None":
        """The grouped gate/up products and GLU of ``_grouped_experts`` (its arguments), and its down product as a
        function of the activations; None outside the model's own layout (an adapter or bias on an expert's
        Linear), which ``_grouped_experts`` runs per expert."""
        lora = self.experts_lora
        if any(getattr(m, p).adapter is not None or getattr(m, p).bias is not None
               for m in self.experts for p in ("gate_proj", "up_proj", "down_proj")):
            return None

        def weights(name: str) -> list[torch.Tensor]:
            return [getattr(m, name).weight for m in self.experts]

        def factors(name: str) -> ExpertLoraFactors | None:
            return None if lora is None else lora.factors(name)

        # with LoRA: fp32 base + the experts' fp32 delta, one rounding to x's dtype (the GEMMs compute the deltas
        # from their factors in their epilogues: the value of ``lora.grouped_delta``); gate and up in one op, so
        # that the rows get one gradient (expert_gate_up)
        gate, up = expert_gate_up(hs, weights("gate_proj"), weights("up_proj"), offsets, factors("gate_proj"),
                                  factors("up_proj"), gather=gather)
        down_lora = factors("down_proj")
        down_weights = weights("down_proj")

        def down(act: torch.Tensor) -> torch.Tensor:
            return expert_linear(act, down_weights, offsets, lora=None if down_lora is None else down_lora.up(act, offsets))

        return _ExpertProducts(self.experts[0].glu(gate, up), down)


@dataclass(frozen=True)
class _ExpertProducts:
    """The routed experts' GLU activations [T * top_k, inter] (expert-sorted rows) and their down product."""

    act: torch.Tensor
    down: Callable[[torch.Tensor], torch.Tensor]
