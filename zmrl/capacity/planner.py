"""KV-cache capacity planner: how many tokens (and full-length contexts) the packed cache holds.

One memory model of one GPU, the same for every scenario (docs/capacity.md derives it):

    budget   = gpu_memory_utilization · HBM
    cache    = budget − weights/GPU − activations+graphs − prefill exchange − DCP workspace
    rows     = floor(cache / row_bytes)               # packed block rows (docs/capacity.md)
    kv_rows  = rows − max_num_seqs · n_kda_groups     # one row per request per KDA group
    tokens   = kv_rows · block_size · (W under DCP-W, 1 under TP)

A packed block row holds, for ``block_size`` tokens, every MLA layer's latent page and index-key
page; a KDA group's state for one request takes one row, so the row must be at least that large
(``block_size`` = the smallest power of two >= 64 for which it is).

Under TP every GPU of the group holds every token (latent and index keys are replicated). Under
DCP-W every GPU holds every W-th token, so per-GPU bytes per token drop W-fold and one row on
each GPU covers W·block_size tokens of a request. KDA state is split by head in both layouts.

Two constants are fitted (``ACTIVATION_GIB`` from TP8 FP8 = 3.04 M, ``DCP_WORKSPACE_GIB`` from
DCP8 FP8 = 21.8 M); the other three article figures check them. Everything else is derived from
the config or stated with its source next to it.
"""
from __future__ import annotations

import argparse
import json
import math
import re
import sys
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Sequence

from zmrl.capacity.sizing import INDEX_FORMATS, LATENT_FORMATS, weight_shapes

if TYPE_CHECKING:
    from zmrl.model.config import ModelConfig

GB = 10**9
GiB = 2**30

# ---------------------------------------------------------------------------- stated constants
# Nominal HBM per GPU, taken as decimal GB (10^9 B): GB300 "288 GB HBM3e" -> 288e9 B = 268.2 GiB.
# What a driver reports can differ from the nominal figure (an H100 shows ~85.5e9 B); pass the
# measured total as gpu_memory_bytes when it matters.
GPU_MEMORY_GB: dict[str, int] = {"gb300": 288, "b200": 180, "h200": 141, "h100": 80}

# vLLM's default --gpu-memory-utilization (the article's NVIDIA command leaves it at the default):
# the engine plans within this fraction of HBM; the rest covers the CUDA context, NCCL, cuBLAS
# workspaces and allocator fragmentation.
GPU_MEMORY_UTILIZATION = 0.9

# Peak activations of the profiling forward + CUDA graphs + allocator slack, per GPU. FITTED: the
# single value that makes TP8 FP8 on 8x GB300 hold the article's 3.04 M tokens (the article gives
# no breakdown). The same value then predicts the TP8 NVFP4 (4.49 M) and the 1.7x figures.
ACTIVATION_GIB = 7.4

# Token-sharded prefill all-to-all buffers: "代价是交换缓冲区，每 GPU 约 0.8 GiB 的 KV cache"
# (article). Paid whenever the model-parallel group has >1 GPU: DCP prefill runs the same
# token-sharded prefill on the gathered context.
PREFILL_EXCHANGE_GIB = 0.8

# DCP-only symmetric-memory workspace per GPU: the gathered-context buffer of DCP prefill (the
# article: ~0.7 GB per GPU per 1M FP8 tokens, i.e. one layer's 708 B/token latent + index key),
# the decode query all-gather, top-k exchange and LSE mailboxes, and the extra DCP decode graphs.
# FITTED as one budget: the value that makes DCP8 FP8 hold 21.8 M (= 7.2x TP8); DCP8 NVFP4 (32.1 M)
# checks it. This, not the KDA state, is why DCP8 gives 7.2x and not 8x.
DCP_WORKSPACE_GIB = 5.0

# Concurrent requests whose KDA states the pool reserves (one row per KDA group each). 16 is the
# --max-num-seqs of the article's AMD serve command; it also explains why NVFP4 latents give
# 1.48x the FP8 tokens where the bytes alone give 1.46x (bigger FP8 rows make the reserved KDA
# rows cost more).
MAX_NUM_SEQS = 16

