"""The model runner: owns the model, the engine's page pool and the requests' KDA state, and runs one
step's forward. A step's decode rows go through the fixed-shape decode path (graph_runner.py: CUDA
graphs on a GPU) when it takes them; everything else (prefill chunks, mixed batches) runs eagerly over a
context from ``zmrl.model.context.paged_context``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from zmrl.model.cache import latent_store
from zmrl.model.context import SequenceState, int64_tensor, paged_context
from zmrl.model.kda import KimiDeltaAttention

from .config import EngineConfig
from .graph_runner import DecodeGraphRunner
from .request import Request
from .sampling import is_plain


def plain_temperature(reqs: list[Request]) -> float | None:
    """The temperature every request samples at when all draw from the whole vocabulary (no top-k / top-p) and
    none has siblings to fork now (they sample from its row with their own keys); else None. (A sampled request
    without a seed, which the engine never runs, is left to the eager sampler's error.)"""
    temperature = reqs[0].params.temperature
    for r in reqs:
        p = r.params
        if r.fork_ids or p.temperature != temperature or not is_plain(p) or (p.seed is None and not p.greedy):
            return None
    return temperature


def resolve_decode_graphs(setting: str, model) -> str:
    """``EngineConfig.decode_graphs`` for this model: "auto" becomes "cuda" on a GPU, else "off".

    Models sharded by zmrl.parallel decode eagerly: their collectives and the expert-parallel dispatch
    (host offsets per rank) are not capture-safe yet, so "auto" turns graphs off and a forced mode is refused.
    """
    sharded = getattr(model, "parallel_config", None) is not None
    if setting == "auto":
        return "cuda" if model.device.type == "cuda" and not sharded else "off"
    if setting != "off" and sharded:
        raise ValueError(f"EngineConfig.decode_graphs={setting!r} is not supported for a model sharded by "
                         "zmrl.parallel (tensor/expert parallel): use 'auto' or 'off'")
    return setting


@dataclass
class StepForward:
    computed: list[Request]  # every request of the batch, in the order its tokens were computed
    ready: list[Request]  # those whose next token is due (all their tokens are computed) ...
    logits: torch.Tensor | None  # ... and their logits rows [len(ready), V] fp32
    # ... or, when the decode graph drew them already (every row a plain draw at one temperature, no fork due),
    # their token ids, log-probs and finite flags [3, len(ready)] float64 (sampler.fetch reads them)
    sampled: torch.Tensor | None = None


class ModelRunner:
    def __init__(self, model, config: EngineConfig, max_model_len: int):
        self.model, self.config = model, config
        self.device = model.device
        self.block_size = config.block_size
        decode_graphs = resolve_decode_graphs(config.decode_graphs, model)
        graphs = decode_graphs != "off"
        # With decode graphs the store has one more page than the block manager hands out: the scratch page
        # that a padded batch's dummy rows write to.
        self.store = latent_store(model.config, config.num_blocks + graphs, self.block_size, model.dtype, model.device)
        self.graphs = (DecodeGraphRunner(
            model, self.store, scratch_page=config.num_blocks, max_num_seqs=config.max_num_seqs,
            max_pages=min(config.num_blocks, -(-max_model_len // self.block_size)),
            mode=decode_graphs, latent_format=config.latent_format,  # type: ignore[arg-type]
            batch_sizes=config.decode_graph_batch_sizes,
        ) if graphs else None)
        # Keys of the per-request KDA states: the layer index, or (layer, virtual shard) for a model
        # sharded by zmrl.parallel (each shard of heads keeps its own state).
        self.kda_layers = [m.layer_idx for m in model.modules() if isinstance(m, KimiDeltaAttention)]

    # ------------------------------------------------------------------ request state (scheduler.RequestState)
    def release(self, req: Request) -> None:
        if self.graphs is not None:
            self.graphs.release(req.request_id)

    def evict(self, req: Request) -> None:
        if self.graphs is not None:
            self.graphs.evict(req)

    def fork(self, parent: Request, child: Request, src_page: int | None, dst_page: int | None) -> None:
        if src_page is not None:
            self.store.copy_page(src_page, dst_page)
        child.seq.kda = {k: v.clone() for k, v in parent.seq.kda.items()}

    # ------------------------------------------------------------------ one step
    def run(self, batch: list[tuple[Request, int]]) -> StepForward:
        """Compute the batch's tokens (eager rows first, then the fixed-shape decode rows)."""
        decode = self._graph_decodes(batch)
        if len(decode) == len(batch):  # the common decode step: every row is in the fixed-shape batch
            eager = []
        else:
            in_graph = {id(r) for r in decode}
            eager = [(r, n) for r, n in batch if id(r) not in in_graph]
        ready: list[Request] = []
        parts: list[torch.Tensor] = []
        if eager:
            reqs, logits = self._forward_eager(eager)
            ready += reqs
            parts.append(logits)
        if decode:
            temperature = None if eager or not self.config.sample_in_graph else plain_temperature(decode)
            result = self.graphs.run(decode, temperature)
            for r in decode:
                r.seq.num_tokens += 1
                if self.config.enable_prefix_caching and r.num_computed % self.block_size == 0:
                    self.graphs.snapshot(r)
            ready += decode
            if result.sampled is not None:
                return StepForward(decode, ready, None, result.sampled)
            parts.append(result.logits)
        computed = [r for r, _ in eager] + decode
        if not parts:
            return StepForward(computed, [], None)
        return StepForward(computed, ready, parts[0] if len(parts) == 1 else torch.cat(parts))

    def _graph_decodes(self, batch: list[tuple[Request, int]]) -> list[Request]:
        """The batch's decode rows (one token, the last one) when the graph runner takes them."""
        if self.graphs is None:
            return []
        decode = [r for r, n in batch if n == 1 and r.num_computed == r.num_tokens - 1]
        return decode if self.graphs.accepts(decode) else []

    def _forward_eager(self, batch: list[tuple[Request, int]]) -> tuple[list[Request], torch.Tensor]:
        """Varlen forward of any mix of prefill chunks and decodes; logits of the rows that finished their tokens."""
        for r, _ in batch:
            self.evict(r)
        reqs = [r for r, _ in batch]
        seqs: list[SequenceState] = [r.seq for r in reqs]
        ctx = paged_context([s.page_array() for s in seqs], [s.num_tokens for s in seqs], [n for _, n in batch],
                            self.store, self.device, kda_states=seqs,
                            record_snapshots=self.config.enable_prefix_caching,
                            latent_format=self.config.latent_format)  # type: ignore[arg-type]
        ids = int64_tensor([t for r, n in batch for t in r.token_slice(r.num_computed, r.num_computed + n)]
                           ).to(self.device)
        hidden = self.model(ids, ctx)
        for r, n in batch:
            r.seq.num_tokens += n
        rows = [j for j, r in enumerate(reqs) if r.num_computed == r.num_tokens]
        if not rows:
            return [], hidden.new_zeros(0, self.model.config.vocab_size, dtype=torch.float32)
        last = ctx.cu_seqlens[1:][torch.tensor(rows, device=ctx.cu_seqlens.device)] - 1
        return [reqs[j] for j in rows], self.model.compute_logits(hidden[last])
