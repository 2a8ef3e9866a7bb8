"""Tensor-parallel sharding with layout-independent numerics: V virtual shards.

A plain tensor-parallel row-parallel layer (o_proj, down_proj) ends with an all-reduce whose
summation order depends on the TP degree, so TP=2 and TP=1 give different bits. Here every sharded
layer is ALWAYS computed as ``V`` independent pieces (``virtual_shards``, fixed by the run config):

* a piece is the same module class (``KimiDeltaAttention``, ``MLAAttention``, ``MLP``) holding
  1/V of the heads (or of the MLP's intermediate width): its column-parallel projections are the
  matching row blocks of the weights, its row-parallel output projection (a ``PartialLinear``) the
  matching column block, and it returns that block's fp32 partial product ``[T, D]``;
* a rank computes its V/tp pieces, the partials of all V pieces are all-gathered over the TP group
  (a copy: bits move, nothing is added) and summed with ``tree_sum`` in virtual-shard order, then
  rounded once to the model dtype.

TP=1 (all V pieces local) and TP=t (V/t per rank) therefore run the same arithmetic on the same
values: log-probs are bitwise equal across every tp dividing V. V=1 is exactly the unsharded model.
Replicated sub-layers that a piece needs (MLA's q_a/kv_a projections and the DSA indexer, KDA's f_a/g_a
and o_norm) are shared module objects, computed by each piece (V/tp times per rank), except the DSA
indexer, whose keys and selection are computed once per call and reused by the other pieces.

Routed experts are partitioned over the EP group instead: each rank runs its experts for the
(token, slot) pairs routed to them, the per-rank outputs are all-gathered, and every slot takes its
owner's value (a selection, not a sum), before the unchanged fixed-order ``moe_combine``.

LoRA: apply it to the full model first, then shard (a column block's adapter keeps the shared A and
its rows of B; a row block's keeps its columns of A and the shared B, so the delta is computed per
piece and summed with the partials).
"""
from __future__ import annotations

import copy
import logging
from collections import OrderedDict
from typing import Callable

import torch
from torch import nn

from zmrl.kernels_batch_invariant.reduce import tree_sum
from zmrl.model.kda import KimiDeltaAttention
from zmrl.model.layers import Linear, Weight
from zmrl.model.mla import Indexer, MLAAttention
from zmrl.model.moe import MLP, MoE

from . import state
from .comm import all_reduce_sum, allreduce_grad_hook, enter_region, gather_shards, group_size

log = logging.getLogger(__name__)


class PartialLinear(Linear):
    """A row-parallel block of a Linear: returns its fp32 partial product (base + LoRA delta), never rounded;
    the owner sums all blocks and rounds once."""

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None,
                extra: torch.Tensor | None = None) -> torch.Tensor:
        return super().forward(x, out_dtype=torch.float32, extra=extra)


class SharedIndexer(Indexer):
    """The DSA indexer shared by the MLA pieces of one layer (same parameters, same names).

    Its keys and its top-k selection depend only on replicated inputs (x, the shared q_a latent, the
    replicated latent cache), so every piece of one call would compute the same values; while its
    ``VirtualShards`` runs, the first piece's results are reused (outputs are integer positions and
    FP8 keys: nothing to differentiate). Outside a call it computes as usual."""

    memo: dict | None = None

    def _once(self, key: tuple, keep: tuple, fn: Callable[[], object]):
        if self.memo is None:
            return fn()
        if key not in self.memo:
            self.memo[key] = (keep, fn())  # keep the inputs alive: their ids are the key
        return self.memo[key][1]

    def keys(self, x, positions, rope):
        return self._once(("keys", id(x)), (x,), lambda: Indexer.keys(self, x, positions, rope))

    def select(self, x, q_latent, k8_cache, k_scale_cache, ctx, rope):
        return self._once(("select", id(x), id(ctx)), (x, ctx),
                          lambda: Indexer.select(self, x, q_latent, k8_cache, k_scale_cache, ctx, rope))