MIN_BLOCK_SIZE = 64  # the engine's block_size is a power of two and a multiple of 64 (rollout/block_manager.py)
DEFAULT_CONTEXT = 1_048_576  # K3.1 Pro's 1M-token window
LAYOUTS = ("tp", "dcp")

# Weight formats: (routed-expert matrices, other matrices). Embeddings, lm_head, routers, norms,
# biases and conv taps stay bf16 in every format (as in published FP8/FP4 MoE checkpoints).
WEIGHT_FORMATS: dict[str, tuple[str, str]] = {
    "mxfp4-experts": ("mxfp4", "bf16"),  # default: K3 stores experts in MXFP4 (group 32), rest bf16
    "mxfp4-experts-fp8": ("mxfp4", "fp8"),
    "nvfp4-experts": ("nvfp4", "bf16"),
    "fp8": ("fp8", "fp8"),
    "bf16": ("bf16", "bf16"),
}

# Tensors every GPU of a TP group holds in full (not split by head / expert / vocab / width):
# MLA down projections (their output is the latent all heads share), the whole DSA indexer (it is
# not split by head: "索引器完全不按头切分"), KDA's rank-128 forget-gate down projection, MoE
# routers, and every 1-D tensor (norms, biases).
_REPLICATED_RE = re.compile(
    r"(self_attn\.(q_a_proj|kv_a_proj_with_mqa|f_a_proj)\.weight$|self_attn\.indexer\.|mlp\.gate\.)")
_ALWAYS_BF16_RE = re.compile(r"(embed_tokens|lm_head|mlp\.gate\.|_conv1d\.)")
_EXPERT_RE = re.compile(r"\.mlp\.experts\.\d+\.")

# The article's figures (vLLM Kimi K3.1 Pro day-0 post, 8x GB300).
ARTICLE_TOKENS = {
    ("tp", "fp8", "fp8"): 3.04e6,
    ("dcp", "fp8", "fp8"): 21.8e6,
    ("tp", "nvfp4", "fp8"): 4.49e6,
    ("dcp", "nvfp4", "fp8"): 32.1e6,
}
ARTICLE_NVFP4_MXFP4_RATIO = 1.7  # TP8 NVFP4 latent + MXFP4 index vs TP8 FP8 + FP8
ARTICLE_TP8_FP8_REQUESTS = 2.9  # full 1M contexts in TP8 FP8


# ---------------------------------------------------------------------------- weights
def _matrix_bytes(shape: tuple[int, ...], fmt: str) -> int:
    """Bytes of one tensor stored in ``fmt``; scales group along the last (input) dim."""
    n = math.prod(shape)
    if fmt == "bf16" or len(shape) < 2:
        return 2 * n
    rows, cols = n // shape[-1], shape[-1]
    if fmt == "mxfp4":  # e2m1 pairs + one e8m0 scale per 32
        return rows * (math.ceil(cols / 2) + math.ceil(cols / 32))
    if fmt == "nvfp4":  # e2m1 pairs + one e4m3 scale per 16 (+ one fp32 per tensor)
        return rows * (math.ceil(cols / 2) + math.ceil(cols / 16)) + 4
    if fmt == "fp8":  # e4m3 + one fp32 scale per 128x128 block (DeepSeek-style)
        return n + 4 * math.ceil(rows / 128) * math.ceil(cols / 128)
    raise AssertionError(fmt)


@lru_cache(maxsize=32)
def _weight_totals(cfg_json: str, weight_format: str) -> tuple[int, int]:
    """(replicated_bytes, sharded_bytes) of the whole model; cached because k3.1-pro has 250k
    tensors (~0.6 s to enumerate)."""
    from zmrl.model.config import ModelConfig

    cfg = ModelConfig.from_dict(json.loads(cfg_json))
    expert_fmt, other_fmt = WEIGHT_FORMATS[weight_format]
    rep = shard = 0
    for name, shape in weight_shapes(cfg).items():
        if _EXPERT_RE.search(name):
            fmt = expert_fmt
        elif _ALWAYS_BF16_RE.search(name):
            fmt = "bf16"
        else:
            fmt = other_fmt
        b = _matrix_bytes(shape, fmt)
        if len(shape) < 2 or _REPLICATED_RE.search(name):
            rep += b
        else:
            shard += b
    return rep, shard


