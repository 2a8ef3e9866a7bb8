"""Trainer throughput of the bench preset (bf16, LoRA r=32, H200): bitwise vs fast kernels.

    python benchmarks/trainer_throughput.py [--seq-lens 4096,4096,4096,4096] [--layers 16]
        [--modes bitwise,fast] [--iters 3] [--out FILE.json]

What is timed: one packed micro-batch (default 4 sequences x 4096 = 16K tokens, the second half of
each sequence being the "response") through ``zmrl.trainer.compute_logprobs`` with autograd on
(the RL trainer's forward: full-sequence logits, response-token log-probs), then ``backward`` of a
REINFORCE-style loss into the LoRA parameters (rank 32 on every attention projection and expert).
Reported: forward-only and forward+backward milliseconds and tokens/s (every packed token counts),
CUDA events, median of ``--iters`` runs after ``--warmup``.
"""
from __future__ import annotations

import argparse
import logging
import time
from typing import Any

import torch

from _common import (OOM_ERRORS, build_on_device, cuda_time_ms, default_out, empty_cache, env, model_config,
                     pick_device, setup_logging, table, write_json)
from zmrl.kernels_batch_invariant import kernel_mode
from zmrl.lora import LoraConfig, apply_lora, lora_parameters
from zmrl.trainer import compute_logprobs

log = logging.getLogger("benchmarks.trainer")


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq-lens", type=_ints, default=[4096] * 4, help="packed sequences (default 4 x 4096)")
    ap.add_argument("--layers", type=int, default=16, help="decoder layers (16 = the full bench preset)")
    ap.add_argument("--lora-r", type=int, default=32)
    ap.add_argument("--modes", default="bitwise,fast")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None,
                    help="JSON result (default benchmarks/results/<date>_trainer_throughput_h200.json)")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny preset, tiny shapes: checks the script runs")
    a = ap.parse_args()
    setup_logging()
    dev = pick_device("trainer_throughput.py", a.smoke)
    if a.smoke:
        a.seq_lens, a.iters, a.warmup = [100, 60, 130], 1, 1
    modes = [m for m in a.modes.split(",") if m]
    t_start = time.perf_counter()
    cfg = model_config(a.layers, a.smoke)
    model = build_on_device(cfg, torch.bfloat16, dev, seed=a.seed)
    apply_lora(model, LoraConfig(r=a.lora_r, alpha=float(a.lora_r), init_b_std=0.02, init_seed=a.seed))
    params = lora_parameters(model)
    log.info("bench model: %d layers, LoRA r=%d (%.1f M trainable), built in %.1fs", cfg.num_hidden_layers, a.lora_r,
             sum(p.numel() for p in params) / 1e6, time.perf_counter() - t_start)
    g = torch.Generator().manual_seed(a.seed)
    seqs = [torch.randint(0, cfg.vocab_size, (n,), generator=g) for n in a.seq_lens]
    plens = [max(1, n // 2) for n in a.seq_lens]
    tokens = sum(a.seq_lens)

    def forward() -> list[torch.Tensor]:
        with torch.enable_grad():
            return compute_logprobs(model, seqs, plens, 1.0, micro_batch_tokens=None)

    def forward_backward() -> None:
        lps = forward()
        n = sum(lp.numel() for lp in lps)
        loss = -sum(lp.sum() for lp in lps) / n
        loss.backward()

    def zero() -> None:
        for p in params:
            p.grad = None

    row: dict[str, Any] = {"tokens": tokens, "sequences": len(seqs), "lora_r": a.lora_r}
    for mode in modes:
        try:  # one mode failing must not hide the other
            with kernel_mode(mode):
                f = cuda_time_ms(forward, warmup=a.warmup, iters=a.iters, setup=zero)
                row[f"{mode}_fwd_ms"] = f["median_ms"]
                fb = cuda_time_ms(forward_backward, warmup=a.warmup, iters=a.iters, setup=zero)
            row[f"{mode}_fwdbwd_ms"] = fb["median_ms"]
            row[f"{mode}_fwdbwd_tok_s"] = tokens / (fb["median_ms"] * 1e-3)
            log.info("%s: forward %.0f ms, forward+backward %.0f ms", mode, f["median_ms"], fb["median_ms"])
        except OOM_ERRORS:
            row[f"{mode}_error"] = "out of memory (try --seq-lens 2048,2048,2048,2048 or --layers 8)"
            log.warning("%s: %s", mode, row[f"{mode}_error"])
        except Exception as e:
            row[f"{mode}_error"] = f"{type(e).__name__}: {e}"[:300]
            log.exception("trainer benchmark, %s mode failed", mode)
        finally:
            zero()
            if dev.type == "cuda":
                row[f"{mode}_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
                torch.cuda.reset_peak_memory_stats()
                empty_cache()
    if "bitwise_fwdbwd_ms" in row and "fast_fwdbwd_ms" in row:
        # throughput ratio (bitwise tok/s / fast tok/s): the target is >= 0.90 in training
        row["bitwise_over_fast"] = row["fast_fwdbwd_ms"] / row["bitwise_fwdbwd_ms"]

    rows = [dict(mode=m, fwd_ms=row.get(f"{m}_fwd_ms"), fwdbwd_ms=row.get(f"{m}_fwdbwd_ms"),
                 tok_s=row.get(f"{m}_fwdbwd_tok_s"), peak=row.get(f"{m}_peak_gib"), error=row.get(f"{m}_error"))
            for m in modes]
    print(f"\nTrainer forward+backward, {'tiny (smoke)' if a.smoke else 'bench'} preset "
          f"({cfg.num_hidden_layers} layers) bf16, LoRA r={a.lora_r}, "
          f"packed micro-batch {'+'.join(map(str, a.seq_lens))} = {tokens} tokens")
    print(table(rows, [("mode", "mode", "s"), ("fwd_ms", "fwd ms", ".0f"), ("fwdbwd_ms", "fwd+bwd ms", ".0f"),
                       ("tok_s", "fwd+bwd tok/s", ".0f"), ("peak", "peak GiB", ".1f"), ("error", "error", "s")]))
    if "bitwise_over_fast" in row:
        print(f"bitwise/fast throughput (fwd+bwd tok/s): {row['bitwise_over_fast']:.2f}")
    write_json(a.out or default_out("trainer_throughput" + ("_smoke" if a.smoke else "")),
               {"benchmark": "trainer_throughput", **env(), "preset": "tiny" if a.smoke else "bench",
                "layers": cfg.num_hidden_layers,
                "dtype": "bfloat16", "seq_lens": a.seq_lens, "warmup": a.warmup, "iters": a.iters, "result": row,
                "wall_s": time.perf_counter() - t_start})
    return 0 if all(f"{m}_fwdbwd_ms" in row for m in modes) else 1


if __name__ == "__main__":
    raise SystemExit(main())
