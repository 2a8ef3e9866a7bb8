"""Triton closed-form backwards of the row-wise ops: short conv, RMSNorm (plain and gated), L2 norm,
SwiGLU and the KDA gate.

The math is ``kernels_batch_invariant/grads.py``'s (the torch closed forms, checked there against
float64 autograd); this module computes the same formulas in one pass per op instead of a chain of
torch kernels. The torch forms move each [T, C] tensor through memory many times (the short conv's
backward re-gathers its window once per tap and scatters per tap: ~17 GB per KDA layer of a 16K-token
bench micro-batch, benchmarks/trainer_op_census.py); here every input is read once, every gradient
written once, and each element's arithmetic stays in fp32 registers.

The backward need not be batch-invariant (docs/numerics.md), only correct and deterministic run to
run. No kernel here uses atomics: every gradient element is written by one program, and parameter
gradients (norm weights, conv taps) are per-program partial sums over fixed row blocks, added by one
torch ``sum`` over the block axis (a fixed reduction for a fixed shape).

Each ``*_grads`` function has the signature of its ``grads.py`` counterpart and falls back to it for
what the kernels do not cover (float64 gradchecks, rows wider than ``MAX_ROW_BLOCK``, a short conv
whose decode state needs a gradient, KDA-gate parameter gradients): the fallback computes the same
function, only slower.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import grads as _grads
from ._common import (
    ELEMENTWISE_BLOCK, ELEMENTWISE_WARPS, MAX_ROW_BLOCK, as_rows, await_previous_kernel, cdiv, next_pow2, pdl,
    sigmoid
)

# Row kernels work on [ROWS, BLOCK_D] tiles of this many elements (rows of width <= BLOCK_D in one tile).
TILE_ELEMS = 4096
TILE_WARPS = 8  # every tile holds TILE_ELEMS elements (rows of width <= TILE_ELEMS)
# Parameter-gradient partials: at most this many row blocks per call (each program loops over its share
# of row tiles), so the [blocks, D] partial buffer stays small next to the activations.
MAX_PARTIAL_BLOCKS = 512
# Short conv: tokens x channels per program.
CONV_TOKENS = 16
CONV_CHANNELS = 128


def _cdt_ok(*tensors: torch.Tensor | None) -> bool:
    """The kernels compute in fp32: float64 inputs (gradchecks) take the torch closed form."""
    return not any(t is not None and t.dtype == torch.float64 for t in tensors)


def _tiling(n_rows: int, d: int, partials: bool) -> tuple[int, int, int, int]:
    """(BLOCK_D, ROWS per tile, tiles per program, programs) for rows of width d: one tile per program, or, when
    the program writes a parameter-gradient partial (``partials``), at most MAX_PARTIAL_BLOCKS programs."""
    block_d = next_pow2(d)
    rows = max(1, TILE_ELEMS // block_d)
    tiles = cdiv(n_rows, rows)
    per_prog = cdiv(tiles, MAX_PARTIAL_BLOCKS) if partials else 1
    return block_d, rows, per_prog, cdiv(tiles, per_prog)


def _sum_blocks(partial: torch.Tensor | None, like: torch.Tensor | None) -> torch.Tensor | None:
    return None if partial is None else partial.sum(0).reshape(like.shape).to(like.dtype)


# ----------------------------------------------------------------------------- RMSNorm (plain, gated)


@triton.jit
def _rms_bwd_kernel(x_ptr, gy_ptr, w_ptr, gate_ptr, dx_ptr, dgate_ptr, dw_ptr, n_rows, D, eps, per_prog,
                    HAS_W: tl.constexpr, GATED: tl.constexpr, NEED_DX: tl.constexpr, NEED_DW: tl.constexpr,
                    NEED_DGATE: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """y = x r w [* sigmoid(gate)], r = rsqrt(mean(x^2) + eps). With gy' = gy [* s] (s = sigmoid(gate)):
    dx = r (gy' w - xhat mean(gy' w xhat)), dw = sum_rows gy' xhat, dgate = gy (xhat w) s (1 - s)."""
    await_previous_kernel()
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    cm = cols < D
    if HAS_W:
        w = tl.load(w_ptr + cols, mask=cm, other=0.0).to(tl.float32)
    else:
        w = tl.full([BLOCK_D], 1.0, tl.float32)
    dw_acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for it in range(0, per_prog):
        rows = (pid * per_prog + it) * ROWS + tl.arange(0, ROWS)
        rm = rows < n_rows
        offs = rows.to(tl.int64)[:, None] * D + cols[None, :]
        m = rm[:, None] & cm[None, :]
        x = tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32)
        gy = tl.load(gy_ptr + offs, mask=m, other=0.0).to(tl.float32)
        r = tl.math.rsqrt(tl.sum(x * x, axis=1) / D + eps)
        xhat = x * r[:, None]
        if GATED:
            s = sigmoid(tl.load(gate_ptr + offs, mask=m, other=0.0).to(tl.float32))
            if NEED_DGATE:
                dg = gy * (xhat * w[None, :]) * s * (1.0 - s)
                tl.store(dgate_ptr + offs, dg.to(dgate_ptr.dtype.element_ty), mask=m)
            gy = gy * s
        if NEED_DW:
            dw_acc += tl.sum(gy * xhat, axis=0)
        if NEED_DX:
            dxhat = gy * w[None, :]
            proj = tl.sum(dxhat * xhat, axis=1) / D
            dx = (dxhat - xhat * proj[:, None]) * r[:, None]
            tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=m)
    if NEED_DW:
        tl.store(dw_ptr + pid * D + cols, dw_acc, mask=cm)


