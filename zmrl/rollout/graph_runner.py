"""Static-shape decode for the rollout engine, replayed from CUDA graphs on the GPU.

A decode step (one new token for each of N running sequences) is the engine's hot loop, and eager it
is bound by Python and kernel launches, not by the GPU (docs/cuda_graph_decode.md). As in vLLM and
nano-vllm, the step is captured once per (batch bucket, context bucket) with ``torch.cuda.CUDAGraph``
and replayed:

* inputs live in static device buffers (token ids, positions, cache slots, KDA pool slots, block
  table) that each step fills with one host->device copy; a batch is padded up to its bucket, the
  padding rows pointing at a scratch cache page and a scratch KDA slot, their logits dropped;
* KDA state lives in a ``KDAStatePool`` (fixed addresses) instead of per-sequence tensors; a
  sequence is loaded into a slot when it starts decoding here and written back to its
  ``KDASeqState`` only when an eager path needs it (a fork);
* every op takes its shapes from the bucket (``ForwardContext.static_kv_len``), never from device
  values, so nothing synchronises inside the step;
* when every row samples the same way (one temperature, no top-k / top-p: an RL rollout's steps) the
  graph also draws the tokens and their log-probs (``sampling.sample_plain``; each row's counter state is
  its request's seed part, kept per pool slot and copied in with the other inputs, mixed with the position
  on the device), so the step's only eager work is the fetch of the result.

The step runs the same modules and ops as every other forward and is bitwise equal to the eager
path (batch invariance: a row's bits depend on neither the batch size nor the padding); tests
compare the two token by token. ``mode="static"`` runs the same fixed-shape code without capture
(any device), which is how CPU tests cover it.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch

from zmrl.kernels_batch_invariant import current_numerics, get_mode
from zmrl.model.context import ForwardContext, PagedLatentStore, int64_tensor
from zmrl.model.kda_pool import KDAStatePool

from .sampling import mix_positions, sample_plain, seed_key_state

if TYPE_CHECKING:
    from zmrl.model.context import SequenceState

    from .request import Request

log = logging.getLogger(__name__)

DecodeGraphs = Literal["auto", "off", "static", "cuda"]
DECODE_GRAPH_MODES: tuple[str, ...] = ("auto", "off", "static", "cuda")


def buckets(limit: int, sizes: Sequence[int] | None = None) -> list[int]:
    """The bucket sizes up to ``limit``: ``sizes`` (by default 1, 2, 4, ...) below ``limit``, then ``limit``
    itself. A batch runs at the smallest bucket that holds it, its other rows padding: finer buckets pad less
    (a draining RL rollout passes through every batch size) but capture more graphs."""
    if sizes is None:
        sizes = [1 << i for i in range(limit.bit_length())]
    return sorted({s for s in sizes if s < limit}) + [limit]


def bucket_of(n: int, sizes: list[int]) -> int:
    return next(b for b in sizes if b >= n)


@dataclass
class _Captured:
    graph: "torch.cuda.CUDAGraph"
    logits: torch.Tensor  # [bs, V] fp32, written by every replay
    sampled: torch.Tensor | None  # [3, bs] float64 (sampling.sample_plain) when the graph samples


@dataclass
class DecodeResult:
    logits: torch.Tensor  # [n, V] fp32
    sampled: torch.Tensor | None  # [3, n] float64: token ids, log-probs, finite flags (``sample_temperature`` set)


class DecodeGraphRunner:
    """Runs decode batches through the static path: captured graphs (``mode="cuda"``) or eagerly."""

    def __init__(self, model, store: PagedLatentStore, scratch_page: int, max_num_seqs: int, max_pages: int,
                 mode: DecodeGraphs, latent_format: str = "native", batch_sizes: Sequence[int] | None = None):
        if mode not in ("static", "cuda"):
            raise ValueError(f"DecodeGraphRunner mode must be 'static' or 'cuda', got {mode!r}")
        self.device = model.device
        if mode == "cuda" and self.device.type != "cuda":
            raise ValueError(f"decode_graphs='cuda' needs the model on a CUDA device, it is on {self.device}")
        self.model, self.store, self.mode, self.latent_format = model, store, mode, latent_format
        self.page_size = store.page_size
        self.scratch_page = scratch_page
        self.batch_sizes = buckets(max_num_seqs, batch_sizes)
        self.page_counts = buckets(max_pages)
        self.pool = KDAStatePool(model, max_num_seqs, self.device)
        self.free_slots = list(range(max_num_seqs - 1, -1, -1))
        self.slot_of: dict[str, int] = {}  # request id -> pool slot holding its KDA state
        mb = self.batch_sizes[-1]
        # ids, positions, cache slots, pool slots, sampler seed states: one contiguous [5, bs] device tensor per
        # batch bucket (``_static_inputs``), filled by one copy per step from the first 5 * bs entries of a pinned
        # host buffer (contiguous on both sides: a strided copy would go through a pageable temporary).
        pin = self.device.type == "cuda"
        self._host = torch.zeros(5 * mb, dtype=torch.int64, pin_memory=pin)
        self._inputs: dict[int, torch.Tensor] = {}
        # per pool slot, the sampler's per-request state (sampling.seed_key_state) of the request holding it,
        # written when the slot is taken; a step gathers its rows' entries like the block-table rows
        self._slot_seed_keys = torch.zeros(max_num_seqs + 1, dtype=torch.int64)
        self.cu_seqlens = torch.arange(mb + 1, dtype=torch.int64, device=self.device)
        self.seq_idx = torch.arange(mb, dtype=torch.int64, device=self.device)
        # Block tables: one persistent host row per pool slot (the scratch slot's row is all scratch page, what
        # a padding row reads), written only when the slot's page list grows or changes; a step gathers its
        # rows into the bucket's host table, which one copy moves to the bucket's device table.
        self._slot_pages = torch.full((max_num_seqs + 1, self.page_counts[-1]), scratch_page, dtype=torch.int64)
        self._slot_rows: list[tuple[list[int], int] | None] = [None] * (max_num_seqs + 1)
        self._block_tables: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        # keyed on the bit-relevant numerics (kernel mode, KDA form, ...): a graph replays the kernels it captured
        self._graphs: dict[tuple[tuple[tuple[str, str], ...], int, int, float | None], _Captured] = {}
        self._graph_pool = None
        self._copied: "torch.cuda.Event | None" = None
        # what a padding row feeds: token 0 at position 0, written to the scratch page and the scratch slot
        self._pad_row = torch.tensor([[0], [0], [scratch_page * self.page_size], [self.pool.scratch_slot], [0]])

    # ------------------------------------------------------------------ admission
    def accepts(self, reqs: list["Request"]) -> bool:
        """Whether these decode requests fit a bucket and the pool (else the engine runs them eagerly)."""
        if not reqs or len(reqs) > self.batch_sizes[-1]:
            return False
        if self.mode == "cuda" and get_mode() != "bitwise":
            return False  # the stock kernels of fast mode read lengths on the host: not capturable
        if max(len(r.seq.pages) for r in reqs) > self.page_counts[-1]:
            return False
        new = sum(r.request_id not in self.slot_of for r in reqs)
        return new <= len(self.free_slots)

    def release(self, request_id: str) -> None:
        """Free a request's pool slot (finished or preempted: its state is dropped)."""
        slot = self.slot_of.pop(request_id, None)
        if slot is not None:
            self.free_slots.append(slot)
            self._slot_rows[slot] = None

    def evict(self, req: "Request") -> None:
        """Hand a request's KDA state back to its ``KDASeqState`` (an eager forward or a fork follows)."""
        slot = self.slot_of.get(req.request_id)
        if slot is not None:
            self.pool.store(req.seq, slot)
            self.release(req.request_id)

    def snapshot(self, req: "Request") -> None:
        """Record the prefix-cache snapshot of a request whose last step completed a 64-token chunk."""
        self.pool.snapshot(req.seq, self.slot_of[req.request_id])

    # ------------------------------------------------------------------ the step
    @torch.no_grad()
    def run(self, reqs: list["Request"], sample_temperature: float | None = None) -> DecodeResult:
        """Logits [len(reqs), V] (fp32) of one decode step: each request's next token at ``num_computed``; with
        ``sample_temperature`` also the draw of every row at that temperature without top-k / top-p (the
        caller's promise: the graph reads no request's parameters but its seed state)."""
        n = len(reqs)
        bs = bucket_of(n, self.batch_sizes)
        pages = bucket_of(max(len(r.seq.pages) for r in reqs), self.page_counts)
        ps = self.page_size
        # One pass over the requests builds each static input as a Python list (one tensor per step, not one
        # element write per request) and brings the slots' block-table rows up to date.
        ids, positions, cache_slots, pool_slots = [], [], [], []
        slot_of, slot_rows = self.slot_of, self._slot_rows
        for r in reqs:
            slot = slot_of.get(r.request_id)
            if slot is None:
                slot = self.free_slots.pop()
                self.pool.load(r.seq, slot)
                slot_of[r.request_id] = slot
                self._slot_seed_keys[slot] = seed_key_state(r.params, r.sample_key)
            seq = r.seq
            pos, seq_pages = seq.num_tokens, seq.pages
            ids.append(r.token_at(pos))
            positions.append(pos)
            cache_slots.append(seq_pages[pos // ps] * ps + pos % ps)
            pool_slots.append(slot)
            held = slot_rows[slot]
            if held is None or held[0] is not seq_pages or held[1] != len(seq_pages):
                self._write_slot_row(slot, seq, held)
        if max(positions) >= pages * ps:  # the ops take this width on trust (mla_attention.key_width)
            raise RuntimeError(f"decode step: position {max(positions)} beyond the bucket's {pages * ps} keys")
        if self._copied is not None:
            self._copied.synchronize()  # the pinned buffers are still being read by the last step's copy
        host = self._host[: 5 * bs].view(5, bs)
        host[:4, :n] = int64_tensor(ids + positions + cache_slots + pool_slots).view(4, n)
        host[:, n:] = self._pad_row
        if sample_temperature is not None:
            torch.index_select(self._slot_seed_keys, 0, host[3], out=host[4])
        bt_dev, bt_host = self._block_table(bs, pages)
        # padding rows gather the scratch slot's row: every entry the scratch page
        torch.index_select(self._slot_pages[:, :pages], 0, host[3], out=bt_host)
        self._static_inputs(bs).copy_(host, non_blocking=True)
        bt_dev.copy_(bt_host, non_blocking=True)
        if self.device.type == "cuda":
            self._copied = torch.cuda.Event()
            self._copied.record()
        if self.mode == "static":
            logits, sampled = self._forward(bs, pages, sample_temperature)
        else:
            captured = self._graphs.get((self._numerics_key(), bs, pages, sample_temperature))
            if captured is None:
                captured = self._capture(bs, pages, sample_temperature)
            captured.graph.replay()
            logits, sampled = captured.logits, captured.sampled
        return DecodeResult(logits[:n], None if sampled is None else sampled[:, :n])

    def _write_slot_row(self, slot: int, seq: "SequenceState", held: tuple[list[int], int] | None) -> None:
        """Bring a slot's block-table row to the sequence's pages. A page list only ever grows in place or is
        replaced (``SequenceState.pages``): the same list object with more entries kept its first ones."""
        row, pages, n = self._slot_pages[slot], seq.pages, len(seq.pages)
        if held is not None and held[0] is pages and held[1] < n:
            row[held[1]: n] = int64_tensor(pages[held[1]:])
        else:
            row.fill_(self.scratch_page)
            if n:
                row[:n] = int64_tensor(pages)
        self._slot_rows[slot] = (pages, n)

    def _static_inputs(self, bs: int) -> torch.Tensor:
        """The bucket's [5, bs] device inputs: ids, positions, cache slots, pool slots, sampler seed states."""
        inputs = self._inputs.get(bs)
        if inputs is None:
            inputs = self._inputs[bs] = torch.zeros(5, bs, dtype=torch.int64, device=self.device)
        return inputs

    def _block_table(self, bs: int, pages: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(device table, pinned host table) of one bucket."""
        key = (bs, pages)
        if key not in self._block_tables:
            pin = self.device.type == "cuda"
            host = torch.full((bs, pages), self.scratch_page, dtype=torch.int64, pin_memory=pin)
            self._block_tables[key] = (torch.zeros(bs, pages, dtype=torch.int64, device=self.device), host)
        return self._block_tables[key]

    def _forward(self, bs: int, pages: int, sample_temperature: float | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The fixed-shape step over the static buffers (what a graph captures): logits, and the draw
        (``sample_plain``) when ``sample_temperature`` is set."""
        ids, positions, slot_mapping, kda_slots, seed_keys = self._static_inputs(bs)
        ctx = ForwardContext(
            cu_seqlens=self.cu_seqlens[: bs + 1], positions=positions, seq_idx=self.seq_idx[:bs],
            block_table=self._block_tables[(bs, pages)][0], slot_mapping=slot_mapping, store=self.store,
            kda_states=None, latent_format=self.latent_format,  # type: ignore[arg-type]
            static_kv_len=pages * self.page_size, kda_pool=self.pool, kda_slots=kda_slots,
            validate_ids=False,
        )
        logits = self.model.compute_logits(self.model(ids, ctx))
        if sample_temperature is None:
            return logits, None
        # the token drawn now sits at position + 1
        return logits, sample_plain(logits, sample_temperature, mix_positions(seed_keys, positions + 1))

    @staticmethod
    def _numerics_key() -> tuple[tuple[str, str], ...]:
        return tuple(current_numerics().bit_fields().items())

    def _capture(self, bs: int, pages: int, sample_temperature: float | None) -> _Captured:
        """Capture the step for one bucket. Warm-up and capture run on padding only (scratch page, scratch
        slot): the real rows' inputs are copied in afterwards, so their state is touched once, by the replay."""
        inputs = self._static_inputs(bs)
        saved = inputs.clone()
        bt_dev = self._block_table(bs, pages)[0]
        saved_bt = bt_dev.clone()
        inputs.copy_(self._pad_row.to(self.device).expand(5, bs))
        bt_dev.fill_(self.scratch_page)
        side = torch.cuda.Stream(device=self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self._forward(bs, pages, sample_temperature)  # compiles kernels and warms allocators outside the capture
        torch.cuda.current_stream(self.device).wait_stream(side)
        if self._graph_pool is None:
            self._graph_pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._graph_pool):
            logits, sampled = self._forward(bs, pages, sample_temperature)
        inputs.copy_(saved)
        bt_dev.copy_(saved_bt)
        captured = _Captured(graph, logits, sampled)
        self._graphs[(self._numerics_key(), bs, pages, sample_temperature)] = captured
        log.info("captured decode graph: batch %d, %d pages, sampling %s (%d graphs)", bs, pages,
                 "off" if sample_temperature is None else f"at temperature {sample_temperature}", len(self._graphs))
        return captured
