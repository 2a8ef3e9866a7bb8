"""Engine throughput: tokens/s of prefill and decode for a preset (tiny on CPU by default).

    python benchmarks/engine_throughput.py [--preset tiny] [--dtype float32] [--num-prompts 16]
        [--prompt-len 128] [--max-tokens 32] [--device cpu] [--mode bitwise|fast] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import platform
import subprocess
import time

import torch

from zmrl.kernels_batch_invariant import kernel_mode
from zmrl.model import ModelConfig, build_model
from zmrl.rollout import EngineConfig, RolloutEngine, SamplingParams


def run(preset: str, dtype: str, num_prompts: int, prompt_len: int, max_tokens: int, device: str, mode: str) -> dict:
    cfg = ModelConfig.preset(preset)
    model = build_model(cfg, seed=0, dtype=dtype, device=device).eval()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, cfg.vocab_size, (prompt_len,), generator=g).tolist() for _ in range(num_prompts)]
    blocks = num_prompts * (-(-(prompt_len + max_tokens) // 64)) + 8
    engine = RolloutEngine(model, EngineConfig(num_blocks=blocks, max_num_seqs=num_prompts,
                                               max_num_batched_tokens=num_prompts * prompt_len,
                                               enable_prefix_caching=False))
    sp = SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=0)
    with kernel_mode(mode):
        engine.generate(prompts[:1], SamplingParams(max_tokens=2))  # warm-up
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, sp)
        t0 = time.perf_counter()
        engine.step()  # the whole prefill fits one step's budget
        t_prefill = time.perf_counter() - t0
        t1 = time.perf_counter()
        n_out = 0
        while engine.has_unfinished_requests():
            n_out += sum(len(o.token_ids) for o in engine.step())
        t_decode = time.perf_counter() - t1
    decoded = n_out - num_prompts  # the first token of each request came out of the prefill step
    return {
        "preset": preset, "dtype": dtype, "device": device, "mode": mode, "threads": torch.get_num_threads(),
        "num_prompts": num_prompts, "prompt_len": prompt_len, "max_tokens": max_tokens,
        "prefill_tokens_per_s": num_prompts * prompt_len / t_prefill,
        "decode_tokens_per_s": decoded / t_decode, "decode_steps": engine.num_steps - 1,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--mode", default="bitwise", choices=["bitwise", "fast"])
    ap.add_argument("--json", default=None, help="also write the result here")
    a = ap.parse_args()
    r = run(a.preset, a.dtype, a.num_prompts, a.prompt_len, a.max_tokens, a.device, a.mode)
    try:
        r["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        r["commit"] = None
    r["date"] = time.strftime("%Y-%m-%d")
    r["host"] = platform.processor() or platform.machine()
    print(f"{'metric':<24}{'value':>14}")
    for k in ("prefill_tokens_per_s", "decode_tokens_per_s"):
        print(f"{k:<24}{r[k]:>14.1f}")
    print(f"{'threads':<24}{r['threads']:>14}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(r, f, indent=2)


if __name__ == "__main__":
    main()
