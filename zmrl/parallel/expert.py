"""Expert parallelism for the routed experts of a ``MoE`` layer.

Every rank holds all tokens (SPMD) and the experts ``[lo, hi)`` of its EP rank (with their LoRA).
It computes the (token, slot) rows routed to its experts through the MoE's own grouped expert path
(``MoE._routed_experts`` on its experts' contiguous range of the expert-sorted rows: a row's result
does not depend on which other rows share the call), writes them into a ``[T * top_k, D]`` buffer
(zeros elsewhere), and the buffers are all-gathered over the EP group; each row then takes the
copy of the rank that owns its expert. That is a selection, not a sum, so the result
is bitwise the EP=1 one in any order and for any degree (an all-reduce of buffers that are zero
elsewhere would also be exact up to the sign of zero; the gather avoids even that). The combine in
fixed slot order is the unchanged ``moe_combine``.
"""
from __future__ import annotations

import itertools

import torch
from torch import nn

from zmrl.model.moe import MoE

from . import state
from .comm import enter_region, gather_shards, group_size


class ExpertParallelMoE(MoE):
    """A ``MoE`` whose ``experts`` (and ``experts_lora``) hold only this rank's slice of the experts."""

    num_experts_total: int
    expert_lo: int
    ep: int

    def _routed_experts(self, hs: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """``hs``: ALL routed rows sorted by global expert id (``counts[e]`` rows for expert e); returns
        every row's expert output, computed by the rank that owns the expert."""
        group = state.ep_group()
        if group_size(group) != self.ep:
            raise RuntimeError(f"MoE was sharded for ep={self.ep} but the current EP group has "
                               f"{group_size(group)} rank(s)")
        per = self.num_experts_total // self.ep
        # counts has one entry per routed expert (MoE.forward sorts over the router's rows, all of them)
        offsets = [0, *itertools.accumulate(counts)]
        hs = enter_region(hs, group)  # backward: every row's input gradient comes from its owner
        lo = self.expert_lo
        a, b = offsets[lo], offsets[lo + per]
        mine = super()._routed_experts(hs[a:b], counts[lo:lo + per])  # local experts, local offsets
        buf = mine.new_zeros(hs.shape[0], mine.shape[-1])
        buf = torch.cat([buf[:a], mine, buf[b:]]) if b > a else buf
        every = gather_shards(buf, group)  # [ep, rows, dim]: a copy of each rank's rows
        # The rows of expert range r come from rank r: a selection, never a sum.
        parts = [every[r, offsets[r * per]:offsets[(r + 1) * per]] for r in range(self.ep)]
        return torch.cat(parts)


def shard_experts(moe: MoE, ep: int, rank: int, slicer=None) -> None:
    """Keep experts ``[rank*E/ep, (rank+1)*E/ep)`` of ``moe`` (and their LoRA rows); switch it to EP."""
    if not hasattr(moe, "_routed_experts"):
        raise RuntimeError("this MoE has no grouped expert path (_routed_experts); expert parallelism needs it")
    E = len(moe.experts)
    if E % ep:
        raise ValueError(f"expert parallelism: ep={ep} must divide n_routed_experts={E}")
    per = E // ep
    lo = rank * per
    moe.experts = nn.ModuleList(list(moe.experts)[lo:lo + per])
    lora = moe.experts_lora
    if lora is not None:
        for name, p in list(lora.named_parameters(recurse=False)):
            if slicer is not None:
                q = slicer.param(p, 0, slice(lo, lo + per))  # records where the slice sits
            else:
                q = nn.Parameter(p.detach()[lo:lo + per].clone(), requires_grad=p.requires_grad)
            q._zmrl_expert_offset = lo
            setattr(lora, name, q)
    moe.__class__ = ExpertParallelMoE
    moe.num_experts_total, moe.expert_lo, moe.ep = E, lo, ep
