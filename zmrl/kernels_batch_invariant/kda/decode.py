"""KDA decode step over a slot cache: one new token per sequence, bitwise the row ``kda_chunk`` gives it.

A decoding sequence's KDA layer keeps, per slot of a fixed-address cache (``KDADecodeCache``), the fp32
state at the start of its current 64-token chunk and the chunk's rows so far (k, v, g, beta). The new
token at absolute position ``p`` is row ``r = p % 64`` of that chunk; its output is the chunked formula
for row r from the boundary state plus rows <= r (the contract of ``kda_chunk``, see ``chunk.py``), and
the state advances when r = 63 completes the chunk.

Backends:

* torch (reference; CPU and fp64): writes the rows into the cache, gathers each slot's chunk and runs
  ``kda_chunk_step`` over all 64 rows (the re-solve of the whole partial chunk), scatters the state back;
* triton, recurrent form (``Numerics.kda_form == "recurrent"``, ``triton/kda_recurrent.py``): advances the
  slot's running state (``run_state``: the state after the chunk's rows so far) by the new token, with the
  kernel the packed forward runs; ``kda_decode_prime`` rebuilds it from the chunk-start state and the
  cached rows. Each position must be stepped once after a prime (a repeated position would advance the
  state twice; the engine never repeats one without reloading the slot).
* triton, chunked form (``triton/kda_chunk.py``): reads and writes the cache in place through the slot table and
  solves only the new row. Row i of the chunk's intra-chunk solve depends on rows <= i only and never
  changes once computed, so the kernel keeps the solved rows of ``(I + A_kk)^-1`` and of the state
  corrected values ``v_e`` in the cache (``solved_t``, ``v_e``; ``solved`` counts the valid rows) and
  runs the chunk kernels' own code from the first unsolved row on: the same instructions on the same
  values, hence the same bits, at a fraction of the work and bytes.

Every shape is fixed by (N, H, dk, dv) and nothing is read back to the host, so a CUDA graph can
capture the call. Slots may repeat only for padding rows whose outputs are discarded (they race on
their shared scratch slot). A slot whose rows are written by anything but this op must be primed
(``kda_decode_prime``) before its next step.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .._dispatch import invariant_op
from ..numerics import current_numerics
from .chunk import CHUNK_SIZE, kda_chunk_step


@dataclass
class KDADecodeCache:
    """Per-slot KDA chunk cache of one layer (S slots). All tensors are indexed by slot first.

    state [S, H, dk, dv] fp32: the state at the start of the current chunk;
    k, g [S, 64, H, dk] (fp32; g fp64 for fp64 models), v [S, 64, H, dv] (model dtype), beta [S, 64, H]
    fp32: the chunk's rows so far, row r of a sequence at position p stored at r = p % 64; rows past the
    current one may hold an earlier chunk's values (never read);
    solved_t [S, H, 64, 64] fp32, v_e [S, H, 64, dv] fp32, run_state [S, H, dk, dv] fp32, solved [S] int32:
    backend scratch of the Triton path. The chunked form (``Numerics.kda_form == "chunk"``) keeps the rows
    of the triangular inverse and of the state-corrected values already computed for the current chunk
    (``solved_t``, ``v_e``); the recurrent form the state after the chunk's rows so far (``run_state``).
    ``allocate`` sizes only the applied form's scratch (the other's tensors have 0 slots).
    ``kda_decode_prime`` must be called whenever a slot's rows are (re)loaded from elsewhere; the torch
    backend ignores them.
    """

    state: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    solved_t: torch.Tensor
    v_e: torch.Tensor
    solved: torch.Tensor
    run_state: torch.Tensor
    form: str = "chunk"  # the Numerics.kda_form the scratch was sized for (check_cache_form)

    @classmethod
    def allocate(cls, num_slots: int, num_heads: int, dk: int, dv: int, v_dtype: torch.dtype,
                 g_dtype: torch.dtype, device: torch.device | str) -> "KDADecodeCache":
        s, c, h = num_slots, CHUNK_SIZE, num_heads
        f32 = torch.float32

        def z(*shape: int, dtype: torch.dtype = f32) -> torch.Tensor:
            return torch.zeros(*shape, dtype=dtype, device=device)

        recurrent = current_numerics().kda_form == "recurrent"
        sc, sr = (0, s) if recurrent else (s, 0)  # slots of the chunked / recurrent scratch
        return cls(state=z(s, h, dk, dv), k=z(s, c, h, dk), v=z(s, c, h, dv, dtype=v_dtype), g=z(s, c, h, dk, dtype=g_dtype),
                   beta=z(s, c, h), solved_t=z(sc, h, c, c), v_e=z(sc, h, c, dv), solved=z(s, dtype=torch.int32),
                   run_state=z(sr, h, dk, dv), form="recurrent" if recurrent else "chunk")

    @property
    def rows(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The chunk-row buffers (k, v, g, beta)."""
        return self.k, self.v, self.g, self.beta

    def flat_rows(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The chunk rows as packed token rows (views): k, g [S * 64, H, dk], v [S * 64, H, dv], beta [S * 64, H];
        slot s's row r is token row s * 64 + r (what the Triton kernels address)."""
        h = self.beta.shape[-1]
        return self.k.view(-1, h, self.k.shape[-1]), self.v.view(-1, h, self.v.shape[-1]), \
            self.g.view(-1, h, self.g.shape[-1]), self.beta.view(-1, h)


def check_cache_form(cache: KDADecodeCache) -> None:
    """The Triton decode step and prime need the scratch of the applied ``Numerics.kda_form``; a cache
    allocated under the other form has none (0 slots). A one-line error from host metadata (capturable)."""
    form = current_numerics().kda_form
    if cache.form != form:
        raise ValueError(f"kda_decode_step: this KDADecodeCache was allocated for kda_form={cache.form!r}, the "
                         f"process now runs kda_form={form!r}; allocate the cache (the engine) after applying "
                         f"the numerics, and keep them for its life")


def check_decode_args(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      positions: torch.Tensor, slots: torch.Tensor, cache: KDADecodeCache) -> tuple[int, int, int, int]:
    """Shape / dtype / device checks from host metadata only (no device reads); returns (N, H, dk, dv)."""
    if q.dim() != 3:
        raise ValueError(f"kda_decode_step: q must be [N, H, dk], got {tuple(q.shape)}")
    n, h, dk = q.shape
    dv = v.shape[-1]
    if k.shape != q.shape or g.shape != q.shape or v.shape != (n, h, dv) or beta.shape != (n, h):
        raise ValueError(f"kda_decode_step: bad shapes q{tuple(q.shape)} k{tuple(k.shape)} v{tuple(v.shape)} "
                         f"g{tuple(g.shape)} beta{tuple(beta.shape)}")
    if positions.shape != (n,) or slots.shape != (n,):
        raise ValueError(f"kda_decode_step: positions {tuple(positions.shape)} and slots {tuple(slots.shape)} must be [{n}]")
    if cache.state.shape[1:] != (h, dk, dv) or cache.k.shape[1:] != (CHUNK_SIZE, h, dk):
        raise ValueError(f"kda_decode_step: cache state {tuple(cache.state.shape)} / rows {tuple(cache.k.shape)} do not "
                         f"match H={h}, dk={dk}, dv={dv}")
    if positions.device != q.device or slots.device != q.device:
        raise ValueError(f"kda_decode_step: positions/slots on {positions.device}/{slots.device}, q on {q.device}")
    if torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v, g, beta)):
        raise RuntimeError("kda_decode_step is a decode-only forward without autograd: call it under torch.no_grad()")
    return n, h, dk, dv


