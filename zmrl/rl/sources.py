"""Where training and evaluation problems come from (recipe keys ``data.train`` / ``data.eval``)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ProblemSource:
    """A fixed problem list read in epochs: step s takes the next ``n`` problems, wrapping around.

    Deterministic in the step alone, so a resumed run sees exactly the problems an uninterrupted
    one would, and a step in a later epoch revisits the problems of the same step one epoch earlier.
    """

    problems: list[dict]

    def batch(self, step: int, n: int) -> list[dict]:
        if not self.problems:
            raise ValueError("the training problem set is empty")
        start = step * n
        return [self.problems[(start + i) % len(self.problems)] for i in range(n)]


def _problems(spec: str) -> list[dict]:
    from .data import default_aime_path, load_problems

    return load_problems(default_aime_path(spec) if spec in ("aime24", "aime25") else spec)


def load_train_source(spec: str, synthetic_pool: int = 40, seed: int = 0) -> ProblemSource:
    """``synthetic``: a pool of generated problems (an epoch of ``synthetic_pool`` problems); else a file."""
    if spec == "synthetic":
        from .synthetic import make_dataset

        return ProblemSource(make_dataset(synthetic_pool, seed=1000 + seed))
    return ProblemSource(_problems(spec))


def load_eval_problems(spec: str, limit: int | None = None) -> list[dict]:
    if spec == "none":
        return []
    if spec == "synthetic":
        from .synthetic import make_dataset

        from .synthetic import heldout_problems

        return heldout_problems(limit)
    else:
        problems = _problems(spec)
    return problems[:limit] if limit else problems
