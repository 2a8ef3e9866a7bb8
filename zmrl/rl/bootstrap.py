"""SFT bootstrap of the embedded default model: the tiny preset (vocab shrunk to 512 for the byte
tokenizer), trained from a seeded init with full-parameter SFT on the synthetic arithmetic task, cached
in a folder so that ``python -m zmrl.train recipes/aime_lora.yaml`` has a policy that is sometimes
right -- on a fresh CPU machine, with no checkpoint and no network.

``bootstrap_model(cache_dir)`` returns ``cache_dir`` when it already holds a checkpoint built from the
same recipe (``bootstrap.json`` stores the recipe and its hash); otherwise it trains, evaluates with
the rollout engine (greedy and T = 1 accuracy on held-out problems), writes everything into a temp
folder beside ``cache_dir`` and renames it into place, so a crash never leaves a half-written cache.

The budget is a number of SFT steps (``max_steps``, recipe key ``model.bootstrap_steps``), never a
time: the init, the problem stream, the teacher's format choices and the batch order are seeded and the
run uses a fixed thread count (``num_threads``, 1), so every machine builds the same model (bitwise, for
the same torch build and CPU kernels) whatever its load, and the cache is keyed by the hash of
everything that determines the weights.

The teacher boxes the answer in ``boxed_frac`` of the targets only (``zmrl.rl.synthetic`` says why).

CLI: ``python -m zmrl.rl.bootstrap --out DIR [--seed 0] [--steps N] [--force]``.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import logging
import math
import os
import random
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch
import torch.nn.functional as F

from .synthetic import TaskSpec, format_solution, make_dataset, make_problem, solution_token_ids
from .tokenizer import ByteTokenizer, write_byte_tokenizer_marker

__all__ = ["BOOTSTRAP_FILE", "BootstrapRecipe", "bootstrap_model", "evaluate_accuracy", "main", "tiny_byte_config"]

log = logging.getLogger(__name__)

BOOTSTRAP_FILE = "bootstrap.json"
BOOTSTRAP_VERSION = 2  # bump when the training code changes in a way that changes the weights
DEFAULT_STEPS = 80


@dataclass
class BootstrapRecipe:
    """Everything that determines the bootstrap weights (hashed into ``bootstrap.json``)."""

    seed: int = 0
    vocab_size: int = 512  # >= 259 (ByteTokenizer); smaller than the preset's 2048 -> faster lm_head
    task: TaskSpec = field(default_factory=TaskSpec)
    max_steps: int = DEFAULT_STEPS  # the budget: SFT steps (never a time, so every machine builds one model)
    boxed_frac: float = 0.25  # fraction of the teacher's targets that box the answer (the rest stop before)
    batch_size: int = 16
    lr: float = 1e-3  # measured: 3e-3 and 2e-3 stall on a plateau (format learnt, digits not); 5e-4 is slower
    min_lr_ratio: float = 0.1
    warmup_steps: int = 10
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    num_threads: int = 1
    eval_problems: int = 64
    eval_seed: int = 1_000_003  # held-out problem stream
    eval_max_tokens: int = 20  # the longest default target is 18 tokens (synthetic.py)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["version"] = BOOTSTRAP_VERSION
        # the text formats are code, not recipe fields: hash what they produce so a change invalidates caches
        d["prompt_example"] = ByteTokenizer().apply_chat_template("What is 7 * 8?")
        d["target_example"] = [format_solution({"question": "What is 7 * 8?", "answer": 56}, boxed)
                               for boxed in (True, False)]
        return d

    def hash(self) -> str:
        blob = json.dumps(self.to_dict(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


def tiny_byte_config(vocab_size: int = 512):
    """``ModelConfig.preset("tiny")`` with the vocabulary shrunk for the byte tokenizer."""
    from zmrl.model import ModelConfig

    if vocab_size < ByteTokenizer().vocab_size:
        raise ValueError(f"vocab_size={vocab_size} is smaller than the byte tokenizer's 259 ids")
    cfg = ModelConfig.preset("tiny")
    cfg.vocab_size = vocab_size
    return cfg.validate()


@contextlib.contextmanager
def _threads(n: int | None) -> Iterator[None]:
    """Pin torch's intra-op thread count (restored afterwards). 1 thread is deterministic and, on a
    shared 2-core box, measured several times faster than 2 oversubscribed threads."""
    prev = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(prev)


def _lr_at(progress: float, step: int, r: BootstrapRecipe) -> float:
    """Linear warmup, then cosine decay to ``min_lr_ratio * lr`` over ``progress`` in [0, 1]."""
    if step < r.warmup_steps:
        return r.lr * (step + 1) / r.warmup_steps
    cos = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return r.lr * (r.min_lr_ratio + (1 - r.min_lr_ratio) * cos)


def _encode_batch(problems: list[dict], tok: ByteTokenizer, boxed: list[bool] | None = None
                  ) -> tuple[torch.Tensor, list[int], torch.Tensor]:
    """Packed ids, sequence lengths, and the targets (-100 = not trained) aligned with the logits;
    ``boxed[i]``: whether problem i's target boxes its answer (default: all do)."""
    ids: list[int] = []
    lens: list[int] = []
    targets: list[int] = []
    for i, p in enumerate(problems):
        prompt = tok.encode(tok.apply_chat_template(p["question"]), add_bos=True)
        answer = solution_token_ids(p, tok, boxed[i] if boxed is not None else True)
        seq = prompt + answer
        ids.extend(seq)
        lens.append(len(seq))
        # logits row j predicts token j+1: train rows len(prompt)-1 .. len(seq)-2; the last row predicts
        # nothing (it would cross into the next packed sequence).
        targets.extend([-100] * (len(prompt) - 1) + answer + [-100])
    return torch.tensor(ids, dtype=torch.int64), lens, torch.tensor(targets, dtype=torch.int64)