def _rms_grads(gy: torch.Tensor, x: torch.Tensor, gate: torch.Tensor | None, weight: torch.Tensor | None,
               eps: float, need_x: bool, need_gate: bool, need_w: bool
               ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    d = x.shape[-1]
    x2, g2 = as_rows(x), as_rows(gy)
    gt2 = as_rows(gate) if gate is not None else None
    w = weight.reshape(d).contiguous() if weight is not None else None
    need_w = need_w and w is not None
    n = x2.shape[0]
    block_d, rows, per_prog, progs = _tiling(n, d, need_w)
    dx = torch.empty_like(x2) if need_x else None
    dgate = torch.empty_like(gt2) if (need_gate and gt2 is not None) else None
    dw = torch.empty(progs, d, dtype=torch.float32, device=x.device) if need_w else None
    if n and d:
        _rms_bwd_kernel[(progs,)](
            x2, g2, w if w is not None else x2, gt2 if gt2 is not None else x2,
            dx if dx is not None else x2, dgate if dgate is not None else x2, dw if dw is not None else x2,
            n, d, float(eps), per_prog, HAS_W=w is not None, GATED=gt2 is not None, NEED_DX=dx is not None,
            NEED_DW=dw is not None, NEED_DGATE=dgate is not None, ROWS=rows, BLOCK_D=block_d,
            num_warps=TILE_WARPS, **pdl())
    elif dw is not None:
        dw.zero_()
    return (None if dx is None else dx.view(x.shape), None if dgate is None else dgate.view(gate.shape),
            _sum_blocks(dw, weight))


def _row_kernel_ok(x: torch.Tensor, *others: torch.Tensor | None) -> bool:
    return _cdt_ok(x, *others) and x.shape[-1] <= MAX_ROW_BLOCK


def rms_norm_grads(grads: _grads.Grads, needs: _grads.Needs, args: _grads.Args) -> dict[str, torch.Tensor | None]:
    x, w = args["x"], args["weight"]
    (gy,) = grads
    if gy is None or not _row_kernel_ok(x, w, gy):
        return _grads.rms_norm_grads(grads, needs, args)
    dx, _, dw = _rms_grads(gy, x, None, w, args["eps"], needs["x"], False, needs["weight"])
    return {"x": dx, "weight": dw}


def rms_norm_gated_grads(grads: _grads.Grads, needs: _grads.Needs, args: _grads.Args
                         ) -> dict[str, torch.Tensor | None]:
    x, gate, w = args["x"], args["gate"], args["weight"]
    (gy,) = grads
    if gy is None or not _row_kernel_ok(x, gate, w, gy):
        return _grads.rms_norm_gated_grads(grads, needs, args)
    dx, dgate, dw = _rms_grads(gy, x, gate, w, args["eps"], needs["x"], needs["gate"], needs["weight"])
    return {"x": dx, "gate": dgate, "weight": dw}


# ----------------------------------------------------------------------------- L2 norm


@triton.jit
def _l2_bwd_kernel(x_ptr, gy_ptr, dx_ptr, n_rows, D, eps, ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """y = x / n, n = sqrt(sum x^2 + eps): dx = (gy - y <gy, y>) / n."""
    await_previous_kernel()
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_D)
    m = (rows < n_rows)[:, None] & (cols < D)[None, :]
    offs = rows.to(tl.int64)[:, None] * D + cols[None, :]
    x = tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32)
    gy = tl.load(gy_ptr + offs, mask=m, other=0.0).to(tl.float32)
    nrm = tl.sqrt(tl.sum(x * x, axis=1) + eps)
    y = x / nrm[:, None]
    dot = tl.sum(gy * y, axis=1)
    dx = (gy - y * dot[:, None]) / nrm[:, None]
    tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=m)


