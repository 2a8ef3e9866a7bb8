"""``kda_chunk_step`` (the fixed-shape KDA decode step), torch backend: bitwise equal to ``kda_chunk`` run
per sequence on its partial chunk, close to the float64 references, batch-invariant.

The decode engine keeps each sequence's current chunk in fixed [64]-row buffers and re-runs it from
the boundary state every step; this op must give exactly the bits ``kda_chunk`` gives for the
``num_rows``-row segment (cu_seqlens = [0, r]), which in turn are the bits of the one-shot prefill
(tests/kernels/test_kda.py). The Triton backend is tested in tests/kernels/triton/test_kda_chunk_step.py.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from zmrl.kernels_batch_invariant import kernel_mode
from zmrl.kernels_batch_invariant.kda import CHUNK_SIZE, kda_chunk, kda_chunk_ref, kda_chunk_step, kda_recurrent_ref

from .invariance import THREAD_COUNTS, num_threads

C = CHUNK_SIZE


# ----------------------------------------------------------------------------- inputs


def make_step_inputs(rows: list[int], h: int, dk: int, dv: int, *, seed: int = 0, device: torch.device | str = "cpu",
                     v_dtype: torch.dtype = torch.float32, decode_q: bool = False, pad: str = "zero"):
    """Inputs of ``kda_chunk_step`` with model-like statistics (q, k L2-normalised, FLA's gate init).

    rows: real rows of each sequence's chunk. ``decode_q``: q = 0 on the pending rows (all but the
    last real row), as the engine re-feeds them. ``pad``: what rows >= num_rows hold: "zero" (the
    caller's contract) or "garbage" (large values and NaN, to show they are ignored).
    Returns (q, k, v, g, beta, num_rows, state) on ``device``."""
    gen = torch.Generator().manual_seed(seed)
    n = len(rows)
    shape = (n, C, h)
    q = F.normalize(torch.randn(*shape, dk, generator=gen), dim=-1)
    k = F.normalize(torch.randn(*shape, dk, generator=gen), dim=-1)
    v = torch.randn(*shape, dv, generator=gen)
    a_log = torch.log(torch.empty(h).uniform_(1.0, 16.0, generator=gen))
    dt = torch.exp(torch.empty(h, dk).uniform_(math.log(1e-3), math.log(0.1), generator=gen))
    dt_bias = dt + torch.log(-torch.expm1(-dt))
    g = -torch.exp(a_log)[:, None] * F.softplus(torch.randn(*shape, dk, generator=gen) + dt_bias)  # ~ -0.05
    beta = torch.sigmoid(torch.randn(*shape, generator=gen))
    state = 0.5 * torch.randn(n, h, dk, dv, generator=gen)
    num_rows = torch.tensor(rows, dtype=torch.int64)
    live = torch.arange(C)[None, :] < num_rows[:, None]  # [N, 64]
    if decode_q:
        q = q * (torch.arange(C)[None, :] == num_rows[:, None] - 1)[:, :, None, None]
    fill = 0.0 if pad == "zero" else float("nan")
    out = []
    for x in (q, k, v, g, beta):
        m = live.view(n, C, *([1] * (x.dim() - 2)))
        bad = torch.full_like(x, fill)
        if pad == "garbage":
            bad[:, ::2] = 1e30  # half NaN, half huge
        out.append(torch.where(m, x, bad))
    q, k, v, g, beta = out
    v = v.to(v_dtype)
    dev = torch.device(device)
    return (*(x.to(dev) for x in (q, k, v, g, beta)), num_rows.to(dev), state.to(dev))


def segment(x: torch.Tensor, i: int, r: int) -> torch.Tensor:
    """Sequence i's r real rows as a packed [r, H, ...] segment."""
    return x[i, :r]


def per_sequence_kda_chunk(q, k, v, g, beta, num_rows, state, scale=None, impl=None):
    """``kda_chunk`` on each sequence's segment alone (cu_seqlens = [0, r]); returns lists of (o, final)."""
    impl = impl or kda_chunk.impls["torch"]
    res = []
    for i, r in enumerate(num_rows.tolist()):
        seg = [segment(x, i, r) for x in (q, k, v, g, beta)]
        cu = torch.tensor([0, r], dtype=torch.int64)
        o, st, _ = impl(*seg, cu, initial_state=state[i:i + 1], scale=scale)
        res.append((o, st[0]))
    return res


def assert_matches_kda_chunk(out, ref, num_rows, state):
    o, nxt = out
    for i, r in enumerate(num_rows.tolist()):
        o_ref, st_ref = ref[i]
        assert torch.equal(o[i, :r], o_ref), f"sequence {i} ({r} rows): rows differ from kda_chunk"
        assert torch.equal(nxt[i], st_ref), f"sequence {i} ({r} rows): next_state differs from kda_chunk"
        if r < C:
            assert torch.equal(nxt[i], state[i].float()), f"sequence {i}: a partial chunk changed the state"
            assert torch.equal(o[i, r:], torch.zeros_like(o[i, r:])), f"sequence {i}: pad rows are not zero"


def step(*args, **kwargs):
    with torch.no_grad():
        return kda_chunk_step(*args, **kwargs)


# ----------------------------------------------------------------------------- bitwise vs kda_chunk

# (rows per sequence, H, dk, dv): the edges 1, 63, 64 mixed in one batch, dk != dv, odd dv.
CASES = [
    ([1, 63, 64, 17, 64], 2, 16, 8),
    ([64, 1, 2, 33, 63, 8, 9, 16], 1, 32, 32),
    ([5], 3, 16, 12),
    ([64], 2, 8, 16),
]


@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("decode_q", [False, True])
def test_equals_kda_chunk_per_sequence(case, decode_q):
    rows, h, dk, dv = CASES[case]
    inp = make_step_inputs(rows, h, dk, dv, seed=case, decode_q=decode_q)
    out = step(*inp)
    q, k, v, g, beta, num_rows, state = inp
    assert out[0].shape == v.shape and out[0].dtype == v.dtype
    assert out[1].shape == state.shape and out[1].dtype == torch.float32
    assert_matches_kda_chunk(out, per_sequence_kda_chunk(*inp), num_rows, state)


def test_random_row_counts_and_options():
    """Random counts in 1..64, bf16 v (the model's), int32 counts, a non-default scale."""
    gen = torch.Generator().manual_seed(7)
    rows = [1, 63, 64] + torch.randint(1, C + 1, (5,), generator=gen).tolist()
    inp = make_step_inputs(rows, 2, 16, 16, seed=3, v_dtype=torch.bfloat16)
    q, k, v, g, beta, num_rows, state = inp
    out = step(q, k, v, g, beta, num_rows.to(torch.int32), state, scale=0.3)
    assert out[0].dtype == torch.bfloat16
    assert_matches_kda_chunk(out, per_sequence_kda_chunk(*inp, scale=0.3), num_rows, state)


def test_pad_rows_are_ignored():
    """Rows >= num_rows may hold anything (NaN, 1e30): the results are those of zero padding."""
    rows = [1, 40, 64, 63]
    clean = make_step_inputs(rows, 2, 16, 8, seed=5)
    dirty = make_step_inputs(rows, 2, 16, 8, seed=5, pad="garbage")
    assert torch.isnan(dirty[0]).any()
    a, b = step(*clean), step(*dirty)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert torch.isfinite(b[0]).all() and torch.isfinite(b[1]).all()


def test_decode_rerun_equals_prefill():
    """End to end: a sequence prefilled at once, against decode steps re-running its last chunk from
    the boundary state with the pending rows' q = 0; every fill level, bitwise."""
    from .test_kda import make_inputs

    n_full, h, dk, dv = 130, 2, 16, 8
    q, k, v, g, beta, _, s0 = make_inputs([n_full], h, dk, dv, seed=21)
    o_full, _, cs = kda_chunk(q, k, v, g, beta, torch.tensor([0, n_full]), initial_state=s0,
                              output_chunk_states=True)
    b0 = C  # the second chunk: rows 64..127 (complete), its boundary state cs[0]
    fills = [1, 2, 17, 33, 63, 64]
    n = len(fills)

    def slot(x: torch.Tensor, r: int, zero_q: bool = False) -> torch.Tensor:
        buf = x.new_zeros(C, *x.shape[1:])
        buf[:r] = x[b0:b0 + r]
        if zero_q:
            buf[: r - 1] = 0
        return buf

    qs = torch.stack([slot(q, r, zero_q=True) for r in fills])
    ks, vs, gs, bs = (torch.stack([slot(x, r) for r in fills]) for x in (k, v, g, beta))
    o, nxt = step(qs, ks, vs, gs, bs, torch.tensor(fills), cs[0:1].expand(n, -1, -1, -1).contiguous())
    for i, r in enumerate(fills):
        assert torch.equal(o[i, r - 1], o_full[b0 + r - 1]), f"decode row at fill {r}"
    assert torch.equal(nxt[-1], cs[1]), "state after completing the chunk"


# ----------------------------------------------------------------------------- float64 references


def test_float64_path_matches_kda_chunk_ref():
    """fp64 inputs run the same composition in fp64: against the dense-solve chunk reference the only
    difference is fp64 rounding in another association order (~1e-15 relative), 1e-12 leaves margin."""
    rows = [1, 63, 64, 20]
    q, k, v, g, beta, num_rows, state = (x.double() if x.is_floating_point() else x
                                         for x in make_step_inputs(rows, 2, 16, 8, seed=9))
    o, nxt = step(q, k, v, g, beta, num_rows, state)
    assert o.dtype == torch.float64 and nxt.dtype == torch.float64
    for i, r in enumerate(rows):
        o_ref, st_ref = kda_chunk_ref(*(segment(x, i, r) for x in (q, k, v, g, beta)), None, state[i])
        torch.testing.assert_close(o[i, :r], o_ref, rtol=0, atol=1e-12)
        torch.testing.assert_close(nxt[i], st_ref, rtol=0, atol=1e-12)


def test_fp32_close_to_recurrent_reference():
    """fp32 against the float64 token recurrence (the ground truth): the step sees the same rounded
    inputs, so its error is fp32 rounding in the chunked order (64-row triangular solve, fp32 bmm):
    ~1e-7..1e-6 relative to max|o| measured; 2e-5 leaves margin for the conditioning of (I + A_kk).
    A real bug (a mask off by a row, a missing decay or beta, the state not carried) is O(|o|)."""
    rows = [1, 63, 64, 37]
    q, k, v, g, beta, num_rows, state = make_step_inputs(rows, 2, 16, 16, seed=11)
    o, nxt = step(q, k, v, g, beta, num_rows, state)
    for i, r in enumerate(rows):
        seg = [segment(x, i, r).double() for x in (q, k, v, g, beta)]
        o_ref, st_run = kda_recurrent_ref(*seg, None, state[i].double())
        st_ref = st_run if r == C else state[i].double()
        tol = 2e-5 * o_ref.abs().max().item()
        assert (o[i, :r].double() - o_ref).abs().max().item() <= tol, f"sequence {i}: o far from reference"
        st_tol = 2e-5 * st_ref.abs().max().item()
        assert (nxt[i].double() - st_ref).abs().max().item() <= st_tol, f"sequence {i}: state far from reference"


# ----------------------------------------------------------------------------- batch invariance


def test_batch_invariance():
    """A sequence's rows and next state are the same bits alone (N = 1) and inside batches of 5 in
    different orders (and with duplicates)."""
    rows = [1, 64, 63, 30, 9]
    q, k, v, g, beta, num_rows, state = make_step_inputs(rows, 2, 16, 8, seed=13)
    alone = [step(*(x[i:i + 1] for x in (q, k, v, g, beta, num_rows, state))) for i in range(len(rows))]
    for order in ([0, 1, 2, 3, 4], [4, 2, 0, 3, 1], [2, 2, 0, 4, 4]):
        idx = torch.tensor(order)
        o, nxt = step(*(x[idx] for x in (q, k, v, g, beta, num_rows, state)))
        for j, i in enumerate(order):
            assert torch.equal(o[j], alone[i][0][0]), f"rows of sequence {i} at position {j} of {order}"
            assert torch.equal(nxt[j], alone[i][1][0]), f"state of sequence {i} at position {j} of {order}"


def test_thread_count():
    rows = [1, 64, 63, 30, 9]
    inputs = make_step_inputs(rows, 2, 16, 8, seed=14)
    with num_threads(1):
        ref = step(*inputs)
    for threads in THREAD_COUNTS[1:]:
        with num_threads(threads):
            o, nxt = step(*inputs)
        assert torch.equal(o, ref[0]) and torch.equal(nxt, ref[1]), threads


# ----------------------------------------------------------------------------- API


def test_errors():
    q, k, v, g, beta, num_rows, state = make_step_inputs([3, 64], 1, 8, 8, seed=1)
    with pytest.raises(ValueError, match="num_rows must be in"):
        step(q, k, v, g, beta, torch.tensor([0, 64]), state)
    with pytest.raises(ValueError, match="num_rows must be in"):
        step(q, k, v, g, beta, torch.tensor([3, 65]), state)
    with pytest.raises(ValueError, match="integer"):
        step(q, k, v, g, beta, num_rows.float(), state)
    with pytest.raises(ValueError, match="q must be"):
        step(q[:, :32], k[:, :32], v[:, :32], g[:, :32], beta[:, :32], num_rows, state)
    with pytest.raises(ValueError, match="state"):
        step(q, k, v, g, beta, num_rows, state[:1])
    with pytest.raises(RuntimeError, match="no_grad"):
        kda_chunk_step(q.requires_grad_(True), k, v, g, beta, num_rows, state)


def test_empty_batch():
    q, k, v, g, beta, num_rows, state = make_step_inputs([3], 1, 8, 8)
    o, nxt = step(q[:0], k[:0], v[:0], g[:0], beta[:0], num_rows[:0], state[:0])
    assert o.shape == (0, C, 1, 8) and nxt.shape == (0, 1, 8, 8)


def test_fast_mode_is_the_bitwise_path_on_cpu():
    inp = make_step_inputs([1, 64, 40], 1, 16, 8, seed=17)
    assert "fast" in kda_chunk_step.impls
    with kernel_mode("fast"):
        assert kda_chunk_step.backend_for(torch.device("cpu")) == "fast"
        a = step(*inp)
    b = step(*inp)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
