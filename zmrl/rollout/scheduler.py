"""Which tokens of which requests run in the next step: continuous batching under a token budget,
chunked prefill, prefix-cache hits, preemption by recompute when pages run out, forks of ``n > 1``
requests, and finishing. Pure bookkeeping over requests and page ids: every tensor operation (KDA
state, page copies) is the model runner's, reached through ``RequestState``.
"""
from __future__ import annotations

import logging
from collections import deque
from typing import TYPE_CHECKING, Any, Protocol

from zmrl.model.context import SequenceState

from .block_manager import BlockManager, block_hash, restore_kda
from .request import Request, RolloutOutput

if TYPE_CHECKING:
    from .config import EngineConfig
    from .sampler import Draw

log = logging.getLogger(__name__)


class RequestState(Protocol):
    """What the scheduler asks of the holder of the requests' tensors (the model runner)."""

    device: Any

    def release(self, req: Request) -> None:
        """The request's state is dropped (finished or preempted)."""

    def evict(self, req: Request) -> None:
        """Bring the request's KDA state back into its ``SequenceState`` (it is about to be copied)."""

    def fork(self, parent: Request, child: Request, src_page: int | None, dst_page: int | None) -> None:
        """Give ``child`` a copy of the parent's KDA state, and of page ``src_page`` in ``dst_page``."""


