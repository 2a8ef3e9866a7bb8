"""Backward of ``kda_chunk`` on the GPU through fla-core's chunked KDA backward.

The forward stays zmrl's bitwise Triton kernel (``kda_chunk.py``); only the gradient comes from
fla-core (a dependency, used through its public ``fla.ops.kda.chunk_kda``). docs/numerics.md lets the
backward differ from the forward's arithmetic as long as it is the gradient of the same function,
checked against float64, and deterministic run to run.

Why fla's gradient is the gradient of zmrl's ``kda_chunk``:

* same recurrence: per-channel log-decay ``g`` (natural log, already through ``kda_gate``), per-head
  ``beta``, state ``S <- diag(exp g) S + beta k (v - k^T diag(exp g) S)^T``, read-out ``o = (scale q)^T S``;
  ``q``/``k`` arrive L2-normalised (zmrl normalises outside the op, so fla's in-kernel L2 norm stays
  off) and both apply ``scale`` (default dk^-0.5) to ``q`` inside;
* same chunking: chunks of 64 aligned to each sequence's start in packed varlen (``cu_seqlens``),
  with per-sequence initial states;
* the outputs ``o`` of every token, including a trailing partial chunk, are the same function of the
  inputs in both (the chunked form is an exact rewrite of the recurrence).

What differs, and how it is handled:

* ``final_state``: zmrl returns the state after each sequence's last COMPLETE chunk, fla the state
  after the last token. The trainer never back-propagates into it (the training forward discards it:
  no per-sequence state is kept), so this backward differentiates ``o`` only; if a gradient does
  reach ``final_state`` or ``chunk_states``, the call falls back to the torch-composition backward
  (exact for zmrl's definition, slow), with a warning once per process.
* arithmetic: fla runs its tensor-core dots on bf16 operands when ``v`` is bf16/fp16 (``q``, ``k``,
  ``beta`` are cast to ``v``'s dtype, as in the 'fast' kernel mode; ``g`` stays fp32), fp32/TF32 when
  ``v`` is fp32. The GPU test (tests/kernels/triton/test_kda_chunk_bwd_gpu.py) measures the error
  of these gradients, next to fla's own, against a float64 reference and bounds it.
* determinism: fla's KDA backward kernels use no atomics (every output tile is written by one
  program), so two identical backward passes give the same bits once its autotuner has settled on a
  config for the shape; the GPU test checks it.

Fallbacks (the torch composition under autograd, ``_autograd.reference_input_grads``): fla-core not
importable, float64 inputs (gradcheck) and gradients into the state outputs, as above.
"""
from __future__ import annotations

import functools
import inspect
import logging
import os
from typing import Any, Callable

import torch

from ._autograd import reference_input_grads

log = logging.getLogger(__name__)

# On by default since its GPU test (tests/kernels/triton/test_kda_chunk_bwd_gpu.py) passed on the H200 at the
# bench head shape with gradient errors equal to fla's own; ZMRL_KDA_FLA_BACKWARD=0 selects the torch
# composition's backward (correct, slow). The forward is the same either way.
ENABLED: bool = os.environ.get("ZMRL_KDA_FLA_BACKWARD", "1") == "1"

_ARGS = ("q", "k", "v", "g", "beta", "cu_seqlens", "initial_state", "scale", "output_chunk_states")
_N_DIFF = 7  # q, k, v, g, beta, cu_seqlens (never), initial_state


@functools.lru_cache(maxsize=1)
def _fla_chunk_kda() -> Callable[..., Any] | None:
    """fla-core's ``chunk_kda`` if importable (lazily: importing fla is slow and needs a GPU triton)."""
    # fla picks its kernels' launch configurations by timing them on first use; different picks give
    # different gradient bits. Triton's on-disk autotune cache keeps the first pick for later processes on
    # this machine, so a resumed run differentiates with the same kernels (set before fla defines them).
    os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")
    try:
        from fla.ops.kda import chunk_kda
    except Exception as exc:  # ImportError, or fla failing to initialise its backends
        log.warning("fla-core chunk_kda unavailable (%s): kda_chunk's backward runs the torch "
                    "composition (slow)", exc)
        return None
    return chunk_kda


def fla_backend_for(q: torch.Tensor) -> Callable[..., Any] | None:
    """The fla entry point to differentiate with for inputs like ``q``, or None (use the reference)."""
    if not ENABLED or q.device.type != "cuda" or q.dtype == torch.float64:
        return None
    return _fla_chunk_kda()


@functools.lru_cache(maxsize=1)
def _warn_state_grad() -> None:
    log.warning("kda_chunk: a gradient reached final_state/chunk_states; zmrl's state (after the last "
                "complete chunk) is not fla's, so this backward runs the torch composition (slow)")


