"""Block (page) allocation with reference counts and prefix caching by block hash.

A cached block carries, besides its latent/index-key pages, the KDA snapshot at its end: the fp32
state and short-conv inputs of every KDA layer. Block sizes are multiples of 64, so a block end is
always a KDA chunk boundary and a request resuming there starts a fresh chunk, exactly as the
sequence that computed the block did.

Snapshots are large (the bench preset: 12 KDA layers x 1 MiB of fp32 state per block end, ~160x a
block's latent pages), so they live under a byte budget (``EngineConfig.prefix_cache_kda_gib``): past
it, the least recently registered or hit snapshot is dropped. A cached chain stays usable up to its last
block that still has a snapshot: the latents of every block are there, and a request resumes where the
KDA state is known.
"""
from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict

import torch

from zmrl.model.context import KDASeqState

KDASnapshot = dict[int, tuple[torch.Tensor, torch.Tensor]]  # layer -> (state, conv inputs)


def restore_kda(snapshot: KDASnapshot) -> dict[int, KDASeqState]:
    """Per-layer KDA states of a sequence resuming at a cached block end (copies: the cache keeps its own)."""
    return {layer: KDASeqState(conv=conv.clone(), state=state.clone()) for layer, (state, conv) in snapshot.items()}


def block_hash(parent: int | None, tokens: list[int], salt: int = 0) -> int:
    """Content hash of a full block chained with its parent's (stable across processes)."""
    h = hashlib.blake2b(digest_size=8)
    h.update(struct.pack("<qq", -1 if parent is None else parent, salt))
    h.update(struct.pack(f"<{len(tokens)}q", *tokens))
    return int.from_bytes(h.digest(), "little") >> 1


def snapshot_bytes(snapshot: KDASnapshot) -> int:
    return sum(t.numel() * t.element_size() for pair in snapshot.values() for t in pair)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 snapshot_budget_bytes: int | None = None):
        """``snapshot_budget_bytes``: most bytes of KDA snapshots kept (None: no limit)."""
        if block_size <= 0 or block_size % 64 or block_size & (block_size - 1):
            raise ValueError(f"block_size must be a power of two and a multiple of 64, got {block_size}")
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_count = [0] * num_blocks
        self.hash_of: list[int | None] = [None] * num_blocks
        # Snapshots in eviction order: least recently registered or hit first.
        self.snapshot_of: OrderedDict[int, KDASnapshot] = OrderedDict()
        self.snapshot_budget = snapshot_budget_bytes
        self.snapshot_total = 0
        self.block_of_hash: dict[int, int] = {}
        # Free blocks in eviction order: never-used first, then least recently freed.
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.hits = self.queries = 0

    @property
    def num_free(self) -> int:
        return len(self.free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free):
            raise RuntimeError(f"allocate({n}) with {len(self.free)} free blocks")
        out = []
        for _ in range(n):
            b, _ = self.free.popitem(last=False)
            self._evict(b)
            self.ref_count[b] = 1
            out.append(b)
        return out

    def _evict(self, b: int) -> None:
        h = self.hash_of[b]
        if h is not None and self.block_of_hash.get(h) == b:
            del self.block_of_hash[h]
        self.hash_of[b] = None
        self._drop_snapshot(b)

    def _drop_snapshot(self, b: int) -> None:
        snap = self.snapshot_of.pop(b, None)
        if snap is not None:
            self.snapshot_total -= snapshot_bytes(snap)

    def share(self, blocks: list[int]) -> None:
        for b in blocks:
            if self.ref_count[b] == 0:
                self.free.pop(b)
            self.ref_count[b] += 1

    def release(self, blocks: list[int]) -> None:
        for b in reversed(blocks):  # the tail of a sequence is evicted first
            self.ref_count[b] -= 1
            if self.ref_count[b] == 0:
                self.free[b] = None

    def match_prefix(self, hashes: list[int]) -> tuple[list[int], KDASnapshot | None]:
        """Longest run of cached blocks for these consecutive block hashes that ends at a block with a KDA
        snapshot, and that snapshot. Does not take references: call ``share`` on the result to keep it."""
        if not self.enable_prefix_caching:
            return [], None
        chain: list[int] = []
        usable = 0
        for h in hashes:
            self.queries += 1
            b = self.block_of_hash.get(h)
            if b is None:
                break
            chain.append(b)
            if b in self.snapshot_of:
                usable = len(chain)
        blocks = chain[:usable]
        self.hits += usable
        if not blocks:
            return [], None
        self.snapshot_of.move_to_end(blocks[-1])
        return blocks, self.snapshot_of[blocks[-1]]

    def register(self, block: int, h: int, snapshot: KDASnapshot) -> None:
        """Publish a full, computed block under its hash (first writer wins), its snapshot within the budget."""
        if not self.enable_prefix_caching or h in self.block_of_hash:
            return
        self.hash_of[block] = h
        self.block_of_hash[h] = block
        size = snapshot_bytes(snapshot)
        if self.snapshot_budget is not None and size > self.snapshot_budget:
            return  # the latents stay reusable up to an earlier block's snapshot
        self.snapshot_of[block] = snapshot
        self.snapshot_total += size
        while self.snapshot_budget is not None and self.snapshot_total > self.snapshot_budget:
            self._drop_snapshot(next(iter(self.snapshot_of)))

    def reset_prefix_cache(self) -> None:
        """Forget every cached block (after a weight update all cached values are stale)."""
        for b in range(self.num_blocks):
            self.hash_of[b] = None
        self.block_of_hash.clear()
        self.snapshot_of.clear()
        self.snapshot_total = 0
