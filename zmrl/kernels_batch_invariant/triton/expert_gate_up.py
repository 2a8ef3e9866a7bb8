"""Triton ``expert_gate_up`` (moe_gemm.py): the experts' gate and up products of the same rows, with one gradient for
the rows.

The forward is the composition the op defines, launch for launch (``_expert_forward`` of the LoRA A products, then
of the base products with the delta in their epilogue), so its bits are the unfused calls'. Under autograd the four
products (gate, up, gate's A, up's A) are one Function, whose backward computes the rows' gradient

    dx = [gy_gate | gy_up] @ [W_gate,e ; W_up,e]  +  [dt_gate | dt_up] @ [A_gate,e ; A_up,e]

as one grouped kernel (``expert_input_grad``: the base weights side by side as the first term, bf16 class; the
LoRA A's as the second, fp32 class), one fp32 accumulator, one rounding. Autograd over separate products writes
four [M, K] gradients and adds them with three more passes (at 16K tokens x top-8 x 2048: 512 MiB each). The
LoRA factors' and (without LoRA) the expert weights' gradients are those of the unfused products
(``expert_linear_grads_triton``, the kernels ``expert_linear_grads`` dispatches to here). Deterministic run to run; not batch-invariant (the backward need not be).

With a ``gather`` (the MoE's rows: token ``order[r] // top_k`` for expert-sorted row r) the products read the
token rows where they lie, in the forward and in the weight-gradient kernels, and the Function keeps the [T, K]
tokens, not the [T * top_k, K] dispatched copy (512 MiB per MoE layer at 16K tokens, top-8, hidden 2048, never
written); x's gradient is then the rows' gradient summed over each token's copies (``moe_gemm.sum_copies``: the
gather's ``slots``).
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from .. import moe_gemm as _moe
from ..matmul import LoraUp
from ..numerics import with_backward_matmuls
from ._common import compute_in_fp64
from .expert_grads import DxTerm, compute_dtype, expert_input_grad, expert_linear_grads_triton
from .matmul import _backward_offsets, _expert_forward, _needs_grad, _prefetch_offsets, expert_linear_triton


def _side_by_side(gate: _moe.Weights, up: _moe.Weights) -> torch.Tensor:
    """[E, N_gate + N_up, K]: expert e's gate and up weights stacked along N (one copy of every expert weight)."""
    if isinstance(gate, torch.Tensor):
        return torch.cat([gate, up], dim=1)
    n_g = gate[0].shape[0]
    out = gate[0].new_empty(len(gate), n_g + up[0].shape[0], gate[0].shape[1])
    torch._foreach_copy_([*out[:, :n_g].unbind(0), *out[:, n_g:].unbind(0)], [*gate, *up])
    return out


# _ExpertGateUpFn.forward's arguments before the LoRA factors (x, offsets, gather, stacked, n_gate, the two scales)
FIRST_FACTOR = 7