def l2_norm_grads(grads: _grads.Grads, needs: _grads.Needs, args: _grads.Args) -> dict[str, torch.Tensor | None]:
    x = args["x"]
    (gy,) = grads
    if gy is None or not needs["x"] or not _row_kernel_ok(x, gy):
        return _grads.l2_norm_grads(grads, needs, args)
    d = x.shape[-1]
    x2, g2 = as_rows(x), as_rows(gy)
    dx = torch.empty_like(x2)
    n = x2.shape[0]
    block_d, rows, _, progs = _tiling(n, d, partials=False)
    if n and d:
        _l2_bwd_kernel[(progs,)](x2, g2, dx, n, d, float(args["eps"]), ROWS=rows, BLOCK_D=block_d,
                                 num_warps=TILE_WARPS, **pdl())
    return {"x": dx.view(x.shape)}


# ----------------------------------------------------------------------------- SwiGLU


@triton.jit
def _swiglu_bwd_kernel(g_ptr, u_ptr, gy_ptr, dg_ptr, du_ptr, n, NEED_DG: tl.constexpr, NEED_DU: tl.constexpr,
                       BLOCK: tl.constexpr):
    """y = g sigmoid(g) u: dg = gy u s (1 + g (1 - s)), du = gy g s."""
    await_previous_kernel()
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    g = tl.load(g_ptr + offs, mask=m, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=m, other=0.0).to(tl.float32)
    gy = tl.load(gy_ptr + offs, mask=m, other=0.0).to(tl.float32)
    s = sigmoid(g)
    if NEED_DG:
        tl.store(dg_ptr + offs, (gy * u * s * (1.0 + g * (1.0 - s))).to(dg_ptr.dtype.element_ty), mask=m)
    if NEED_DU:
        tl.store(du_ptr + offs, (gy * (g * s)).to(du_ptr.dtype.element_ty), mask=m)


def swiglu_grads(grads: _grads.Grads, needs: _grads.Needs, args: _grads.Args) -> dict[str, torch.Tensor | None]:
    gate, up = args["gate"], args["up"]
    (gy,) = grads
    if gy is None or not _cdt_ok(gate, up, gy) or not (needs["gate"] or needs["up"]):
        return _grads.swiglu_grads(grads, needs, args)
    g, u, gyc = gate.contiguous(), up.contiguous(), gy.contiguous()
    dg = torch.empty_like(g) if needs["gate"] else None
    du = torch.empty_like(u) if needs["up"] else None
    n = g.numel()
    if n:
        _swiglu_bwd_kernel[(cdiv(n, ELEMENTWISE_BLOCK),)](
            g, u, gyc, dg if dg is not None else g, du if du is not None else u, n, NEED_DG=dg is not None,
            NEED_DU=du is not None, BLOCK=ELEMENTWISE_BLOCK, num_warps=ELEMENTWISE_WARPS, **pdl())
    return {"gate": dg, "up": du}


# ----------------------------------------------------------------------------- KDA gate


