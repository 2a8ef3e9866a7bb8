"""Analytic backwards of the cheap row-wise / elementwise ops, in plain torch ops.

docs/numerics.md asks the backward to be correct and deterministic, not batch-invariant. The Triton
forwards of these ops used to get their gradient by re-running the op's torch composition under
autograd (``triton/_autograd.with_reference_backward``): correct, but the compositions are built for
invariance (tree reductions of log2(D) levels, a [T, W, C] window gather for the short conv whose
autograd backward is an accumulating scatter), so their autograd graphs are many kernels and large
transients. Here each gradient is the closed form, computed in fp32 (fp64 for fp64 inputs) with
torch's row reductions and column sums, which are deterministic run to run on CPU and CUDA; the
short conv's scatter is written as per-tap ``index_copy`` into distinct rows (no accumulation
races). ``tests/kernels/test_grads.py`` checks every function against autograd of the float64
reference on ragged shapes.

Each function takes ``grads`` (the output gradients, None where an output got none), ``needs``
(argument name -> whether it wants a gradient) and ``args`` (argument name -> value, as the op was
called) and returns argument name -> gradient.
"""
from __future__ import annotations

from typing import Any

import torch

from .short_conv import _device_window_index, _window_index

Grads = tuple[torch.Tensor | None, ...]
Needs = dict[str, bool]
Args = dict[str, Any]