def fla_input_grads(chunk_kda: Callable[..., Any], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    g: torch.Tensor, beta: torch.Tensor, cu_cpu: torch.Tensor, initial_state: torch.Tensor | None,
                    scale: float, do: torch.Tensor, needs: tuple[bool, ...]) -> list[torch.Tensor | None]:
    """d(q, k, v, g, beta, initial_state) of ``<o, do>`` where o is kda_chunk's output, by fla's backward.

    Inputs as ``kda_chunk`` takes them (packed [T, H, d], ``cu_cpu`` the cu_seqlens on the host);
    ``needs`` says which of the six want a gradient. fla's forward is re-run here (with
    ``disable_recompute=True``, so its backward reuses the forward's intermediates instead of
    recomputing them) and differentiated at once: nothing of it outlives this call.
    """
    dev = q.device
    dk = q.shape[-1]
    dt = v.dtype if v.dtype in (torch.bfloat16, torch.float16) else torch.float32
    lens = (cu_cpu[1:] - cu_cpu[:-1]).tolist()
    keep = [i for i, n in enumerate(lens) if n > 0]
    if not keep:  # no token: nothing depends on the inputs
        return [torch.zeros_like(x) if x is not None and need else None
                for x, need in zip((q, k, v, g, beta, initial_state), needs)]
    # fla builds its chunk index from the lengths; empty sequences are dropped (their initial state
    # influences no output, so its gradient is zero).
    cu_f = torch.tensor([0] + [lens[i] for i in keep], dtype=torch.int64).cumsum(0)
    leaves = [x.detach().requires_grad_(need) for x, need in zip((q, k, v, g, beta), needs[:5])]
    h0_leaf = None
    if initial_state is not None:
        h0_leaf = initial_state.detach().requires_grad_(needs[5])
    with torch.enable_grad():
        qx, kx, vx, bx = (x.to(dt)[None] for x in (leaves[0], leaves[1], leaves[2], leaves[4]))
        gx = leaves[3].to(torch.float32)[None]
        h0 = None
        if h0_leaf is not None:
            h0 = h0_leaf.to(torch.float32)
            if len(keep) != len(lens):
                h0 = h0[torch.tensor(keep, dtype=torch.int64, device=dev)]
            h0 = h0.contiguous()
        o, _ = chunk_kda(qx, kx, vx, gx, bx, scale=dk**-0.5 if scale is None else scale, initial_state=h0,
                         output_final_state=False, cu_seqlens=cu_f.to(dev), cu_seqlens_cpu=cu_f,
                         disable_recompute=True)
        wrt = [x for x in (*leaves, h0_leaf) if x is not None and x.requires_grad]
        grads = iter(torch.autograd.grad(o, wrt, do[None].to(o.dtype), allow_unused=True) if wrt else ())
    out = [next(grads) if x is not None and x.requires_grad else None for x in (*leaves, h0_leaf)]
    return [None if gr is None else gr.to(x.dtype) for gr, x in zip(out, (q, k, v, g, beta, initial_state))]


class _KDAChunkFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fwd: Callable[..., Any], ref: Callable[..., Any], q, k, v, g, beta, cu_seqlens,  # type: ignore[override]
                initial_state, scale, output_chunk_states):
        ctx.ref, ctx.scale, ctx.output_chunk_states = ref, scale, output_chunk_states
        ctx.set_materialize_grads(False)
        ctx.has_h0 = initial_state is not None
        ctx.save_for_backward(q, k, v, g, beta, cu_seqlens, *((initial_state,) if ctx.has_h0 else ()))
        # Host copy of cu_seqlens for fla's chunk index (the forward reads it to the host anyway).
        ctx.cu_cpu = cu_seqlens.detach().to("cpu", torch.int64)
        with torch.no_grad():
            o, final, chunk_states = fwd(q, k, v, g, beta, cu_seqlens, initial_state, scale, output_chunk_states)
        return o, final, chunk_states

    @staticmethod
    def backward(ctx, do, d_final, d_chunk_states):  # type: ignore[override]
        saved = ctx.saved_tensors
        q, k, v, g, beta, cu = saved[:6]
        h0 = saved[6] if ctx.has_h0 else None
        needs = ctx.needs_input_grad[2:2 + _N_DIFF]
        fla = fla_backend_for(q)
        state_grads = d_final is not None or d_chunk_states is not None
        if state_grads and fla is not None:
            _warn_state_grad()
        if do is None and not state_grads:
            grads: list[torch.Tensor | None] = [None] * _N_DIFF
        elif fla is None or state_grads:
            flat = [q, k, v, g, beta, cu, h0, ctx.scale, ctx.output_chunk_states]
            is_t = [isinstance(a, torch.Tensor) for a in flat]
            grads = reference_input_grads(
                ctx.ref, (len(flat), ()), is_t, [None if t else a for t, a in zip(is_t, flat)],
                tuple(a for a in flat if isinstance(a, torch.Tensor)), (*needs, False, False),
                (do, d_final, d_chunk_states))[:_N_DIFF]
        else:
            dq, dk, dv, dg, db, dh0 = fla_input_grads(fla, q, k, v, g, beta, ctx.cu_cpu, h0, ctx.scale, do,
                                                      (*needs[:5], needs[6]))
            grads = [dq, dk, dv, dg, db, None, dh0]
        return (None, None, *grads, None, None)


def with_fla_backward(ref: Callable[..., Any]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator for ``kda_chunk``'s Triton forward: autograd with fla-core's backward (see the module
    docstring), ``ref`` (the torch composition) as the fallback backward. Without autograd the forward
    runs directly."""
    sig = inspect.signature(ref)
    assert tuple(sig.parameters) == _ARGS, f"with_fla_backward: unexpected signature {sig}"

    def deco(fwd: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fwd)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            bound = sig.bind(*args, **kwargs)
            bound.apply_defaults()
            a = bound.arguments
            if not (torch.is_grad_enabled() and any(
                    isinstance(a[n], torch.Tensor) and a[n].requires_grad for n in _ARGS[:_N_DIFF])):
                return fwd(*bound.args)
            return _KDAChunkFunction.apply(fwd, ref, *(a[n] for n in _ARGS))

        return wrapper

    return deco
