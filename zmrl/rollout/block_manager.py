"""Block (page) allocation with reference counts and prefix caching by block hash.

A cached block carries, besides its latent/index-key pages, the KDA snapshot at its end: the fp32
state and short-conv inputs of every KDA layer. Block sizes are multiples of 64, so a block end is
always a KDA chunk boundary and a request resuming there starts a fresh chunk, exactly as the
sequence that computed the block did.
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


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if block_size <= 0 or block_size % 64 or block_size & (block_size - 1):
            raise ValueError(f"block_size must be a power of two and a multiple of 64, got {block_size}")
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_count = [0] * num_blocks
        self.hash_of: list[int | None] = [None] * num_blocks
        self.snapshot_of: dict[int, KDASnapshot] = {}
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
        self.snapshot_of.pop(b, None)

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
        """Longest run of cached blocks for these consecutive block hashes, and the KDA snapshot at its end.
        Does not take references: call ``share`` on the result to keep it."""
        if not self.enable_prefix_caching:
            return [], None
        blocks: list[int] = []
        for h in hashes:
            self.queries += 1
            b = self.block_of_hash.get(h)
            if b is None or b not in self.snapshot_of:
                break
            blocks.append(b)
            self.hits += 1
        return blocks, (self.snapshot_of[blocks[-1]] if blocks else None)

    def register(self, block: int, h: int, snapshot: KDASnapshot) -> None:
        """Publish a full, computed block under its hash (first writer wins)."""
        if not self.enable_prefix_caching or h in self.block_of_hash:
            return
        self.hash_of[block] = h
        self.block_of_hash[h] = block
        self.snapshot_of[block] = snapshot

    def reset_prefix_cache(self) -> None:
        """Forget every cached block (after a weight update all cached values are stale)."""
        for b in range(self.num_blocks):
            self.hash_of[b] = None
        self.block_of_hash.clear()
        self.snapshot_of.clear()
