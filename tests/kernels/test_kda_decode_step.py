"""``kda_decode_step`` (KDA decode over a slot cache), torch backend: every decoded row is bitwise the row
``kda_chunk`` gives the same token in a one-shot pass over the whole sequence, whatever the slots, the
batch, the chunk boundaries crossed and where decoding started; the cache's state ends as kda_chunk's.

``decode_scenario`` is shared with the Triton test (tests/kernels/triton/test_kda_decode_step.py), which
also reloads slots mid-chunk (primed again: the Triton backend solves their kept rows anew).
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from zmrl.kernels_batch_invariant.kda import CHUNK_SIZE, KDADecodeCache, kda_chunk, kda_decode_prime, kda_decode_step

C = CHUNK_SIZE


def sequence_inputs(length: int, h: int, dk: int, dv: int, gen: torch.Generator, v_dtype: torch.dtype):
    """(q, k, v, g, beta) of one sequence with model-like statistics (q, k L2-normalised; FLA's gate)."""
    q = F.normalize(torch.randn(length, h, dk, generator=gen), dim=-1)
    k = F.normalize(torch.randn(length, h, dk, generator=gen), dim=-1)
    v = torch.randn(length, h, dv, generator=gen).to(v_dtype)
    a_log = torch.log(torch.empty(h).uniform_(1.0, 16.0, generator=gen))
    dt = torch.exp(torch.empty(h, dk).uniform_(math.log(1e-3), math.log(0.1), generator=gen))
    dt_bias = dt + torch.log(-torch.expm1(-dt))
    g = -torch.exp(a_log)[:, None] * F.softplus(torch.randn(length, h, dk, generator=gen) + dt_bias)
    beta = torch.sigmoid(torch.randn(length, h, generator=gen))
    return q, k, v, g, beta


def load_prefix(cache: KDADecodeCache, slot: int, seq: tuple, p0: int, state: torch.Tensor, prime) -> None:
    """Put a sequence that has seen p0 tokens into ``slot``: its boundary state and partial-chunk rows."""
    _, k, v, g, beta = seq
    start = p0 // C * C
    cache.state[slot] = state
    for buf, x in zip(cache.rows, (k, v, g, beta)):
        buf[slot, : p0 - start] = x[start:p0].to(buf.dtype)
    dev = cache.state.device
    prime(torch.tensor([slot], device=dev), torch.tensor([p0 - start], device=dev), cache)


def decode_scenario(impl, device: torch.device, *, h: int, dk: int, dv: int, lengths: list[int], starts: list[int],
                    seed: int = 0, v_dtype: torch.dtype = torch.float32, pad_rows: int = 1,
                    reset_every: int = 0, strided_v: bool = False) -> int:
    """Decode several sequences together, each in its own (shuffled) slot, from position ``starts[i]`` to
    ``lengths[i]`` (sequences join and leave the batch as they start and finish), with ``pad_rows``
    padding rows pointing at a scratch slot; every ``reset_every`` steps one live slot is reloaded from the
    eager state mid-chunk; ``strided_v``: v a per-head view of a wider tensor (as inside the fused projection
    output). Asserts each output row and each final state against ``kda_chunk`` (same
    backend as ``impl``) on the whole sequence; returns the number of rows compared."""
    gen = torch.Generator().manual_seed(seed)
    n = len(lengths)
    seqs = [sequence_inputs(L, h, dk, dv, gen, v_dtype) for L in lengths]
    backend = "torch" if impl is kda_decode_step.impls["torch"] else "triton"
    chunk_impl, prime = kda_chunk.impls[backend], kda_decode_prime.impls[backend]
    dev_seqs = [tuple(x.to(device) for x in s) for s in seqs]
    refs = []
    with torch.no_grad():
        for s, L in zip(dev_seqs, lengths):
            cu = torch.tensor([0, L], dtype=torch.int64, device=device)
            o, final, states = chunk_impl(*s, cu, output_chunk_states=True)
            refs.append((o, final, states))
    num_slots = n + 1
    scratch = n
    g_dtype = torch.float32
    cache = KDADecodeCache.allocate(num_slots, h, dk, dv, v_dtype, g_dtype, device)
    # garbage in every buffer: nothing may depend on what a slot held before
    for t in (cache.state, cache.k, cache.g, cache.beta, cache.solved_t, cache.v_e, cache.run_state):
        t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype) * 1e3)
    slot_of = torch.randperm(n, generator=gen).tolist()

    def boundary_state(i: int, p: int) -> torch.Tensor:
        nc = p // C
        if nc == 0:
            return torch.zeros(h, dk, dv, device=device)
        return refs[i][2][nc - 1]

    for i in range(n):
        load_prefix(cache, slot_of[i], dev_seqs[i], starts[i], boundary_state(i, starts[i]), prime)
    pos = list(starts)
    compared, step = 0, 0
    while True:
        live = [i for i in range(n) if pos[i] < lengths[i]]
        if not live:
            break
        step += 1
        if reset_every and step % reset_every == 0:
            i = live[step % len(live)]
            load_prefix(cache, slot_of[i], dev_seqs[i], pos[i], boundary_state(i, pos[i]), prime)
        order = torch.randperm(len(live), generator=gen).tolist()
        batch = [live[j] for j in order]
        rows = [tuple(x[pos[i]] for x in dev_seqs[i]) for i in batch]
        pad = [tuple(torch.zeros_like(x) for x in rows[0]) for _ in range(pad_rows)]
        q, k, v, g, beta = (torch.stack(list(col)) for col in zip(*(rows + pad)))
        if strided_v:
            v = torch.cat([v.reshape(v.shape[0], -1), torch.full_like(v.reshape(v.shape[0], -1), float("nan"))],
                          dim=1)[:, : h * dv].view(v.shape)
        positions = torch.tensor([pos[i] for i in batch] + [0] * pad_rows, dtype=torch.int64, device=device)
        slots = torch.tensor([slot_of[i] for i in batch] + [scratch] * pad_rows, dtype=torch.int64, device=device)
        with torch.no_grad():
            o = impl(q, k, v, g, beta, positions, slots, cache)
        assert o.shape == (len(batch) + pad_rows, h, dv) and o.dtype == v.dtype
        for j, i in enumerate(batch):
            want = refs[i][0][pos[i]]
            assert torch.equal(o[j], want), (f"sequence {i} position {pos[i]} (step {step}): max diff "
                                             f"{(o[j].float() - want.float()).abs().max().item():.3e}")
            compared += 1
            pos[i] += 1
    for i in range(n):
        p = lengths[i]
        assert torch.equal(cache.state[slot_of[i]], boundary_state(i, p)), f"sequence {i}: final state differs"
    return compared


