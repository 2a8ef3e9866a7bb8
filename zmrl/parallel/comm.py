"""Collectives with the autograd rules of an SPMD model-parallel region.

Every rank of a group runs the same replicated computation outside the sharded region, so the
gradient arriving at a region's output is identical on all ranks. Inside, each rank only covers
its own shards:

* ``enter_region(x)``: identity forward; backward sums the input gradient over the group (each
  rank's gradient covers only its shards' paths).
* ``gather_shards(t)``: all-gather along a new leading dim, in rank order; backward keeps this
  rank's slice (the output gradient is the same everywhere, no communication needed).
* ``allreduce_grad_hook``: for a parameter that is replicated but used inside the region (its
  gradient on one rank covers only that rank's shards).

Forward collectives move bits, never add them: an all-gather is a copy, so the values a rank
receives are exactly the values another rank computed. The backward all-reduces are ordinary
(degree-dependent order): backward must be correct, not bitwise invariant (docs/numerics.md).
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def group_size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: dist.ProcessGroup | None) -> int:
    return 0 if group is None else dist.get_rank(group)


def all_gather_exact(t: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """[n, *t.shape]: every rank's ``t`` in group-rank order (a copy: bitwise the senders' values)."""
    if group is None:
        return t.unsqueeze(0)
    t = t.contiguous()
    out = torch.empty((dist.get_world_size(group), *t.shape), dtype=t.dtype, device=t.device)
    # Move raw bytes: exact for every dtype (float8 included) and independent of backend dtype support.
    src, dst = t.view(torch.uint8), out.view(torch.uint8)
    if t.is_cuda:
        dist.all_gather_into_tensor(dst, src, group=group)
    else:  # gloo has no all_gather_into_tensor
        dist.all_gather(list(dst.unbind(0)), src, group=group)
    return out


class _EnterRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # type: ignore[override]
        g = g.contiguous().clone()
        dist.all_reduce(g, group=ctx.group)
        return g, None


class _GatherShards(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t: torch.Tensor, group) -> torch.Tensor:  # type: ignore[override]
        ctx.rank = dist.get_rank(group)
        return all_gather_exact(t, group)

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # type: ignore[override]
        return g[ctx.rank].clone(), None


class _AllReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t: torch.Tensor, group) -> torch.Tensor:  # type: ignore[override]
        t = t.contiguous().clone()
        dist.all_reduce(t, group=group)
        return t

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # type: ignore[override]
        return g, None


def all_reduce_sum(t: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Plain all-reduce (the summation order is the backend's: NOT layout-independent)."""
    if group is None:
        return t
    if torch.is_grad_enabled() and t.requires_grad:
        return _AllReduceSum.apply(t, group)
    t = t.contiguous().clone()
    dist.all_reduce(t, group=group)
    return t


def enter_region(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    if group is None or not (torch.is_grad_enabled() and x.requires_grad):
        return x
    return _EnterRegion.apply(x, group)


def gather_shards(t: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """All-gather along a new dim 0 (rank order) with the SPMD backward (keep this rank's slice)."""
    if group is None:
        return t.unsqueeze(0)
    if torch.is_grad_enabled() and t.requires_grad:
        return _GatherShards.apply(t, group)
    return all_gather_exact(t, group)


def allreduce_grad_hook(group: dist.ProcessGroup):
    """A ``Tensor.register_hook`` callback: the parameter's gradient summed over ``group``.

    Tensor hooks see the gradient summed over every use in this backward pass (before it is
    accumulated into ``.grad``), so gradient accumulation over micro-batches stays correct."""

    def hook(g: torch.Tensor) -> torch.Tensor:
        g = g.contiguous().clone()
        dist.all_reduce(g, group=group)
        return g

    return hook