class _ExpertGateUpFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, offsets: list[int] | torch.Tensor, gather: _moe.RowGather | None,
                stacked: bool, n_gate: int, gate_scale: float, up_scale: float, gate_a: torch.Tensor | None,
                gate_b: torch.Tensor | None, up_a: torch.Tensor | None, up_b: torch.Tensor | None,
                *weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        gate_w = weights[0] if stacked else list(weights[:n_gate])
        up_w = weights[1] if stacked else list(weights[n_gate:])
        ctx.offsets, ctx.gather, ctx.stacked, ctx.scales = offsets, gather, stacked, (gate_scale, up_scale)
        ctx.host_offsets = (_prefetch_offsets(offsets) if isinstance(offsets, torch.Tensor) and offsets.is_cuda
                            else None)
        outs, ts = [], []
        for w, a, b, scale in ((gate_w, gate_a, gate_b, gate_scale), (up_w, up_a, up_b, up_scale)):
            # the calls expert_linear makes for the composition (moe_gemm.expert_gate_up), in its order
            t = None if a is None else _expert_forward(x, a, offsets, torch.float32, gather=gather)
            outs.append(_expert_forward(x, w, offsets, x.dtype, None, None if t is None else LoraUp(t, b, scale),
                                        gather=gather))
            ts.append(t)
        # x (with a gather: the source rows, not the [M, K] gathered ones) feeds the A factors' and the weights'
        # gradients; with frozen weights and no LoRA it is not kept
        need = ctx.needs_input_grad
        keep_x = need[FIRST_FACTOR] or need[FIRST_FACTOR + 2] or any(need[FIRST_FACTOR + 4:])
        ctx.save_for_backward(x if keep_x else None, *ts, gate_a, gate_b, up_a, up_b, *weights)
        ctx.x_dtype = x.dtype
        return outs[0], outs[1]

    @staticmethod
    @with_backward_matmuls
    def backward(ctx: Any, gy_gate: torch.Tensor, gy_up: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, t_gate, t_up, gate_a, gate_b, up_a, up_b, *weights = ctx.saved_tensors
        need = ctx.needs_input_grad[FIRST_FACTOR:]  # gate A, gate B, up A, up B, the weights
        gather = ctx.gather
        offsets = _backward_offsets(ctx)
        need_x = ctx.needs_input_grad[0]
        n_w = len(weights) // 2 if not ctx.stacked else 1
        gate_w = weights[0] if ctx.stacked else weights[:n_w]
        up_w = weights[1] if ctx.stacked else weights[n_w:]

        factor_grads: list[torch.Tensor | None] = []
        lora_terms: list[tuple[torch.Tensor, torch.Tensor]] = []  # (scaled dt, A) of each adapted product
        for gy, t, a, b, scale, need_a, need_b in ((gy_gate, t_gate, gate_a, gate_b, ctx.scales[0], need[0], need[1]),
                                                   (gy_up, t_up, up_a, up_b, ctx.scales[1], need[2], need[3])):
            da = db = None
            if t is not None and (need_x or need_a or need_b):
                # the up product's backward (that of expert_linear(t, b), fp32 class), then scaled
                dt, dbs = expert_linear_grads_triton(gy, t, b, offsets, need_x or need_a, [need_b], t.dtype)
                db = dbs[0]
                if scale != 1.0:
                    dt, db = (None if dt is None else dt * scale), (None if db is None else db * scale)
                if need_a:
                    da = expert_linear_grads_triton(dt, x, a, offsets, False, [True], ctx.x_dtype, x_gather=gather)[1][0]
                if need_x:
                    lora_terms.append((dt, a))
            factor_grads += [da, db]

        dx = None
        if need_x:
            w_dtype = gate_w.dtype if ctx.stacked else gate_w[0].dtype
            base = DxTerm(torch.cat([gy_gate, gy_up], dim=1), _side_by_side(gate_w, up_w),
                          compute_dtype(ctx.x_dtype, w_dtype))
            lora = None
            if lora_terms:
                dts, a_s = zip(*lora_terms)
                lora = DxTerm(torch.cat(dts, dim=1) if len(dts) > 1 else dts[0],
                              torch.cat(a_s, dim=1) if len(a_s) > 1 else a_s[0],
                              compute_dtype(ctx.x_dtype, a_s[0].dtype))
            dx = expert_input_grad(base, offsets, ctx.x_dtype, lora)
            if gather is not None:  # the gather's backward: each source row's copies' gradients, summed where they lie
                dx = _moe.sum_copies(dx, gather.slots, ctx.x_dtype)

        weight_grads: list[torch.Tensor | None] = []
        for gy, ws, flags in ((gy_gate, gate_w, need[4:4 + n_w]), (gy_up, up_w, need[4 + n_w:])):
            if any(flags):
                weight_grads += expert_linear_grads_triton(gy, x, ws, offsets, False, list(flags), ctx.x_dtype,
                                                           x_gather=gather)[1]
            else:
                weight_grads += [None] * n_w
        return (dx, *[None] * (FIRST_FACTOR - 1), *factor_grads, *weight_grads)


@_moe.expert_gate_up.register("triton")
def expert_gate_up_triton(x: torch.Tensor, gate_weights: _moe.Weights, up_weights: _moe.Weights,
                          offsets: Sequence[int] | torch.Tensor, gate_lora: _moe.ExpertLoraFactors | None = None,
                          up_lora: _moe.ExpertLoraFactors | None = None,
                          gather: _moe.RowGather | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton ``expert_gate_up``: under autograd one Function with one gradient for x (the module doc); without
    it, with a gather (the engine) or fp64 operands (gradchecks), the composition of Triton ``expert_linear``s."""
    loras = [lo for lo in (gate_lora, up_lora) if lo is not None]
    gate_list = [gate_weights] if isinstance(gate_weights, torch.Tensor) else list(gate_weights)
    up_list = [up_weights] if isinstance(up_weights, torch.Tensor) else list(up_weights)
    factors = [f for lo in loras for f in (lo.a, lo.b)]
    # a gather whose source needs a gradient needs the copies' slots (the backward sums them)
    fused = ((gather is None or gather.slots is not None or not x.requires_grad)
             and _needs_grad(x, *factors, *gate_list, *up_list)
             and isinstance(gate_weights, torch.Tensor) == isinstance(up_weights, torch.Tensor)
             and len(gate_list) == len(up_list)
             and not compute_in_fp64(x, gate_list[0], up_list[0], *factors))
    if not fused:
        return _moe.gate_up_composition(x, gate_weights, up_weights, offsets, gate_lora, up_lora, gather,
                                        expert_linear_triton)
    if gather is not None:
        _moe.check_gather(x, gather)
    # (the shapes are checked by each product's _expert_forward, as expert_linear_triton's are)
    dev = _moe.device_offsets(offsets, x)
    offs: list[int] | torch.Tensor = dev if dev is not None else _moe.as_offsets(offsets)

    def parts(lora: _moe.ExpertLoraFactors | None) -> tuple[float, torch.Tensor | None, torch.Tensor | None]:
        return (1.0, None, None) if lora is None else (float(lora.scale), lora.a, lora.b)

    (gs, ga, gb), (us, ua, ub) = parts(gate_lora), parts(up_lora)
    stacked = isinstance(gate_weights, torch.Tensor)
    return _ExpertGateUpFn.apply(x, offs, gather, stacked, len(gate_list), gs, us, ga, gb, ua, ub, *gate_list, *up_list)
