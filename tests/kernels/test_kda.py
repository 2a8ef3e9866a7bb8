"""KDA chunked forward: accuracy against float64 references and the bitwise contract (DESIGN §2).

The invariance tests are the point: a token's KDA output must be bitwise the same whether its chunk
is complete (trainer), partial with zero padding (decode), prefilled in pieces (chunked prefill), or
packed with any other sequences.
"""
from __future__ import annotations

import importlib.util
import math
import pathlib
import random

import pytest
import torch

from zmrl.kernels_batch_invariant.kda import CHUNK_SIZE, kda_chunk, kda_chunk_ref, kda_recurrent_ref
from zmrl.kernels_batch_invariant.kda_gate import kda_gate
from zmrl.kernels_batch_invariant.l2norm import l2_norm, l2_norm_ref

from .invariance import THREAD_COUNTS

C = CHUNK_SIZE


# ----------------------------------------------------------------------------- inputs

def make_gate_params(h: int, dk: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A_log = log U(1, 16); dt_bias = inv_softplus(dt), dt log-uniform in [1e-3, 0.1] (FLA init)."""
    a_log = torch.log(torch.empty(h).uniform_(1.0, 16.0, generator=gen))
    dt = torch.exp(torch.empty(h * dk).uniform_(math.log(1e-3), math.log(0.1), generator=gen))
    dt_bias = dt + torch.log(-torch.expm1(-dt))
    return a_log, dt_bias


def make_inputs(
    lens: list[int],
    h: int,
    dk: int,
    dv: int,
    dtype: torch.dtype = torch.float32,
    gate: str = "realistic",
    seed: int = 0,
    with_state: bool = True,
):
    """Packed varlen KDA inputs with model-like statistics. Returns (q, k, v, g, beta, cu, s0)."""
    gen = torch.Generator().manual_seed(seed)
    t = sum(lens)
    q = l2_norm(torch.randn(t, h, dk, generator=gen)).to(dtype)
    k = l2_norm(torch.randn(t, h, dk, generator=gen)).to(dtype)
    v = torch.randn(t, h, dv, generator=gen).to(dtype)
    a_log, dt_bias = make_gate_params(h, dk, gen)
    z = torch.randn(t, h * dk, generator=gen)
    if gate == "realistic":  # g ~ -0.05 per token, chunk cumsum a few units
        g = kda_gate(z, a_log, dt_bias, h)
    elif gate == "strong":  # g ~ -50 per token: cumsum reaches -3000 inside a chunk
        g = kda_gate(z + 4.0, torch.full((h,), math.log(16.0)), torch.zeros(h * dk), h)
    elif gate == "lower_bound":  # K3 safe gate, g in (-5, 0)
        g = kda_gate(z, torch.zeros(h), dt_bias, h, lower_bound=-5.0)
    else:
        raise ValueError(gate)
    beta = torch.sigmoid(torch.randn(t, h, generator=gen))
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int64)
    s0 = 0.5 * torch.randn(len(lens), h, dk, dv, generator=gen) if with_state else None
    return q, k, v, g, beta, cu, s0


def reference(q, k, v, g, beta, cu, s0, scale=None):
    """float64 recurrent reference per sequence; the final state is the one after the last complete
    chunk (kda_chunk's contract), i.e. the recurrence run on the first 64*(L//64) tokens."""
    outs, states = [], []
    for s in range(cu.numel() - 1):
        a, b = int(cu[s]), int(cu[s + 1])
        init = None if s0 is None else s0[s]
        o, _ = kda_recurrent_ref(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], scale, init)
        m = a + (b - a) // C * C
        _, st = kda_recurrent_ref(q[a:m], k[a:m], v[a:m], g[a:m], beta[a:m], scale, init)
        outs.append(o)
        states.append(st)
    return torch.cat(outs), torch.stack(states)


def sub_batch(x: torch.Tensor, cu: torch.Tensor, s: int) -> torch.Tensor:
    return x[int(cu[s]) : int(cu[s + 1])]


# ----------------------------------------------------------------------------- accuracy

SHAPES = [  # (lens, H, dk, dv)
    *[([t], 1, 16, 16) for t in (1, 5, 63, 64, 65, 130, 200)],
    ([130], 4, 64, 64),
    ([200], 4, 16, 32),  # dk != dv
    ([65], 1, 32, 16),
    ([5, 130, 64, 1, 200, 63], 4, 16, 16),  # packed varlen
    ([64, 37, 129], 4, 64, 64),
]


@pytest.mark.parametrize("lens,h,dk,dv", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_recurrent_reference(lens, h, dk, dv, dtype):
    q, k, v, g, beta, cu, s0 = make_inputs(lens, h, dk, dv, dtype, seed=len(lens) * 1000 + sum(lens) + dk)
    o, st, _ = kda_chunk(q, k, v, g, beta, cu, initial_state=s0)
    assert o.dtype == dtype and o.shape == v.shape
    assert st.dtype == torch.float32 and st.shape == (len(lens), h, dk, dv)
    o_ref, st_ref = reference(q, k, v, g, beta, cu, s0)
    # The reference sees the same (bf16-rounded) inputs in fp64, so the only differences are fp32
    # rounding in a different association order (chunked WY form with a 64-row triangular solve
    # vs the token recurrence): ~1e-7 relative measured; 2e-5 leaves margin for unlucky
    # conditioning of (I + A_kk). bf16 outputs add one rounding of o to 8 bits (<= 2^-8 relative).
    # A real bug (wrong mask, decay off by one row, beta misplaced, state not carried) gives
    # errors of the order of |o| itself (~0.1-1).
    o_scale = o_ref.abs().max().item()
    o_tol = 2e-5 * o_scale + (2**-8 * o_ref.abs() if dtype == torch.bfloat16 else 0.0)
    assert ((o.double() - o_ref).abs() <= o_tol).all(), (o.double() - o_ref).abs().max()
    torch.testing.assert_close(st.double(), st_ref, rtol=0, atol=2e-5 * st_ref.abs().max().item())


@pytest.mark.parametrize("gate", ["strong", "lower_bound"])
def test_gate_regimes(gate):
    """Strong decay drives the in-chunk cumsum to about -3000: a factored exp(gc_i)*exp(-gc_j)
    would give inf*0 = nan; masked differences must stay finite and exact."""
    lens = [130, 70]
    q, k, v, g, beta, cu, s0 = make_inputs(lens, 2, 16, 16, gate=gate, seed=7)
    if gate == "strong":
        gc_min = min(g[a : a + C].sum(0).min().item() for a in (0, 64))
        assert gc_min < -1000, gc_min  # the regime is really reached
    o, st, _ = kda_chunk(q, k, v, g, beta, cu, initial_state=s0)
    assert torch.isfinite(o).all() and torch.isfinite(st).all()
    o_ref, st_ref = reference(q, k, v, g, beta, cu, s0)
    # Same justification as test_matches_recurrent_reference.
    torch.testing.assert_close(o.double(), o_ref, rtol=0, atol=2e-5 * o_ref.abs().max().item())
    torch.testing.assert_close(st.double(), st_ref, rtol=0, atol=2e-5 * st_ref.abs().max().item())


def test_float64_is_the_exact_math():
    """In fp64 the chunked form must agree with the recurrence to ~1e-15: this isolates the algebra
    (masks, decays, solve, state update) from fp32 rounding. Also checks the fp64 chunk reference."""
    lens = [130, 1, 64, 77]
    q, k, v, g, beta, cu, s0 = make_inputs(lens, 2, 16, 24, torch.float64, seed=3)
    s0 = s0.double()
    o, st, _ = kda_chunk(q, k, v, g, beta, cu, initial_state=s0, scale=0.3)
    assert o.dtype == torch.float64 and st.dtype == torch.float64
    o_ref, st_ref = reference(q, k, v, g, beta, cu, s0, scale=0.3)
    # fp64 rounding only (eps 1e-16, ~100 ops deep); any algebra error is >= 1e-3.
    torch.testing.assert_close(o, o_ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(st, st_ref, rtol=0, atol=1e-12)
    for s in range(len(lens)):
        sl = slice(int(cu[s]), int(cu[s + 1]))
        oc, sc = kda_chunk_ref(q[sl], k[sl], v[sl], g[sl], beta[sl], 0.3, s0[s])
        torch.testing.assert_close(oc, o_ref[sl], rtol=0, atol=1e-12)
        torch.testing.assert_close(sc, st_ref[s], rtol=0, atol=1e-12)


def test_empty_and_zero_length_sequences():
    q, k, v, g, beta, cu, s0 = make_inputs([0, 70, 0], 2, 8, 8, seed=5)
    o, st, cs = kda_chunk(q, k, v, g, beta, cu, initial_state=s0, output_chunk_states=True)
    assert torch.equal(st[0], s0[0]) and torch.equal(st[2], s0[2])
    assert cs.shape == (1, 2, 8, 8)
    o0, st0, cs0 = kda_chunk(q[:0], k[:0], v[:0], g[:0], beta[:0], torch.tensor([0, 0]),
                             initial_state=s0[:1], output_chunk_states=True)
    assert o0.shape == (0, 2, 8) and torch.equal(st0, s0[:1]) and cs0.shape == (0, 2, 8, 8)


# ----------------------------------------------------------------------------- fla cross-check

def _load_fla_naive():
    """fla-core's pure-torch KDA reference. ``import fla`` pulls in triton (absent on CPU), so the
    one self-contained file fla/ops/kda/naive.py is loaded directly (it needs only torch+einops)."""
    pytest.importorskip("einops")
    spec = importlib.util.find_spec("fla")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("fla-core not installed")
    path = pathlib.Path(spec.submodule_search_locations[0]) / "ops" / "kda" / "naive.py"
    if not path.exists():
        pytest.skip("fla-core has no ops/kda/naive.py")
    mod_spec = importlib.util.spec_from_file_location("_fla_kda_naive", path)
    mod = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(mod)
    if not hasattr(mod, "naive_recurrent_kda"):
        pytest.skip("fla-core naive.py has no naive_recurrent_kda")
    return mod


@pytest.mark.parametrize("t", [63, 130])
def test_matches_fla_naive_recurrent(t):
    fla_naive = _load_fla_naive()
    q, k, v, g, beta, cu, s0 = make_inputs([t], 4, 32, 32, seed=11)
    o, _, _ = kda_chunk(q, k, v, g, beta, cu, initial_state=s0)
    # fla: [B, T, H, K] layout, fp32 recurrence, final state after ALL tokens.
    o_fla, s_fla = fla_naive.naive_recurrent_kda(
        q[None], k[None], v[None], g[None], beta[None], initial_state=s0.clone(), output_final_state=True
    )
    # fp32 chunked vs fp32 recurrent: both ~1e-7 relative from the exact value (see above).
    torch.testing.assert_close(o, o_fla[0], rtol=0, atol=2e-5 * o_fla.abs().max().item())
    # Our final state stops at the last complete chunk; compare with fla on that prefix.
    m = t // C * C
    if m:
        _, st, _ = kda_chunk(q[:m], k[:m], v[:m], g[:m], beta[:m], torch.tensor([0, m]), initial_state=s0)
        _, s_fla = fla_naive.naive_recurrent_kda(
            q[None, :m], k[None, :m], v[None, :m], g[None, :m], beta[None, :m],
            initial_state=s0.clone(), output_final_state=True,
        )
        torch.testing.assert_close(st, s_fla, rtol=0, atol=2e-5 * s_fla.abs().max().item())


# ----------------------------------------------------------------------------- invariance

def test_invariant_to_packing_and_threads():
    """(a) a sequence alone vs packed at any position with others: torch.equal on o, final state
    and chunk states. The mix covers partial-only batches (row loop stops early) and batches with
    complete chunks (all 64 rows), and both thread counts."""
    lens = [130, 5, 64, 200, 1, 63, 65]
    h, dk, dv = 2, 16, 32
    q, k, v, g, beta, cu, s0 = make_inputs(lens, h, dk, dv, seed=21)
    o_all, st_all, cs_all = kda_chunk(q, k, v, g, beta, cu, initial_state=s0, output_chunk_states=True)
    n_complete = [n // C for n in lens]
    cstart = [0, *torch.tensor(n_complete).cumsum(0).tolist()]
    rng = random.Random(0)
    prev_threads = torch.get_num_threads()
    try:
        for threads in THREAD_COUNTS:
            torch.set_num_threads(threads)
            for s in range(len(lens)):
                # alone
                args = [sub_batch(x, cu, s) for x in (q, k, v, g, beta)]
                o1, st1, cs1 = kda_chunk(*args, torch.tensor([0, lens[s]]), initial_state=s0[s : s + 1],
                                         output_chunk_states=True)
                assert torch.equal(o1, sub_batch(o_all, cu, s))
                assert torch.equal(st1[0], st_all[s])
                assert torch.equal(cs1, cs_all[cstart[s] : cstart[s + 1]])
                # at a random position among a random subset of the others
                others = rng.sample([i for i in range(len(lens)) if i != s], k=rng.randint(1, len(lens) - 1))
                order = others[:]
                order.insert(rng.randint(0, len(order)), s)
                sel = lambda x: torch.cat([sub_batch(x, cu, i) for i in order])  # noqa: E731
                cu2 = torch.tensor([0, *torch.tensor([lens[i] for i in order]).cumsum(0).tolist()])
                o2, st2, _ = kda_chunk(*(sel(x) for x in (q, k, v, g, beta)), cu2,
                                       initial_state=s0[order])
                pos = order.index(s)
                assert torch.equal(sub_batch(o2, cu2, pos), sub_batch(o_all, cu, s))
                assert torch.equal(st2[pos], st_all[s])
    finally:
        torch.set_num_threads(prev_threads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_partial_chunk_rule(dtype):
    """(b) Decode: row r computed from the prefix [64c, r] (zero-padded partial chunk, initial state
    = the state at boundary 64c from an earlier call) is bitwise the full-length run's row r.
    Checked alone and inside a decode batch with other requests at other rows."""
    t = 130
    q, k, v, g, beta, cu, s0 = make_inputs([t, 100, 3], 4, 32, 32, dtype, seed=31)
    o_full, _, cs = kda_chunk(q, k, v, g, beta, cu, initial_state=s0, output_chunk_states=True)
    boundary_state = [s0[0], cs[0], cs[1]]  # sequence 0's state at 0, 64, 128
    for r in (0, 1, 37, 63, 64, 65, 100, 127, 128, 129):
        c = r // C
        a = c * C
        init = boundary_state[c][None]
        pre = [x[a : r + 1] for x in (q, k, v, g, beta)]
        o_r, st_r, _ = kda_chunk(*pre, torch.tensor([0, r + 1 - a]), initial_state=init)
        assert torch.equal(o_r, o_full[a : r + 1]), r
        # the state never advances through a partial chunk; a just-completed chunk gives the boundary
        expect = init[0] if r + 1 - a < C else cs[c]
        assert torch.equal(st_r[0], expect), r
        # the same request inside a decode batch: sequence 1 (100 tokens) at its own row 70,
        # a fresh 3-token request, and a complete chunk of sequence 1 (forces all 64 rows).
        b1 = int(cu[1])
        pieces = [(a, r + 1), (b1 + 64, b1 + 71), (int(cu[2]), int(cu[2]) + 3), (b1, b1 + 64)]
        cat = lambda x: torch.cat([x[i:j] for i, j in pieces])  # noqa: E731
        cu_b = torch.tensor([0, *torch.tensor([j - i for i, j in pieces]).cumsum(0).tolist()])
        init_b = torch.stack([init[0], cs[2], s0[2], s0[1]])
        o_b, _, _ = kda_chunk(*(cat(x) for x in (q, k, v, g, beta)), cu_b, initial_state=init_b)
        assert torch.equal(o_b[: r + 1 - a], o_full[a : r + 1]), r


def test_chunked_prefill_emulation():
    """(c) Continuous batching: several sequences fed in random pieces; every call re-runs each
    request's current partial chunk from its boundary state (as the engine does) together with
    whatever other requests are scheduled. Concatenated new rows and the final states must be
    bitwise the one-shot run."""
    lens = [200, 130, 77]
    h, dk, dv = 2, 16, 16
    q, k, v, g, beta, cu, s0 = make_inputs(lens, h, dk, dv, seed=41)
    o_ref, st_ref, _ = kda_chunk(q, k, v, g, beta, cu, initial_state=s0)
    rng = random.Random(1)
    boundary = [0] * len(lens)  # local position of each request's current chunk start
    done = [0] * len(lens)  # tokens whose output is already emitted
    state = [s0[s] for s in range(len(lens))]
    emitted: list[list[torch.Tensor]] = [[] for _ in lens]
    while any(d < n for d, n in zip(done, lens)):
        live = [s for s in range(len(lens)) if done[s] < lens[s]]
        sched = [s for s in live if rng.random() < 0.7] or live[:1]
        ends = {s: min(lens[s], done[s] + rng.choice([1, 1, 2, 5, 17, 64, 100])) for s in sched}
        seg = lambda x: torch.cat([x[int(cu[s]) + boundary[s] : int(cu[s]) + ends[s]] for s in sched])  # noqa: E731
        seg_lens = [ends[s] - boundary[s] for s in sched]
        cu_b = torch.tensor([0, *torch.tensor(seg_lens).cumsum(0).tolist()])
        o_b, st_b, _ = kda_chunk(*(seg(x) for x in (q, k, v, g, beta)), cu_b,
                                 initial_state=torch.stack([state[s] for s in sched]))
        for i, s in enumerate(sched):
            rows = o_b[int(cu_b[i]) : int(cu_b[i + 1])]
            emitted[s].append(rows[done[s] - boundary[s] :])
            state[s] = st_b[i]
            boundary[s] += seg_lens[i] // C * C
            done[s] = ends[s]
    for s in range(len(lens)):
        assert torch.equal(torch.cat(emitted[s]), sub_batch(o_ref, cu, s))
        assert torch.equal(state[s], st_ref[s])


def test_chunk_states_are_truncated_final_states():
    """(d) chunk_states[j] is bitwise the final state of a run truncated after that chunk."""
    lens = [130, 64, 5, 200]
    q, k, v, g, beta, cu, s0 = make_inputs(lens, 2, 16, 16, seed=51)
    _, st, cs = kda_chunk(q, k, v, g, beta, cu, initial_state=s0, output_chunk_states=True)
    assert cs.shape[0] == sum(n // C for n in lens)
    j = 0
    for s, n in enumerate(lens):
        for c in range(n // C):
            m = (c + 1) * C
            args = [sub_batch(x, cu, s)[:m] for x in (q, k, v, g, beta)]
            _, st_m, _ = kda_chunk(*args, torch.tensor([0, m]), initial_state=s0[s : s + 1])
            assert torch.equal(cs[j], st_m[0]), (s, c)
            j += 1
        if n >= C:
            assert torch.equal(st[s], cs[j - 1])


# ----------------------------------------------------------------------------- autograd

def test_gradcheck():
    q, k, v, g, beta, cu, s0 = make_inputs([70], 1, 8, 8, torch.float64, seed=61)
    inputs = [x.detach().double().requires_grad_() for x in (q, k, v, g, beta, s0)]

    def f(q, k, v, g, beta, s0):
        o, st, _ = kda_chunk(q, k, v, g, beta, cu, initial_state=s0)
        return o, st

    assert torch.autograd.gradcheck(f, inputs, fast_mode=True)


@pytest.mark.parametrize("checkpoint", [True, False])
def test_backward_fp32(checkpoint, monkeypatch):
    """Backward runs in fp32 with and without recomputation of the intra-chunk part, and the
    recomputation changes nothing: same forward bits, same gradients."""
    import zmrl.kernels_batch_invariant.kda.chunk as chunk_mod

    q, k, v, g, beta, cu, s0 = make_inputs([100, 30], 2, 16, 16, seed=62)
    o_ref, st_ref, _ = kda_chunk(q, k, v, g, beta, cu, initial_state=s0)  # no grad: plain path
    monkeypatch.setattr(chunk_mod, "CHECKPOINT_INTRA", checkpoint)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, g, beta, s0)]
    o, st, _ = kda_chunk(*leaves[:5], cu, initial_state=leaves[5])
    assert torch.equal(o, o_ref) and torch.equal(st, st_ref)
    (o.square().sum() + st.square().sum()).backward()
    grads = [x.grad for x in leaves]
    assert all(gr is not None and torch.isfinite(gr).all() for gr in grads)
    monkeypatch.setattr(chunk_mod, "CHECKPOINT_INTRA", not checkpoint)
    leaves2 = [x.detach().clone().requires_grad_() for x in leaves]
    o2, st2, _ = kda_chunk(*leaves2[:5], cu, initial_state=leaves2[5])
    (o2.square().sum() + st2.square().sum()).backward()
    for a, b in zip(grads, (x.grad for x in leaves2)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


# ----------------------------------------------------------------------------- l2 norm

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_l2_norm(dtype):
    x = (torch.randn(37, 4, 64) * 3).to(dtype)
    y = l2_norm(x)
    assert y.dtype == dtype
    # fp32: 64-term tree sum + sqrt + divide, a few ulp (1e-7); bf16 adds the output rounding 2^-8.
    tol = 1e-6 if dtype == torch.float32 else 2**-8
    torch.testing.assert_close(y.double(), l2_norm_ref(x), rtol=tol, atol=tol)
    assert l2_norm(x, out_dtype=torch.float32).dtype == torch.float32
    for i in (0, 5, 36):  # a row alone and at other positions / batch sizes
        assert torch.equal(l2_norm(x[i : i + 1]), y[i : i + 1])
        assert torch.equal(l2_norm(x[i:]), y[i:])
    assert torch.autograd.gradcheck(l2_norm, torch.randn(5, 8, dtype=torch.float64, requires_grad=True))
