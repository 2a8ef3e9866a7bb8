"""Triton ``kda_chunk_step`` (the fixed-shape KDA decode step): bitwise equal to the Triton ``kda_chunk``
per sequence, close to float64, batch-invariant, and (on CUDA) capturable in a CUDA graph without
host syncs.

Under TRITON_INTERPRET=1 (CPU) tiny shapes run; on CUDA also the bench dims (H = 16, dk = dv = 128).
"""
from __future__ import annotations

import pytest
import torch

from zmrl.kernels_batch_invariant import kernel_mode
from zmrl.kernels_batch_invariant.kda import CHUNK_SIZE, kda_chunk, kda_chunk_ref, kda_chunk_step, kda_recurrent_ref
from zmrl.kernels_batch_invariant.triton import triton_impl

from ..test_kda_chunk_step import assert_matches_kda_chunk, make_step_inputs, per_sequence_kda_chunk
from .test_kda_chunk import REL

pytestmark = [pytest.mark.gpu, pytest.mark.triton, pytest.mark.usefixtures("kda_form")]

C = CHUNK_SIZE


def step(*args, **kwargs):
    with torch.no_grad():
        return triton_impl(kda_chunk_step)(*args, **kwargs)


def chunk_ref(*inp, scale=None):
    """Triton ``kda_chunk`` on each sequence's segment alone (what the step must reproduce bitwise)."""
    with torch.no_grad():
        return per_sequence_kda_chunk(*inp, scale=scale, impl=triton_impl(kda_chunk))


def dims(interpret: bool) -> tuple[int, int, int]:
    """(H, dk, dv): tiny under the interpreter; the bench preset's KDA heads on CUDA."""
    return (1, 16, 16) if interpret else (16, 128, 128)


# ----------------------------------------------------------------------------- bitwise vs kda_chunk


@pytest.mark.parametrize("decode_q", [False, True])
def test_equals_kda_chunk_per_sequence(decode_q, device, interpret):
    h, dk, dv = dims(interpret)
    gen = torch.Generator().manual_seed(1)
    extra = [] if interpret else torch.randint(1, C + 1, (12,), generator=gen).tolist()
    rows = [1, 63, 64, 17] + extra
    inp = make_step_inputs(rows, h, dk, dv, seed=2, device=device, decode_q=decode_q)
    out = step(*inp)
    assert out[0].shape == inp[2].shape and out[0].dtype == inp[2].dtype
    assert out[1].shape == inp[6].shape and out[1].dtype == torch.float32
    assert_matches_kda_chunk(out, chunk_ref(*inp), inp[5], inp[6])


def test_options_and_odd_dims(device, interpret):
    """bf16 v (the model's dtype; fp32 under the interpreter, whose bf16 dots are wrong), int32 counts,
    a non-default scale, dk != dv with a non-power-of-two dv (masked columns)."""
    h, dk, dv = (2, 16, 24) if interpret else (4, 64, 48)
    v_dtype = torch.float32 if interpret else torch.bfloat16
    inp = make_step_inputs([64, 5, 1, 63], h, dk, dv, seed=3, device=device, v_dtype=v_dtype)
    q, k, v, g, beta, num_rows, state = inp
    out = step(q, k, v, g, beta, num_rows.to(torch.int32), state, scale=0.3)
    assert out[0].dtype == v_dtype
    assert_matches_kda_chunk(out, chunk_ref(*inp, scale=0.3), num_rows.cpu(), state)


def test_pad_rows_are_ignored(device, interpret):
    """Rows >= num_rows may hold anything (NaN, 1e30): masked loads, the results of zero padding."""
    h, dk, dv = dims(interpret)
    rows = [1, 40, 64]
    a = step(*make_step_inputs(rows, h, dk, dv, seed=5, device=device))
    b = step(*make_step_inputs(rows, h, dk, dv, seed=5, device=device, pad="garbage"))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


# ----------------------------------------------------------------------------- float64 references


