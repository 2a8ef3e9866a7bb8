"""A reward the untrained tiny model's random responses vary on (their number of ASCII digits), so that
GRPO's advantages and gradients are non-zero and the second step samples from updated weights.
Loaded by verl from this file (reward.custom_reward_function.path) in test_verl_main_ppo.py."""


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    return float(sum(c.isdigit() for c in solution_str))