def _cfg_key(cfg: "ModelConfig") -> str:
    return json.dumps(cfg.to_dict(), sort_keys=True)


def weight_bytes_per_gpu(cfg: "ModelConfig", weight_format: str = "mxfp4-experts", degree: int = 8) -> int:
    """Weight bytes one GPU of a ``degree``-wide TP group holds: replicated tensors in full, the
    rest (heads, experts, vocab, widths) split ``degree`` ways."""
    _check_choice("weight_format", weight_format, tuple(WEIGHT_FORMATS))
    rep, shard = _weight_totals(_cfg_key(cfg), weight_format)
    return rep + math.ceil(shard / degree)


# ---------------------------------------------------------------------------- the plan
@dataclass(frozen=True)
class CapacityPlan:
    """Result of ``plan_capacity``. Byte fields are per GPU unless named otherwise."""

    model: str
    gpu: str
    num_gpus: int
    layout: str
    degree: int
    replicas: int  # independent engines: num_gpus // degree
    latent: str
    index: str
    weight_format: str
    context_len: int
    max_num_seqs: int
    gpu_memory_utilization: float
    # per-GPU memory
    hbm_bytes: int
    budget_bytes: int
    weight_bytes: int
    activation_bytes: int
    prefill_exchange_bytes: int
    dcp_workspace_bytes: int
    cache_bytes: int  # what is left for the packed pool
    # packed pool
    block_size: int
    row_bytes: int
    attention_row_bytes: int
    kda_groups: int
    kda_group_state_bytes: int  # one request's state of one KDA group on one GPU
    kda_rows: int
    kv_rows: int
    kv_bytes_per_token_per_gpu: float  # TP: n_mla·latent + n_index·index; DCP-W: that / W
    # results
    tokens_per_replica: int
    tokens_that_fit: int  # all replicas together
    full_context_requests: float  # tokens_that_fit / context_len (the article's "2.9")
    full_context_requests_whole: int  # whole contexts: each must fit inside one replica

    @property
    def kda_state_bytes(self) -> int:
        """Pool bytes reserved for KDA states (max_num_seqs · kda_groups rows)."""
        return self.kda_rows * self.row_bytes

    @property
    def kv_pool_bytes(self) -> int:
        """Pool bytes holding latent + index-key pages."""
        return self.kv_rows * self.row_bytes

    @property
    def unused_bytes(self) -> int:
        """Less than one row: what the floor to whole rows leaves."""
        return self.cache_bytes - (self.kda_rows + self.kv_rows) * self.row_bytes

    def table(self) -> str:
        """A human-readable breakdown (GiB and GB side by side)."""
        lay = f"{self.layout.upper()}{self.degree}"
        head = (f"{self.model}: {self.num_gpus}x {self.gpu}, {lay} ({self.replicas} replica"
                f"{'s' if self.replicas != 1 else ''}), latent {self.latent}, index {self.index}, "
                f"weights {self.weight_format}")
        rows = [
            ("HBM", self.hbm_bytes),
            (f"budget (gpu_memory_utilization {self.gpu_memory_utilization:g})", self.budget_bytes),
            (f"- weights ({self.weight_format})", self.weight_bytes),
            ("- activations + CUDA graphs", self.activation_bytes),
            ("- token-sharded prefill exchange", self.prefill_exchange_bytes),
            ("- DCP workspace", self.dcp_workspace_bytes),
            ("= packed cache pool", self.cache_bytes),
            (f"    KDA state ({self.max_num_seqs} seqs x {self.kda_groups} groups = {self.kda_rows} rows)",
             self.kda_state_bytes),
            (f"    KV pages ({self.kv_rows} rows)", self.kv_pool_bytes),
            ("    unused (< 1 row)", self.unused_bytes),
        ]
        w = max(len(r[0]) for r in rows) + 2
        out = [head, f"{'per GPU':<{w}}{'GiB':>10}{'GB':>10}"]
        out += [f"{name:<{w}}{b / GiB:>10.2f}{b / GB:>10.2f}" for name, b in rows]
        per_row = self.block_size * (self.degree if self.layout == "dcp" else 1)
        out += [
            f"block size {self.block_size} tokens/GPU; row {self.row_bytes:,} B "
            f"(attention {self.attention_row_bytes:,} B, KDA group state {self.kda_group_state_bytes:,} B); "
            f"one row holds {per_row:,} tokens of a request",
            f"KV bytes per token per GPU: {self.kv_bytes_per_token_per_gpu:,.1f}",
            f"tokens that fit: {self.tokens_that_fit:,} ({self.tokens_that_fit / 1e6:.2f} M)",
            f"full {self.context_len:,}-token contexts: {self.full_context_requests:.2f} "
            f"({self.full_context_requests_whole} whole)",
        ]
        if self.full_context_requests_whole > self.max_num_seqs * self.replicas:
            out.append(f"note: more contexts fit than max_num_seqs={self.max_num_seqs} reserves KDA rows for; "
                       f"raise max_num_seqs to serve them all at once (each costs {self.kda_groups} rows)")
        return "\n".join(out)


