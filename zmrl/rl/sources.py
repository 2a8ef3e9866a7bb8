"""Where training and evaluation problems come from (recipe keys ``data.train`` / ``data.eval``)."""
from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass
class ProblemSource:
    """A fixed list of problems, or the synthetic generator when ``problems`` is None."""

    problems: list[dict] | None = None

    def sample(self, rng: random.Random, n: int) -> list[dict]:
        if self.problems is None:
            from .synthetic import make_problem

            return [make_problem(rng) for _ in range(n)]
        return [self.problems[rng.randrange(len(self.problems))] for _ in range(n)]


def _problems(spec: str) -> list[dict]:
    from .data import default_aime_path, load_problems

    return load_problems(default_aime_path(spec) if spec in ("aime24", "aime25") else spec)


def load_train_source(spec: str) -> ProblemSource:
    return ProblemSource(None if spec == "synthetic" else _problems(spec))


def load_eval_problems(spec: str, limit: int | None = None) -> list[dict]:
    if spec == "none":
        return []
    if spec == "synthetic":
        from .synthetic import make_dataset

        problems = make_dataset(limit or 64, seed=12345)
    else:
        problems = _problems(spec)
    return problems[:limit] if limit else problems
