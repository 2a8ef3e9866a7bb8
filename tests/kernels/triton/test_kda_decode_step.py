"""Triton ``kda_decode_step``: every decoded row bitwise equal to the Triton ``kda_chunk`` one-shot row,
while the kernels solve only the rows not yet kept in the cache (and the whole chunk again after a slot
is reloaded mid-chunk); the cache state ends as kda_chunk's; the step is capturable in a CUDA graph.

Under TRITON_INTERPRET=1 (CPU) tiny shapes run; on CUDA also the bench dims (H = 16, dk = dv = 128).
"""
from __future__ import annotations

import pytest
import torch

from zmrl.kernels_batch_invariant.kda import KDADecodeCache, kda_chunk, kda_decode_step
from zmrl.kernels_batch_invariant.triton import triton_impl

from ..test_kda_decode_step import decode_scenario, sequence_inputs

pytestmark = [pytest.mark.gpu, pytest.mark.triton, pytest.mark.usefixtures("kda_form")]


@pytest.mark.parametrize("reset_every,strided_v", [(0, False), (7, False), (0, True)])
def test_rows_equal_one_shot_kda_chunk(device, interpret, reset_every, strided_v):
    h, dk, dv = (1, 16, 16) if interpret else (16, 128, 128)
    lengths, starts = ([70, 131, 3], [60, 60, 0]) if interpret else ([200, 131, 70, 64, 129], [0, 62, 5, 63, 100])
    v_dtype = torch.float32 if interpret else torch.bfloat16
    n = decode_scenario(triton_impl(kda_decode_step), device, h=h, dk=dk, dv=dv, lengths=lengths, starts=starts,
                        seed=11, v_dtype=v_dtype, pad_rows=2, reset_every=reset_every, strided_v=strided_v)
    assert n == sum(L - s for L, s in zip(lengths, starts))


def test_cache_of_the_other_form_is_refused(device, interpret, kda_form):
    """A cache holds the scratch of the form it was allocated under; the decode step and the prime refuse it
    under the other form (one line, before any launch) instead of writing into scratch it does not have."""
    from zmrl.kernels_batch_invariant import current_numerics, numerics_scope
    from zmrl.kernels_batch_invariant.kda import kda_decode_prime

    h, dk, dv = 1, 16, 16
    cache = KDADecodeCache.allocate(3, h, dk, dv, torch.float32, torch.float32, device)
    assert cache.form == kda_form
    other = "chunk" if kda_form == "recurrent" else "recurrent"
    x = torch.zeros(2, h, dk, device=device)
    pos, slots = torch.zeros(2, dtype=torch.int64, device=device), torch.tensor([0, 1], device=device)
    with numerics_scope(current_numerics().replace(kda_form=other)), torch.no_grad():
        with pytest.raises(ValueError, match=f"allocated for kda_form='{kda_form}'"):
            triton_impl(kda_decode_step)(x, x, x[..., :dv], x, x[..., 0], pos, slots, cache)
        with pytest.raises(ValueError, match="allocated for kda_form"):
            triton_impl(kda_decode_prime)(slots, pos, cache)


def test_one_recurrent_binary_for_every_caller(device, interpret, kda_form):
    """The recurrent form's parity argument: the packed forward, the decode prime, the decode step and
    kda_chunk_step launch ONE compiled kernel (same dtypes, alignments and constants). Checked on the GPU
    from Triton's cache of compiled variants (the interpreter compiles nothing)."""
    if interpret or kda_form != "recurrent":
        pytest.skip("compiled variants exist on a GPU, in the recurrent form")
    from zmrl.kernels_batch_invariant.kda import kda_chunk_step, kda_decode_prime
    from zmrl.kernels_batch_invariant.triton import kda_recurrent as kr

    h, dk, dv = 16, 128, 128
    gen = torch.Generator().manual_seed(2)
    seq = tuple(x.to(device) for x in sequence_inputs(100, h, dk, dv, gen, torch.bfloat16))
    cache = KDADecodeCache.allocate(2, h, dk, dv, torch.bfloat16, torch.float32, device)
    slots = torch.tensor([1], device=device)
    kr._kda_recurrent_kernel.device_caches.clear()  # other tests of this process compiled other dtypes
    with torch.no_grad():
        triton_impl(kda_chunk)(*seq, torch.tensor([0, 100], device=device))
        for buf, x in zip(cache.rows, seq[1:]):
            buf[1, :36] = x[64:100].to(buf.dtype)
        triton_impl(kda_decode_prime)(slots, torch.tensor([36], device=device), cache)
        triton_impl(kda_decode_step)(*(x[100 - 1:100] for x in seq), torch.tensor([99], device=device), slots, cache)
        qc = seq[0][:64][None].contiguous()
        triton_impl(kda_chunk_step)(qc, *(x[:64][None].contiguous() for x in seq[1:]), torch.tensor([64], device=device),
                                    torch.zeros(1, h, dk, dv, device=device))
    variants = [c for caches in kr._kda_recurrent_kernel.device_caches.values() for c in caches[0].values()]
    assert len(variants) == 1, f"{len(variants)} compiled variants of the recurrent kernel"