# ---------------------------------------------------------------------- slicing helpers
class _Slicer:
    """Builds pieces and records which parameters it created (sharded) vs. reused (replicated)."""

    def __init__(self) -> None:
        self.sharded: set[int] = set()
        # id(new param) -> (id(full param), dim, start, stop): where each slice sits in the full tensor
        self.origin: dict[int, tuple[int, int, int, int]] = {}
        self.shared_indexers: dict[int, SharedIndexer] = {}

    def shared_indexer(self, ix: Indexer) -> SharedIndexer:
        """One SharedIndexer per layer, used by all of that layer's pieces."""
        if id(ix) not in self.shared_indexers:
            shared = self.shell(ix)
            shared.__class__ = SharedIndexer
            self.shared_indexers[id(ix)] = shared
        return self.shared_indexers[id(ix)]

    def param(self, like: nn.Parameter, dim: int, sl: slice) -> nn.Parameter:
        """A new parameter holding ``like``'s block ``sl`` along ``dim`` (a copy: the full tensor can go)."""
        t = like.detach().narrow(dim, sl.start, sl.stop - sl.start)
        p = nn.Parameter(t.clone(), requires_grad=like.requires_grad)
        self.sharded.add(id(p))
        self.origin[id(p)] = (id(like), dim, sl.start, sl.stop)
        return p

    @staticmethod
    def shell(m: nn.Module) -> nn.Module:
        """A shallow copy of ``m`` with its own parameter/module tables (submodules still shared)."""
        p = copy.copy(m)
        p._parameters = OrderedDict(m._parameters)
        p._buffers = OrderedDict(m._buffers)
        p._modules = OrderedDict(m._modules)
        return p

    def linear(self, lin: Linear, rows: slice | None = None, cols: slice | None = None,
               partial: bool = False, keep_bias: bool = True) -> Linear:
        """Rows = a column-parallel block (output features); cols = a row-parallel block (input features)."""
        new = self.shell(lin)
        if partial:
            new.__class__ = PartialLinear
        if (rows is None) == (cols is None):
            raise ValueError("slice a Linear by rows or by columns")
        new.weight = self.param(lin.weight, 0, rows) if rows is not None else self.param(lin.weight, 1, cols)
        new.out_features, new.in_features = new.weight.shape
        if lin.bias is not None:
            if rows is not None:
                new.bias = self.param(lin.bias, 0, rows)
            elif not keep_bias:
                new.bias = None  # a row block's bias is added by one block only
        if lin.adapter is not None:
            a = self.shell(lin.adapter)
            if rows is not None:  # y_rows = B[rows] (A x): A shared, B sliced
                a.lora_B = self.param(lin.adapter.lora_B, 0, rows)
            if cols is not None:  # partial = B (A[:, cols] x_cols): A sliced, B shared
                a.lora_A = self.param(lin.adapter.lora_A, 1, cols)
            new.adapter = a
        return new

    def weight_rows(self, w: Weight, rows: slice) -> Weight:
        new = self.shell(w)
        new.weight = self.param(w.weight, 0, rows)
        return new


def _blocks(n: int, v: int, parts: int, what: str) -> slice:
    if n % parts:
        raise ValueError(f"virtual_shards={parts} must divide {what}={n}")
    b = n // parts
    return slice(v * b, (v + 1) * b)


def _kda_piece(m: KimiDeltaAttention, v: int, V: int, s: _Slicer) -> KimiDeltaAttention:
    H, K = m.num_heads, m.head_dim
    heads = _blocks(H, v, V, "KDA num_heads")
    ch = slice(heads.start * K, heads.stop * K)
    p = s.shell(m)
    p.num_heads = H // V
    # Each piece keeps its own recurrent state: key it (layer, piece) in SequenceState.kda.
    p.layer_idx = (m.layer_idx, v)
    for name in ("q_proj", "k_proj", "v_proj", "f_b_proj"):
        setattr(p, name, s.linear(getattr(m, name), rows=ch))
    for name in ("q_conv1d", "k_conv1d", "v_conv1d"):
        setattr(p, name, s.weight_rows(getattr(m, name), ch))
    p.A_log = s.param(m.A_log, 0, heads)
    p.dt_bias = s.param(m.dt_bias, 0, ch)
    p.b_proj = s.linear(m.b_proj, rows=heads)
    if hasattr(m, "g_proj"):
        p.g_proj = s.linear(m.g_proj, rows=ch)
    else:
        p.g_b_proj = s.linear(m.g_b_proj, rows=ch)  # g_a_proj (-> dk) is shared
    p.o_proj = s.linear(m.o_proj, cols=ch, partial=True, keep_bias=v == 0)
    return p


def _mla_piece(m: MLAAttention, v: int, V: int, s: _Slicer) -> MLAAttention:
    H = m.num_heads
    heads = _blocks(H, v, V, "num_attention_heads")
    qk = m.nope + m.rope_dim

    def per_head(width: int) -> slice:
        return slice(heads.start * width, heads.stop * width)

    p = s.shell(m)
    p.num_heads = H // V
    if hasattr(m, "q_proj"):
        p.q_proj = s.linear(m.q_proj, rows=per_head(qk))
    else:
        p.q_b_proj = s.linear(m.q_b_proj, rows=per_head(qk))  # q_a_proj + q_a_layernorm shared
    p.kv_b_proj = s.linear(m.kv_b_proj, rows=per_head(m.nope + m.v_dim))  # kv_a + indexer shared
    if m.indexer is not None:
        p.indexer = s.shared_indexer(m.indexer)
    if hasattr(m, "g_proj"):
        p.g_proj = s.linear(m.g_proj, rows=per_head(m.v_dim))
    p.o_proj = s.linear(m.o_proj, cols=per_head(m.v_dim), partial=True, keep_bias=v == 0)
    return p


