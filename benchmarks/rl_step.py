"""One RL step on one GPU without Ray, phase by phase: rollout, trainer log-probs + loss + backward,
optimizer step, weight push to the engine.

    python benchmarks/rl_step.py [--prompts 64] [--n 8] [--prompt-len 512] [--max-new 1024]
        [--min-new-frac 0.25] [--layers 16] [--micro-batch-tokens 16384] [--max-num-seqs 256] [--recompute none]
        [--parity-pass separate,fused] [--rollout-only] [--out FILE.json] [--smoke]

The batch is RL-shaped: ``--prompts`` random prompts of ``--prompt-len`` tokens, ``--n`` samples each
(temperature 1, per-request seeds), each prompt's response length drawn uniformly from
[``--min-new-frac`` x ``--max-new``, ``--max-new``], the same in every step (no stop tokens, so
the lengths are exactly these: a random-weight model's "EOS" would be noise). Engine and trainer are two copies of the same
bench model (bf16, LoRA r=32 on every target) in one process, as a colocated LoRA RL job runs them.

Phases (CUDA-synchronised wall clock):

* ``rollout``: ``RolloutEngine.generate`` of the whole batch (continuous batching, graph decode);
* ``parity_forward``: the no-grad trainer forward over every sequence whose log-probs are compared
  with the engine's (only with ``--parity-pass separate``, today's loop; ``fused`` takes the
  comparison from the training forward's log-probs, which are the same bits, and drops this pass);
* ``train_forward_backward``: per micro-batch (whole sequences, at most ``--micro-batch-tokens``)
  the packed forward with autograd, a GRPO loss (group-normalised random rewards, PPO-clip ratio
  against the rollout log-probs, token mean) and backward (gradients accumulate);
* ``optimizer``: ``make_optimizer``'s AdamW step on the LoRA parameters;
* ``weight_push``: ``engine.update_weights(lora_state_dict(trainer))``.

Step 0 is a warm-up (Triton compilation, CUDA-graph capture) and is reported but not summarised;
each later step runs one ``--parity-pass`` mode. Every step checks the contract: the fraction of
response tokens whose trainer log-prob equals the engine's bitwise (1.0 expected in bitwise mode).

On a GPU the rollout is also put against its bound (``rollout_bound``): the prefill's forward FLOPs of
the distinct prompts (prefix caching serves a prompt's n samples) over the matmul peak, plus, for an
ideal engine that decodes every sequence from the first step, each decode step's bytes (the weights
the step's batch reads, every live sequence's index keys, selected latents and KDA state at its
context) over the copy bandwidth; both measured in the run. The training phase reports TFLOP/s and MFU
(``benchmarks/_train_flops.py``).
``--smoke``: CPU, tiny preset and sizes; checks the script end to end (numbers meaningless).
"""
from __future__ import annotations

import argparse
import copy
import logging
import time
from typing import Any, Callable

import torch

from _common import (build_on_device, copy_bandwidth_tb_s, decode_weight_bytes, default_out, env, kv_state_bytes_per_seq,
                     model_config, pick_device, setup_logging, table, write_json)
from _train_flops import forward_flops, measured_matmul_peak_tflops, train_flops
from zmrl.kernels_batch_invariant import apply_numerics, current_numerics, set_mode
from zmrl.kernels_batch_invariant.numerics import BACKWARD_MATMUL_PRECISIONS
from zmrl.lora import LoraConfig, apply_lora, lora_parameters, lora_state_dict
from zmrl.model import RECOMPUTE_POLICIES, apply_recompute
from zmrl.rollout import EngineConfig, RolloutEngine, SamplingParams
from zmrl.trainer import compute_logprobs, make_optimizer, pack_micro_batches

log = logging.getLogger("benchmarks.rl_step")
PARITY_PASSES = ("separate", "fused")


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def timed(dev: torch.device, times: dict[str, float], name: str, fn: Callable[[], Any]) -> Any:
    _sync(dev)
    t0 = time.perf_counter()
    out = fn()
    _sync(dev)
    times[name] = times.get(name, 0.0) + time.perf_counter() - t0
    return out