class Scheduler:
    def __init__(self, config: "EngineConfig", max_model_len: int, kda_layers: list, state: RequestState):
        self.config, self.max_model_len, self.kda_layers, self.state = config, max_model_len, kda_layers, state
        self.block_size = config.block_size
        # The only allocator of the engine's page pool.
        self.blocks = BlockManager(config.num_blocks, self.block_size, config.enable_prefix_caching,
                                   snapshot_budget_bytes=int(config.prefix_cache_kda_gib * 2**30))
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.finished: list[RolloutOutput] = []
        self.ids: set[str] = set()
        self.weights_version = 0
        self.num_preemptions = 0

    # ------------------------------------------------------------------ requests in and out
    def add(self, request_id: str, prompt: list[int], params) -> None:
        ids = [str(request_id)] if params.n == 1 else [f"{request_id}-{j}" for j in range(params.n)]
        dup = [i for i in ids if i in self.ids]
        if dup:
            raise ValueError(f"request id {dup[0]!r} is already in use by an unfinished request")
        self.ids.update(ids)
        req = Request(ids[0], prompt, params, fork_ids=ids[1:])
        longest = min(len(prompt) + params.max_tokens, self.max_model_len)
        if -(-longest // self.block_size) > self.config.num_blocks:
            msg = (f"request {req.request_id!r} needs up to {longest} tokens = {-(-longest // self.block_size)} blocks "
                   f"of {self.block_size}, but the cache has only num_blocks={self.config.num_blocks}")
            for j, rid in enumerate(ids):
                self._finish(Request(rid, prompt, params, sample_index=j), "error", error=msg)
            return
        if params.n > self.config.max_num_seqs:
            log.warning("request %r has n=%d samples, more than max_num_seqs=%d: it runs alone (decode steps "
                        "without CUDA graphs) and the requests queued after it wait for it", request_id, params.n,
                        self.config.max_num_seqs)
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.finished)

    def take_finished(self) -> list[RolloutOutput]:
        out, self.finished = self.finished, []
        return out

    def new_weights(self) -> int:
        """Cached prefixes hold values of the old weights: forget them. Returns the new weights version."""
        if self.waiting or self.running:
            raise RuntimeError("update_weights with unfinished requests: their caches hold old-weight values")
        self.weights_version += 1
        self.blocks.reset_prefix_cache()
        return self.weights_version

    # ------------------------------------------------------------------ the next step
    def _blocks_needed(self, req: Request, n: int) -> int:
        return max(0, -(-(req.num_computed + n) // self.block_size) - len(req.seq.pages))

    def _preempt(self, req: Request) -> None:
        """Free everything the request holds; it recomputes prompt + output so far when rescheduled."""
        self.blocks.release(req.seq.pages)
        req.seq.reset()
        self.state.release(req)
        req.hashes = []
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.running.remove(req)
        self.waiting.appendleft(req)
        log.debug("preempted %s at %d tokens", req.request_id, len(req.tokens))

    def _full_block_hashes(self, req: Request, n_blocks: int, start: list[int]) -> list[int]:
        hashes = list(start)
        bs = self.block_size
        for b in range(len(hashes), n_blocks):
            hashes.append(block_hash(hashes[-1] if hashes else None, req.token_slice(b * bs, (b + 1) * bs),
                                     self.weights_version))
        return hashes

    def _apply_prefix_cache(self, req: Request) -> None:
        if not self.config.enable_prefix_caching:
            return
        # At least the last token must be computed: its logits are needed for sampling.
        n_full = (len(req.tokens) - 1) // self.block_size
        hashes = self._full_block_hashes(req, n_full, [])
        blocks, snapshot = self.blocks.match_prefix(hashes)
        if not blocks:
            return
        self.blocks.share(blocks)
        req.seq.pages = list(blocks)
        req.seq.num_tokens = len(blocks) * self.block_size
        req.seq.kda = restore_kda(snapshot)
        req.hashes = hashes[: len(blocks)]

    def schedule(self) -> list[tuple[Request, int]]:
        """(request, number of its tokens to compute) for the next step, pages allocated for them."""
        budget = self.config.max_num_batched_tokens
        batch: list[tuple[Request, int]] = []
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed, budget)
            need = self._blocks_needed(req, n)
            if need:  # nothing allocated or preempted for a sequence whose pages already hold its next tokens
                preempted_self = False
                while need > self.blocks.num_free:  # preempting another request does not change this one's need
                    victim = self.running[-1]
                    self._preempt(victim)
                    if victim is req:
                        preempted_self = True
                        break
                if preempted_self:
                    continue
                req.seq.pages.extend(self.blocks.allocate(need))
            batch.append((req, n))
            budget -= n
            i += 1
        # max_num_seqs counts sequences: a prompt with n samples takes n slots once it forks. Admitting it on
        # one free slot overfilled the decode batch past the largest graph bucket, and every later step
        # ran eagerly (the 64 x 8 rollout benchmark: ~10x slower steps). A request that needs more slots
        # than the engine has runs alone, so that nothing waits forever.
        seqs = sum(_num_seqs(r) for r in self.running)
        while self.waiting and budget > 0:
            req = self.waiting[0]
            if self.running and seqs + _num_seqs(req) > self.config.max_num_seqs:
                break
            if req.num_computed == 0 and not req.seq.pages:
                self._apply_prefix_cache(req)
            n = min(req.num_tokens - req.num_computed, budget)
            need = self._blocks_needed(req, n)
            if need > self.blocks.num_free:
                if req.seq.pages:  # give prefix-cache references back while it waits
                    self.blocks.release(req.seq.pages)
                    req.seq.reset()
                    req.hashes = []
                break
            req.seq.pages.extend(self.blocks.allocate(need))
            self.waiting.popleft()
            self.running.append(req)
            seqs += _num_seqs(req)
            batch.append((req, n))
            budget -= n
        if not batch and self.waiting and not self.running:
            raise RuntimeError("scheduler made no progress with an empty running set (this is a bug)")
        return batch

    # ------------------------------------------------------------------ after the forward
    def register_blocks(self, reqs: list[Request]) -> None:
        """Publish the requests' newly completed full blocks (with their KDA snapshots) for prefix caching."""
        if not self.config.enable_prefix_caching:
            return
        for r in reqs:
            self._register(r)

    def _register(self, r: Request) -> None:
        n_full = r.num_computed // self.block_size
        if n_full <= len(r.hashes):
            return
        first_new = len(r.hashes)
        r.hashes = self._full_block_hashes(r, n_full, r.hashes)
        for b in range(first_new, n_full):
            end = (b + 1) * self.block_size
            snap = {}
            for layer in self.kda_layers:
                st = r.seq.kda.get(layer)
                if st is None or end not in st.snapshots:
                    return  # computed before snapshots were recorded: leave it unpublished
                snap[layer] = st.snapshots[end]
            self.blocks.register(r.seq.pages[b], r.hashes[b], snap)

    def with_forks(self, ready: list[Request]) -> list[tuple[Request, int]]:
        """(request, logits row) of everything that samples this step: each ready request, followed by the
        siblings forked from it when its prompt is done (n > 1), on the same row."""
        if not any(r.fork_ids for r in ready):
            return list(zip(ready, range(len(ready))))
        rows: list[tuple[Request, int]] = []
        for row, r in enumerate(ready):
            rows.append((r, row))
            if r.fork_ids:
                rows.extend((child, row) for child in self._fork(r))
        return rows

    def _fork(self, parent: Request) -> list[Request]:
        """Siblings of an n > 1 request share the prompt's full blocks and copy its partial last block."""
        children = []
        self.state.evict(parent)  # the children copy its KDA state
        for j, cid in enumerate(parent.fork_ids, start=parent.sample_index + 1):
            child = Request(cid, parent.prompt, parent.params, sample_index=j)
            n_full = parent.num_computed // self.block_size
            partial = parent.num_computed % self.block_size != 0
            if partial and self.blocks.num_free == 0:
                self.waiting.appendleft(child)  # no block to copy into: it recomputes (or hits the prefix cache)
                continue
            shared = parent.seq.pages[:n_full]
            self.blocks.share(shared)
            pages = list(shared)
            src = dst = None
            if partial:
                (dst,) = self.blocks.allocate(1)
                src = parent.seq.pages[n_full]
                pages.append(dst)
            child.seq = SequenceState(num_tokens=parent.num_computed, pages=pages)
            self.state.fork(parent, child, src, dst)
            child.hashes = list(parent.hashes)
            self.running.append(child)
            children.append(child)
        parent.fork_ids = []
        return children

    def apply(self, errors: list[tuple[Request, str]], draws: list["Draw"]) -> None:
        """Record what the sampler drew; finish requests that failed, stopped or reached their length."""
        for r, error in errors:
            self._drop(r, "error", error=error)
        for d in draws:
            r = d.request
            r.output.append(d.token)
            r.logprobs.append(d.logprob)
            p = r.params
            if p.stop_token_ids and d.token in p.stop_token_ids:
                self._drop(r, "stop")
            elif len(r.output) >= p.max_tokens or r.num_tokens >= self.max_model_len:
                self._drop(r, "length")

    def _drop(self, r: Request, reason: str, error: str | None = None) -> None:
        self.blocks.release(r.seq.pages)
        r.seq.reset()
        self.state.release(r)
        if r in self.running:
            self.running.remove(r)
        self._finish(r, reason, error)

    def _finish(self, r: Request, reason: str, error: str | None = None) -> None:
        self.ids.discard(r.request_id)
        self.finished.append(r.finish(reason, self.weights_version, self.state.device, error))


def _num_seqs(req: Request) -> int:
    """Sequences a request holds once its prompt is done: itself and the samples it will fork."""
    return 1 + len(req.fork_ids)