def test_close_to_float64_references(device, interpret):
    """Against the float64 token recurrence and the dense-solve chunk reference. Tolerance REL from
    test_kda_chunk.py: fp32-level dots (tf32x3 / ieee / the interpreter) give ~1e-7..1e-6 relative to
    max|o|; 2e-5 leaves margin (1e-2 with the opt-in single-pass TF32)."""
    h, dk, dv = (1, 16, 16) if interpret else (4, 64, 64)
    rows = [1, 63, 64, 29]
    q, k, v, g, beta, num_rows, state = make_step_inputs(rows, h, dk, dv, seed=11, device=device)
    o, nxt = step(q, k, v, g, beta, num_rows, state)
    for i, r in enumerate(rows):
        seg = [x[i, :r].double().cpu() for x in (q, k, v, g, beta)]
        s0 = state[i].double().cpu()
        o_rec, st_rec = kda_recurrent_ref(*seg, None, s0)
        o_chk, st_chk = kda_chunk_ref(*seg, None, s0)
        st_ref = st_rec if r == C else s0
        torch.testing.assert_close(st_chk, st_ref, rtol=0, atol=1e-10)  # the two references agree
        for o_ref in (o_rec, o_chk):
            err = (o[i, :r].double().cpu() - o_ref).abs().max().item()
            assert err <= REL * o_ref.abs().max().item(), f"sequence {i}: max |o - ref| = {err:.3e}"
        st_err = (nxt[i].double().cpu() - st_ref).abs().max().item()
        assert st_err <= REL * st_ref.abs().max().item(), f"sequence {i}: max |state - ref| = {st_err:.3e}"


# ----------------------------------------------------------------------------- batch invariance


def test_batch_invariance(device, interpret):
    """A sequence alone (N = 1) and inside batches of 5 in other orders: the same bits."""
    h, dk, dv = dims(interpret)
    rows = [1, 64, 63, 30, 9]
    inp = make_step_inputs(rows, h, dk, dv, seed=13, device=device)
    alone = [step(*(x[i:i + 1] for x in inp)) for i in range(len(rows))]
    orders = ([4, 2, 0, 3, 1],) if interpret else ([0, 1, 2, 3, 4], [4, 2, 0, 3, 1], [2, 2, 0, 4, 4])
    for order in orders:
        idx = torch.tensor(order, device=device)
        o, nxt = step(*(x[idx] for x in inp))
        for j, i in enumerate(order):
            assert torch.equal(o[j], alone[i][0][0]), f"rows of sequence {i} at position {j} of {order}"
            assert torch.equal(nxt[j], alone[i][1][0]), f"state of sequence {i} at position {j} of {order}"


# ----------------------------------------------------------------------------- dispatch, fast mode


def test_dispatch_and_fast_mode(device, interpret):
    """On CUDA the op reaches this kernel, in "bitwise" and in "fast" mode alike (no stock kernel)."""
    if interpret:
        pytest.skip("dispatch to 'triton' happens for CUDA tensors only")
    inp = make_step_inputs([1, 64, 33], 2, 64, 64, seed=29, device=device)
    ref = step(*inp)
    assert kda_chunk_step.backend_for(torch.device("cuda")) == "triton"
    for mode in ("bitwise", "fast"):
        with kernel_mode(mode), torch.no_grad():
            out = kda_chunk_step(*inp)
        assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1]), mode


# ----------------------------------------------------------------------------- CUDA graphs


@pytest.mark.parametrize("n", [1, 16, 64])
def test_cuda_graph_capture_and_replay(n, device, interpret):
    """Capture the step at bench dims, replay it on new inputs copied into the static buffers: the same
    bits as an eager call and as per-sequence kda_chunk (Triton). The eager call also runs under
    sync-debug-mode "error", so a host sync anywhere in the wrapper would raise."""
    if interpret:
        pytest.skip("CUDA graphs need a GPU")
    h, dk, dv = dims(interpret)
    gen = torch.Generator().manual_seed(n)

    def inputs(seed: int):
        rows = torch.randint(1, C + 1, (n,), generator=gen).tolist()
        rows[: min(n, 3)] = [64, 1, 63][: min(n, 3)]
        return make_step_inputs(rows, h, dk, dv, seed=seed, device=device, v_dtype=torch.bfloat16,
                                decode_q=True)

    static = [x.clone() for x in inputs(100 + n)]
    with torch.no_grad():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up (compiles the kernels) off the capture stream
            kda_chunk_step(*static)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            o_static, st_static = kda_chunk_step(*static)

        for seed in (200 + n, 300 + n):
            new = inputs(seed)
            for dst, src in zip(static, new):
                dst.copy_(src)
            graph.replay()
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                o_eager, st_eager = kda_chunk_step(*new)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            assert torch.equal(o_static, o_eager), "graph replay rows differ from the eager call"
            assert torch.equal(st_static, st_eager), "graph replay state differs from the eager call"
            assert_matches_kda_chunk((o_static, st_static), chunk_ref(*new), new[5].cpu(), new[6])
