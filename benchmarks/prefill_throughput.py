"""Prefill throughput of the bench preset (bf16, H200): bitwise vs fast kernels, side by side.

    python benchmarks/prefill_throughput.py [--shapes 4x8192,1x32768] [--layers 16]
        [--modes bitwise,fast] [--chunk 0] [--iters 3] [--out FILE.json]

What is timed: the engine's prefill of whole prompts into a fresh paged cache (batch context
with KDA chunk-boundary snapshots recorded, as the engine does with prefix caching on; the forward
over every prompt token; the fp32 logits of each prompt's last token), CUDA events, median of
``--iters`` runs after ``--warmup``. ``--chunk N`` prefills in engine-style chunks of at most N
tokens per step (chunked prefill) instead of one step per shape. A shape ``BxL`` is B prompts of
L tokens; tokens/s counts every prompt token. On a GPU each mode's MFU is the forward FLOPs
(``_train_flops.forward_flops``: matmuls, MLA attention over min(t + 1, top-k) keys, the indexer, KDA;
the last token's logits) over the bf16 matmul peak measured in the same run. ``--profile`` adds the
device time per kernel of one bitwise prefill of each shape (where the time goes).
"""
from __future__ import annotations

import argparse
import logging
import time
from typing import Any

import torch

from _common import (OOM_ERRORS, build_on_device, cuda_time_ms, default_out, empty_cache, env, model_config,
                     pick_device, print_profile, profile_step, setup_logging, table, write_json)
from _train_flops import forward_flops, measured_matmul_peak_tflops
from zmrl.kernels_batch_invariant import kernel_mode
from zmrl.model import ModelCache, SequenceState

log = logging.getLogger("benchmarks.prefill")

PAGE = 64


def _shapes(s: str) -> list[tuple[int, int]]:
    out = []
    for part in s.split(","):
        if not part.strip():
            continue
        try:
            b, n = part.lower().split("x")
            out.append((int(b), int(n)))
        except ValueError:
            raise argparse.ArgumentTypeError(f"shape {part!r} must look like BxL, e.g. 4x8192") from None
    return out


