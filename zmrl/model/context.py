"""What a forward pass needs besides the token ids: where each token sits, where its cache
entries go, and the per-sequence recurrent state.

The trainer and the engine build the same ``ForwardContext``; only the store behind it differs
(an ephemeral, autograd-friendly store for the trainer, persistent pages for the engine), so both
reach the same layer code and the same ops.
"""
from __future__ import annotations

import abc
import array
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Sequence

import torch

from zmrl.kernels_batch_invariant.cache_write import write_cache_rows

if TYPE_CHECKING:
    from .kda_pool import KDAStatePool

LatentFormat = Literal["native", "fp8"]


@dataclass
class KDASeqState:
    """Recurrent state of one KDA layer for one sequence.

    ``state`` is the fp32 delta-rule state at the start of the current 64-token chunk; ``pending``
    holds the rows of that chunk seen so far (k, v, g, beta), so the next call re-runs the chunk
    from its boundary and computes every token with the full-chunk arithmetic (docs/numerics.md, KDA).
    """

    conv: torch.Tensor | None = None  # [W-1, 3*H*dk] last short-conv inputs
    state: torch.Tensor | None = None  # [H, dk, dv] fp32
    pending: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # Chunk boundaries completed during the last forward (prefix-cache snapshots):
    # absolute position -> (fp32 state, conv inputs before it) — all a sequence resuming there needs.
    snapshots: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def clone(self) -> "KDASeqState":
        copy = lambda t: None if t is None else t.clone()  # noqa: E731
        pending = None if self.pending is None else tuple(t.clone() for t in self.pending)
        return KDASeqState(conv=copy(self.conv), state=copy(self.state), pending=pending)

    @property
    def num_pending(self) -> int:
        return 0 if self.pending is None else self.pending[0].shape[0]


@dataclass
class SequenceState:
    """Everything the model remembers about one sequence between incremental calls."""

    kda: dict[int, KDASeqState] = field(default_factory=dict)
    num_tokens: int = 0  # tokens whose cache entries and states exist
    # The sequence's cache pages in order. A page list only ever grows in place (``extend``/``append``) or is
    # replaced by another list (assignment, ``reset``): ``page_array`` and the decode runner's block-table rows
    # rely on it to update only what was appended.
    pages: list[int] = field(default_factory=list)
    # page_array's mirror of ``pages``: (the list it mirrors, its length then, the int64 array)
    _page_mirror: tuple[list[int], int, array.array] | None = field(default=None, init=False, repr=False,
                                                                     compare=False)

    def reset(self) -> None:
        self.kda.clear()
        self.num_tokens = 0
        self.pages = []

    def page_array(self) -> array.array:
        """``pages`` as an int64 ``array.array`` kept in step with the list: only the pages appended since the
        last call are converted, so a long sequence costs its new pages, not all of them. The array is the
        live mirror (it grows with the sequence): read it or copy it, never change it."""
        pages, n = self.pages, len(self.pages)
        mirror = self._page_mirror
        if mirror is not None and mirror[0] is pages and mirror[1] <= n:
            pages_i64 = mirror[2]
            if n > mirror[1]:
                pages_i64.extend(pages[mirror[1]:])
        else:
            pages_i64 = array.array("q", pages)
        self._page_mirror = (pages, n, pages_i64)
        return pages_i64


