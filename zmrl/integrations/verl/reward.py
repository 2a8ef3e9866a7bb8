"""verl's custom reward function for zmrl's problem sets (``reward.custom_reward_function.path=
pkg://zmrl.integrations.verl.reward``, ``name=compute_score``): the zmrl loop's own reward
(zmrl/rl/reward.py), 1.0 when the boxed answer equals the ground truth."""
from __future__ import annotations

from typing import Any

from zmrl.rl.reward import aime_reward


def compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None, **_: Any) -> float:
    return aime_reward(solution_str, ground_truth)