def train_sft(model, recipe: BootstrapRecipe, tok: ByteTokenizer, progress: bool = True) -> dict:
    """Full-parameter SFT on synthetic problems for ``max_steps`` steps; returns stats."""
    from tqdm import tqdm

    from zmrl.model import cu_seqlens_from_lens, forward_packed

    rng = random.Random(recipe.seed)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=recipe.lr, betas=(0.9, 0.95), weight_decay=recipe.weight_decay)
    t0 = time.perf_counter()
    bar = tqdm(total=recipe.max_steps, desc="bootstrap sft", unit="step", disable=not progress, file=sys.stderr,
               dynamic_ncols=True)
    losses: list[float] = []
    for step in range(recipe.max_steps):
        lr = _lr_at(step / recipe.max_steps, step, recipe)
        for g in opt.param_groups:
            g["lr"] = lr
        batch = [make_problem(rng, recipe.task) for _ in range(recipe.batch_size)]
        boxed = [rng.random() < recipe.boxed_frac for _ in batch]
        ids, lens, targets = _encode_batch(batch, tok, boxed)
        logits = forward_packed(model, ids, cu_seqlens_from_lens(lens, ids.device))
        loss = F.cross_entropy(logits, targets, ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if recipe.grad_clip:
            torch.nn.utils.clip_grad_norm_(params, recipe.grad_clip)
        opt.step()
        losses.append(float(loss.detach()))
        bar.update(1)
        bar.set_postfix(loss=f"{losses[-1]:.3f}", lr=f"{lr:.1e}")
    bar.close()
    model.eval()
    tail = losses[-10:]
    return {"steps": recipe.max_steps, "train_seconds": round(time.perf_counter() - t0, 2),
            "final_loss": sum(tail) / len(tail) if tail else None, "first_loss": losses[0] if losses else None}


@torch.no_grad()
def evaluate_accuracy(model, problems: list[dict], tok=None, temperature: float = 0.0, seed: int = 0,
                      max_tokens: int = 16) -> float:
    """Fraction of ``problems`` answered correctly (``aime_reward``) by the rollout engine."""
    from zmrl.rollout import EngineConfig, RolloutEngine, SamplingParams
    from zmrl.rollout.sampling import derive_seed

    from .reward import aime_reward

    tok = tok or ByteTokenizer()
    prompts = [tok.encode(tok.apply_chat_template(p["question"]), add_bos=True) for p in problems]
    longest = max(len(p) for p in prompts) + max_tokens
    blocks_per_seq = -(-longest // 64)
    engine = RolloutEngine(model, EngineConfig(block_size=64, num_blocks=blocks_per_seq * len(prompts) + 1,
                                               max_num_seqs=len(prompts), max_num_batched_tokens=4096))
    params = [SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=derive_seed(seed, i),
                             stop_token_ids=tok.stop_token_ids) for i in range(len(prompts))]  # own noise per prompt
    outs = engine.generate(prompts, params)
    rewards = [aime_reward(tok.decode(o.token_ids), p["answer"]) for o, p in zip(outs, problems)]
    return sum(rewards) / len(rewards)


def _cache_hit(cache: Path, recipe_hash: str) -> bool:
    meta = cache / BOOTSTRAP_FILE
    if not ((cache / "config.json").exists() and meta.exists()):
        return False
    try:
        return json.loads(meta.read_text()).get("recipe_hash") == recipe_hash
    except (OSError, json.JSONDecodeError):
        return False


def _check_replaceable(cache: Path) -> None:
    """Only an earlier bootstrap result or an empty folder may be replaced: never a user's folder."""
    if cache.exists() and not (cache / BOOTSTRAP_FILE).exists() and (not cache.is_dir() or any(cache.iterdir())):
        raise FileExistsError(f"{cache} exists and is not a bootstrap cache (no {BOOTSTRAP_FILE}); refusing to "
                              f"replace it -- pick another folder or empty it")


def bootstrap_model(cache_dir: str | os.PathLike, seed: int = 0, max_steps: int | None = None,
                    recipe: BootstrapRecipe | None = None, force: bool = False, evaluate: bool = True,
                    progress: bool = True) -> Path:
    """The bootstrap checkpoint folder (``config.json`` + safetensors + ``bootstrap.json`` +
    ``zmrl_tokenizer.json``), trained now unless ``cache_dir`` already holds this recipe's result.

    ``recipe`` overrides everything; otherwise the default recipe with ``seed`` and ``max_steps``
    applied. ``evaluate=False`` skips the accuracy measurement (tests)."""
    from zmrl.model import build_model, save_pretrained

    if recipe is None:
        recipe = BootstrapRecipe(seed=seed)
        if max_steps is not None:
            recipe.max_steps = max_steps
    cache = Path(cache_dir).expanduser()
    rhash = recipe.hash()
    if not force and _cache_hit(cache, rhash):
        log.info("bootstrap cache hit: %s (recipe %s)", cache, rhash)
        return cache
    _check_replaceable(cache)  # before spending minutes on training
    log.info("bootstrapping the default model into %s (recipe %s)", cache, rhash)
    tok = ByteTokenizer()
    t0 = time.perf_counter()
    with _threads(recipe.num_threads):
        torch.manual_seed(recipe.seed)
        model = build_model(tiny_byte_config(recipe.vocab_size), seed=recipe.seed, dtype="float32")
        stats = train_sft(model, recipe, tok, progress=progress)
        meta: dict = {"recipe_hash": rhash, "recipe": recipe.to_dict(), **stats,
                      "num_threads": torch.get_num_threads(), "torch_version": torch.__version__}
        if evaluate:
            log.info("bootstrap: measuring greedy and T=1 accuracy on %d held-out problems", recipe.eval_problems)
            t1 = time.perf_counter()
            problems = make_dataset(recipe.eval_problems, recipe.eval_seed, recipe.task)
            meta["greedy_accuracy"] = evaluate_accuracy(model, problems, tok, 0.0, recipe.seed, recipe.eval_max_tokens)
            meta["sampled_accuracy"] = evaluate_accuracy(model, problems, tok, 1.0, recipe.seed,
                                                         recipe.eval_max_tokens)
            meta["eval_seconds"] = round(time.perf_counter() - t1, 2)
            log.info("bootstrap accuracy: greedy %.3f, T=1 %.3f", meta["greedy_accuracy"], meta["sampled_accuracy"])
    meta["total_seconds"] = round(time.perf_counter() - t0, 2)

    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{cache.name}.tmp-", dir=cache.parent))
    try:
        os.chmod(tmp, 0o755)  # mkdtemp makes it owner-only; the cache is an ordinary folder
        save_pretrained(model, tmp)
        write_byte_tokenizer_marker(tmp)
        (tmp / BOOTSTRAP_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
        if cache.exists():  # stale (other recipe) or forced: move it aside, then swap in the new one
            _check_replaceable(cache)
            old = Path(tempfile.mkdtemp(prefix=f".{cache.name}.old-", dir=cache.parent))
            os.replace(cache, old / "x")
            shutil.rmtree(old, ignore_errors=True)
        try:
            os.replace(tmp, cache)
        except OSError:
            if _cache_hit(cache, rhash):  # a concurrent bootstrap of the same recipe won the race
                shutil.rmtree(tmp, ignore_errors=True)
                return cache
            raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return cache


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m zmrl.rl.bootstrap", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="checkpoint folder (reused if it holds this recipe)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=DEFAULT_STEPS, help=f"SFT steps (default {DEFAULT_STEPS})")
    ap.add_argument("--force", action="store_true", help="retrain even on a cache hit")
    ap.add_argument("--no-eval", action="store_true", help="skip the accuracy measurement")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    path = bootstrap_model(args.out, seed=args.seed, max_steps=args.steps, force=args.force, evaluate=not args.no_eval)
    meta = json.loads((path / BOOTSTRAP_FILE).read_text())
    keys = ("steps", "train_seconds", "final_loss", "greedy_accuracy", "sampled_accuracy",
            "eval_seconds", "total_seconds")
    print(json.dumps({"path": str(path), **{k: meta.get(k) for k in keys}}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
