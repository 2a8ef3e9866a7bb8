"""The token-recurrent form of the Triton KDA ops (``Numerics.kda_form == "recurrent"``).

One kernel, ``_kda_recurrent_kernel``, runs the delta rule token by token over a run of rows:

    S = S * exp(g_t)[:, None];   pred = k_t^T S;   S = S + (beta_t k_t) (v_t - pred)^T;   o_t = (scale q_t)^T S

with the state ``S`` [dk, BV] held in registers by one program per (run, head, column block of BV
values). Every caller launches this same compiled kernel with the same launch configuration -- the
packed forward (``kda_chunk``: prefill and the trainer), the decode step, the decode prime and
``kda_chunk_step`` -- and differs only in a table of where each run's rows, queries, outputs and states
live. A token's arithmetic is therefore the same instructions on the same values wherever it runs: the
state after a row is the same bits in the trainer's pass over a whole sequence, in a prefill, and in a
decode step that continues from a stored state (an fp32 state stored and loaded again is exact), which
is what makes rollout and trainer agree bitwise. Its reductions (``pred``, ``o_t``: sums over dk) have
the layouts of that one binary. A run's bits depend on nothing but its own rows and start state, so the
form is batch-invariant: programs never share values.

The ops keep ``kda_chunk``'s contract (``kda/chunk.py``): ``final_state`` is the state after each
sequence's last COMPLETE 64-token chunk and ``chunk_states`` the state at every complete chunk's end
(the engine's prefix-cache snapshots); rows of a trailing partial chunk produce outputs but leave
``final_state`` at the chunk's start, and the model re-runs them from there (their rows are kept), which
by the above gives the same bits. The decode cache (``KDADecodeCache``) keeps, per slot, the state after
the rows so far (``run_state``), so a decode step runs one token; ``kda_decode_prime`` rebuilds it from
the chunk-start state and the cached rows.

Speed (why this form exists next to the chunked one, ``kda_chunk.py``): a decode step is one token of
vector work per (sequence, head, column block), bounded by reading and writing the state; the chunked
form re-solves 64-row tiles every step. The cost is a sequential pass over each sequence in prefill and
training: fine for many sequences of RL length, slow for one long prompt (fla-core's token-recurrent
kernel took ~4x the chunked form's time on one 32K-token sequence:
benchmarks/results/2026-12-02_kda_recurrent_probe_h200.json; this kernel's own prefill is not measured yet).

Autograd: fla-core's chunked backward, as for the chunked forward (``kda_chunk_bwd.py``): the backward
needs correctness and determinism, not the forward's bits.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..kda import CHUNK_SIZE, KDADecodeCache
from ..kda.chunk import packed_lengths
from ..numerics import kda_recurrent_launch
from ._common import await_previous_kernel, cdiv, next_pow2, pdl

# The run table: one row of INFO_COLS int32 per run, the columns of ``run_table`` in its order (see
# _kda_recurrent_kernel).
INFO_COLS = 9


def launch_config(dk: int, dv: int) -> dict[str, int]:
    """From the head dims and the contract's ``kda_recurrent_launch`` (BV state columns x warps per program)
    only: every caller must launch the same binary (the module docstring). The state block [dk, BV] lives in
    registers; N x H x dv / BV programs."""
    bv, warps = kda_recurrent_launch()
    return {"DKP": max(16, next_pow2(dk)), "BV": min(bv, next_pow2(dv)), "num_warps": warps}


@triton.jit
def _load_row(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, t, tq, h, H, ks, vs, km, vm, live, want_q,
              DK: tl.constexpr, DV: tl.constexpr):
    """Row t's k, g, v, beta (and its query, row tq, if ``want_q``) in fp32, beta as a [DKP] vector of the one
    value; zeros unless ``live``. The conditions become full-shape masks (the interpreter refuses a scalar one)."""
    lk = km & ((ks * 0 + live.to(tl.int32)) > 0)
    lq = lk & ((ks * 0 + want_q.to(tl.int32)) > 0)
    k_i = tl.load(k_ptr + (t * H + h) * DK + ks, mask=lk, other=0.0).to(tl.float32)
    g_i = tl.load(g_ptr + (t * H + h) * DK + ks, mask=lk, other=0.0).to(tl.float32)
    v_i = tl.load(v_ptr + (t * H + h) * DV + vs, mask=vm & ((vs * 0 + live.to(tl.int32)) > 0), other=0.0).to(tl.float32)
    # beta_t in every lane of dk (one address: a broadcast load), as the k_i-shaped factor it multiplies
    b_i = tl.load(beta_ptr + t * H + h + ks * 0, mask=lk, other=0.0).to(tl.float32)
    q_i = tl.load(q_ptr + (tq * H + h) * DK + ks, mask=lq, other=0.0).to(tl.float32)
    return k_i, g_i, v_i, b_i, q_i


@triton.jit(do_not_specialize=["H"])
def _kda_recurrent_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr,  # rows [*, H, dk | dk | dv | dk], [*, H]; q addressed through QTOK0
    o_ptr,  # [*, H, dv], rows as q
    h0_ptr, run_ptr, fin_ptr, cs_ptr,  # fp32 states [*, H, dk, dv]: start (IN_ROW), running, chunk end, chunk states
    info_ptr,  # [N, INFO_COLS] int32 run table
    scale, H,
    DK: tl.constexpr, DV: tl.constexpr, DKP: tl.constexpr, BV: tl.constexpr, C: tl.constexpr,
):
    """Run r = program_id(0) (table row): rows TOK0 .. TOK0 + NROWS - 1 of k, v, g, beta from the state at
    h0[IN_ROW] (zeros if IN_ROW < 0). Row i's query is q[QTOK0 + i] and its output o[QTOK0 + i], for
    i >= OUT0 only. The row at absolute position POS0 + i ends a chunk when (POS0 + i + 1) % C == 0: the
    state is then stored at fin[FIN_ROW] (if >= 0) and at cs[CS_ROW0 + j] for the run's j-th chunk end (if
    CS_ROW0 >= 0). The state after the last row goes to run[RUN_ROW] (if >= 0)."""
    await_previous_kernel()
    r = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    vb = tl.program_id(2)
    info = info_ptr + r * 9
    tok0 = tl.load(info + 0).to(tl.int64)
    n = tl.load(info + 1)
    qtok0 = tl.load(info + 2).to(tl.int64)
    out0 = tl.load(info + 3)
    in_row = tl.load(info + 4).to(tl.int64)
    run_row = tl.load(info + 5).to(tl.int64)
    pos0 = tl.load(info + 6)
    cs_row = tl.load(info + 7).to(tl.int64)
    fin_row = tl.load(info + 8).to(tl.int64)

    ks = tl.arange(0, DKP)
    vs = vb * BV + tl.arange(0, BV)
    km = ks < DK
    vm = vs < DV
    smask = km[:, None] & vm[None, :]
    st = (h * DK + ks[:, None]).to(tl.int64) * DV + vs[None, :]  # within one state row [H, dk, dv]
    st_row = H * DK * DV
    has_h0 = (tl.zeros([DKP, BV], tl.int64) + in_row) >= 0  # (a full-shape mask: the interpreter wants one)
    s = tl.load(h0_ptr + tl.maximum(in_row, 0) * st_row + st, mask=smask & has_h0, other=0.0)
    # Row i's inputs are loaded during row i - 1 (software pipelining by hand): the loop is one dependent
    # chain per token, and a global load's latency inside it was most of a token's time. Which values are
    # loaded, and so the arithmetic, is the same either way.
    k_i, g_i, v_i, b_i, q_i = _load_row(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, tok0, qtok0, h, H, ks, vs, km, vm,
                                        n > 0, out0 <= 0, DK, DV)
    for i in range(0, n):
        k_n, g_n, v_n, b_n, q_n = _load_row(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, tok0 + i + 1, qtok0 + i + 1, h, H,
                                            ks, vs, km, vm, i + 1 < n, i + 1 >= out0, DK, DV)
        s = s * tl.exp(g_i)[:, None]
        pred = tl.sum(k_i[:, None] * s, axis=0)  # what the state recalls for k_i
        s = s + (b_i * k_i)[:, None] * (v_i - pred)[None, :]
        if i >= out0:
            tq = qtok0 + i
            o_i = tl.sum((q_i * scale)[:, None] * s, axis=0)
            tl.store(o_ptr + (tq * H + h) * DV + vs, o_i.to(o_ptr.dtype.element_ty), mask=vm)
        if (pos0 + i + 1) % C == 0:
            if fin_row >= 0:
                tl.store(fin_ptr + fin_row * st_row + st, s, mask=smask)
            if cs_row >= 0:
                tl.store(cs_ptr + cs_row * st_row + st, s, mask=smask)
                cs_row += 1
        k_i, g_i, v_i, b_i, q_i = k_n, g_n, v_n, b_n, q_n
    if run_row >= 0:
        tl.store(run_ptr + run_row * st_row + st, s, mask=smask)


def _launch(q, k, v, g, beta, o, h0, run, fin, cs, info: torch.Tensor, scale: float, h: int, dk: int, dv: int) -> None:
    """One launch over the runs of ``info``; unused pointers may be any tensor of the device (never touched:
    their rows are -1). Every base pointer is 16-byte aligned (inputs copied if not, outputs checked) and
    the pointer dtypes are fixed (below), so every caller gets the same specialisation of the kernel."""
    cfg = launch_config(dk, dv)
    # q, k, g, beta in fp32 for every caller (the model's dtypes; exact conversions otherwise), v and o in the
    # model dtype: the same pointer dtypes everywhere, hence the same binary.
    q, k, g, beta = (_aligned(x.to(torch.float32)) for x in (q, k, g, beta))
    v = _aligned(v)
    if o.dtype != v.dtype:
        raise ValueError(f"kda (recurrent): output dtype {o.dtype} != v dtype {v.dtype}")
    for x in (o, h0, run, fin, cs):
        if x.data_ptr() % 16:
            raise ValueError("kda (recurrent): an output or state buffer is not 16-byte aligned")
    _kda_recurrent_kernel[(info.shape[0], h, cdiv(dv, cfg["BV"]))](
        q, k, v, g, beta, o, h0, run, fin, cs, info, scale, h,
        DK=dk, DV=dv, DKP=cfg["DKP"], BV=cfg["BV"], C=CHUNK_SIZE, num_warps=cfg["num_warps"],
        num_stages=1, **pdl())


def _aligned(x: torch.Tensor) -> torch.Tensor:
    """``x`` contiguous at a 16-byte aligned address (a copy if it is not): Triton specialises a pointer
    argument on that alignment, and every caller must get the same binary."""
    x = x.contiguous()
    return x if x.data_ptr() % 16 == 0 else x.clone()


def rows_in_place(v: torch.Tensor) -> torch.Tensor:
    """v [N, H, dv] as it is when each row's H * dv values are adjacent (v inside the fused projection's
    output: only the row stride differs), else a contiguous copy. The one kernel that reads it copies each row
    into the cache (``stage_new_row``)."""
    n, h, dv = v.shape
    if v.stride(2) == 1 and v.stride(1) == dv:
        return v
    return v.contiguous()


def run_table(*, tok0, nrows, qtok0, out0, in_row, run_row, pos0, cs_row0, fin_row) -> torch.Tensor:
    """[N, INFO_COLS] int32 run table from its columns ([N] tensors, or lists built on the host); -1 = none."""
    cols = (tok0, nrows, qtok0, out0, in_row, run_row, pos0, cs_row0, fin_row)
    return torch.stack([torch.as_tensor(c).to(torch.int32) for c in cols], dim=1).contiguous()


def recurrent_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      cu_seqlens: torch.Tensor, initial_state: torch.Tensor | None, scale: float | None,
                      output_chunk_states: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``kda_chunk``'s packed varlen forward in the recurrent form (same arguments and returns)."""
    t, h, dk = q.shape
    dv = v.shape[-1]
    dev = q.device
    scale = dk**-0.5 if scale is None else float(scale)
    cu, lens = packed_lengths(cu_seqlens, t)
    n = len(lens)
    if t >= 2**31:
        raise ValueError("kda_chunk (triton): more than 2^31 tokens")
    c = CHUNK_SIZE
    complete = [m // c for m in lens]
    cs_start = [sum(complete[:i]) for i in range(n)]
    final = (torch.zeros(n, h, dk, dv, dtype=torch.float32, device=dev) if initial_state is None
             else initial_state.to(torch.float32).clone().contiguous())
    chunk_states = torch.empty(sum(complete), h, dk, dv, dtype=torch.float32, device=dev) if output_chunk_states else None
    o = torch.empty(t, h, dv, dtype=v.dtype, device=dev)
    if n == 0 or t == 0:
        return o, final, chunk_states
    seq, none, zero = list(range(n)), [-1] * n, [0] * n
    info = run_table(tok0=cu[:-1], nrows=lens, qtok0=cu[:-1], out0=zero, in_row=seq if initial_state is not None else none,
                     run_row=none, pos0=zero, fin_row=seq,
                     cs_row0=[cs_start[i] if output_chunk_states and complete[i] else -1 for i in seq]
                     ).to(dev, non_blocking=True)
    _launch(q, k, v, g, beta, o, final, final, final, chunk_states if chunk_states is not None else final, info,
            scale, h, dk, dv)
    return o, final, chunk_states


def recurrent_chunk_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                         num_rows: torch.Tensor, state: torch.Tensor, scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``kda_chunk_step`` in the recurrent form: each of N chunks [64, H, d] from its start ``state``, rows
    < num_rows; the state advances only for a complete chunk. No host reads (CUDA-graph capturable)."""
    n, c, h, dk = q.shape
    dv = v.shape[-1]
    dev = q.device
    scale = dk**-0.5 if scale is None else float(scale)
    o = torch.zeros(n, c, h, dv, dtype=v.dtype, device=dev)
    final = state.to(torch.float32).clone().contiguous()
    if n == 0:
        return o, final
    seq = torch.arange(n, dtype=torch.int32, device=dev)
    none = torch.full_like(seq, -1)
    zero = torch.zeros_like(seq)
    info = run_table(tok0=seq * c, nrows=num_rows.clamp(0, c), qtok0=seq * c, out0=zero, in_row=seq, run_row=none,
                     pos0=zero, cs_row0=none, fin_row=seq)
    _launch(*(x.reshape(n * c, h, -1) for x in (q, k, v, g)), beta.reshape(n * c, h), o.view(n * c, h, dv),
            final, final, final, final, info, scale, h, dk, dv)
    return o, final


@triton.jit
def _decode_rows_kernel(
    pos_ptr, slot_ptr, solved_ptr,  # [N] positions, [N] int64 slots, [S] int32 rows folded into run_state
    k_ptr, v_ptr, g_ptr, beta_ptr,  # the new rows [N, H, dk | dv | dk], [N, H]
    ck_ptr, cv_ptr, cg_ptr, cbeta_ptr,  # the cache's chunk rows [S, 64, H, ...]
    info_ptr,  # out: [N, 9] run table
    v_stride,  # elements between v's rows
    HK: tl.constexpr, HV: tl.constexpr, H: tl.constexpr, BLOCK: tl.constexpr, C: tl.constexpr,
):
    """Per sequence: store the new row at its chunk row in the cache, count it as folded into the running
    state, and write its run: one row from run_state[slot] back to run_state[slot], the query and output at
    row i of the step, the chunk-end state (when the row completes the chunk) to the cache's state."""
    await_previous_kernel()
    i = tl.program_id(0)
    slot, r, dst = stage_new_row(i, pos_ptr, slot_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, ck_ptr, cv_ptr, cg_ptr,
                                 cbeta_ptr, v_stride, HK, HV, H, BLOCK, C)
    tl.store(solved_ptr + slot, r + 1)
    s32 = slot.to(tl.int32)
    info = info_ptr + i * 9
    tl.store(info + 0, dst.to(tl.int32))
    tl.store(info + 1, 1)
    tl.store(info + 2, i)
    tl.store(info + 3, 0)
    tl.store(info + 4, s32)
    tl.store(info + 5, s32)
    tl.store(info + 6, r)
    tl.store(info + 7, -1)
    tl.store(info + 8, s32)


@triton.jit
def stage_new_row(i, pos_ptr, slot_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, ck_ptr, cv_ptr, cg_ptr, cbeta_ptr, v_stride,
                  HK: tl.constexpr, HV: tl.constexpr, H: tl.constexpr, BLOCK: tl.constexpr, C: tl.constexpr):
    """A decode step's sequence i: its slot and chunk row r = position % C, and its new k, v, g, beta ([N, H, d] /
    [N, H]; v's rows ``v_stride`` elements apart, so it is read where the projection left it) copied to that
    row of the slot's cached chunk. Returns (slot, r, the row's token index in the cache's [S * C, H, d] view)."""
    slot = tl.load(slot_ptr + i)
    r = (tl.load(pos_ptr + i) % C).to(tl.int32)
    dst = slot * C + r
    for b in tl.static_range(0, HK, BLOCK):
        e = b + tl.arange(0, BLOCK)
        m = e < HK
        tl.store(ck_ptr + dst * HK + e, tl.load(k_ptr + i * HK + e, mask=m).to(ck_ptr.dtype.element_ty), mask=m)
        tl.store(cg_ptr + dst * HK + e, tl.load(g_ptr + i * HK + e, mask=m).to(cg_ptr.dtype.element_ty), mask=m)
    for b in tl.static_range(0, HV, BLOCK):
        e = b + tl.arange(0, BLOCK)
        m = e < HV
        tl.store(cv_ptr + dst * HV + e, tl.load(v_ptr + i * v_stride + e, mask=m).to(cv_ptr.dtype.element_ty), mask=m)
    hb = tl.arange(0, BLOCK)
    mb = hb < H
    tl.store(cbeta_ptr + dst * H + hb, tl.load(beta_ptr + i * H + hb, mask=mb).to(cbeta_ptr.dtype.element_ty), mask=mb)
    return slot, r, dst


def recurrent_decode_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                          positions: torch.Tensor, slots: torch.Tensor, cache: KDADecodeCache,
                          scale: float | None) -> torch.Tensor:
    """``kda_decode_step`` in the recurrent form: one token per sequence from ``cache.run_state`` (the state
    after the chunk's earlier rows, kept by the previous step or ``recurrent_decode_prime``). Two launches,
    no host reads: CUDA-graph capturable."""
    n, h, dk = q.shape
    dv = v.shape[-1]
    dev = q.device
    scale = dk**-0.5 if scale is None else float(scale)
    o = torch.empty(n, h, dv, dtype=v.dtype, device=dev)
    if n == 0:
        return o
    if v.dtype != cache.v.dtype:
        raise ValueError(f"kda_decode_step: v is {v.dtype}, the cache holds {cache.v.dtype}")
    q, k, g, beta = (_aligned(x) for x in (q, k, g, beta))
    v = rows_in_place(v)
    info = torch.empty(n, INFO_COLS, dtype=torch.int32, device=dev)
    _decode_rows_kernel[(n,)](positions, slots, cache.solved, k, v, g, beta, cache.k, cache.v, cache.g, cache.beta,
                              info, v.stride(0), HK=h * dk, HV=h * dv, H=h, BLOCK=max(next_pow2(h), 1024), C=CHUNK_SIZE,
                              num_warps=4, **pdl())
    _launch(q, *cache.flat_rows(), o, cache.run_state, cache.run_state, cache.state, cache.state, info, scale, h, dk, dv)
    return o


