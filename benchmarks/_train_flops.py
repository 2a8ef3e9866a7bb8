"""FLOPs of one trainer forward + backward (LoRA training) of a packed micro-batch: the formula the
MFU figures of ``trainer_throughput.py`` and ``rl_step.py`` use.

Counted (2 FLOPs per multiply-add; T = packed tokens, t = a token's position in its sequence):

* base matmuls, forward: 2 T x (sum of every 2-D weight a token multiplies: attention and indexer
  projections, MLA's absorbed kv_b (same count as the un-absorbed product), routers, dense MLPs,
  shared experts, ``num_experts_per_tok`` routed experts; not the embedding lookup); lm_head only
  for the rows that predict a scored (response) token (``logit_rows``; the trainer computes no other
  logits: zmrl/kernels_batch_invariant/lm_head_logprobs.py), all T rows when not given;
* base matmuls, input-gradient pass: the same again (dX of every matmul); base weights are frozen,
  so no weight-gradient pass;
* LoRA (rank r on every adapted matmul): forward 2 r (in + out) per token per adapter (routed-expert
  adapters: top-k of them), then the same for the input gradient and the same for the A/B weight
  gradients (3x in total);
* MLA attention (absorbed, per layer): forward sum_t 2 H L_t (d_qk + d_v) with L_t = min(t + 1,
  index_topk) keys, d_qk = kv_lora + rope, d_v = kv_lora; backward 2x forward (dQ, dK, dV, dP);
* DSA indexer scores: forward only (the top-k selection passes no gradient): sum_t 2 Hi (t + 1) di;
* KDA (chunk C = 64, per layer, per token and head): forward 2 C (2 dk) for A_qk and A_kk,
  2 C (dk + dv) for the triangular solve applied to [K | V], 2 C dv for A_qk V, 2 dk dv x 3 for the
  state read-out, the state-corrected values and the state update; backward 2x forward.

Not counted: elementwise work, norms, convolutions, softmax exponentials, the recompute of
activation checkpointing (MFU counts useful work only).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Sequence

from zmrl.model import ModelConfig
from zmrl.capacity.sizing import _is_active, weight_shapes

KDA_CHUNK = 64
_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.")


@dataclass(frozen=True)
class TrainFlops:
    base_fwd: float
    base_input_grad: float
    lora: float  # forward + input gradient + weight gradient
    attention: float  # MLA forward + backward
    indexer: float  # forward only
    kda: float  # forward + backward

    @property
    def total(self) -> float:
        return self.base_fwd + self.base_input_grad + self.lora + self.attention + self.indexer + self.kda

    def as_dict(self) -> dict[str, float]:
        return {"base_fwd": self.base_fwd, "base_input_grad": self.base_input_grad, "lora": self.lora,
                "attention": self.attention, "indexer": self.indexer, "kda": self.kda, "total": self.total}


def _lora_targets(name: str) -> bool:
    """Base weights that carry a LoRA adapter (zmrl/lora: every attention and indexer projection and
    every routed / shared expert; not routers, dense MLPs, lm_head)."""
    if ".self_attn." in name:
        return name.endswith("_proj.weight") or name.endswith("proj_with_mqa.weight") or \
            name.endswith("indexer.wq_b.weight") or name.endswith("indexer.wk.weight")
    return ".experts." in name or ".shared_experts." in name


def train_flops(cfg: ModelConfig, seq_lens: Sequence[int], lora_r: int, logit_rows: int | None = None) -> TrainFlops:
    """``logit_rows``: rows that go through lm_head (the response tokens' predecessors); default T."""
    tokens = sum(seq_lens)
    logit_rows = tokens if logit_rows is None else logit_rows
    k = cfg.num_experts_per_tok
    per_token = lora_per_token = head = 0
    for name, shape in weight_shapes(cfg).items():
        if len(shape) != 2 or name == "model.embed_tokens.weight" or not _is_active(name, k):
            continue
        out_f, in_f = shape
        if name == "lm_head.weight":
            head = 2 * out_f * in_f
            continue
        per_token += 2 * out_f * in_f
        if lora_r and _lora_targets(name):
            lora_per_token += 2 * lora_r * (in_f + out_f)
    if cfg.tie_word_embeddings:  # the head is the embedding matrix (weight_shapes lists it once)
        head = 2 * cfg.vocab_size * cfg.hidden_size
    base_fwd = float(tokens * per_token + logit_rows * head)
    lora = 3.0 * tokens * lora_per_token

    n_mla = sum(1 for i in range(cfg.num_hidden_layers) if not cfg.is_kda_layer(i))
    n_kda = cfg.num_hidden_layers - n_mla
    d_qk, d_v = cfg.kv_lora_rank + cfg.qk_rope_head_dim, cfg.kv_lora_rank
    topk = cfg.index_topk if cfg.has_indexer else None
    keys = sum(sum(min(t + 1, topk) if topk else t + 1 for t in range(n)) for n in seq_lens)
    all_prev = sum(n * (n + 1) // 2 for n in seq_lens)
    attn_fwd = n_mla * 2.0 * cfg.num_attention_heads * keys * (d_qk + d_v)
    indexer = (n_mla * 2.0 * cfg.index_n_heads * all_prev * cfg.index_head_dim) if cfg.has_indexer else 0.0

    la = cfg.linear_attn_config
    dk = dv = la.head_dim
    c = KDA_CHUNK
    kda_tok_head = 2 * c * 2 * dk + 2 * c * (dk + dv) + 2 * c * dv + 3 * 2 * dk * dv
    kda_fwd = n_kda * float(tokens) * la.num_heads * kda_tok_head
    return TrainFlops(base_fwd=base_fwd, base_input_grad=base_fwd, lora=lora, attention=3.0 * attn_fwd,
                      indexer=indexer, kda=3.0 * kda_fwd)


def forward_flops(cfg: ModelConfig, seq_lens: Sequence[int], lora_r: int, logit_rows: int | None = None) -> float:
    """FLOPs of one forward (a prefill) of the packed sequences: ``train_flops``' base forward plus the
    forward third of its attention, KDA and LoRA terms (those count forward + backward there) and the
    indexer (forward only); ``lora_r`` 0 for a model without adapters."""
    f = train_flops(cfg, seq_lens, lora_r, logit_rows=logit_rows)
    return f.base_fwd + (f.attention + f.kda + f.lora) / 3 + f.indexer


def measured_matmul_peak_tflops(device, n: int = 8192, iters: int = 10) -> float:
    """bf16 dense GEMM throughput (TFLOP/s) of torch.mm at n x n x n on ``device``: the roofline the MFU
    is relative to (DESIGN: FLOPs divided by the matmul peak measured in the same run)."""
    import torch

    from _common import cuda_time_ms

    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    ms = cuda_time_ms(lambda: a @ b, warmup=3, iters=iters)["min_ms"]
    return 2 * n**3 / (ms * 1e-3) / 1e12


def fmt_tflop(x: float) -> str:
    return f"{x / 1e12:.2f}" if math.isfinite(x) else "-"


# ----------------------------------------------------------------------------- expected peak memory
# A first-order model of the trainer's peak GPU memory (bf16 model, LoRA, one packed micro-batch), so a
# GPU run can put the measured peak next to what the tensors autograd keeps should take. Per token
# and layer it counts the dominant tensors the backward reads (Triton backend: linear keeps no input for a
# frozen weight, LoRA keeps its input and its rank-r intermediate, kda_chunk keeps q, k, g in fp32 and
# v, the MLA absorbed attention keeps q_lat and o_lat in fp32 plus the selected key positions, the MoE
# keeps the gathered expert rows, the GLU inputs and the expert outputs); it ignores small vectors
# (norm statistics, routing weights, beta) and allocator fragmentation.
#
# Policies (zmrl/model/recompute.py): "none" keeps every layer's tensors; "layer" keeps each layer's
# input and holds one layer's tensors again while that layer's backward runs; "selective" keeps the
# input and the mid-layer residual and holds one sub-block's tensors; "attention" keeps the MLP/MoE
# tensors of every layer and holds one token mixer's. On top: the weights, the LoRA parameters and their
# gradients (fp32), the backward's working set (about one layer's saved tensors again: the gradients
# of those tensors, alive while the layer's backward runs), and one lm_head chunk (fp32 logits, their
# softmax-gradient and its bf16 copy: 10 bytes per row and vocabulary entry).

BF16, FP32, INDEX = 2, 4, 8


@dataclass(frozen=True)
class MemoryEstimate:
    policy: str
    weights: float
    lora: float  # parameters + gradients
    kept: float  # saved for the backward across the whole forward
    working: float  # one layer / sub-block recomputed or resident while its backward runs + its gradients
    logits: float  # one lm_head chunk

    @property
    def total(self) -> float:
        return self.weights + self.lora + self.kept + self.working + self.logits

    def as_dict(self) -> dict[str, float | str]:
        return {"policy": self.policy, "weights": self.weights, "lora": self.lora, "kept": self.kept,
                "working": self.working, "logits": self.logits, "total": self.total}


def saved_bytes_per_token(cfg: ModelConfig, layer: int, lora_r: int, context: int) -> tuple[float, float]:
    """(token mixer, channel mixer) bytes per token that autograd keeps for layer ``layer`` (its input
    norm included); ``context`` = mean keys a query can attend to (for the selected-position lists)."""
    d, r = cfg.hidden_size, lora_r
    if cfg.is_kda_layer(layer):
        la = cfg.linear_attn_config
        hd, dk = la.num_heads * la.head_dim, la.head_dim
        mixer = (2 * BF16 * d  # layer input (input norm) and the normed input (every adapter's LoRA A input)
                 + 3 * BF16 * hd  # q, k, v projections (short-conv input)
                 + 2 * BF16 * hd  # conv outputs q, k (L2-norm input)
                 + 3 * FP32 * hd + BF16 * hd  # kda_chunk inputs: q, k, g fp32, v
                 + BF16 * hd + BF16 * dk  # gate pre-activation (f_b output) and f_a output
                 + FP32 * hd + BF16 * hd  # o (fp32) and the output gate (gated RMSNorm inputs)
                 + BF16 * hd  # o_proj input
                 + 9 * FP32 * r)  # LoRA intermediates
    else:
        h, c, p, n, v = (cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim,
                         cfg.v_head_dim)
        q = cfg.q_lora_rank or d
        keys = min(context, cfg.index_topk) if cfg.has_indexer else context
        mixer = (2 * BF16 * d + 2 * BF16 * q  # input, normed input, q_a output, q latent
                 + BF16 * h * (n + p)  # q
                 + BF16 * (c + p) + BF16 * c  # kv_a output, normed c_kv
                 + 2 * FP32 * h * c + FP32 * h * p  # q_lat and o_lat (fp32), q_pe (fp32)
                 + (INDEX * keys if cfg.has_indexer else 0)  # selected key positions
                 + BF16 * h * v  # o_proj input
                 + 2 * FP32 * h * r + 8 * FP32 * r)  # absorbed kv_b LoRA, other LoRA intermediates
    if cfg.is_moe_layer(layer):
        k, i = cfg.num_experts_per_tok, cfg.moe_intermediate_size
        shared = cfg.n_shared_experts * i
        mlp = (2 * BF16 * d  # post-attention norm input and the normed input (the experts read their rows there)
               + 3 * BF16 * k * i  # gate, up (GLU inputs), the GLU output (down input)
               + 3 * FP32 * k * r  # expert-LoRA intermediates
               # (the expert outputs, the combine's input, are recomputed in the backward: MoE.forward)
               + 3 * BF16 * shared)  # shared expert
    else:
        mlp = 2 * BF16 * d + 3 * BF16 * cfg.intermediate_size
    return float(mixer), float(mlp)


def expected_peak_memory(cfg: ModelConfig, seq_lens: Sequence[int], lora_r: int, policy: str,
                         logit_chunk_rows: int = 1024, logit_rows: int | None = None) -> MemoryEstimate:
    """Expected peak bytes of one forward + backward for ``policy`` (see the model above)."""
    tokens = sum(seq_lens)
    logit_rows = tokens if logit_rows is None else logit_rows
    shapes = weight_shapes(cfg)
    weights = float(sum(math.prod(s) for s in shapes.values())) * BF16
    lora_params = 0
    for name, shape in shapes.items():
        if len(shape) != 2 or not _lora_targets(name):
            continue
        lora_params += lora_r * (shape[0] + shape[1])
    lora = 2.0 * FP32 * lora_params
    context = max(1, sum(n * (n + 1) // 2 for n in seq_lens) // max(tokens, 1))
    per_layer = [saved_bytes_per_token(cfg, i, lora_r, context) for i in range(cfg.num_hidden_layers)]
    boundary = BF16 * cfg.hidden_size
    if policy == "none":
        kept = sum(a + b for a, b in per_layer)
        hold = 0.0
    elif policy == "layer":
        kept = float(boundary * len(per_layer))
        hold = max(a + b for a, b in per_layer)
    elif policy == "selective":
        kept = float(2 * boundary * len(per_layer))
        hold = max(max(a, b) for a, b in per_layer)
    elif policy == "attention":
        kept = sum(boundary + b for _, b in per_layer)
        hold = max(a for a, _ in per_layer)
    else:
        raise ValueError(f"unknown recompute policy {policy!r}")
    grads = max(max(a, b) for a, b in per_layer)  # gradients of one block's saved tensors
    head = 2 * BF16 * cfg.hidden_size  # final norm input and the selected hidden rows
    logits = float(min(logit_chunk_rows, max(logit_rows, 1)) * cfg.vocab_size * (FP32 + FP32 + BF16))
    return MemoryEstimate(policy=policy, weights=weights, lora=lora, kept=(kept + head) * tokens,
                          working=(hold + grads) * tokens, logits=logits)
