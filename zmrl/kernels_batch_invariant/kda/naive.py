"""float64 references for KDA (docs/model.md: the token recurrence, and its chunked form), one sequence at a time.

These are for tests only: they are written for clarity, not speed, and never sit on the parity
path. q and k are given already L2-normalised; ``scale`` (default dk^-0.5) multiplies q.
"""
from __future__ import annotations

import torch


def kda_recurrent_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token delta rule with per-channel decay.

    q, k: [T, H, dk]; v: [T, H, dv]; g: [T, H, dk] log-decay; beta: [T, H];
    initial_state: [H, dk, dv] (None = zeros). Returns (o [T, H, dv], S [H, dk, dv]), float64.
    """
    q, k, v, g, beta = (x.double() for x in (q, k, v, g, beta))
    t, h, dk = q.shape
    dv = v.shape[-1]
    scale = dk**-0.5 if scale is None else scale
    s = q.new_zeros(h, dk, dv) if initial_state is None else initial_state.double().clone()
    outs = []
    for i in range(t):
        s = s * torch.exp(g[i])[..., None]
        pred = torch.einsum("hk,hkv->hv", k[i], s)  # what the state currently recalls for k_i
        s = s + torch.einsum("hk,hv->hkv", beta[i][:, None] * k[i], v[i] - pred)
        outs.append(torch.einsum("hk,hkv->hv", scale * q[i], s))
    o = torch.stack(outs) if outs else v.new_zeros(0, h, dv)
    return o, s


def kda_chunk_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked (WY) form in float64 with a dense triangular solve, same semantics as
    ``kda_chunk`` for one sequence: a trailing partial chunk yields outputs but does not advance
    the returned state. Shapes as ``kda_recurrent_ref``."""
    q, k, v, g, beta = (x.double() for x in (q, k, v, g, beta))
    t, h, dk = q.shape
    dv = v.shape[-1]
    scale = dk**-0.5 if scale is None else scale
    s = q.new_zeros(h, dk, dv) if initial_state is None else initial_state.double().clone()
    c = chunk_size
    eye = torch.eye(c, dtype=torch.float64)
    strict = torch.tril(torch.ones(c, c, dtype=torch.bool), -1)
    outs = []
    for start in range(0, t, c):
        n = min(c, t - start)

        def pad(x: torch.Tensor) -> torch.Tensor:  # [n, H, ...] -> [H, C, ...], zero rows
            x = x[start : start + n].transpose(0, 1)
            return torch.cat([x, x.new_zeros(h, c - n, *x.shape[2:])], dim=1)

        qc, kc, vc, gc, bc = pad(scale * q), pad(k), pad(v), pad(g).cumsum(1), pad(beta)
        diff = gc[:, :, None, :] - gc[:, None, :, :]  # [H, i, j, dk]
        lower = strict | torch.eye(c, dtype=torch.bool)
        decay = torch.where(lower[None, :, :, None], diff, float("-inf")).exp()
        a_kk = torch.einsum("hid,hjd,hijd->hij", kc, kc, decay) * bc[..., None] * strict
        a_qk = torch.einsum("hid,hjd,hijd->hij", qc, kc, decay)
        rhs = bc[..., None] * torch.cat([torch.exp(gc) * kc, vc], dim=-1)
        x = torch.linalg.solve_triangular(eye + a_kk, rhs, upper=False, unitriangular=True)
        w, u = x[..., :dk], x[..., dk:]
        v_e = u - w @ s
        o = (qc * torch.exp(gc)) @ s + a_qk @ v_e
        outs.append(o.transpose(0, 1)[:n])
        if n == c:
            g_last = gc[:, -1]  # [H, dk]
            s = torch.exp(g_last)[..., None] * s + (torch.exp(g_last[:, None] - gc) * kc).transpose(1, 2) @ v_e
    o = torch.cat(outs) if outs else v.new_zeros(0, h, dv)
    return o, s