def grpo_advantages(rewards: torch.Tensor, n: int) -> torch.Tensor:
    """Group-normalised rewards (GRPO): per prompt, (r - mean) / (std + 1e-6) over its n samples."""
    r = rewards.view(-1, n)
    return ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-6)).view(-1)


def ppo_clip_loss(lp: torch.Tensor, old: torch.Tensor, adv: float, clip: float = 0.2) -> torch.Tensor:
    """Sum over the sequence's tokens of the PPO-clip objective (negated)."""
    ratio = torch.exp(lp - old)
    return torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - clip, 1 + clip)).sum()


def rollout_bound(model: torch.nn.Module, prompt_lens: list[int], lengths: list[tuple[int, int]], lora_r: int,
                  bw_tb_s: float, peak_tflops: float) -> dict[str, float]:
    """Seconds the rollout needs at the hardware's limits: forward FLOPs of the distinct ``prompt_lens``
    over ``peak_tflops``, plus the bytes of every decode step of the (prompt, response) ``lengths``
    (the first response token comes from the prefill) over ``bw_tb_s``. See the module docstring."""
    cfg = model.config
    prefill_flops = forward_flops(cfg, prompt_lens, lora_r, logit_rows=len(prompt_lens))
    weights: dict[int, int] = {}
    state: dict[int, int] = {}
    decode_bytes = 0
    for step in range(1, max((r for _, r in lengths), default=0)):
        live = [p + step for p, r in lengths if r > step]
        if len(live) not in weights:
            weights[len(live)] = decode_weight_bytes(model, len(live))
        decode_bytes += weights[len(live)]
        for ctx in live:
            if ctx not in state:
                state[ctx] = kv_state_bytes_per_seq(cfg, ctx)
            decode_bytes += state[ctx]
    prefill_s = prefill_flops / (peak_tflops * 1e12)
    decode_s = decode_bytes / (bw_tb_s * 1e12)
    return {"prefill_tflop": prefill_flops / 1e12, "decode_gb": decode_bytes / 1e9, "prefill_s": prefill_s,
            "decode_s": decode_s, "total_s": prefill_s + decode_s}


