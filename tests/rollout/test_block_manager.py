"""The prefix cache's KDA snapshot budget (zmrl/rollout/block_manager.py)."""
from __future__ import annotations

import pytest
import torch

from zmrl.rollout import EngineConfig
from zmrl.rollout.block_manager import BlockManager, snapshot_bytes


def _snap(value: float, layers: int = 2) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    return {layer: (torch.full((4, 4), value), torch.full((3, 2), value)) for layer in range(layers)}


SNAP_BYTES = snapshot_bytes(_snap(0.0))  # 2 layers x (16 + 6) fp32 = 176 bytes


def _chain(bm: BlockManager, hashes: list[int], snaps: list[dict | None]) -> list[int]:
    blocks = bm.allocate(len(hashes))
    for b, h, s in zip(blocks, hashes, snaps):
        bm.register(b, h, s if s is not None else _snap(float(h)))
    return blocks


def test_budget_keeps_the_most_recent_snapshots_and_the_chain_up_to_the_last_one():
    bm = BlockManager(8, 64, snapshot_budget_bytes=2 * SNAP_BYTES)
    blocks = _chain(bm, [11, 12, 13], [None, None, None])
    assert bm.snapshot_total == 2 * SNAP_BYTES and list(bm.snapshot_of) == blocks[1:]  # 11's was dropped
    got, snap = bm.match_prefix([11, 12, 13, 99])
    assert got == blocks and torch.equal(snap[0][0], torch.full((4, 4), 13.0))
    # a hit makes a snapshot the most recent: the next registration drops 13's neighbour 12, not 13
    bm.match_prefix([11, 12, 13])
    _chain(bm, [21], [None])
    assert blocks[2] in bm.snapshot_of and blocks[1] not in bm.snapshot_of
    # a chain whose last blocks lost their snapshots is usable up to the last one that has it
    bm.snapshot_of.pop(blocks[2])
    bm.snapshot_total -= SNAP_BYTES
    assert bm.match_prefix([11, 12, 13]) == ([], None)  # 11 and 12 have none left either
    assert bm.match_prefix([21])[0] != []


def test_chain_resumes_at_the_last_snapshot_in_it():
    bm = BlockManager(8, 64)
    blocks = _chain(bm, [1, 2, 3], [None, None, None])
    bm._drop_snapshot(blocks[2])
    got, snap = bm.match_prefix([1, 2, 3])
    assert got == blocks[:2] and torch.equal(snap[1][1], torch.full((3, 2), 2.0))
    assert bm.hits == 2 and bm.queries == 3


def test_zero_budget_and_oversized_snapshots_keep_latents_but_no_kda_resume():
    bm = BlockManager(4, 64, snapshot_budget_bytes=0)
    _chain(bm, [5, 6], [None, None])
    assert not bm.snapshot_of and bm.snapshot_total == 0 and bm.block_of_hash.keys() == {5, 6}
    assert bm.match_prefix([5, 6]) == ([], None)
    # a model without KDA layers has empty snapshots: free under any budget
    bm2 = BlockManager(4, 64, snapshot_budget_bytes=0)
    blocks = _chain(bm2, [7, 8], [{}, {}])
    assert bm2.match_prefix([7, 8]) == (blocks, {})


def test_eviction_and_reset_account_for_the_bytes():
    bm = BlockManager(2, 64, snapshot_budget_bytes=10 * SNAP_BYTES)
    blocks = _chain(bm, [1, 2], [None, None])
    bm.release(blocks)
    bm.allocate(1)  # reuses (evicts) the least recently freed block: its snapshot goes with it
    assert bm.snapshot_total == SNAP_BYTES and len(bm.snapshot_of) == 1
    bm.reset_prefix_cache()
    assert bm.snapshot_total == 0 and not bm.snapshot_of


def test_engine_config_checks_the_budget():
    with pytest.raises(ValueError, match="EngineConfig.prefix_cache_kda_gib must be >= 0"):
        EngineConfig(prefix_cache_kda_gib=-1).validate()
    with pytest.raises(ValueError, match="prefix_cache_kda_gib"):
        EngineConfig(prefix_cache_kda_gib=float("nan")).validate()