def test_odd_dims(device, interpret):
    """dk != dv, a non-power-of-two dv (masked columns)."""
    h, dk, dv = (2, 16, 24) if interpret else (4, 64, 48)
    decode_scenario(triton_impl(kda_decode_step), device, h=h, dk=dk, dv=dv, lengths=[66, 20], starts=[60, 10],
                    seed=5, reset_every=5)


def test_cuda_graph_capture(device, interpret):
    """Captured once, replayed for consecutive positions: the same rows as eager calls."""
    if interpret:
        pytest.skip("CUDA graphs need a GPU")
    h, dk, dv, n = 16, 128, 128, 8
    gen = torch.Generator().manual_seed(0)
    seqs = [tuple(x.to(device) for x in sequence_inputs(80, h, dk, dv, gen, torch.bfloat16)) for _ in range(n)]
    slots = torch.arange(n, device=device).flip(0).contiguous()

    def fresh() -> KDADecodeCache:
        return KDADecodeCache.allocate(n, h, dk, dv, torch.bfloat16, torch.float32, device)

    def inputs(p: int):
        return [torch.stack([s[j][p] for s in seqs]) for j in range(5)]

    step = triton_impl(kda_decode_step)
    eager_cache, eager = fresh(), []
    with torch.no_grad():
        for p in range(70):
            eager.append(step(*inputs(p), torch.full((n,), p, device=device), slots, eager_cache))
    cache = fresh()
    static = [x.clone() for x in inputs(0)]
    positions = torch.zeros(n, dtype=torch.int64, device=device)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        step(*static, positions, slots, fresh())  # compile outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.no_grad():
        out = step(*static, positions, slots, cache)
    for p in range(70):
        for buf, x in zip(static, inputs(p)):
            buf.copy_(x)
        positions.fill_(p)
        graph.replay()
        assert torch.equal(out, eager[p]), f"position {p}"
    assert torch.equal(cache.state, eager_cache.state)


@pytest.mark.parametrize("blocks", [32, 16])
def test_rows_equal_kda_chunk_under_other_column_blocks(device, interpret, monkeypatch, blocks, kda_form):
    """The intra kernel's dk / dv column blocks (BK, BVI) are shared numerics: with other blocks the chunk
    kernel's bits move, and the decode rows must move with them (benchmarks/kda_decode_vs_fla.py --sweep
    times these candidates)."""
    if kda_form != "chunk":
        pytest.skip("the chunked form's column blocks")
    if interpret:
        pytest.skip("bench dims only (the interpreter's tiny dk is one block already)")
    from zmrl.kernels_batch_invariant.triton import kda_chunk as tk

    gen = torch.Generator().manual_seed(3)
    seq = tuple(x.to(device) for x in sequence_inputs(130, 16, 128, 128, gen, torch.bfloat16))
    cu = torch.tensor([0, 130], device=device)
    chunk = triton_impl(kda_chunk)
    with torch.no_grad():
        default_rows = chunk(*seq, cu)[0]
    default = tk._launch_config
    monkeypatch.setattr(tk, "_launch_config", lambda dk, dv: {**default(dk, dv), "BK": blocks, "BVI": blocks})
    with torch.no_grad():
        # the candidate is in force: it moves the chunk kernel's bits (else this test would compare nothing new)
        assert not torch.equal(chunk(*seq, cu)[0], default_rows)
    decode_scenario(triton_impl(kda_decode_step), device, h=16, dk=128, dv=128, lengths=[200, 131, 70],
                    starts=[0, 62, 5], seed=13, v_dtype=torch.bfloat16, pad_rows=2, reset_every=7)