def rl_step(a: argparse.Namespace, dev: torch.device, engine: RolloutEngine, trainer, optimizer, prompts: list[list[int]],
            step: int, parity_pass: str, peak_tflops: float | None = None, bw_tb_s: float | None = None
            ) -> dict[str, Any]:
    times: dict[str, float] = {}
    # The same response lengths every step (the steps' timings compare); tokens and rewards vary.
    lo = max(1, int(a.min_new_frac * a.max_new))
    new_lens = torch.randint(lo, a.max_new + 1, (len(prompts),), generator=torch.Generator().manual_seed(a.seed)).tolist()
    g = torch.Generator().manual_seed(1000 + step)
    params = [SamplingParams(temperature=1.0, max_tokens=m, seed=step * 100003 + i, n=a.n)
              for i, m in enumerate(new_lens)]
    outs = timed(dev, times, "rollout", lambda: engine.generate(prompts, params))
    if any(o.error for o in outs):
        raise RuntimeError(f"rollout errors: {[o.error for o in outs if o.error][:3]}")
    bound = None
    if peak_tflops and bw_tb_s:
        bound = rollout_bound(engine.model, [len(p) for p in prompts],
                              [(len(o.prompt_token_ids), len(o.token_ids)) for o in outs], a.lora_r, bw_tb_s, peak_tflops)
    n_resp = sum(len(o.token_ids) for o in outs)
    rollout = {"step": step, "parity_pass": parity_pass, "sequences": len(outs), "response_tokens": n_resp,
               "rollout_tok_s": n_resp / times["rollout"], "rollout_bound": bound,
               "rollout_frac_of_bound": bound["total_s"] / times["rollout"] if bound else None}
    if a.rollout_only:  # no trainer pass: nothing checks the log-probs, so no parity figure is reported
        return {**rollout, "seconds": times, "total_s": times["rollout"], "logprob_equal_fraction": None}
    seqs = [o.prompt_token_ids + o.token_ids for o in outs]
    plens = [len(o.prompt_token_ids) for o in outs]
    old = [o.logprobs.to(dev) for o in outs]
    rewards = torch.rand(len(outs), generator=g)
    adv = grpo_advantages(rewards, a.n).tolist()
    batches = pack_micro_batches([len(s) for s in seqs], a.micro_batch_tokens)
    equal = 0

    def count_equal(idx: list[int], lps: list[torch.Tensor]) -> int:
        return sum(int((lp.detach() == old[i]).sum()) for i, lp in zip(idx, lps))

    if parity_pass == "separate":
        def parity_forward() -> int:
            with torch.no_grad():
                return sum(count_equal(b, compute_logprobs(trainer, [seqs[i] for i in b], [plens[i] for i in b], 1.0))
                           for b in batches)
        equal = timed(dev, times, "parity_forward", parity_forward)

    def train() -> int:
        eq = 0
        for b in batches:
            lps = compute_logprobs(trainer, [seqs[i] for i in b], [plens[i] for i in b], 1.0)
            if parity_pass == "fused":
                eq += count_equal(b, lps)
            loss = sum(ppo_clip_loss(lp, old[i], adv[i]) for i, lp in zip(b, lps)) / n_resp
            loss.backward()
        return eq

    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    eq_train = timed(dev, times, "train_forward_backward", train)
    train_peak = torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else None
    if parity_pass == "fused":
        equal = eq_train

    def opt_step() -> None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    timed(dev, times, "optimizer", opt_step)
    timed(dev, times, "weight_push", lambda: engine.update_weights(lora_state_dict(trainer)))
    total = sum(times.values())
    # useful training FLOPs of the step (benchmarks/_train_flops.py), micro-batch by micro-batch
    flops = sum(train_flops(trainer.config, [len(seqs[i]) for i in b], a.lora_r,
                            logit_rows=sum(len(seqs[i]) - plens[i] for i in b)).total for b in batches)
    tflop_s = flops / times["train_forward_backward"] / 1e12
    return {**rollout, "tokens": sum(len(s) for s in seqs), "micro_batches": len(batches),
            "logprob_equal_fraction": equal / max(1, n_resp), "seconds": times, "total_s": total,
            "share": {k: v / total for k, v in times.items()},
            "train_tok_s": sum(len(s) for s in seqs) / times["train_forward_backward"],
            # peak allocated GiB during the training phase (both models, the engine's cache, the optimizer)
            "train_peak_gib": train_peak,
            "train_tflop": flops / 1e12, "train_tflop_s": tflop_s,
            "train_mfu": tflop_s / peak_tflops if peak_tflops else None}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--n", type=int, default=8, help="samples per prompt")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--max-new", type=int, default=1024)
    ap.add_argument("--min-new-frac", type=float, default=0.25)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--lora-r", type=int, default=32)
    ap.add_argument("--micro-batch-tokens", type=int, default=16384)
    ap.add_argument("--max-batched-tokens", type=int, default=16384, help="engine prefill token budget per step")
    ap.add_argument("--max-num-seqs", type=int, default=256,
                    help="engine cap on running sequences (continuous batching admits the rest as others finish)")
    ap.add_argument("--graph-batch-sizes", default=None,
                    help="comma-separated decode-graph batch buckets (EngineConfig.decode_graph_batch_sizes; "
                         "default 1, 2, 4, ... max-num-seqs)")
    ap.add_argument("--recompute", default="none", choices=RECOMPUTE_POLICIES)
    ap.add_argument("--backward-precision", default="tf32", choices=BACKWARD_MATMUL_PRECISIONS,
                    help="the trainer's backward_matmul_precision (recipe trainer.backward_matmul_precision)")
    ap.add_argument("--parity-pass", default="separate,fused",
                    help="one timed step per value: separate (no-grad parity forward, then training "
                         "forward) or fused (parity from the training forward)")
    ap.add_argument("--rollout-only", action="store_true",
                    help="time the rollout alone (tokens/s and fraction of its bound); no trainer, no parity figure")
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="JSON result (default benchmarks/results/<date>_rl_step_<device>.json)")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny preset, tiny sizes: checks the script runs")
    a = ap.parse_args()
    setup_logging()
    try:
        graph_sizes = None if a.graph_batch_sizes is None else [int(b) for b in a.graph_batch_sizes.split(",") if b]
    except ValueError:
        raise SystemExit(f"--graph-batch-sizes: {a.graph_batch_sizes!r} (comma-separated integers)") from None
    passes = [p for p in a.parity_pass.split(",") if p]
    if not passes or any(p not in PARITY_PASSES for p in passes):
        raise SystemExit(f"--parity-pass: {a.parity_pass!r} (allowed, comma-separated: {', '.join(PARITY_PASSES)})")
    dev = pick_device("rl_step.py", a.smoke)
    if a.smoke:
        a.prompts, a.n, a.prompt_len, a.max_new, a.micro_batch_tokens, a.max_batched_tokens = 2, 2, 24, 12, 64, 256
    n_seqs = a.prompts * a.n
    per_seq_blocks = -(-(a.prompt_len + a.max_new) // 64)
    try:  # checked before the models are built (minutes on a GPU)
        engine_config = EngineConfig(
            num_blocks=n_seqs * per_seq_blocks + 16, max_num_seqs=min(n_seqs, a.max_num_seqs),
            max_num_batched_tokens=a.max_batched_tokens, enable_prefix_caching=True, kernel_mode="bitwise",
            decode_graph_batch_sizes=graph_sizes).validate()
    except ValueError as e:
        raise SystemExit(f"rl_step.py: {e}") from None
    t_start = time.perf_counter()
    set_mode("bitwise")
    apply_numerics(current_numerics().replace(backward_matmul_precision=a.backward_precision))
    cfg = model_config(a.layers, a.smoke)
    trainer = build_on_device(cfg, torch.bfloat16, dev, seed=a.seed)
    apply_lora(trainer, LoraConfig(r=a.lora_r, alpha=float(a.lora_r), init_b_std=0.02, init_seed=a.seed))
    optimizer = None
    if a.rollout_only:  # the engine's model alone: no trainer copy, no optimizer state on the device
        engine_model, trainer = trainer, None
    else:
        engine_model = copy.deepcopy(trainer)
        apply_recompute(trainer, a.recompute)
        for p in lora_parameters(trainer):
            p.requires_grad_(True)
        optimizer = make_optimizer(trainer, lr=a.lr)
    engine = RolloutEngine(engine_model, engine_config)
    g = torch.Generator().manual_seed(a.seed)
    prompts = [torch.randint(0, cfg.vocab_size, (a.prompt_len,), generator=g).tolist() for _ in range(a.prompts)]
    log.info("models and engine ready in %.1fs", time.perf_counter() - t_start)

    out = a.out or default_out("rl_step" + ("_smoke" if a.smoke else ""))
    steps: list[dict[str, Any]] = []

    peak = measured_matmul_peak_tflops(dev) if dev.type == "cuda" else None
    bw = copy_bandwidth_tb_s(dev) if dev.type == "cuda" else None

    def save() -> None:  # after every step: a run cut short by a time limit keeps what it measured
        write_json(out, {"benchmark": "rl_step", **env(), "preset": "tiny" if a.smoke else "bench",
                         "layers": cfg.num_hidden_layers, "dtype": "bfloat16", "args": vars(a),
                         "matmul_peak_tflop_s": peak, "copy_bandwidth_tb_s": bw, "flop_formula": "benchmarks/_train_flops.py", "steps": steps,
                         "wall_s": time.perf_counter() - t_start})

    if a.rollout_only:
        passes = ["none"]
    for step, mode in enumerate(["fused"] + passes):  # step 0: warm-up
        r = rl_step(a, dev, engine, trainer, optimizer, prompts, step, mode, peak, bw)
        steps.append(r)
        save()
        log.info("step %d (%s): %.1fs, log-prob parity %s", step, mode, r["total_s"], r["logprob_equal_fraction"])
    timed_steps = steps[1:]
    if a.rollout_only:
        for r in timed_steps:
            rb = "" if r["rollout_bound"] is None else \
                f" = {r['rollout_frac_of_bound']:.1%} of its {r['rollout_bound']['total_s']:.2f} s bound"
            print(f"\nRollout, bench preset ({cfg.num_hidden_layers} layers) bf16, LoRA r={a.lora_r}: {a.prompts} prompts x "
                  f"n={a.n}, prompt {a.prompt_len}: {r['response_tokens']} response tokens in {r['total_s']:.2f} s, "
                  f"{r['rollout_tok_s']:.0f} tok/s{rb}")
        save()
        return 0
    phases = ["rollout", "parity_forward", "train_forward_backward", "optimizer", "weight_push"]
    rows = []
    for ph in phases:
        row: dict[str, Any] = {"phase": ph}
        for r in timed_steps:
            s = r["seconds"].get(ph)
            row[f"{r['parity_pass']}_s"] = s
            row[f"{r['parity_pass']}_share"] = None if s is None else s / r["total_s"]
        rows.append(row)
    rows.append({"phase": "total", **{f"{r['parity_pass']}_s": r["total_s"] for r in timed_steps},
                 **{f"{r['parity_pass']}_share": 1.0 for r in timed_steps}})
    cols = [("phase", "phase", "s")]
    for r in timed_steps:
        cols += [(f"{r['parity_pass']}_s", f"{r['parity_pass']} s", ".2f"), (f"{r['parity_pass']}_share", "share", ".1%")]
    print(f"\nRL step, {'tiny (smoke)' if a.smoke else 'bench'} preset ({cfg.num_hidden_layers} layers) bf16, "
          f"LoRA r={a.lora_r}: {a.prompts} prompts x n={a.n}, prompt {a.prompt_len}, new tokens "
          f"{max(1, int(a.min_new_frac * a.max_new))}..{a.max_new}, trainer micro-batches <= {a.micro_batch_tokens} "
          f"tokens, recompute {a.recompute}")
    print(table(rows, cols))
    for r in timed_steps:
        mem = "" if r["train_peak_gib"] is None else f", training peak {r['train_peak_gib']:.1f} GiB"
        mfu = "" if r["train_mfu"] is None else f" = {r['train_mfu']:.1%} MFU of the {peak:.0f} TFLOP/s matmul peak"
        rb = "" if r["rollout_bound"] is None else \
            f" ({r['rollout_frac_of_bound']:.1%} of its {r['rollout_bound']['total_s']:.2f} s bound)"
        print(f"{r['parity_pass']}: {r['response_tokens']} response tokens, rollout {r['rollout_tok_s']:.0f} tok/s{rb}, "
              f"trainer {r['train_tok_s']:.0f} tok/s ({r['train_tflop_s']:.1f} TFLOP/s{mfu}){mem}, "
              f"log-prob parity {r['logprob_equal_fraction']:.4f}")
    sep = {r["parity_pass"]: r for r in timed_steps}
    if "separate" in sep:
        pf = sep["separate"]["seconds"]["parity_forward"]
        print(f"one forward per update saves the parity forward: {pf:.2f}s "
              f"({pf / sep['separate']['total_s']:.1%} of the step with it)")
    save()
    ok = all(r["logprob_equal_fraction"] == 1.0 for r in steps)
    if not ok:
        log.error("rollout/trainer log-probs differ (bitwise mode): see logprob_equal_fraction")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
