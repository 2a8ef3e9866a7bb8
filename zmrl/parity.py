"""Rollout/trainer log-prob parity: the measurement (``compare_logprobs``), a self-contained audit on
the tiny model (``run_audit``) and the ``zmrl parity`` subcommand.

DESIGN §2: mismatch is measured, never assumed. ``compare_logprobs`` is the one place that turns
two lists of per-token log-probs into the numbers every RL step logs: the fraction of response
tokens whose log-probs are bitwise equal, max |Δlogp|, and the k1 / k3 KL estimators between the
rollout policy (the sampler) and the trainer policy,

    k1 = mean(lp_roll - lp_train)
    k3 = mean(exp(lp_train - lp_roll) - (lp_train - lp_roll) - 1)

over all response tokens (Schulman's estimators of KL(roll || train) from samples of the rollout
policy). With bitwise parity every Δ is exactly 0, so both are exactly 0.0.

``run_audit`` exercises the whole path the way an RL step does: a LoRA'd tiny model, a live engine
on a separate copy of it, a scenario drawn from the seed (staggered arrivals, chunked prefill,
preemption, prefix caching, long prompts, FP8 latents, n > 1), the trainer's packed forward with a
random micro-batch size and packing order, optimiser steps and ``update_weights`` pushes.
"""
from __future__ import annotations

import argparse
import copy
import math
import random
import sys
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

__all__ = ["FEATURES", "ParityReport", "add_parity_subcommand", "compare_logprobs", "run_audit", "trainer_logprobs"]

# Scenario features run_audit can switch on (``--scenario``: one of these, a comma-separated list,
# "random" = a seed-drawn subset, "all", or "basic" = none: every request submitted at once).
FEATURES = ("staggered", "chunked", "preemption", "prefix", "long", "fp8", "fork")
_SCENARIO_WORDS = ("random", "all", "basic")


@dataclass
class ParityReport:
    """Token-level comparison of rollout vs trainer log-probs (response tokens only).

    A sequence whose two tensors differ in length, or that is missing on one side, counts all of its
    unpaired tokens as compared-and-unequal; Δ statistics (max |Δ|, k1, k3) cover paired tokens only.
    """

    tokens_compared: int
    tokens_equal: int
    # tokens_equal / tokens_compared; NaN when nothing was compared: an empty comparison proves nothing,
    # so it must never read as "all equal"
    bitwise_equal_frac: float
    max_abs_dlogp: float  # over paired tokens; NaN if a NaN log-prob was involved
    kl_k1: float
    kl_k3: float
    num_sequences: int
    scenario: str = ""
    sequences_mismatched: int = 0
    first_mismatch: tuple[int, int] | None = None  # (sequence index, token index) of the first difference
    length_mismatches: int = 0  # sequences whose rollout and trainer token counts differ (or are missing)
    details: dict[str, Any] = field(default_factory=dict)  # scenario facts (preemptions, prefix hits, ...)
    sequences_compared: int = 0  # sequences with at least one response token compared

    @property
    def ok(self) -> bool:
        """Every token bitwise equal, and at least one token compared (an empty audit proves nothing)."""
        return self.tokens_compared > 0 and self.tokens_equal == self.tokens_compared

    def as_dict(self, prefix: str = "parity/") -> dict[str, float]:
        """Flat scalar metrics for a logger / dashboard."""
        return {
            f"{prefix}tokens_compared": float(self.tokens_compared),
            f"{prefix}sequences_compared": float(self.sequences_compared),
            f"{prefix}bitwise_equal_frac": self.bitwise_equal_frac,
            f"{prefix}max_abs_dlogp": self.max_abs_dlogp,
            f"{prefix}kl_k1": self.kl_k1,
            f"{prefix}kl_k3": self.kl_k3,
        }

    def table(self) -> str:
        rows = []
        if self.scenario:
            rows.append(("scenario", self.scenario))
        rows += [
            ("sequences", f"{self.num_sequences}"),
            ("tokens compared", f"{self.tokens_compared}"),
            ("bitwise equal", f"{self.tokens_equal} ({self.bitwise_equal_frac:.6f})"),
            ("max |dlogp|", f"{self.max_abs_dlogp:.3e}"),
            ("kl k1", f"{self.kl_k1:.3e}"),
            ("kl k3", f"{self.kl_k3:.3e}"),
        ]
        if self.sequences_mismatched:
            rows.append(("sequences mismatched", f"{self.sequences_mismatched}"))
        if self.first_mismatch is not None:
            rows.append(("first mismatch", f"sequence {self.first_mismatch[0]}, token {self.first_mismatch[1]}"))
        if self.length_mismatches:
            rows.append(("length mismatches", f"{self.length_mismatches}"))
        rows += [(k.replace("_", " "), f"{v}") for k, v in self.details.items()]
        width = max(24, max(len(k) for k, _ in rows) + 2)
        lines = [f"{k:<{width}}{v}" for k, v in rows]
        lines.append("PASS: rollout and trainer log-probs are bitwise equal" if self.ok
                     else "FAIL: rollout/trainer log-prob mismatch")
        return "\n".join(lines)


