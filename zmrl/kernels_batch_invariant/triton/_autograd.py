"""Autograd for Triton forwards: the backward differentiates the op's torch composition.

The backward must be correct, not invariant (docs/numerics.md). Most Triton kernels here are forward-only;
``with_reference_backward`` makes such a forward differentiable by recomputing the op's torch
("reference") backend under autograd in the backward pass and returning its input gradients. The
values the rest of the graph sees are the Triton kernel's; only the gradient comes from the torch
composition (mathematically the same function). Ops whose recompute would be too slow register a
faster backward instead (``kda_chunk``: ``kda_chunk_bwd.py``), keeping this one as their fallback.
"""
from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

import torch


class _ReferenceBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fwd: Callable[..., Any], ref: Callable[..., Any], spec: tuple, *flat: Any) -> Any:  # type: ignore[override]
        ctx.ref, ctx.spec = ref, spec
        tensors = [a if isinstance(a, torch.Tensor) else None for a in flat]
        ctx.save_for_backward(*[t for t in tensors if t is not None])
        ctx.is_tensor = [t is not None for t in tensors]
        ctx.others = [None if isinstance(a, torch.Tensor) else a for a in flat]
        args, kwargs = _unflatten(spec, flat)
        with torch.no_grad():
            out = fwd(*args, **kwargs)
        outs = out if isinstance(out, tuple) else (out,)
        ctx.tuple_out = isinstance(out, tuple)
        nondiff = [o for o in outs if isinstance(o, torch.Tensor) and not o.is_floating_point()]
        if nondiff:
            ctx.mark_non_differentiable(*nondiff)
        return out

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None) -> tuple[Any, ...]:  # type: ignore[override]
        result = reference_input_grads(ctx.ref, ctx.spec, ctx.is_tensor, ctx.others, ctx.saved_tensors,
                                       ctx.needs_input_grad[3:], grads)
        return (None, None, None, *result)


def reference_input_grads(ref: Callable[..., Any], spec: tuple, is_tensor: list[bool], others: list[Any],
                          saved: tuple[torch.Tensor, ...], needs_grad: tuple[bool, ...],
                          grads: tuple[torch.Tensor | None, ...]) -> list[torch.Tensor | None]:
    """Input gradients of ``ref`` (the op's torch composition) at the saved inputs, by autograd.

    ``spec``/``is_tensor``/``others``/``saved`` describe the flat call (tensors saved in order, the other
    arguments kept as values), ``needs_grad`` which flat arguments want a gradient and ``grads`` the
    output gradients (None for outputs that got none). Returns one entry per flat argument.
    """
    it_saved = iter(saved)
    flat, needs = [], []
    for is_t, other, need in zip(is_tensor, others, needs_grad):
        if not is_t:
            flat.append(other)
            continue
        t = next(it_saved)
        if need:
            t = t.detach().requires_grad_(True)
            needs.append(t)
        flat.append(t)
    args, kwargs = _unflatten(spec, tuple(flat))
    with torch.enable_grad():
        out = ref(*args, **kwargs)
    outs = out if isinstance(out, tuple) else (out,)
    pairs = [(o, g) for o, g in zip(outs, grads)
             if g is not None and isinstance(o, torch.Tensor) and o.requires_grad]
    if not pairs or not needs:
        input_grads = [None] * len(needs)
    else:
        input_grads = list(torch.autograd.grad([o for o, _ in pairs], needs, [g for _, g in pairs],
                                               allow_unused=True))
    it = iter(input_grads)
    return [next(it) if (is_t and need) else None for is_t, need in zip(is_tensor, needs_grad)]


def _unflatten(spec: tuple, flat: tuple) -> tuple[tuple, dict]:
    n_args, kw_names = spec
    return flat[:n_args], dict(zip(kw_names, flat[n_args:]))


def with_reference_backward(ref: Callable[..., Any]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator for a Triton forward ``fwd`` with the same signature as ``ref`` (the op's torch backend).

    Without autograd (inference, or no input requiring grad) ``fwd`` runs directly; otherwise the call
    goes through an autograd Function whose backward differentiates ``ref``.
    """
    sig = inspect.signature(ref)

    def deco(fwd: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fwd)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            bound = sig.bind(*args, **kwargs)
            flat_args = bound.args
            if not (torch.is_grad_enabled() and any(
                    isinstance(a, torch.Tensor) and a.requires_grad for a in (*flat_args, *bound.kwargs.values()))):
                return fwd(*args, **kwargs)
            kw_names = tuple(bound.kwargs)
            spec = (len(flat_args), kw_names)
            return _ReferenceBackward.apply(fwd, ref, spec, *flat_args, *bound.kwargs.values())

        return wrapper

    return deco


class _AnalyticBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fwd: Callable[..., Any], grads_fn: Callable[..., Any], names: tuple[str, ...],  # type: ignore[override]
                *flat: Any) -> Any:
        ctx.grads_fn, ctx.names = grads_fn, names
        ctx.is_tensor = [isinstance(a, torch.Tensor) for a in flat]
        ctx.save_for_backward(*[a for a in flat if isinstance(a, torch.Tensor)])
        ctx.others = [None if isinstance(a, torch.Tensor) else a for a in flat]
        ctx.set_materialize_grads(False)
        with torch.no_grad():
            out = fwd(*flat)
        outs = out if isinstance(out, tuple) else (out,)
        nondiff = [o for o in outs if isinstance(o, torch.Tensor) and not o.is_floating_point()]
        if nondiff:
            ctx.mark_non_differentiable(*nondiff)
        return out

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None) -> tuple[Any, ...]:  # type: ignore[override]
        saved = iter(ctx.saved_tensors)
        values = [next(saved) if is_t else other for is_t, other in zip(ctx.is_tensor, ctx.others)]
        args = dict(zip(ctx.names, values))
        needs = dict(zip(ctx.names, ctx.needs_input_grad[3:]))
        result = ctx.grads_fn(grads, needs, args)
        return (None, None, None, *(result.get(n) if needs[n] else None for n in ctx.names))


def with_analytic_backward(ref: Callable[..., Any], grads_fn: Callable[..., Any]
                           ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator for a Triton forward ``fwd`` with the signature of ``ref`` (the op's torch backend):
    its backward is ``grads_fn(grads, needs, args)`` (closed forms in ``kernels_batch_invariant/grads.py``),
    called with the output gradients (None for outputs without one), which arguments want a gradient
    and the call's arguments by name. Without autograd ``fwd`` runs directly. The closed forms compute
    in float64 for float64 inputs (gradcheck)."""
    sig = inspect.signature(ref)
    names = tuple(sig.parameters)

    def deco(fwd: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fwd)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            bound = sig.bind(*args, **kwargs)
            bound.apply_defaults()
            flat = tuple(bound.arguments[n] for n in names)
            if not (torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in flat)):
                return fwd(*args, **kwargs)
            return _AnalyticBackward.apply(fwd, grads_fn, names, *flat)

        return wrapper

    return deco