@pytest.mark.parametrize("v_dtype", [torch.float32, torch.bfloat16])
def test_decode_rows_equal_one_shot_kda_chunk(v_dtype):
    n = decode_scenario(kda_decode_step.impls["torch"], torch.device("cpu"), h=2, dk=16, dv=16,
                        lengths=[70, 131, 5, 64], starts=[60, 62, 0, 63], seed=3, v_dtype=v_dtype)
    assert n == (70 - 60) + (131 - 62) + 5 + 1


def test_bad_arguments():
    cache = KDADecodeCache.allocate(2, 2, 16, 16, torch.float32, torch.float32, "cpu")
    q = torch.zeros(3, 2, 16)
    pos, slots = torch.zeros(3, dtype=torch.int64), torch.zeros(3, dtype=torch.int64)
    with pytest.raises(ValueError, match="bad shapes"):
        kda_decode_step(q, q, q, q, torch.zeros(3, 3), pos, slots, cache)
    with pytest.raises(ValueError, match="positions"):
        kda_decode_step(q, q, q, q, torch.zeros(3, 2), pos[:2], slots, cache)
    with pytest.raises(ValueError, match="cache"):
        kda_decode_step(q[:, :1], q[:, :1], q[:, :1], q[:, :1], torch.zeros(3, 1), pos, slots, cache)
    with pytest.raises(RuntimeError, match="no_grad"):
        kda_decode_step(q.requires_grad_(), q, q, q, torch.zeros(3, 2), pos, slots, cache)


def test_same_bits_at_every_thread_count():
    """One decode step (and the prime before it) at 1, 2 and 4 CPU threads: the same output and state bits."""
    gen = torch.Generator().manual_seed(7)
    h, dk, dv, n = 2, 32, 32, 5
    seqs = [sequence_inputs(C, h, dk, dv, gen, torch.float32) for _ in range(n)]
    starts = [0, 1, 30, 63, 17]
    results = []
    before = torch.get_num_threads()
    try:
        for threads in (1, 2, 4):
            torch.set_num_threads(threads)
            cache = KDADecodeCache.allocate(n, h, dk, dv, torch.float32, torch.float32, "cpu")
            for i, p0 in enumerate(starts):
                load_prefix(cache, i, seqs[i], p0, 0.1 * torch.ones(h, dk, dv), kda_decode_prime)
            q, k, v, g, beta = (torch.stack([s[j][p] for s, p in zip(seqs, starts)]) for j in range(5))
            with torch.no_grad():
                o = kda_decode_step(q, k, v, g, beta, torch.tensor(starts), torch.arange(n), cache)
            results.append((o, cache.state.clone()))
    finally:
        torch.set_num_threads(before)
    for o, st in results[1:]:
        assert torch.equal(o, results[0][0]) and torch.equal(st, results[0][1])