def _flat(t: Any) -> torch.Tensor:
    return torch.as_tensor(t.detach() if isinstance(t, torch.Tensor) else t).reshape(-1).cpu()


def compare_logprobs(rollout: Sequence[torch.Tensor], train: Sequence[torch.Tensor], scenario: str = "",
                     details: dict[str, Any] | None = None) -> ParityReport:
    """Compare per-sequence response log-probs; never raises on a mismatch, only reports it.

    rollout[i], train[i]: [n_i] log-probs of sequence i's response tokens (any float dtype, any
    device, grad or not: they are detached and moved to CPU). Equality is elementwise ``==`` (the
    per-token meaning of ``torch.equal``); Δ statistics are accumulated in float64.
    """
    n_seq = max(len(rollout), len(train))
    compared = equal = mismatched = length_bad = seqs_compared = 0
    first: tuple[int, int] | None = None
    max_abs = 0.0
    k1_sum = k3_sum = 0.0
    paired = 0
    for i in range(n_seq):
        a = _flat(rollout[i]) if i < len(rollout) else torch.zeros(0)
        b = _flat(train[i]) if i < len(train) else torch.zeros(0)
        n = min(a.numel(), b.numel())
        extra = max(a.numel(), b.numel()) - n
        a_p, b_p = a[:n], b[:n]
        eq = a_p == b_p
        n_eq = int(eq.sum())
        compared += n + extra
        seqs_compared += (n + extra) > 0
        equal += n_eq
        if extra or i >= len(rollout) or i >= len(train):
            length_bad += 1
        if n_eq < n or extra:
            mismatched += 1
            if first is None:
                first = (i, int((~eq).nonzero()[0, 0]) if n_eq < n else n)
        if n:
            a64, b64 = a_p.double(), b_p.double()
            # equal tokens contribute exactly 0 (also for -inf == -inf, where a - b would be NaN)
            d = torch.where(eq, torch.zeros_like(a64), b64 - a64)  # lp_train - lp_roll
            m = float(d.abs().max())  # NaN if any Δ is NaN
            max_abs = math.nan if math.isnan(m) or math.isnan(max_abs) else max(max_abs, m)
            k1_sum += float((-d).sum())
            k3_sum += float((torch.exp(d) - d - 1).sum())
            paired += n
    return ParityReport(
        tokens_compared=compared, tokens_equal=equal,
        bitwise_equal_frac=equal / compared if compared else math.nan,
        max_abs_dlogp=max_abs if paired else math.nan,
        kl_k1=k1_sum / paired if paired else math.nan, kl_k3=k3_sum / paired if paired else math.nan,
        num_sequences=n_seq, scenario=scenario, sequences_mismatched=mismatched, first_mismatch=first,
        length_mismatches=length_bad, details=dict(details or {}), sequences_compared=seqs_compared,
    )


# ----------------------------------------------------------------------------- the audit


def trainer_logprobs(model, sequences, prompt_lens, temperatures, micro_batch_tokens, order, latent_format):
    """The trainer side of the audit (a module-level hook so tests can substitute a faulty trainer)."""
    from zmrl.trainer import compute_logprobs

    return compute_logprobs(model, sequences, prompt_lens, temperatures, micro_batch_tokens=micro_batch_tokens,
                            order=order, latent_format=latent_format)