def recurrent_decode_prime(slots: torch.Tensor, num_rows: torch.Tensor, cache: KDADecodeCache,
                           scale: float | None) -> None:
    """``kda_decode_prime`` in the recurrent form: run_state[slot] = the state after the slot's first
    ``num_rows`` cached rows, from its chunk-start state (no outputs; the chunk-start state is left as it is)."""
    m = slots.numel()
    # 0..63 rows (kda_decode_prime's contract); clamped on the device (a host check would sync)
    rows_n = num_rows.to(torch.int32).clamp(0, CHUNK_SIZE - 1)
    cache.solved[slots] = rows_n
    if m == 0:
        return
    h, dk, dv = cache.state.shape[1:]
    scale = dk**-0.5 if scale is None else float(scale)
    s = slots.to(torch.int32)
    none = torch.full_like(s, -1)
    zero = torch.zeros_like(s)
    # out0 = rows: no row has an output; fin_row -1: the chunk-start state stays.
    info = run_table(tok0=s * CHUNK_SIZE, nrows=rows_n, qtok0=zero, out0=rows_n, in_row=s, run_row=s, pos0=zero,
                     cs_row0=none, fin_row=none)
    k, v, g, beta = cache.flat_rows()
    # q / o are never touched: stand-ins of the decode step's dtypes (k, v) keep the binary the same.
    _launch(k, k, v, g, beta, v, cache.state, cache.run_state, cache.state, cache.state, info, scale, h, dk, dv)
