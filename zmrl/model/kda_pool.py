"""Static KDA state pool: the fixed-address home of every decoding sequence's KDA state.

A CUDA graph bakes in tensor addresses, so a captured decode step cannot read the per-sequence
tensors of ``KDASeqState`` (they are rebound after every forward). The pool holds the same state in
preallocated tensors, one slot per sequence, that the static decode path (``KimiDeltaAttention``
with ``ForwardContext.kda_pool`` set) reads and writes in place:

* ``conv``  [S, W-1, 3*H*dk] the last short-conv inputs (model dtype);
* ``chunk``: a ``KDADecodeCache`` (the op layer's slot cache, see
  ``kernels_batch_invariant/kda/decode.py``): the fp32 delta-rule state at the start of the current
  64-token chunk, the rows of that chunk seen so far (row r of a sequence at absolute position p lives
  at ``p % 64``; rows after the current one are never read, so stale rows of an earlier chunk never need
  clearing) and the backend's solved rows, primed (``kda_decode_prime``) whenever a slot is loaded.

The last slot is scratch: padding rows of a captured batch point there. ``load`` / ``store`` move a
sequence between its ``KDASeqState`` (what eager forwards use) and its slot, bit for bit.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable

import torch
from torch import nn

from zmrl.kernels_batch_invariant.kda import CHUNK_SIZE, KDADecodeCache, kda_decode_prime

from .context import KDASeqState, SequenceState


@dataclass
class KDALayerPool:
    conv: torch.Tensor  # [S, W-1, C]
    chunk: KDADecodeCache  # state at the chunk start + the chunk's rows so far, per slot

    @property
    def state(self) -> torch.Tensor:
        return self.chunk.state

    @property
    def pending(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.chunk.rows


class KDAStatePool:
    """One ``KDALayerPool`` per KDA module (keyed like ``SequenceState.kda``), ``num_slots`` real slots
    plus one scratch slot."""

    def __init__(self, model: nn.Module, num_slots: int, device: torch.device | str):
        from .kda import KimiDeltaAttention  # kda.py imports this module's siblings only

        if num_slots < 1:
            raise ValueError(f"KDAStatePool needs num_slots >= 1, got {num_slots}")
        self.num_slots = num_slots
        self.scratch_slot = num_slots
        s = num_slots + 1
        self.layers: dict[Hashable, KDALayerPool] = {}
        for m in model.modules():
            if not isinstance(m, KimiDeltaAttention):
                continue
            h, dk = m.num_heads, m.head_dim
            dt = m.q_proj.weight.dtype
            # the dtypes the layer produces: q/k are L2-normalised to fp32 and beta is fp32 whatever the model
            # dtype, so the chunk runs (and keeps its state) in fp32; the gate follows fp64 models
            g_dt = torch.float64 if dt == torch.float64 else torch.float32
            self.layers[m.layer_idx] = KDALayerPool(
                conv=torch.zeros(s, m.conv_size - 1, 3 * h * dk, dtype=dt, device=device),
                chunk=KDADecodeCache.allocate(s, h, dk, dk, v_dtype=dt, g_dtype=g_dt, device=device))

    def layer(self, key: Hashable) -> KDALayerPool:
        return self.layers[key]

    @torch.no_grad()
    def load(self, seq: SequenceState, slot: int) -> None:
        """Copy a sequence's eager KDA state into ``slot`` (empty layers load as zeros: a fresh sequence)."""
        r = seq.num_tokens % CHUNK_SIZE
        if not self.layers:
            return
        # the prime's index tensors, made on the device by a fill (a host tensor copied in would synchronise)
        dev = next(iter(self.layers.values())).state.device
        slot_t = torch.full((1,), slot, dtype=torch.int64, device=dev)
        row_t = torch.full((1,), r, dtype=torch.int64, device=dev)
        for key, pool in self.layers.items():
            st = seq.kda.get(key) or KDASeqState()
            if st.num_pending != r:
                raise RuntimeError(f"KDA layer {key}: {st.num_pending} pending rows but the sequence is at token "
                                   f"{seq.num_tokens} (expected {r}); its state is not at a chunk-aligned point")
            if st.conv is None:
                pool.conv[slot].zero_()
            else:
                pool.conv[slot].copy_(st.conv)
            if st.state is None:
                pool.state[slot].zero_()
            else:
                pool.state[slot].copy_(st.state)
            for buf, rows in zip(pool.pending, st.pending or ()):
                buf[slot, :r].copy_(rows)
            kda_decode_prime(slot_t, row_t, pool.chunk)

    @torch.no_grad()
    def store(self, seq: SequenceState, slot: int) -> None:
        """Write ``slot`` back into the sequence's ``KDASeqState`` objects (fresh tensors, as eager forwards
        leave them), so an eager forward or a fork can continue from it."""
        r = seq.num_tokens % CHUNK_SIZE
        for key, pool in self.layers.items():
            seq.kda[key] = KDASeqState(
                conv=pool.conv[slot].clone(), state=pool.state[slot].clone(),
                pending=None if r == 0 else tuple(buf[slot, :r].clone() for buf in pool.pending))

    @torch.no_grad()
    def snapshot(self, seq: SequenceState, slot: int) -> None:
        """Record the prefix-cache snapshot of a sequence that just completed a chunk (what an eager forward
        records in ``KDASeqState.snapshots``: the state at the boundary and the conv inputs before it)."""
        pos = seq.num_tokens
        if pos % CHUNK_SIZE:
            raise RuntimeError(f"snapshot at token {pos}: not a chunk boundary")
        for key, pool in self.layers.items():
            st = seq.kda.setdefault(key, KDASeqState())
            st.snapshots = {pos: (pool.state[slot].clone(), pool.conv[slot].clone())}