def _parse_scenario(scenario: str, rng: random.Random) -> tuple[str, ...]:
    if scenario == "random":
        chosen = tuple(f for f in FEATURES if rng.random() < 0.5)
        return chosen or (rng.choice(FEATURES),)
    if scenario == "all":
        return FEATURES
    if scenario == "basic":
        return ()
    names = tuple(s.strip() for s in scenario.split(",") if s.strip())
    bad = [s for s in names if s not in FEATURES]
    if bad or not names:
        raise ValueError(f"unknown scenario {scenario!r}: use one of {_SCENARIO_WORDS + FEATURES} "
                         f"or a comma-separated list of {FEATURES}")
    return tuple(f for f in FEATURES if f in names)


def _sampling_mix(rng: random.Random, max_tokens: int, fork: bool):
    from zmrl.rollout import SamplingParams

    temperature = rng.choice([0.0, 0.6, 1.0])
    top_p = rng.choice([1.0, 0.9])
    top_k = rng.choice([-1, 20])
    n = rng.choice([1, 2, 3]) if fork else 1
    return SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=max_tokens,
                          seed=rng.randrange(2**31), n=n)


def _drive(engine, prompts: list[list[int]], params: list, ids: list[str], arrivals: list[int]):
    """Run requests to completion, submitting request i at engine step ``arrivals[i]``."""
    pending = sorted(range(len(prompts)), key=lambda i: (arrivals[i], i))
    outs, step, j = [], 0, 0
    while j < len(pending) or engine.has_unfinished_requests():
        while j < len(pending) and arrivals[pending[j]] <= step:
            i = pending[j]
            engine.add_request(ids[i], prompts[i], params[i])
            j += 1
        outs += engine.step()
        step += 1
    return outs


def run_audit(num_requests: int = 16, seed: int = 0, dtype: str = "float32", scenario: str = "random",
              steps: int = 1, lr: float = 1e-2, kernel_mode: str = "bitwise",
              device: str | torch.device = "cpu") -> ParityReport:
    """Generate with a live engine, recompute with the trainer, compare bitwise; repeat after updates.

    ``kernel_mode`` ("bitwise" or "fast") is used by both the engine and the trainer; in "fast" mode
    parity is not expected and the report shows how far off the stock kernels are. ``device`` is
    where the model, the engine's cache and the trainer run ("cuda" on a GPU machine).

    The tiny model gets LoRA with a non-zero B; the engine runs on a deepcopy of it (engine and
    trainer are separate objects, as in a real deployment). ``steps`` RL rounds follow the first
    generation: each takes one AdamW step on a REINFORCE loss ``-Σ A_i·Σ lp_i`` (random advantages)
    through the trainer's log-probs, pushes the LoRA weights with ``update_weights`` and generates
    again. The report covers every generated token of every round.
    """
    from zmrl.kernels_batch_invariant import kernel_mode as kernel_mode_ctx
    from zmrl.rollout.engine import KERNEL_MODES

    if kernel_mode not in KERNEL_MODES:
        raise ValueError(f"kernel_mode must be one of {KERNEL_MODES}, got {kernel_mode!r}")
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but torch.cuda.is_available() is False")
    with kernel_mode_ctx(kernel_mode):  # the trainer's ops read the process-wide mode
        return _run_audit(num_requests, seed, dtype, scenario, steps, lr, kernel_mode, device)


