"""Token log-probabilities and log-softmax of temperature-scaled logits, row-invariant.

This is the op both sides of the bitwise contract (docs/numerics.md) end in: the rollout engine records
``token_logprobs`` for every sampled token and the trainer recomputes it, so it must be a function
of the row alone. torch's ``logsumexp``/``log_softmax`` choose their reduction split from the
shape; here the max is ``amax`` (exact) and the sum is ``tree_sum`` (fixed tree). Fixed order:

    z   = logits in fp32;  z = z / temperature   (true IEEE division by fp32(temperature), the same
                                                  op the sampler applies; skipped when T is 0 or 1)
    m   = amax(z);  lse = m + log(tree_sum(exp(z - m)))
    out = z[token] - lse           (log_softmax: z - lse, so the two agree bit for bit)

temperature == 0 (greedy sampling) uses the raw logits. fp64 logits are computed in fp64 (for
gradcheck); everything else in fp32.
"""
from __future__ import annotations

import math

import torch

from ._dispatch import invariant_op
from .reduce import tree_sum


def _cdt(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _check_temperature(temperature: float) -> None:
    if not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature must be finite and >= 0 (0 means greedy), got {temperature}")


def _scaled_logits(logits: torch.Tensor, temperature: float, check: bool = True) -> torch.Tensor:
    """Upcast, divide by the temperature, and reject non-finite values (naming the first bad row; ``check=False``
    skips that test, which reads a device value on the host)."""
    _check_temperature(temperature)
    z = logits.to(_cdt(logits.dtype))
    if temperature > 0 and temperature != 1.0:
        z = z / temperature
    if check and not bool(torch.isfinite(z).all()):
        flat = int((~torch.isfinite(z)).reshape(-1, z.shape[-1]).any(-1).nonzero()[0, 0])
        row: object = flat
        if z.dim() > 2:
            row = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), z.shape[:-1]))
        raise ValueError(f"logits row {row} contains NaN or Inf (after dividing by temperature {temperature})")
    return z


def _lse(z: torch.Tensor) -> torch.Tensor:
    """log-sum-exp over the last dim, keepdim. The max is detached: the lse gradient (softmax)
    does not depend on it, and amax's tie-splitting gradient would only add rounding noise."""
    m = torch.amax(z, dim=-1, keepdim=True).detach()
    return m + torch.log(tree_sum(torch.exp(z - m), dim=-1, keepdim=True))


@invariant_op
def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, temperature: float = 1.0, *,
                   check: bool = True) -> torch.Tensor:
    """log p(token) under softmax(logits / temperature).

    logits: [T, V] (or [..., V]), any float dtype; token_ids: [T] (or [...]) integer.
    Returns [T] fp32 (fp64 for fp64 logits). Raises ValueError for ids outside [0, V), NaN/Inf
    logits, or a negative temperature. ``check=False`` skips the id-range and finiteness tests (each reads
    a device value on the host, a synchronisation): for a caller that guarantees both, the rollout
    sampler, whose ids come from an argmax over the same finite rows. Same arithmetic either way.
    """
    if check:
        _check_token_ids(logits, token_ids)
    z = _scaled_logits(logits, temperature, check)
    picked = z.gather(-1, token_ids.long().unsqueeze(-1))
    return (picked - _lse(z)).squeeze(-1)


@invariant_op
def log_softmax(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log softmax(logits / temperature) over the last dim. logits: [T, V]; returns [T, V] fp32."""
    z = _scaled_logits(logits, temperature)
    return z - _lse(z)


# Shared with the Triton backend (triton/logprob.py) and the fast backend below.


def _scales(temperature: float) -> bool:
    return temperature > 0 and temperature != 1.0


def _check_token_ids(logits: torch.Tensor, token_ids: torch.Tensor) -> None:
    """Argument checks of every ``token_logprobs`` backend (one order, one set of messages)."""
    v = logits.shape[-1]
    if token_ids.shape != logits.shape[:-1]:
        raise ValueError(f"token_ids {tuple(token_ids.shape)} must match logits {tuple(logits.shape)}[:-1]")
    if token_ids.dtype.is_floating_point or token_ids.dtype == torch.bool:
        raise ValueError(f"token_ids must be an integer tensor, got {token_ids.dtype}")
    if token_ids.numel() > 0:
        bad = (token_ids < 0) | (token_ids >= v)
        if bool(bad.any()):
            pos = bad.reshape(-1).nonzero()[0, 0].item()
            raise ValueError(
                f"token id {int(token_ids.reshape(-1)[pos])} at position {pos} is outside the vocabulary [0, {v})"
            )


# ----------------------------------------------------------------------------- fast mode (stock kernels)


def _fast_scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    _check_temperature(temperature)
    z = logits.to(torch.float64 if logits.dtype == torch.float64 else torch.float32)
    return z / temperature if _scales(temperature) else z


@token_logprobs.register("fast")
def token_logprobs_fast(logits: torch.Tensor, token_ids: torch.Tensor, temperature: float = 1.0, *,
                        check: bool = True) -> torch.Tensor:
    """Stock ``torch.log_softmax`` + gather (no finiteness check: fast mode skips the host sync)."""
    if check:
        _check_token_ids(logits, token_ids)
    ls = torch.log_softmax(_fast_scaled(logits, temperature), dim=-1)
    return ls.gather(-1, token_ids.long().unsqueeze(-1)).squeeze(-1)


@log_softmax.register("fast")
def log_softmax_fast(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    return torch.log_softmax(_fast_scaled(logits, temperature), dim=-1)


# ----------------------------------------------------------------------------- float64 references


def _ref_scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    _check_temperature(temperature)
    z = logits.double()
    return z / temperature if temperature > 0 else z


def token_logprobs_ref(logits: torch.Tensor, token_ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """float64 reference for ``token_logprobs``."""
    z = _ref_scaled(logits, temperature)
    return z.gather(-1, token_ids.long().unsqueeze(-1)).squeeze(-1) - torch.logsumexp(z, dim=-1)


def log_softmax_ref(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """float64 reference for ``log_softmax``."""
    z = _ref_scaled(logits, temperature)
    return z - torch.logsumexp(z, dim=-1, keepdim=True)
