"""A minimal paged cache for incremental forwards: page pool for MLA latents and index keys, plus
per-sequence KDA state. The rollout engine puts its scheduler, prefix cache and preemption on top."""
from __future__ import annotations

import torch

from .config import ModelConfig
from .context import ForwardContext, LatentFormat, PagedLatentStore, SequenceState, paged_context


class CacheFullError(RuntimeError):
    """No free page for a sequence's next tokens (the engine preempts; direct users see this)."""


def latent_store(cfg: ModelConfig, num_pages: int, page_size: int = 64, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> PagedLatentStore:
    """The page pool of every MLA layer of ``cfg`` (latents, and index keys when the model has a DSA indexer:
    FP8, or the model dtype with ``index_quant: none``, for the layers whose indexer computes a selection)."""
    if num_pages < 1:
        raise ValueError(f"num_pages must be >= 1, got {num_pages}")
    mla_layers = [i for i in range(cfg.num_hidden_layers) if not cfg.is_kda_layer(i)]
    index_layers = cfg.index_key_layers()
    index_dtype = torch.float8_e4m3fn if cfg.index_quant == "fp8" else dtype
    return PagedLatentStore(mla_layers, num_pages, page_size, cfg.kv_lora_rank + cfg.qk_rope_head_dim,
                            cfg.index_head_dim if cfg.has_indexer else None, dtype, device,
                            index_dtype=index_dtype, index_layers=index_layers)


class ModelCache:
    """A page pool with its own free list, for direct users of ``forward_incremental``. (The rollout engine
    uses ``latent_store`` with its block manager as the only allocator.)"""

    def __init__(self, cfg: ModelConfig, num_pages: int, page_size: int = 64, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", latent_format: LatentFormat = "native"):
        self.cfg, self.page_size, self.latent_format = cfg, page_size, latent_format
        self.device = torch.device(device)
        self.store = latent_store(cfg, num_pages, page_size, dtype, device)
        self.free_pages: list[int] = list(range(num_pages - 1, -1, -1))  # pop() hands out page 0 first

    @property
    def num_free_pages(self) -> int:
        return len(self.free_pages)

    def pages_needed(self, seq: SequenceState, num_new: int) -> int:
        total = seq.num_tokens + num_new
        return max(0, -(-total // self.page_size) - len(seq.pages))

    def allocate(self, seq: SequenceState, num_new: int) -> None:
        need = self.pages_needed(seq, num_new)
        if need > len(self.free_pages):
            raise CacheFullError(f"need {need} free pages, {len(self.free_pages)} left")
        seq.pages.extend(self.free_pages.pop() for _ in range(need))

    def release(self, seq: SequenceState) -> None:
        self.free_pages.extend(reversed(seq.pages))
        seq.reset()

    def context(self, seqs: list[SequenceState], num_new: list[int], record_snapshots: bool = False) -> ForwardContext:
        """Allocate pages for ``num_new`` tokens of each sequence and describe the batch."""
        for s, n in zip(seqs, num_new):
            if s.num_tokens + n > self.cfg.max_position_embeddings:
                raise ValueError(f"sequence would reach {s.num_tokens + n} tokens, more than "
                                 f"max_position_embeddings={self.cfg.max_position_embeddings}")
            self.allocate(s, n)
        return paged_context([s.page_array() for s in seqs], [s.num_tokens for s in seqs], num_new, self.store,
                             self.device, kda_states=seqs, latent_format=self.latent_format,
                             record_snapshots=record_snapshots)


@torch.no_grad()
def forward_incremental(model, cache: ModelCache, seqs: list[SequenceState], new_tokens: list[torch.Tensor],
                        logits_rows: str = "all") -> torch.Tensor:
    """Engine path: run the new tokens of each sequence over its cache; returns fp32 logits.

    ``logits_rows="all"`` gives [T, V] for every new token, ``"last"`` gives [N, V] for the last new
    token of each sequence (the lm_head is row-invariant, so both agree bitwise on shared rows).
    """
    lens = [int(t.numel()) for t in new_tokens]
    if any(n < 1 for n in lens):
        raise ValueError(f"every sequence needs at least one new token, got lengths {lens}")
    ctx = cache.context(seqs, lens)
    ids = torch.cat([t.reshape(-1) for t in new_tokens]).to(cache.device)
    hidden = model(ids, ctx)
    for s, n in zip(seqs, lens):
        s.num_tokens += n
    if logits_rows == "last":
        hidden = hidden[ctx.cu_seqlens[1:] - 1]
    return model.compute_logits(hidden)