def _cdt(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _sigmoid(x: torch.Tensor) -> torch.Tensor:
    return torch.sigmoid(x)


def _col_sum(t: torch.Tensor, d: int) -> torch.Tensor:
    """Sum over every leading dim of ``t`` [..., d] -> [d]."""
    return t.reshape(-1, d).sum(0)


def _zero_like_grad(x: torch.Tensor | None, need: bool) -> torch.Tensor | None:
    return torch.zeros_like(x) if (x is not None and need) else None


def _rms_core(gy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, eps: float,
              need_x: bool, need_w: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """d(x, weight) of ``<gy, x * rsqrt(mean(x^2) + eps) * weight>`` (gy already in the compute dtype)."""
    cdt = _cdt(x.dtype)
    d = x.shape[-1]
    xf = x.to(cdt)
    r = torch.rsqrt(_sq_sum(xf) / d + eps)
    xhat = xf * r
    dw = _col_sum(gy * xhat, d).to(weight.dtype) if (weight is not None and need_w) else None
    dx = None
    if need_x:
        dxhat = gy * weight.to(cdt) if weight is not None else gy
        proj = (dxhat * xhat).mean(-1, keepdim=True)
        dx = torch.addcmul(dxhat, xhat, proj, value=-1.0).mul_(r).to(x.dtype)  # r (dxhat - xhat proj)
    return dx, dw


def _sq_sum(xf: torch.Tensor) -> torch.Tensor:
    """sum(x^2) over the last dim (keepdim) as one reduction, without an x * x temporary."""
    return torch.linalg.vector_norm(xf, dim=-1, keepdim=True).square_()


def rms_norm_grads(grads: Grads, needs: Needs, args: Args) -> dict[str, torch.Tensor | None]:
    x, w = args["x"], args["weight"]
    (gy,) = grads
    if gy is None:
        return {"x": _zero_like_grad(x, needs["x"]), "weight": _zero_like_grad(w, needs["weight"])}
    dx, dw = _rms_core(gy.to(_cdt(x.dtype)), x, w, args["eps"], needs["x"], needs["weight"])
    return {"x": dx, "weight": dw}


def rms_norm_gated_grads(grads: Grads, needs: Needs, args: Args) -> dict[str, torch.Tensor | None]:
    x, gate, w, eps = args["x"], args["gate"], args["weight"], args["eps"]
    (gy,) = grads
    if gy is None:
        return {n: _zero_like_grad(args[n], needs[n]) for n in ("x", "gate", "weight")}
    cdt = _cdt(x.dtype)
    gy = gy.to(cdt)
    s = _sigmoid(gate.to(cdt))
    dgate = None
    if needs["gate"]:
        xf = x.to(cdt)
        yn = xf * torch.rsqrt((xf * xf).mean(-1, keepdim=True) + eps) * w.to(cdt)
        dgate = (gy * yn * s * (1.0 - s)).to(gate.dtype)
    dx, dw = _rms_core(gy * s, x, w, eps, needs["x"], needs["weight"])
    return {"x": dx, "gate": dgate, "weight": dw}


def layer_norm_grads(grads: Grads, needs: Needs, args: Args) -> dict[str, torch.Tensor | None]:
    x, w, b, eps = args["x"], args["weight"], args["bias"], args["eps"]
    (gy,) = grads
    if gy is None:
        return {n: _zero_like_grad(args[n], needs[n]) for n in ("x", "weight", "bias")}
    cdt = _cdt(x.dtype)
    d = x.shape[-1]
    gy = gy.to(cdt)
    xf = x.to(cdt)
    xc = xf - xf.mean(-1, keepdim=True)
    r = torch.rsqrt((xc * xc).mean(-1, keepdim=True) + eps)
    xhat = xc * r
    out: dict[str, torch.Tensor | None] = {"x": None, "weight": None, "bias": None}
    if w is not None and needs["weight"]:
        out["weight"] = _col_sum(gy * xhat, d).to(w.dtype)
    if b is not None and needs["bias"]:
        out["bias"] = _col_sum(gy, d).to(b.dtype)
    if needs["x"]:
        dxhat = gy * w.to(cdt) if w is not None else gy
        out["x"] = (r * (dxhat - dxhat.mean(-1, keepdim=True)
                         - xhat * (dxhat * xhat).mean(-1, keepdim=True))).to(x.dtype)
    return out


def l2_norm_grads(grads: Grads, needs: Needs, args: Args) -> dict[str, torch.Tensor | None]:
    x, eps = args["x"], args["eps"]
    (gy,) = grads
    if gy is None or not needs["x"]:
        return {"x": _zero_like_grad(x, needs["x"])}
    cdt = _cdt(x.dtype)
    xf, gy = x.to(cdt), gy.to(cdt)
    n = torch.sqrt(_sq_sum(xf) + eps)
    y = xf / n
    dot = (gy * y).sum(-1, keepdim=True)
    return {"x": torch.addcmul(gy, y, dot, value=-1.0).div_(n).to(x.dtype)}  # (gy - y <gy, y>) / n


def kda_gate_grads(grads: Grads, needs: Needs, args: Args) -> dict[str, torch.Tensor | None]:
    z, a_log, dt_bias, h, lb = args["z"], args["A_log"], args["dt_bias"], args["num_heads"], args["lower_bound"]
    (gy,) = grads
    names = ("z", "A_log", "dt_bias")
    if gy is None:
        return {n: _zero_like_grad(args[n], needs[n]) for n in names}
    cdt = _cdt(z.dtype)
    t, hd = z.shape
    dk = hd // h
    a = torch.exp(a_log.reshape(h).to(cdt)).view(1, h, 1)
    x = (z.to(cdt) + dt_bias.to(cdt).reshape(hd)).view(t, h, dk)
    gy = gy.to(cdt)
    if lb is None:  # g = -a softplus(x): dg/dx = -a sigmoid(x), dg/dA_log = g
        s = _sigmoid(x)
        dx = gy * (-a) * s
        da_log = (gy * (-a) * torch.nn.functional.softplus(x)).sum((0, 2)) if needs["A_log"] else None
    else:  # g = lb sigmoid(a x): dg/d(ax) = lb s (1 - s); d(ax)/dA_log = a x
        s = _sigmoid(a * x)
        dax = gy * (lb * s * (1.0 - s))
        dx = dax * a
        da_log = (dax * a * x).sum((0, 2)) if needs["A_log"] else None
    dx = dx.reshape(t, hd)
    return {"z": dx.to(z.dtype) if needs["z"] else None,
            "A_log": None if da_log is None else da_log.reshape(a_log.shape).to(a_log.dtype),
            "dt_bias": dx.sum(0).reshape(dt_bias.shape).to(dt_bias.dtype) if needs["dt_bias"] else None}


def swiglu_grads(grads: Grads, needs: Needs, args: Args) -> dict[str, torch.Tensor | None]:
    gate, up = args["gate"], args["up"]
    (gy,) = grads
    if gy is None:
        return {n: _zero_like_grad(args[n], needs[n]) for n in ("gate", "up")}
    cdt = _cdt(gate.dtype)
    g, u, gy = gate.to(cdt), up.to(cdt), gy.to(cdt)
    # torch's fused SiLU derivative: gy u s (1 + g (1 - s)), s = sigmoid(g), in one kernel
    return {"gate": torch.ops.aten.silu_backward(gy * u, g).to(gate.dtype) if needs["gate"] else None,
            "up": (gy * torch.nn.functional.silu(g)).to(up.dtype) if needs["up"] else None}


def situ_glu_grads(grads: Grads, needs: Needs, args: Args) -> dict[str, torch.Tensor | None]:
    gate, up = args["gate"], args["up"]
    (gy,) = grads
    if gy is None:
        return {n: _zero_like_grad(args[n], needs[n]) for n in ("gate", "up")}
    beta, linear_beta = float(args.get("beta", 4.0)), args.get("linear_beta", 25.0)
    cdt = _cdt(gate.dtype)
    g, u, gy = gate.to(cdt), up.to(cdt), gy.to(cdt)
    s = _sigmoid(g)
    tg = torch.tanh(g / beta)
    a = beta * tg * s
    if linear_beta is None:  # uncapped up branch: b = u, db/du = 1
        b, db = u, torch.ones_like(u)
    else:
        tu = torch.tanh(u / float(linear_beta))
        b, db = float(linear_beta) * tu, 1.0 - tu * tu
    out: dict[str, torch.Tensor | None] = {"gate": None, "up": None}
    if needs["gate"]:
        out["gate"] = (gy * b * ((1.0 - tg * tg) * s + beta * tg * s * (1.0 - s))).to(gate.dtype)
    if needs["up"]:
        out["up"] = (gy * a * db).to(up.dtype)
    return out


def causal_short_conv_grads(grads: Grads, needs: Needs, args: Args) -> dict[str, torch.Tensor | None]:
    """Gradient of ``causal_short_conv``: y_t = act(sum_i w_i * src[win[t, i]]), new_state = src[last].

    ``src`` = x followed by the previous conv state rows. For a fixed tap i, ``win[:, i]`` maps
    distinct tokens to distinct source rows, so each tap's contribution to d(src) is one
    ``index_add_`` into the gradient buffer in which no two entries hit one row (each row gets at most
    one add per call, whatever the order of the adds), and the taps are added in fixed order:
    deterministic run to run. The SiLU's derivative is torch's fused ``silu_backward``.
    """
    x, weight, cu, state, act = args["x"], args["weight"], args["cu_seqlens"], args["conv_state"], args["activation"]
    gy, g_state = grads
    cdt = _cdt(x.dtype)
    t, c = x.shape
    w = weight.shape[-1]
    n = cu.numel() - 1
    st = state if state is not None else x.new_zeros(n, w - 1, c)
    src = torch.cat([x.to(cdt), st.to(cdt).reshape(n * (w - 1), c)], dim=0)
    # On the GPU the window indices are built there (no host round trip of cu_seqlens, no blocking copy).
    win, last = (_device_window_index(cu.to(device=x.device, dtype=torch.int64), t, w) if x.is_cuda
                 else _window_index(cu, t, w))
    wt = weight.to(cdt).reshape(c, w)
    dsrc = None
    dw = None
    if gy is not None:
        gy = gy.to(cdt)
        if act == "silu":
            pre = src[win[:, 0]] * wt[:, 0]
            for i in range(1, w):
                pre.addcmul_(src[win[:, i]], wt[:, i])
            gy = torch.ops.aten.silu_backward(gy, pre)  # gy * s (1 + pre (1 - s)), s = sigmoid(pre)
            del pre
        if needs["weight"]:
            dw = torch.stack([(gy * src[win[:, i]]).sum(0) for i in range(w)], dim=1)
            dw = dw.reshape(weight.shape).to(weight.dtype)
        if needs["x"] or (state is not None and needs["conv_state"]):
            # The newest tap reads token t itself (win[:, W-1] = t): it initialises the token rows.
            dsrc = torch.empty_like(src)
            torch.mul(gy, wt[:, w - 1], out=dsrc[:t])
            dsrc[t:].zero_()
            for i in range(w - 1):
                dsrc.index_add_(0, win[:, i], gy * wt[:, i])
    if dsrc is None:
        dsrc = torch.zeros_like(src)
    if g_state is not None and n:
        dsrc.index_add_(0, last.reshape(-1), g_state.to(cdt).reshape(-1, c))
    return {"x": dsrc[:t].to(x.dtype) if needs["x"] else None,
            "weight": dw if needs["weight"] else None,
            "conv_state": (dsrc[t:].reshape(n, w - 1, c).to(state.dtype)
                           if state is not None and needs["conv_state"] else None)}
