"""The scheduler on its own: no model, no tensors. Chunked prefill under the token budget, the block
manager as the only page allocator, preemption by recompute (the runner is told to drop the state),
forks sharing full blocks and copying the partial one, and finishing."""
from __future__ import annotations

import ast
from pathlib import Path

from zmrl.rollout.config import EngineConfig
from zmrl.rollout.sampling import SamplingParams
from zmrl.rollout.scheduler import Scheduler


class FakeState:
    """Stands in for the model runner: records what the scheduler asks of it."""

    device = "cpu"

    def __init__(self):
        self.calls: list[tuple] = []

    def release(self, req):
        self.calls.append(("release", req.request_id))

    def evict(self, req):
        self.calls.append(("evict", req.request_id))

    def fork(self, parent, child, src_page, dst_page):
        self.calls.append(("fork", parent.request_id, child.request_id, src_page, dst_page))


def _compute(batch):
    """What the runner does to the bookkeeping: the scheduled tokens are now computed."""
    for req, n in batch:
        req.seq.num_tokens += n


def test_scheduler_module_has_no_tensor_code():
    tree = ast.parse(Path(__file__).resolve().parents[2].joinpath("zmrl/rollout/scheduler.py").read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert not any(m == "torch" or m.startswith("torch.") for m in imported)


def test_chunked_prefill_preemption_and_finish():
    state = FakeState()
    cfg = EngineConfig(num_blocks=4, max_num_batched_tokens=100, enable_prefix_caching=False)
    sched = Scheduler(cfg, max_model_len=1024, kda_layers=[0], state=state)
    sched.add("a", list(range(150)), SamplingParams(max_tokens=10))  # at most 3 blocks of 64
    sched.add("b", list(range(60)), SamplingParams(max_tokens=10))  # at most 2 blocks
    batch = sched.schedule()
    assert [(r.request_id, n) for r, n in batch] == [("a", 100)]  # the budget cuts a's prefill
    assert batch[0][0].seq.pages == [0, 1] and sched.blocks.num_free == 2
    _compute(batch)
    batch = sched.schedule()
    assert [(r.request_id, n) for r, n in batch] == [("a", 50), ("b", 50)]
    _compute(batch)
    a, b = sched.running
    # a's next tokens need a 4th block and none is free: the last running request is preempted (it
    # recomputes later) and its block goes to a
    a.output += [1] * 50
    b.output += [1] * 5
    batch = sched.schedule()
    assert [(r.request_id, n) for r, n in batch] == [("a", 50)]
    assert ("release", "b") in state.calls and sched.num_preemptions == 1 and b.num_computed == 0
    assert list(sched.waiting) == [b] and b.seq.pages == []
    _compute(batch)
    sched._drop(a, "length")
    (out,) = sched.take_finished()
    assert out.request_id == "a" and out.finish_reason == "length" and sched.blocks.num_free == 4


def test_fork_shares_full_blocks_and_copies_the_partial_one():
    state = FakeState()
    sched = Scheduler(EngineConfig(num_blocks=8, enable_prefix_caching=False), 1024, [0], state)
    sched.add("p", list(range(70)), SamplingParams(max_tokens=5, n=3))
    batch = sched.schedule()
    _compute(batch)
    (parent,) = [r for r, _ in batch]
    rows = sched.with_forks([parent])
    assert [(r.request_id, row) for r, row in rows] == [("p-0", 0), ("p-1", 0), ("p-2", 0)]
    assert state.calls[0] == ("evict", "p-0")
    children = [r for r, _ in rows[1:]]
    for child, call in zip(children, state.calls[1:]):
        assert child.seq.pages[0] == parent.seq.pages[0]  # the full block is shared
        assert child.seq.pages[1] != parent.seq.pages[1]  # the partial one is a copy
        assert call == ("fork", "p-0", child.request_id, parent.seq.pages[1], child.seq.pages[1])
    assert sched.blocks.ref_count[parent.seq.pages[0]] == 3


def test_max_num_seqs_counts_the_samples_a_prompt_will_fork():
    """A prompt with n samples takes n of the max_num_seqs slots (a decode batch stays within it, so it fits
    the largest decode-graph bucket); a request with more samples than that runs alone instead of waiting
    forever (its batch exceeds max_num_seqs: decode without graphs)."""
    sched = Scheduler(EngineConfig(num_blocks=64, max_num_seqs=4, enable_prefix_caching=False), 1024, [0], FakeState())
    sched.add("a", list(range(10)), SamplingParams(max_tokens=5, n=3))
    sched.add("b", list(range(10)), SamplingParams(max_tokens=5, n=2))
    batch = sched.schedule()
    assert [r.request_id for r, _ in batch] == ["a-0"]  # 3 + 2 sequences > 4: b waits
    _compute(batch)
    sched.with_forks([batch[0][0]])
    assert len(sched.running) == 3
    assert [r.request_id for r, _ in sched.schedule()] == ["a-0", "a-1", "a-2"]
    sched._drop(sched.running[0], "length")
    batch = sched.schedule()  # two slots free: b (two samples) is admitted
    assert [r.request_id for r, _ in batch] == ["a-1", "a-2", "b-0"]
    _compute(batch)
    sched.with_forks([batch[-1][0]])
    assert len(sched.running) == 4

    wide = Scheduler(EngineConfig(num_blocks=64, max_num_seqs=2, enable_prefix_caching=False), 1024, [0], FakeState())
    wide.add("w", list(range(10)), SamplingParams(max_tokens=5, n=3))
    wide.add("x", list(range(10)), SamplingParams(max_tokens=5))
    assert [r.request_id for r, _ in wide.schedule()] == ["w-0"]