class LatentStore(abc.ABC):
    """Storage for the per-token caches of MLA layers: latent ``[c_kv | k_pe]`` and FP8 index keys."""

    page_size: int

    @abc.abstractmethod
    def write(self, layer_idx: int, slots: torch.Tensor, latent: torch.Tensor,
              index_k8: torch.Tensor | None, index_scale: torch.Tensor | None
              ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Write the new tokens' entries at flat ``slots`` and return the page tensors to read."""

    def write_parts(self, layer_idx: int, slots: torch.Tensor, latent_parts: Sequence[torch.Tensor],
                    index_k8: torch.Tensor | None, index_scale: torch.Tensor | None
                    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """``write`` with the latent given as its parts side by side (``[c_kv | k_pe]``)."""
        return self.write(layer_idx, slots, torch.cat(list(latent_parts), dim=-1), index_k8, index_scale)


class EphemeralLatentStore(LatentStore):
    """Trainer-side store: builds the pages out of place each call so gradients flow to the latents."""

    def __init__(self, num_pages: int, page_size: int):
        self.num_pages, self.page_size = num_pages, page_size

    def _scatter(self, slots: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        flat = values.new_zeros(self.num_pages * self.page_size, *values.shape[1:])
        flat = flat.index_put((slots,), values)
        return flat.view(self.num_pages, self.page_size, *values.shape[1:])

    def write(self, layer_idx, slots, latent, index_k8, index_scale):
        kv = self._scatter(slots, latent)
        if index_k8 is None:
            return kv, None, None
        # float8 has no zeros_like/index_put kernels on CPU: scatter its bytes
        k8 = self._scatter(slots, index_k8.view(torch.uint8)).view(index_k8.dtype)
        return kv, k8, self._scatter(slots, index_scale)


class PagedLatentStore(LatentStore):
    """Engine-side store: one preallocated page pool per MLA layer, written in place."""

    def __init__(self, mla_layers: list[int], num_pages: int, page_size: int, latent_dim: int,
                 index_dim: int | None, dtype: torch.dtype, device: torch.device | str = "cpu",
                 index_dtype: torch.dtype = torch.float8_e4m3fn, index_layers: list[int] | None = None):
        """Index keys (``index_dim`` values of ``index_dtype`` per token) are kept for ``index_layers``
        (default: every MLA layer); layers whose indexer is shared write none."""
        if page_size % 64:
            raise ValueError(f"page_size must be a multiple of 64, got {page_size}")
        self.num_pages, self.page_size = num_pages, page_size
        self.kv = {i: torch.zeros(num_pages, page_size, latent_dim, dtype=dtype, device=device) for i in mla_layers}
        self.k8: dict[int, torch.Tensor] = {}
        self.kscale: dict[int, torch.Tensor] = {}
        if index_dim is not None:
            for i in (mla_layers if index_layers is None else index_layers):
                # float8 has no zeros kernel on CPU: zero the bytes, then view them as index_dtype
                nbytes = index_dim * torch.empty((), dtype=index_dtype).element_size()
                zeros = torch.zeros(num_pages, page_size, nbytes, dtype=torch.uint8, device=device)
                self.k8[i] = zeros.view(index_dtype)
                self.kscale[i] = torch.zeros(num_pages, page_size, dtype=torch.float32, device=device)

    @torch.no_grad()
    def write(self, layer_idx, slots, latent, index_k8, index_scale):
        return self.write_parts(layer_idx, slots, (latent,), index_k8, index_scale)

    @torch.no_grad()
    def write_parts(self, layer_idx, slots, latent_parts, index_k8, index_scale):
        # one launch on the GPU for the latent parts, the index keys and scales (write_cache_rows)
        kv = self.kv[layer_idx]
        if index_k8 is None:
            write_cache_rows(slots, kv, latent_parts)
            return kv, None, None
        k8, ks = self.k8[layer_idx], self.kscale[layer_idx]
        write_cache_rows(slots, kv, latent_parts, k8, index_k8, ks, index_scale)
        return kv, k8, ks

    @torch.no_grad()
    def copy_page(self, src: int, dst: int) -> None:
        """Copy one page of every layer (a forked sequence gets its own copy of a partial page)."""
        for t in (*self.kv.values(), *self.kscale.values(), *(k.view(torch.uint8) for k in self.k8.values())):
            t[dst].copy_(t[src])


@dataclass
class ForwardContext:
    """Batch metadata for one forward over packed new tokens of N sequences."""

    cu_seqlens: torch.Tensor  # [N+1] int64, new tokens per sequence
    positions: torch.Tensor  # [T] absolute position of every new token
    seq_idx: torch.Tensor  # [T] row of block_table / kda_states of every new token
    block_table: torch.Tensor  # [N, max_pages] int64
    slot_mapping: torch.Tensor  # [T] flat cache slot of every new token
    store: LatentStore
    kda_states: list[SequenceState] | None = None  # None: every sequence starts empty (trainer)
    latent_format: LatentFormat = "native"
    record_snapshots: bool = False  # keep KDA states at chunk boundaries (engine prefix caching)
    # Set by the CUDA-graph decode runner: the key width (block_table.shape[1] * page_size) every MLA /
    # DSA op of this forward uses for its shapes, so that nothing reads a device value on the host and
    # every shape is fixed at capture time. None: widths follow the batch (eager forwards).
    static_kv_len: int | None = None
    # Static decode (one new token per sequence, CUDA-graph capturable): KDA layers read and write their
    # state in ``kda_pool`` at rows ``kda_slots`` [N] instead of ``kda_states``.
    kda_pool: "KDAStatePool | None" = None
    kda_slots: torch.Tensor | None = None
    # False skips the token-id range check (a host sync): the decode runner feeds sampled ids, in range by
    # construction, and prompts were checked when they were added.
    validate_ids: bool = True
    # DSA top-k selections [T, topk] of this forward by the layer that computed them, for the layers
    # whose indexer is "shared" (config.index_source_layer). Keyed by layer, so an activation-recompute
    # pass of a later layer reads the same selection as its first pass.
    index_selection: dict[int, torch.Tensor] = field(default_factory=dict)

    @property
    def num_seqs(self) -> int:
        return self.cu_seqlens.numel() - 1

    @property
    def seq_lens(self) -> list[int]:
        return (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).tolist()

    @property
    def start_positions(self) -> list[int]:
        return self.positions[self.cu_seqlens[:-1].clamp(max=max(self.positions.numel() - 1, 0))].tolist()


def cu_seqlens_from_lens(lens: list[int], device: torch.device | str = "cpu") -> torch.Tensor:
    cu = torch.zeros(len(lens) + 1, dtype=torch.int64, device=device)
    if lens:
        cu[1:] = torch.tensor(lens, dtype=torch.int64, device=device).cumsum(0)
    return cu


def _int64_array(pages: Sequence[int] | array.array | torch.Tensor) -> array.array:
    if isinstance(pages, array.array) and pages.typecode == "q":
        return pages
    return array.array("q", pages.tolist() if isinstance(pages, torch.Tensor) else pages)


def int64_tensor(values: Sequence[int]) -> torch.Tensor:
    """A CPU int64 tensor of Python ints, through ``array.array`` (several times faster than ``torch.tensor``
    on a list: the engine builds its per-step metadata this way)."""
    if not len(values):
        return torch.zeros(0, dtype=torch.int64)
    return torch.frombuffer(array.array("q", values), dtype=torch.int64)  # the tensor owns the fresh array


def paged_context(pages: Sequence[Sequence[int] | array.array | torch.Tensor], starts: Sequence[int],
                  lens: Sequence[int], store: LatentStore, device: torch.device | str = "cpu",
                  kda_states: list[SequenceState] | None = None, latent_format: LatentFormat = "native",
                  record_snapshots: bool = False, cu_seqlens: torch.Tensor | None = None) -> ForwardContext:
    """The one builder of an eager ``ForwardContext``: sequence i has ``lens[i]`` new tokens at positions
    ``starts[i]...`` over the pages ``pages[i]`` of ``store`` (a list or range of page ids, an int64
    ``array.array`` such as ``SequenceState.page_array()`` (cheapest for long sequences), or a 1-D integer
    tensor). Built on the host with a fixed number of tensor ops whatever the batch (the block table is the
    page arrays joined, each padded with zeros to the longest), moved in one copy per tensor. (The CUDA-graph
    decode step fills fixed device buffers instead: rollout/graph_runner.py.)"""
    ps = store.page_size
    n = len(pages)
    rows = [_int64_array(p) for p in pages]
    num_pages = [len(r) for r in rows]
    max_pages = max(num_pages, default=1) or 1
    if n:
        zeros = memoryview(bytes(8 * max_pages))
        parts = []
        for row, k in zip(rows, num_pages):
            parts.append(row)
            parts.append(zeros[: 8 * (max_pages - k)])
        block_table = torch.frombuffer(bytearray().join(parts), dtype=torch.int64).view(n, max_pages)
    else:
        block_table = torch.zeros(0, max_pages, dtype=torch.int64)
    lens = list(lens)
    starts_t = int64_tensor(starts)
    if all(k == 1 for k in lens):  # a decode batch: one new token per sequence
        seq_idx_t = torch.arange(n, dtype=torch.int64)
        positions_t = starts_t
    else:
        lens_t = int64_tensor(lens)
        seq_idx_t = torch.repeat_interleave(torch.arange(n, dtype=torch.int64), lens_t)
        first_row = torch.cumsum(lens_t, 0) - lens_t  # packed row of each sequence's first new token
        # token j of sequence i sits at starts[i] + (j - first_row[i])
        positions_t = torch.arange(seq_idx_t.numel(), dtype=torch.int64) + (starts_t - first_row)[seq_idx_t]
    slots = block_table[seq_idx_t, positions_t // ps] * ps + positions_t % ps
    return ForwardContext(
        cu_seqlens=cu_seqlens if cu_seqlens is not None else cu_seqlens_from_lens(lens, device),
        positions=positions_t.to(device), seq_idx=seq_idx_t.to(device), block_table=block_table.to(device),
        slot_mapping=slots.to(device), store=store, kda_states=kda_states, latent_format=latent_format,
        record_snapshots=record_snapshots,
    )


def packed_context(cu_seqlens: torch.Tensor, page_size: int = 64,
                   latent_format: LatentFormat = "native") -> ForwardContext:
    """Context for whole sequences starting at position 0 (the trainer's packed varlen batch): sequence i
    gets the next ``ceil(len_i / page_size)`` pages of an ephemeral store."""
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    pages, first = [], 0
    for n in lens:
        p = (n + page_size - 1) // page_size
        pages.append(range(first, first + p))
        first += p
    return paged_context(pages, [0] * len(lens), lens, EphemeralLatentStore(max(first, 1), page_size),
                         device=cu_seqlens.device, latent_format=latent_format, cu_seqlens=cu_seqlens)