@invariant_op
def kda_decode_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    cache: KDADecodeCache,
    scale: float | None = None,
) -> torch.Tensor:
    """One decode step: the new token of each of N sequences, whose chunk lives at ``cache[slots[i]]``.

    q, k, g: [N, H, dk] (q, k L2-normalised, fp32); v: [N, H, dv]; beta: [N, H]; positions: [N] absolute
    positions of the new tokens; slots: [N] int64 cache slots; scale as in ``kda_chunk``.

    Writes row ``positions % 64`` of each slot's chunk, advances ``cache.state`` in place where the row
    completes the chunk, and returns o [N, H, dv] (v.dtype): bitwise the row ``kda_chunk`` returns for
    that token (on the same backend), given the chunk's earlier rows and boundary state in the cache.
    """
    n, h, dk, dv = check_decode_args(q, k, v, g, beta, positions, slots, cache)
    c = CHUNK_SIZE
    row = positions % c
    for buf, new in zip(cache.rows, (k, v, g, beta)):
        buf[slots, row] = new.to(buf.dtype)
    seq = torch.arange(n, device=q.device)
    qc = q.new_zeros(n, c, h, dk)
    qc[seq, row] = q
    o, next_state = kda_chunk_step(qc, *(buf[slots] for buf in cache.rows), row + 1, cache.state[slots], scale)
    cache.state[slots] = next_state
    return o[seq, row]


@invariant_op
def kda_decode_prime(slots: torch.Tensor, num_rows: torch.Tensor, cache: KDADecodeCache, scale: float | None = None) -> None:
    """Make the backend scratch of ``slots`` [M] hold their chunks' first ``num_rows`` [M] rows, just written
    into the cache (with the boundary state) from another source: a sequence entering decode after an
    eager prefill, a fork, a prefix-cache hit; ``num_rows`` in 0..63 (a chunk's rows before its last). The
    Triton backend's chunked form solves those rows (no outputs) so that the next ``kda_decode_step`` solves
    only its new row, its recurrent form runs them from the chunk-start state into ``run_state``; the torch
    backend keeps nothing."""
    cache.solved[slots] = num_rows.to(torch.int32)