@triton.jit
def _kda_gate_bwd_kernel(z_ptr, a_ptr, b_ptr, gy_ptr, dz_ptr, n, HD, DK, lower_bound,
                         HAS_LB: tl.constexpr, BLOCK: tl.constexpr):
    """x = z + dt_bias, a = exp(A_log[head]): g = -a softplus(x) (dx = -a sigmoid(x) gy) or, with a lower
    bound, g = lb sigmoid(a x) (dx = gy lb s (1 - s) a, s = sigmoid(a x))."""
    await_previous_kernel()
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    col = offs % HD
    x = tl.load(z_ptr + offs, mask=m, other=0.0).to(tl.float32) + tl.load(b_ptr + col, mask=m, other=0.0).to(tl.float32)
    a = tl.exp(tl.load(a_ptr + col // DK, mask=m, other=0.0).to(tl.float32))
    gy = tl.load(gy_ptr + offs, mask=m, other=0.0).to(tl.float32)
    if HAS_LB:
        s = sigmoid(a * x)
        dx = gy * (lower_bound * s * (1.0 - s)) * a
    else:
        dx = gy * (-a) * sigmoid(x)
    tl.store(dz_ptr + offs, dx.to(dz_ptr.dtype.element_ty), mask=m)


def kda_gate_grads(grads: _grads.Grads, needs: _grads.Needs, args: _grads.Args) -> dict[str, torch.Tensor | None]:
    z, a_log, dt_bias, h, lb = args["z"], args["A_log"], args["dt_bias"], args["num_heads"], args["lower_bound"]
    (gy,) = grads
    # The parameter gradients (A_log, dt_bias: reductions over tokens) take the torch closed form.
    if gy is None or not needs["z"] or needs["A_log"] or needs["dt_bias"] or not _cdt_ok(z, a_log, dt_bias, gy):
        return _grads.kda_gate_grads(grads, needs, args)
    t, hd = z.shape
    zc, gyc = z.contiguous(), gy.contiguous()
    dz = torch.empty_like(zc)
    n = zc.numel()
    if n:
        _kda_gate_bwd_kernel[(cdiv(n, ELEMENTWISE_BLOCK),)](
            zc, a_log.reshape(h).contiguous(), dt_bias.reshape(hd).contiguous(), gyc, dz, n, hd, hd // h,
            float(lb) if lb is not None else 0.0, HAS_LB=lb is not None, BLOCK=ELEMENTWISE_BLOCK,
            num_warps=ELEMENTWISE_WARPS, **pdl())
    return {"z": dz, "A_log": None, "dt_bias": None}


# ----------------------------------------------------------------------------- causal short conv


@triton.jit
def _conv_src(x_ptr, st_ptr, seq, start, tok, c, mc, ok, C, W: tl.constexpr, HAS_STATE: tl.constexpr):
    """The conv input at absolute token ``tok`` [BT] of sequence ``seq`` [BT] (channels ``c``): x before the
    sequence start is the sequence's conv_state row (or zero). ``ok`` masks rows outside every sequence."""
    q = tok - start  # position in the sequence (< 0: the state)
    v = tl.load(x_ptr + tok[:, None] * C + c[None, :], mask=(ok & (q >= 0))[:, None] & mc[None, :],
                other=0.0).to(tl.float32)
    if HAS_STATE:
        sv = tl.load(st_ptr + (seq * (W - 1) + (W - 1) + q)[:, None] * C + c[None, :],
                     mask=(ok & (q < 0) & (q >= -(W - 1)))[:, None] & mc[None, :], other=0.0).to(tl.float32)
        v = tl.where((q >= 0)[:, None], v, sv)
    return v


@triton.jit
def _short_conv_bwd_kernel(x_ptr, w_ptr, st_ptr, gy_ptr, seq_ptr, cu_ptr, dx_ptr, dw_ptr, T, C,
                           W: tl.constexpr, HAS_STATE: tl.constexpr, SILU: tl.constexpr, NEED_DX: tl.constexpr,
                           NEED_DW: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    """Tokens [t0, t0 + BT) x channels of one block. y_t = act(pre_t), pre_t = sum_i w_i src(t - W + 1 + i):
    gpre_t = gy_t act'(pre_t); dx_t = sum_i w_i gpre_{t + W - 1 - i} over tokens of t's own sequence;
    dw_i (partial over the block) = sum_t gpre_t src(t - W + 1 + i). The W future tokens' pre-activations
    are recomputed from the (L1-resident) inputs instead of being stored by the forward."""
    await_previous_kernel()
    pid_t = tl.program_id(0)
    tok = pid_t * BT + tl.arange(0, BT)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    mc = c < C
    tm = tok < T
    tok = tl.where(tm, tok, 0).to(tl.int64)
    seq = tl.load(seq_ptr + tok, mask=tm, other=0).to(tl.int64)
    start = tl.load(cu_ptr + seq, mask=tm, other=0).to(tl.int64)
    end = tl.load(cu_ptr + seq + 1, mask=tm, other=0).to(tl.int64)
    dx = tl.zeros([BT, BC], dtype=tl.float32)
    for k in tl.static_range(W):  # output token tok + k uses input tok through tap W - 1 - k
        out_tok = tok + k
        ok = tm & (out_tok < end)
        pre = tl.zeros([BT, BC], dtype=tl.float32)
        for i in tl.static_range(W):
            wi = tl.load(w_ptr + c * W + i, mask=mc, other=0.0).to(tl.float32)
            pre += _conv_src(x_ptr, st_ptr, seq, start, out_tok - (W - 1) + i, c, mc, ok, C, W, HAS_STATE) * wi[None, :]
        g = tl.load(gy_ptr + out_tok[:, None] * C + c[None, :], mask=ok[:, None] & mc[None, :], other=0.0).to(tl.float32)
        if SILU:
            s = sigmoid(pre)
            g = g * s * (1.0 + pre * (1.0 - s))
        if NEED_DX:
            wk = tl.load(w_ptr + c * W + (W - 1 - k), mask=mc, other=0.0).to(tl.float32)
            dx += g * wk[None, :]
        if NEED_DW:
            if k == 0:  # the block's own tokens: dw_i += gpre_t src(t - W + 1 + i)
                for i in tl.static_range(W):
                    src = _conv_src(x_ptr, st_ptr, seq, start, tok - (W - 1) + i, c, mc, tm, C, W, HAS_STATE)
                    tl.store(dw_ptr + (pid_t * W + i) * C + c, tl.sum(g * src, axis=0), mask=mc)
    if NEED_DX:
        tl.store(dx_ptr + tok[:, None] * C + c[None, :], dx.to(dx_ptr.dtype.element_ty), mask=tm[:, None] & mc[None, :])


def causal_short_conv_grads(grads: _grads.Grads, needs: _grads.Needs, args: _grads.Args
                            ) -> dict[str, torch.Tensor | None]:
    x, weight, cu, state, act = args["x"], args["weight"], args["cu_seqlens"], args["conv_state"], args["activation"]
    gy, g_state = grads
    # The decode state's own gradient (and one flowing into it from new_state) take the torch closed form;
    # the trainer's forwards start every sequence from an empty state and discard the new one.
    if (gy is None or g_state is not None or (state is not None and needs["conv_state"])
            or not _cdt_ok(x, weight, state, gy) or not (needs["x"] or needs["weight"])):
        return _grads.causal_short_conv_grads(grads, needs, args)
    t, c = x.shape
    w = weight.shape[-1]
    xc, gyc = x.contiguous(), gy.contiguous()
    wt = weight.reshape(c, w).contiguous()
    cu64 = cu.to(device=x.device, dtype=torch.int64).contiguous()
    st = state.contiguous() if state is not None else xc
    dx = torch.empty_like(xc) if needs["x"] else None
    n_tb = cdiv(t, CONV_TOKENS)
    dw = torch.empty(n_tb, w, c, dtype=torch.float32, device=x.device) if needs["weight"] else None
    if t and c:
        seq = torch.searchsorted(cu64[1:], torch.arange(t, device=x.device, dtype=torch.int64), right=True)
        _short_conv_bwd_kernel[(n_tb, cdiv(c, CONV_CHANNELS))](
            xc, wt, st, gyc, seq, cu64, dx if dx is not None else xc, dw if dw is not None else xc, t, c,
            W=w, HAS_STATE=state is not None, SILU=act == "silu", NEED_DX=dx is not None, NEED_DW=dw is not None,
            BT=CONV_TOKENS, BC=CONV_CHANNELS, num_warps=4, **pdl())
    elif dw is not None:
        dw.zero_()
    return {"x": dx,
            "weight": None if dw is None else dw.sum(0).t().reshape(weight.shape).to(weight.dtype),
            "conv_state": None}
