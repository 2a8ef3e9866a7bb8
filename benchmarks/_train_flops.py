"""FLOPs of one trainer forward + backward (LoRA training) of a packed micro-batch: the formula the
MFU figures of ``trainer_throughput.py`` and ``rl_step.py`` use.

Counted (2 FLOPs per multiply-add; T = packed tokens, t = a token's position in its sequence):

* base matmuls, forward: 2 T x (sum of every 2-D weight a token multiplies: attention and indexer
  projections, MLA's absorbed kv_b (same count as the un-absorbed product), routers, dense MLPs,
  shared experts, ``num_experts_per_tok`` routed experts, lm_head; not the embedding lookup);
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


def train_flops(cfg: ModelConfig, seq_lens: Sequence[int], lora_r: int) -> TrainFlops:
    tokens = sum(seq_lens)
    k = cfg.num_experts_per_tok
    per_token = lora_per_token = 0
    for name, shape in weight_shapes(cfg).items():
        if len(shape) != 2 or name == "model.embed_tokens.weight" or not _is_active(name, k):
            continue
        out_f, in_f = shape
        per_token += 2 * out_f * in_f
        if lora_r and _lora_targets(name):
            lora_per_token += 2 * lora_r * (in_f + out_f)
    base_fwd = float(tokens * per_token)
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