def _mlp_piece(m: MLP, v: int, V: int, s: _Slicer) -> MLP:
    cols = _blocks(m.gate_proj.out_features, v, V, "MLP intermediate size")
    p = s.shell(m)
    p.gate_proj = s.linear(m.gate_proj, rows=cols)
    p.up_proj = s.linear(m.up_proj, rows=cols)
    p.down_proj = s.linear(m.down_proj, cols=cols, partial=True, keep_bias=v == 0)
    return p


class VirtualShards(nn.Module):
    """Runs this rank's pieces of a sharded layer and returns the fixed-order sum of all V pieces.

    ``pieces`` maps the virtual-shard index (global, so parameter names match across layouts) to a
    piece module returning an fp32 partial ``[T, D]``. Output: ``tree_sum`` over the V partials in
    shard order, rounded once to the input dtype."""

    def __init__(self, pieces: dict[int, nn.Module], virtual_shards: int, tp: int, reduce: str = "tree"):
        super().__init__()
        self.pieces = nn.ModuleDict({str(v): p for v, p in sorted(pieces.items())})
        self.virtual_shards, self.tp, self.reduce = virtual_shards, tp, reduce
        # shared sub-layers that reuse the first piece's results within one call (a plain list: the
        # modules are registered through the pieces already)
        self._memos = list({id(m): m for m in self.pieces.modules() if isinstance(m, SharedIndexer)}.values())

    def _group(self):
        group = state.tp_group()
        if group_size(group) != self.tp:
            raise RuntimeError(f"model was sharded for tp={self.tp} but the current TP group has "
                               f"{group_size(group)} rank(s) (init_parallel with the same ParallelConfig)")
        return group

    def forward(self, x: torch.Tensor, *args) -> torch.Tensor:
        group = self._group()
        x_in = enter_region(x, group)
        for m in self._memos:
            m.memo = {}
        try:
            local = torch.stack([piece(x_in, *args) for piece in self.pieces.values()])  # [V/tp, T, D] fp32
        finally:
            for m in self._memos:
                m.memo = None
        if self.reduce == "allreduce":  # Megatron-style: the bits depend on the TP degree
            return all_reduce_sum(tree_sum(local, dim=0), group).to(x.dtype)
        allp = gather_shards(local, group).reshape(self.virtual_shards, *local.shape[1:])
        return tree_sum(allp, dim=0).to(x.dtype)

    def extra_repr(self) -> str:
        return f"virtual_shards={self.virtual_shards}, tp={self.tp}, reduce={self.reduce}, local={list(self.pieces)}"


def _wrap(m: nn.Module, make: Callable[[nn.Module, int, int, _Slicer], nn.Module], cfg: state.ParallelConfig,
          rank: int, s: _Slicer) -> VirtualShards:
    V, tp = cfg.virtual_shards, cfg.tp
    per = V // tp
    w = VirtualShards({v: make(m, v, V, s) for v in range(rank * per, (rank + 1) * per)}, V, tp, cfg.reduce)
    if tp > 1:
        # Replicated parameters used inside the region see only this rank's pieces' gradient.
        group = state.tp_group()
        for p in w.parameters():
            if id(p) not in s.sharded and p.requires_grad:
                p.register_hook(allreduce_grad_hook(group))
    return w