def _run_audit(num_requests: int, seed: int, dtype: str, scenario: str, steps: int, lr: float, kernel_mode: str,
               device: torch.device) -> ParityReport:
    from zmrl.lora import LoraConfig, apply_lora, lora_state_dict
    from zmrl.model import ModelConfig, build_model
    from zmrl.rollout import EngineConfig, RolloutEngine
    from zmrl.trainer import make_optimizer

    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    if steps < 0:
        raise ValueError(f"steps must be >= 0, got {steps}")
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {dtype!r}")
    rng = random.Random(seed)
    features = _parse_scenario(scenario, rng)
    cfg = ModelConfig.preset("tiny")
    model = build_model(cfg, seed=seed, dtype=dtype, device=device)
    apply_lora(model, LoraConfig(r=32, init_b_std=0.02, init_seed=seed))
    bs = 64
    topk = cfg.index_topk or 64

    # prompts: short by default; "long" makes half of them exceed index_topk (sparse DSA selection);
    # "prefix" makes half of them share a >= 2-block prefix
    prompts: list[list[int]] = []
    base = [rng.randrange(cfg.vocab_size) for _ in range(rng.randint(2 * bs, 2 * bs + 40))]
    for i in range(num_requests):
        if "prefix" in features and i % 2 == 0:
            p = base + [rng.randrange(cfg.vocab_size) for _ in range(rng.randint(1, 40))]
        elif "long" in features and i % 2 == 1:
            p = [rng.randrange(cfg.vocab_size) for _ in range(rng.randint(topk + 1, 200))]
        else:
            p = [rng.randrange(cfg.vocab_size) for _ in range(rng.randint(1, 60))]
        if "preemption" in features and not ("prefix" in features and i % 2 == 0):
            # end 1-3 tokens before a block boundary: decode then needs a new block, which the tiny
            # cache often does not have, so a running request is preempted and later recomputed
            target = (len(p) // bs + 1) * bs - rng.randint(1, 3)
            p = (p + [rng.randrange(cfg.vocab_size) for _ in range(target)])[:target]
        prompts.append(p)
    max_tokens = [rng.randint(4, 12) for _ in range(num_requests)]

    latent = "fp8" if "fp8" in features else "native"
    budget = rng.choice([7, 13, 29, 37, 61]) if "chunked" in features else 2048
    fork = "fork" in features
    need = [-(-(len(p) + mt) // bs) for p, mt in zip(prompts, max_tokens)]
    # "preemption": a cache of about a quarter of what the requests need together (and never less
    # than the largest one needs), so running requests outgrow it and get preempted
    num_blocks = max(max(need) + 1, sum(need) // 4) if "preemption" in features else sum(need) * 3 + 4
    engine = RolloutEngine(copy.deepcopy(model),
                           EngineConfig(block_size=bs, num_blocks=num_blocks, max_num_batched_tokens=budget,
                                        enable_prefix_caching=True, latent_format=latent,
                                        kernel_mode=kernel_mode))
    opt = make_optimizer(model, lr=lr) if steps else None

    desc = [f"seed {seed}", dtype] + ([] if device.type == "cpu" else [str(device)]) + [f"{num_requests} requests",
            "+".join(features) if features else "basic", f"{steps} update(s)"]
    if "chunked" in features:
        desc.append(f"max_num_batched_tokens={budget}")
    if "preemption" in features:
        desc.append(f"num_blocks={num_blocks}")
    all_roll: list[torch.Tensor] = []
    all_train: list[torch.Tensor] = []
    micro_desc: list[str] = []
    for rnd in range(steps + 1):
        params = [_sampling_mix(rng, mt, fork) for mt in max_tokens]
        ids = [f"r{rnd}-{i}" for i in range(num_requests)]
        arrivals = [rng.randint(0, 2 * num_requests) if "staggered" in features else 0 for _ in prompts]
        if "prefix" in features:
            # the first prefix sharer runs alone first so that its blocks are published for the others
            outs = _drive(engine, prompts[:1], params[:1], ids[:1], [0])
            outs += _drive(engine, prompts[1:], params[1:], ids[1:], arrivals[1:])
        else:
            outs = _drive(engine, prompts, params, ids, arrivals)
        errors = [o for o in outs if o.finish_reason == "error"]
        if errors:  # a set-up bug of the audit (the cache is sized for every request), not a parity result
            raise RuntimeError(f"audit request {errors[0].request_id} failed: {errors[0].error}")
        seqs = [o.prompt_token_ids + o.token_ids for o in outs]
        plens = [len(o.prompt_token_ids) for o in outs]
        micro = rng.choice([None, 1, 37, rng.randint(16, 512)])
        order = list(range(len(outs)))
        how = rng.choice(["natural", "reversed", "shuffled"])
        if how == "reversed":
            order.reverse()
        elif how == "shuffled":
            rng.shuffle(order)
        micro_desc.append(f"{micro}/{how}")
        with torch.enable_grad():
            lps = trainer_logprobs(model, seqs, plens, [o.temperature for o in outs], micro, order, latent)
            all_roll += [o.logprobs for o in outs]
            all_train += [lp.detach() for lp in lps]
            if rnd < steps:
                gen = torch.Generator().manual_seed(seed * 1000 + rnd)
                adv = torch.randn(len(lps), generator=gen)
                n_tok = max(1, sum(lp.numel() for lp in lps))
                loss = -sum(a * lp.sum() for a, lp in zip(adv.tolist(), lps)) / n_tok
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
        if rnd < steps:
            engine.update_weights(lora_state_dict(model))
    details = {"kernel mode": kernel_mode if kernel_mode == "bitwise" else f"{kernel_mode} (parity not expected)",
               "micro batch/order": ", ".join(micro_desc), "latent format": latent,
               "engine steps": engine.num_steps, "preemptions": engine.num_preemptions,
               "prefix cache hits": engine.blocks.hits, "weights version": engine.weights_version}
    return compare_logprobs(all_roll, all_train, scenario=", ".join(desc), details=details)


# ----------------------------------------------------------------------------- CLI


def _scenario_arg(value: str) -> str:
    try:
        _parse_scenario(value, random.Random(0))
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return value


def _nonneg_int(value: str) -> int:
    n = int(value)
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return n


def _positive_int(value: str) -> int:
    n = int(value)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return n


def _device_arg(value: str) -> str:
    try:
        dev = torch.device(value)
    except RuntimeError as e:
        raise argparse.ArgumentTypeError(f"not a torch device: {value!r} ({e})") from None
    if dev.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"device must be cpu or cuda[:N], got {value!r}")
    return value


def _parity_main(args: argparse.Namespace) -> int:
    # the tiny model's ops are too small to gain from intra-op threads, and on a busy few-core
    # machine each op's thread rendezvous makes torch 10x slower; parity does not depend on it
    torch.set_num_threads(args.threads)
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        print(f"zmrl parity: --device {args.device} but torch.cuda.is_available() is False "
              f"(torch {torch.__version__})", file=sys.stderr)
        return 2
    report = run_audit(num_requests=args.num_requests, seed=args.seed, dtype=args.dtype, scenario=args.scenario,
                       steps=args.steps, kernel_mode=args.kernel_mode, device=args.device)
    print(report.table())
    return 0 if report.ok else 1


def add_parity_subcommand(subparsers: "argparse._SubParsersAction") -> argparse.ArgumentParser:
    """Register ``parity`` on a ``parser.add_subparsers(...)`` object; sets ``func`` (returns the exit code)."""
    p = subparsers.add_parser(
        "parity", help="audit rollout/trainer log-prob parity on the tiny model (exit 1 on any mismatch)",
        description="Generate with the rollout engine, recompute every response token's log-prob with the "
                    "trainer (random micro-batching), optionally after optimiser steps pushed with "
                    "update_weights, and report the bitwise-equal fraction, max |dlogp| and k1/k3 KL. "
                    f"Scenario features: {', '.join(FEATURES)}.")
    p.add_argument("--num-requests", type=_positive_int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--scenario", type=_scenario_arg, default="random",
                   help="random (seed-drawn mix), all, basic, or a comma-separated list of: " + ", ".join(FEATURES))
    p.add_argument("--steps", type=_nonneg_int, default=1,
                   help="optimiser steps, each followed by update_weights and a fresh generation (default 1)")
    p.add_argument("--threads", type=_positive_int, default=1, help="torch intra-op threads (default 1)")
    p.add_argument("--kernel-mode", default="bitwise", choices=["bitwise", "fast"],
                   help="kernels of both the engine and the trainer: bitwise (batch-invariant, the default) or "
                        "fast (stock kernels: parity is not expected, the exit code is then usually 1)")
    p.add_argument("--device", type=_device_arg, default="cpu", help="cpu (default) or cuda[:N]")
    p.set_defaults(func=_parity_main)
    return p
