"""A synthetic task in AIME format (a question, an integer answer in 0..999) that the tiny byte-level
model picks up on CPU in a few minutes of SFT, leaving a gap that RL visibly closes.

Problems are small arithmetic questions, e.g. ``What is 7 + 8?`` -> 15. The mix of operations and
operand ranges (``TaskSpec``) sets the difficulty; the default is sums and differences (a >= b) of
operands 0..5, 57 distinct problems: small enough that the 4-layer model learns the arithmetic in 80
SFT steps on one CPU thread, so the demo's time goes to RL.

The SFT target (``format_solution``) is one line of work, then the boxed answer:
``7+8=15 \\boxed{15}``. Restating the expression puts the operands right before the answer digits, which
the 4-layer model exploits far sooner than operands 20 bytes back in the prompt. The bootstrap's teacher
(``zmrl.rl.bootstrap``) writes the box in only a fraction of its solutions (``boxed_frac``) and stops after
``7+8=15`` otherwise -- like a base model that knows the arithmetic but not the answer format the grader
reads. The reward (``zmrl.rl.reward``) reads only a box or an "Answer: N", so the bootstrapped policy
earns little reward at T = 1 although its arithmetic is mostly right, and GRPO has a clear, shared
direction to learn (box the answer) plus the arithmetic to sharpen. The longest default target is
``5+5=10 \\boxed{10}`` + EOS = 18 tokens, so rollouts need ``max_tokens >= 18``.

Splits: training pools and the bootstrap draw from seeded streams; the held-out split
(``heldout_problems``, ``data.eval=synthetic``) is the first problems of another stream
(``HELDOUT_SEED``). With 57 distinct problems the two share problems: the held-out curve measures the
policy on the task's distribution with samples it never trained on, not on unseen facts.
"""
from __future__ import annotations

import random
import re
from dataclasses import asdict, dataclass

__all__ = ["DEFAULT_TASK", "HELDOUT_SEED", "TaskSpec", "format_solution", "heldout_problems", "make_dataset",
           "make_problem", "solution_token_ids"]

HELDOUT_SEED = 12345  # the held-out split (``data.eval=synthetic``): a stream no training pool draws from

_QUESTION = re.compile(r"What is (\d+) ([-+*]) (\d+)\?")
_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


@dataclass(frozen=True)
class TaskSpec:
    """Operation weights and operand ranges (inclusive). Subtraction draws a >= b so answers stay >= 0."""

    add_weight: float = 1.0
    sub_weight: float = 1.0
    mul_weight: float = 0.0
    add_max: int = 5
    sub_max: int = 5
    mul_max: int = 9

    def to_dict(self) -> dict:
        return asdict(self)


DEFAULT_TASK = TaskSpec()


def make_problem(rng: random.Random, spec: TaskSpec = DEFAULT_TASK) -> dict:
    """One problem ``{"question": str, "answer": int}``; the answer is in 0..999 for any sane spec."""
    ops = ["+", "-", "*"]
    weights = [spec.add_weight, spec.sub_weight, spec.mul_weight]
    op = rng.choices(ops, weights=weights)[0]
    hi = {"+": spec.add_max, "-": spec.sub_max, "*": spec.mul_max}[op]
    a, b = rng.randint(0, hi), rng.randint(0, hi)
    if op == "-" and b > a:
        a, b = b, a
    answer = _OPS[op](a, b)
    if not 0 <= answer <= 999:
        raise ValueError(f"TaskSpec {spec} produced answer {answer} outside 0..999: lower the operand ranges")
    return {"question": f"What is {a} {op} {b}?", "answer": answer}


def make_dataset(n: int, seed: int = 0, spec: TaskSpec = DEFAULT_TASK) -> list[dict]:
    """``n`` problems drawn from a ``random.Random(seed)`` stream (deterministic, no global state)."""
    rng = random.Random(seed)
    return [make_problem(rng, spec) for _ in range(n)]


def heldout_problems(limit: int | None = None, spec: "TaskSpec | None" = None) -> list[dict]:
    """The held-out evaluation split: the first ``limit`` (default 64) problems of the held-out stream."""
    return make_dataset(limit or 64, seed=HELDOUT_SEED, spec=spec or DEFAULT_TASK)


def format_solution(problem: dict, boxed: bool = True) -> str:
    """The SFT target text: ``a+b=N \\boxed{N}`` for a synthetic question (just ``\\boxed{N}`` for any
    other); ``boxed=False`` stops after the work (``a+b=N``, no answer the reward can read). The
    tokenizer's EOS id goes after it as a token (``solution_token_ids``): EOS is not text."""
    answer = int(problem["answer"])
    m = _QUESTION.fullmatch(problem["question"].strip())
    work = f"{m.group(1)}{m.group(2)}{m.group(3)}={answer}" if m else ""
    if not boxed and work:
        return work
    return f"{work} \\boxed{{{answer}}}" if work else f"\\boxed{{{answer}}}"


def solution_token_ids(problem: dict, tokenizer, boxed: bool = True) -> list[int]:
    """``format_solution`` encoded without BOS, followed by ``tokenizer.eos_token_id``."""
    return tokenizer.encode(format_solution(problem, boxed), add_bos=False) + [tokenizer.eos_token_id]