def shard_model(model: nn.Module, cfg: state.ParallelConfig | None = None) -> nn.Module:
    """Shard ``model`` (a full ``HybridForCausalLM``, LoRA already applied if any) in place for this rank.

    With ``cfg.virtual_shards == 1`` and ``ep == 1`` nothing changes. Every rank of a TP group must call
    this with the same full weights (e.g. each loads the same checkpoint, or builds with the same seed)."""
    cfg = (cfg or state.get_config() or state.ParallelConfig()).validate()
    if getattr(model, "parallel_config", None) is not None:
        raise RuntimeError("shard_model: this model is already sharded")
    V, tp = cfg.virtual_shards, cfg.tp
    if tp > 1 and group_size(state.tp_group()) != tp:
        raise RuntimeError(f"shard_model: tp={tp} needs init_parallel(...) with tp={tp} first")
    rank = state.tp_rank()
    s = _Slicer()
    originals = dict(model.named_parameters())  # kept alive so ids stay unique while we slice
    full_name = {id(p): n for n, p in originals.items()}
    for layer in model.model.layers:
        if V > 1:
            attn = layer.self_attn
            make = _kda_piece if isinstance(attn, KimiDeltaAttention) else _mla_piece
            layer.self_attn = _wrap(attn, make, cfg, rank, s)
            if isinstance(layer.mlp, MoE):
                if layer.mlp.shared_experts is not None:
                    layer.mlp.shared_experts = _wrap(layer.mlp.shared_experts, _mlp_piece, cfg, rank, s)
            else:
                layer.mlp = _wrap(layer.mlp, _mlp_piece, cfg, rank, s)
        if cfg.ep > 1 and isinstance(layer.mlp, MoE):
            from .expert import shard_experts

            shard_experts(layer.mlp, cfg.ep, state.ep_rank(), s)
    fmap: dict[str, tuple[str, int | None, int, int, tuple[int, ...]]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in s.origin:
            src, dim, a, b = s.origin[id(p)]
            fmap[name] = (full_name[src], dim, a, b, tuple(originals[full_name[src]].shape))
        else:
            fmap[name] = (full_name[id(p)], None, 0, 0, tuple(p.shape))
    model.full_param_map = fmap
    model.parallel_config = cfg
    log.info("sharded for V=%d tp=%d ep=%d (tp rank %d, ep rank %d): %d local parameters", V, tp, cfg.ep,
             rank, state.ep_rank(), sum(p.numel() for p in model.parameters()))
    return model


# ---------------------------------------------------------------------- full <-> sharded state
def _full_map(model: nn.Module) -> dict[str, tuple[str, int | None, int, int, tuple[int, ...]]]:
    fmap = getattr(model, "full_param_map", None)
    if fmap is None:  # an unsharded model: every parameter is its own full tensor
        fmap = {n: (n, None, 0, 0, tuple(p.shape)) for n, p in model.named_parameters(remove_duplicate=False)}
    return fmap


@torch.no_grad()
def load_full_state(model: nn.Module, state_dict: dict[str, torch.Tensor],
                    keep: Callable[[str], bool] | None = None) -> int:
    """Copy full (unsharded-name) tensors into a sharded model: each parameter takes its block.

    ``keep(full_name)`` selects the parameters to load (default all); each selected one must be in
    ``state_dict`` with the full shape. Returns how many parameters were written. E.g. LoRA weights
    gathered from a trainer at TP=b into an engine at TP=a."""
    n = 0
    for name, p in model.named_parameters(remove_duplicate=False):
        full, dim, a, b, shape = _full_map(model)[name]
        if keep is not None and not keep(full):
            continue
        if full not in state_dict:
            raise ValueError(f"load_full_state: {full} (for {name}) is missing")
        t = state_dict[full]
        if tuple(t.shape) != shape:
            raise ValueError(f"load_full_state: {full} has shape {tuple(t.shape)}, expected {shape}")
        p.copy_(t if dim is None else t.narrow(dim, a, b - a))
        n += 1
    return n


@torch.no_grad()
def gather_full_state(model: nn.Module, keep: Callable[[str], bool] | None = None) -> dict[str, torch.Tensor]:
    """The full (unsharded) tensors under the unsharded model's names, assembled from the ranks of this
    rank's TP and EP groups (a collective over those groups). ``keep(full_name)``
    selects which; e.g. ``gather_full_state(model, lambda n: ".lora_" in n or "experts_lora" in n)``."""
    local: dict[str, list] = {}
    for name, p in model.named_parameters():
        full, dim, a, b, shape = _full_map(model)[name]
        if keep is not None and not keep(full):
            continue
        local.setdefault(full, [shape]).append((dim, a, b, p.detach().cpu()))
    per_rank = [local]
    # Pieces are spread over the TP group, experts over the EP group: gather over each in turn (a
    # collective over those groups only, so data-parallel replicas need not take part).
    for group in (state.tp_group(), state.ep_group()):
        if group is not None:
            got: list = [None] * group_size(group)
            torch.distributed.all_gather_object(got, per_rank, group=group)
            per_rank = [d for lst in got for d in lst]
    out: dict[str, torch.Tensor] = {}
    covered: dict[str, torch.Tensor] = {}
    for d in per_rank:
        for full, (shape, *parts) in d.items():
            for dim, a, b, t in parts:
                if dim is None:
                    out[full] = t
                    covered[full] = torch.ones(shape, dtype=torch.bool)
                    continue
                if full not in out:
                    out[full] = torch.zeros(shape, dtype=t.dtype)
                    covered[full] = torch.zeros(shape, dtype=torch.bool)
                out[full].narrow(dim, a, b - a).copy_(t)
                covered[full].narrow(dim, a, b - a).fill_(True)
    holes = [k for k, c in covered.items() if not bool(c.all())]
    if holes:
        raise RuntimeError(f"gather_full_state: no rank holds all of {holes[:3]}")
    return out