def prefill(model, cache: ModelCache, seqs: list[SequenceState], prompts: list[torch.Tensor], chunk: int) -> None:
    """Prefill every prompt; ``chunk`` > 0: at most that many tokens per step, FIFO like the engine."""
    done = [0] * len(prompts)
    while any(d < p.numel() for d, p in zip(done, prompts)):
        budget = chunk if chunk > 0 else sum(p.numel() for p in prompts)
        rows, lens = [], []
        for i, p in enumerate(prompts):
            n = min(p.numel() - done[i], budget)
            if n > 0:
                rows.append(i)
                lens.append(n)
                budget -= n
            if budget <= 0:
                break
        ctx = cache.context([seqs[i] for i in rows], lens, record_snapshots=True)
        ids = torch.cat([prompts[i][done[i]:done[i] + n] for i, n in zip(rows, lens)])
        hidden = model(ids, ctx)
        model.compute_logits(hidden[ctx.cu_seqlens[1:] - 1])
        for i, n in zip(rows, lens):
            seqs[i].num_tokens += n
            done[i] += n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", type=_shapes, default=[(4, 8192), (1, 32768)])
    ap.add_argument("--layers", type=int, default=16, help="decoder layers (16 = the full bench preset)")
    ap.add_argument("--modes", default="bitwise,fast")
    ap.add_argument("--chunk", type=int, default=0, help="tokens per prefill step (0 = the whole shape in one step)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--time-budget-s", type=float, default=170.0, help="skip the remaining shapes after this")
    ap.add_argument("--profile", action="store_true", help="per-kernel device time of one bitwise prefill per shape")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None,
                    help="JSON result (default benchmarks/results/<date>_prefill_throughput_h200.json)")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny preset, tiny shapes: checks the script runs")
    a = ap.parse_args()
    setup_logging()
    dev = pick_device("prefill_throughput.py", a.smoke)
    if a.smoke:
        a.shapes, a.iters, a.warmup = [(2, 100), (1, 200)], 1, 1
    modes = [m for m in a.modes.split(",") if m]
    t_start = time.perf_counter()
    cfg = model_config(a.layers, a.smoke)
    model = build_on_device(cfg, torch.bfloat16, dev, seed=a.seed)
    gen = torch.Generator(device=dev).manual_seed(a.seed)
    peak = measured_matmul_peak_tflops(dev) if dev.type == "cuda" else None

    results: list[dict[str, Any]] = []
    with torch.no_grad():
        for batch, length in a.shapes:
            row: dict[str, Any] = {"shape": f"{batch}x{length}", "tokens": batch * length, "chunk": a.chunk or None}
            results.append(row)
            if time.perf_counter() - t_start > a.time_budget_s:
                row["skipped"] = "time budget"
                continue
            cache = None
            try:
                pages = batch * -(-length // PAGE) + 1
                cache = ModelCache(cfg, num_pages=pages, page_size=PAGE, dtype=model.dtype, device=dev)
                if peak:  # forward FLOPs of the shape (no LoRA; the last token's logits per prompt)
                    row["tflop"] = forward_flops(cfg, [length] * batch, 0, logit_rows=batch) / 1e12
                prompts = [torch.randint(0, cfg.vocab_size, (length,), device=dev, generator=gen) for _ in range(batch)]
                seqs: list[SequenceState] = []

                def reset() -> None:
                    for s in seqs:
                        cache.release(s)
                    seqs[:] = [SequenceState() for _ in range(batch)]

                for mode in modes:
                    try:  # one mode failing must not hide the other
                        with kernel_mode(mode):
                            t = cuda_time_ms(lambda: prefill(model, cache, seqs, prompts, a.chunk), warmup=a.warmup,
                                             iters=a.iters, setup=reset)
                    except OOM_ERRORS:
                        row["error"] = (row.get("error", "") + f" {mode}: out of memory;").strip()
                        reset()
                        empty_cache()
                        continue
                    except Exception as e:
                        row["error"] = (row.get("error", "") + f" {mode}: {type(e).__name__}: {e}"[:300] + ";").strip()
                        log.exception("prefill %s, %s mode failed", row["shape"], mode)
                        reset()
                        continue
                    row[f"{mode}_ms"] = t["median_ms"]
                    if a.profile and mode == "bitwise":
                        with kernel_mode(mode):
                            reset()
                            row["profile"] = profile_step(lambda: prefill(model, cache, seqs, prompts, a.chunk),
                                                          dev.type == "cuda", steps=1)
                        reset()
                    row[f"{mode}_tok_s"] = batch * length / (t["median_ms"] * 1e-3)
                    if peak:
                        row[f"{mode}_mfu"] = row["tflop"] / (t["median_ms"] * 1e-3) / peak
                if "bitwise_ms" in row and "fast_ms" in row:
                    # throughput ratio (bitwise tok/s / fast tok/s): the targets are >= 0.95 decode, >= 0.90 training
                    row["bitwise_over_fast"] = row["fast_ms"] / row["bitwise_ms"]
                log.info("prefill %s: %s", row["shape"],
                         ", ".join(f"{m} {row.get(m + '_tok_s', float('nan')):.0f} tok/s" for m in modes))
            except OOM_ERRORS:
                row["skipped"] = "out of memory"
                log.warning("prefill %s: out of memory", row["shape"])
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {e}"[:300]
                log.exception("prefill %s failed", row["shape"])
            finally:
                del cache
                empty_cache()

    cols = [("shape", "shape", "s"), ("tokens", "tokens", "d")]
    for m in modes:
        cols += [(f"{m}_ms", f"{m} ms", ".1f"), (f"{m}_tok_s", f"{m} tok/s", ".0f"), (f"{m}_mfu", "MFU", ".1%")]
    cols += [("bitwise_over_fast", "bitwise/fast tok/s", ".2f"), ("skipped", "note", "s"), ("error", "error", "s")]
    print(f"\nPrefill, {'tiny (smoke)' if a.smoke else 'bench'} preset ({cfg.num_hidden_layers} layers) bf16"
          + (f", chunks of {a.chunk} tokens" if a.chunk else ", one step per shape")
          + (f"; MFU of the {peak:.0f} TFLOP/s bf16 matmul peak measured in this run" if peak else ""))
    print(table(results, cols))
    for r in results:
        if r.get("profile"):
            print_profile(f"Where the time goes: prefill {r['shape']}, bitwise (kernels busy "
                          f"{r['profile'][-1]['ms_per_step']:.1f} ms of a {r['bitwise_ms']:.1f} ms step)", r["profile"])
    write_json(a.out or default_out("prefill_throughput" + ("_smoke" if a.smoke else "")),
               {"benchmark": "prefill_throughput", **env(), "preset": "tiny" if a.smoke else "bench",
                "layers": cfg.num_hidden_layers,
                "dtype": "bfloat16", "warmup": a.warmup, "iters": a.iters, "matmul_peak_tflop_s": peak,
                "flop_formula": "benchmarks/_train_flops.py forward_flops", "results": results,
                "wall_s": time.perf_counter() - t_start})
    return 0 if any(f"{m}_ms" in r for r in results for m in modes) else 1


if __name__ == "__main__":
    raise SystemExit(main())