def _check_choice(field: str, value: object, allowed: Sequence[object]) -> None:
    if value not in allowed:
        raise ValueError(f"unknown {field} {value!r}; allowed: {list(allowed)}")


def _n_layers(cfg: "ModelConfig") -> tuple[int, int]:
    n_kda = sum(1 for i in range(cfg.num_hidden_layers) if cfg.is_kda_layer(i))
    return cfg.num_hidden_layers - n_kda, n_kda


def plan_capacity(
    cfg: "ModelConfig",
    gpu_memory_bytes: int | str = "gb300",
    num_gpus: int = 8,
    *,
    weight_bytes: int | None = None,
    weight_format: str = "mxfp4-experts",
    latent: str = "fp8",
    index: str = "fp8",
    layout: str = "tp",
    degree: int | None = 8,
    context_len: int = DEFAULT_CONTEXT,
    gpu_memory_utilization: float = GPU_MEMORY_UTILIZATION,
    activation_gib: float = ACTIVATION_GIB,
    prefill_exchange_gib: float = PREFILL_EXCHANGE_GIB,
    dcp_workspace_gib: float = DCP_WORKSPACE_GIB,
    max_num_seqs: int = MAX_NUM_SEQS,
    block_size: int | None = None,
    model: str = "model",
) -> CapacityPlan:
    """Plan the packed KV cache of ``num_gpus`` GPUs serving ``cfg``.

    gpu_memory_bytes: HBM per GPU in bytes, or a GPU name from ``GPU_MEMORY_GB``.
    weight_bytes: total weight bytes of the model (all GPUs); if given, split evenly ``degree``
        ways and ``weight_format`` is only a label. Otherwise weights are derived per tensor from
        ``weight_shapes(cfg)`` in ``weight_format``.
    layout / degree: ``tp`` (latent + index keys replicated on the ``degree`` GPUs) or ``dcp``
        (TP group of ``degree`` GPUs that is also the DCP group: tokens sharded ``degree`` ways).
        ``degree`` must divide ``num_gpus``; ``num_gpus // degree`` replicas run side by side.
        ``None`` means ``num_gpus``.
    block_size: tokens per row per GPU; ``None`` picks the smallest power of two >= 64 whose
        attention row holds one KDA group's state.
    The memory knobs default to the module constants (see their comments and docs/capacity.md).
    Raises ValueError naming the field for unknown formats/layouts/GPUs, bad degrees, or a model
    that does not fit.
    """
    _check_choice("latent format", latent, LATENT_FORMATS)
    _check_choice("index format", index, INDEX_FORMATS)
    _check_choice("layout", layout, LAYOUTS)
    _check_choice("weight_format", weight_format, tuple(WEIGHT_FORMATS))
    if isinstance(gpu_memory_bytes, str):
        _check_choice("gpu", gpu_memory_bytes, tuple(GPU_MEMORY_GB))
        gpu, hbm = gpu_memory_bytes, GPU_MEMORY_GB[gpu_memory_bytes] * GB
    else:
        gpu, hbm = f"{gpu_memory_bytes / GiB:.1f} GiB GPU", int(gpu_memory_bytes)
    if hbm <= 0:
        raise ValueError(f"gpu_memory_bytes must be > 0, got {hbm}")
    if num_gpus < 1:
        raise ValueError(f"num_gpus must be >= 1, got {num_gpus}")
    if degree is None:
        degree = num_gpus
    if degree < 1 or num_gpus % degree != 0:
        raise ValueError(f"degree {degree} must be >= 1 and divide num_gpus {num_gpus} "
                         f"(allowed: {[d for d in range(1, num_gpus + 1) if num_gpus % d == 0]})")
    if context_len < 1:
        raise ValueError(f"context_len must be >= 1, got {context_len}")
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    for name, v in (("activation_gib", activation_gib), ("prefill_exchange_gib", prefill_exchange_gib),
                    ("dcp_workspace_gib", dcp_workspace_gib)):
        if v < 0:
            raise ValueError(f"{name} must be >= 0, got {v}")
    if block_size is not None and (block_size < MIN_BLOCK_SIZE or block_size & (block_size - 1)):
        raise ValueError(f"block_size must be a power of two >= {MIN_BLOCK_SIZE}, got {block_size}")

    n_mla, n_kda = _n_layers(cfg)
    if n_mla == 0:
        raise ValueError("config has no MLA layers: its cache is KDA state only, not bounded by tokens")

    # bytes per token: every MLA layer stores one latent, and every layer whose indexer computes its own
    # selection one index key ("shared" indexer layers reuse an earlier layer's top-k and store none)
    lat_b, idx_b = cfg.kv_bytes_per_token_per_layer(latent=latent, index=index)
    token_bytes = n_mla * lat_b + len(cfg.index_key_layers()) * idx_b  # per replica copy, i.e. per GPU under TP
    shards = degree if layout == "dcp" else 1

    # KDA state per GPU: split by head over the TP group (ceil: a GPU may hold one extra head)
    kda_groups = kda_group_state = 0
    if n_kda:
        la = cfg.linear_attn_config
        per_head_layer = cfg.kda_state_bytes_per_request() // (n_kda * la.num_heads)
        kda_groups = math.ceil(n_kda / n_mla)  # groups no larger than the attention group (24)
        layers_per_group = math.ceil(n_kda / kda_groups)
        kda_group_state = layers_per_group * math.ceil(la.num_heads / degree) * per_head_layer

    if block_size is None:
        block_size = MIN_BLOCK_SIZE
        while block_size * token_bytes < kda_group_state:
            block_size *= 2
    attention_row = block_size * token_bytes
    row = max(attention_row, kda_group_state)

    # memory of one GPU
    budget = int(gpu_memory_utilization * hbm)
    weights = math.ceil(weight_bytes / degree) if weight_bytes is not None else \
        weight_bytes_per_gpu(cfg, weight_format, degree)
    act = int(activation_gib * GiB)
    exch = int(prefill_exchange_gib * GiB) if degree > 1 else 0
    dcp_ws = int(dcp_workspace_gib * GiB) if layout == "dcp" and degree > 1 else 0
    cache = budget - weights - act - exch - dcp_ws
    rows = cache // row if cache > 0 else 0
    kda_rows = max_num_seqs * kda_groups
    kv_rows = rows - kda_rows
    if cache <= 0:
        raise ValueError(
            f"does not fit: per GPU the budget is {budget / GiB:.1f} GiB ({gpu_memory_utilization:g} x "
            f"{hbm / GiB:.1f} GiB HBM) but weights take {weights / GiB:.1f} GiB and the reserves "
            f"(activations {act / GiB:.1f}, prefill exchange {exch / GiB:.1f}, DCP workspace "
            f"{dcp_ws / GiB:.1f} GiB) leave {cache / GiB:.1f} GiB for the cache; use a larger degree, "
            f"a smaller weight_format or a bigger GPU")
    if kv_rows <= 0:
        raise ValueError(
            f"does not fit: the {cache / GiB:.2f} GiB cache pool per GPU holds {rows} rows of "
            f"{row / 2**20:.1f} MiB, but the KDA states of max_num_seqs={max_num_seqs} need {kda_rows} rows "
            f"({kda_groups} per request) and no row is left for tokens; lower max_num_seqs or free memory")

    replicas = num_gpus // degree
    per_replica = kv_rows * block_size * shards
    tokens = replicas * per_replica
    return CapacityPlan(
        model=model, gpu=gpu, num_gpus=num_gpus, layout=layout, degree=degree, replicas=replicas,
        latent=latent, index=index, weight_format=weight_format if weight_bytes is None else "given bytes",
        context_len=context_len, max_num_seqs=max_num_seqs, gpu_memory_utilization=gpu_memory_utilization,
        hbm_bytes=hbm, budget_bytes=budget, weight_bytes=weights, activation_bytes=act,
        prefill_exchange_bytes=exch, dcp_workspace_bytes=dcp_ws, cache_bytes=cache,
        block_size=block_size, row_bytes=row, attention_row_bytes=attention_row, kda_groups=kda_groups,
        kda_group_state_bytes=kda_group_state, kda_rows=kda_rows, kv_rows=kv_rows,
        kv_bytes_per_token_per_gpu=token_bytes / shards,
        tokens_per_replica=per_replica, tokens_that_fit=tokens,
        full_context_requests=tokens / context_len,
        full_context_requests_whole=replicas * (per_replica // context_len),
    )


# ---------------------------------------------------------------------------- article comparison
@dataclass(frozen=True)
class ComparisonRow:
    scenario: str
    ours: float
    article: float
    unit: str  # "M tokens", "x", "contexts"

    @property
    def error_pct(self) -> float:
        return 100.0 * (self.ours - self.article) / self.article


def article_comparison(cfg: "ModelConfig | None" = None, **knobs) -> list[ComparisonRow]:
    """Our figures next to the article's for K3.1 Pro on 8x GB300. ``knobs`` go to
    ``plan_capacity`` (memory constants, weight format, ...); layout, formats, GPUs and context
    are fixed by the scenarios."""
    from zmrl.model.config import ModelConfig

    cfg = cfg if cfg is not None else ModelConfig.preset("k3.1-pro")
    knobs = {k: v for k, v in knobs.items() if k not in ("latent", "index", "layout", "degree", "num_gpus",
                                                         "context_len", "gpu_memory_bytes")}

    def plan(layout: str, latent: str, index: str) -> CapacityPlan:
        return plan_capacity(cfg, "gb300", 8, layout=layout, degree=8, latent=latent, index=index,
                             context_len=DEFAULT_CONTEXT, **knobs)

    rows = []
    for (layout, latent, index), ref in ARTICLE_TOKENS.items():
        p = plan(layout, latent, index)
        name = f"{layout.upper()}8 {latent} latent + {index} index: tokens"
        rows.append(ComparisonRow(name, p.tokens_that_fit / 1e6, ref / 1e6, "M tokens"))
    tp_fp8 = plan("tp", "fp8", "fp8")
    tp_mx = plan("tp", "nvfp4", "mxfp4")
    dcp_fp8 = plan("dcp", "fp8", "fp8")
    dcp_mx = plan("dcp", "nvfp4", "mxfp4")
    rows += [
        ComparisonRow("TP8 nvfp4 + mxfp4 / TP8 fp8 + fp8", tp_mx.tokens_that_fit / tp_fp8.tokens_that_fit,
                      ARTICLE_NVFP4_MXFP4_RATIO, "x"),
        ComparisonRow("DCP8 / TP8 (fp8)", dcp_fp8.tokens_that_fit / tp_fp8.tokens_that_fit, 7.2, "x"),
        ComparisonRow("TP8 fp8: concurrent 1M contexts", tp_fp8.full_context_requests,
                      ARTICLE_TP8_FP8_REQUESTS, "contexts"),
        ComparisonRow("DCP8 nvfp4 + mxfp4: 1M contexts (article: 'about 36')", dcp_mx.full_context_requests,
                      36.0, "contexts"),
    ]
    return rows


def format_comparison(rows: list[ComparisonRow]) -> str:
    """``article_comparison`` as a Markdown table."""
    out = ["| scenario (8x GB300, K3.1 Pro) | ours | article | error |", "|---|---:|---:|---:|"]
    for r in rows:
        out.append(f"| {r.scenario} | {r.ours:.3f} {r.unit} | {r.article:g} {r.unit} | {r.error_pct:+.2f} % |")
    return "\n".join(out)


# ---------------------------------------------------------------------------- CLI
def _load_cfg(args: argparse.Namespace) -> tuple["ModelConfig", str]:
    from zmrl.model.config import ModelConfig

    if args.config:
        return ModelConfig.from_json(args.config), args.config
    return ModelConfig.preset(args.preset), args.preset


def _knobs(args: argparse.Namespace) -> dict:
    return dict(
        weight_bytes=args.weight_bytes, weight_format=args.weight_format,
        gpu_memory_utilization=args.gpu_memory_utilization, activation_gib=args.activation_gib,
        prefill_exchange_gib=args.prefill_exchange_gib, dcp_workspace_gib=args.dcp_workspace_gib,
        max_num_seqs=args.max_num_seqs, block_size=args.block_size,
    )


def _plan_main(args: argparse.Namespace) -> int:
    try:
        cfg, name = _load_cfg(args)
        if args.all:
            print(format_comparison(article_comparison(cfg, **_knobs(args))))
            return 0
        mem: int | str = args.gpu if args.gpu_memory_gib is None else int(args.gpu_memory_gib * GiB)
        plan = plan_capacity(cfg, mem, args.num_gpus, latent=args.latent, index=args.index, layout=args.layout,
                             degree=args.degree, context_len=args.context, model=name, **_knobs(args))
    except ValueError as e:  # ConfigError is a ValueError too
        print(f"zmrl plan: error: {e}", file=sys.stderr)
        return 2
    print(plan.table())
    return 0


def _positive_int(s: str) -> int:
    v = int(s)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def add_plan_subcommand(subparsers: "argparse._SubParsersAction") -> argparse.ArgumentParser:
    """Register ``plan`` on a ``parser.add_subparsers(...)`` object; sets ``func`` to the entry."""
    p = subparsers.add_parser(
        "plan", help="KV-cache capacity: tokens and full-length contexts that fit",
        description="Plan the packed KV cache (MLA latent + DSA index keys + KDA state) of one model on "
                    "N GPUs; see docs/capacity.md for every assumption.")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--preset", default="k3.1-pro", help="model preset (default k3.1-pro)")
    src.add_argument("--config", help="path to a config.json instead of a preset")
    p.add_argument("--gpu", default="gb300", choices=sorted(GPU_MEMORY_GB), help="GPU memory preset")
    p.add_argument("--gpu-memory-gib", type=float, help="HBM per GPU in GiB (overrides --gpu)")
    p.add_argument("--num-gpus", type=_positive_int, default=8)
    p.add_argument("--layout", default="tp", choices=LAYOUTS)
    p.add_argument("--degree", type=_positive_int, help="TP/DCP group size (default: --num-gpus)")
    p.add_argument("--latent", default="fp8", choices=LATENT_FORMATS, help="MLA latent cache format")
    p.add_argument("--index", default="fp8", choices=INDEX_FORMATS, help="DSA index-key cache format")
    p.add_argument("--context", type=_positive_int, default=DEFAULT_CONTEXT, help="context length per request")
    p.add_argument("--weight-format", default="mxfp4-experts", choices=sorted(WEIGHT_FORMATS))
    p.add_argument("--weight-bytes", type=int, help="total weight bytes of the model (overrides --weight-format)")
    p.add_argument("--gpu-memory-utilization", type=float, default=GPU_MEMORY_UTILIZATION)
    p.add_argument("--activation-gib", type=float, default=ACTIVATION_GIB,
                   help="activations + CUDA graphs per GPU (fitted default)")
    p.add_argument("--prefill-exchange-gib", type=float, default=PREFILL_EXCHANGE_GIB)
    p.add_argument("--dcp-workspace-gib", type=float, default=DCP_WORKSPACE_GIB,
                   help="DCP-only workspace per GPU (fitted default)")
    p.add_argument("--max-num-seqs", type=_positive_int, default=MAX_NUM_SEQS,
                   help="requests whose KDA state rows are reserved")
    p.add_argument("--block-size", type=int, help="tokens per row per GPU (default: auto)")
    p.add_argument("--all", action="store_true", help="print the comparison with the article's figures")
    p.set_defaults(func=_plan_main)
    return p


def main(argv: list[str] | None = None) -> int:
    """Standalone entry: ``python -m zmrl.capacity.planner [plan options]`` (no subcommand word)."""
    parser = argparse.ArgumentParser(prog="zmrl")
    sub = parser.add_subparsers(dest="command", required=True)
    add_plan_subcommand(sub)
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] != "plan":
        argv = ["plan", *argv]
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
