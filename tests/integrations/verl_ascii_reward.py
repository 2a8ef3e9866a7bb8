"""A reward the untrained tiny model's random responses vary on (their number of ASCII characters: about a
quarter of its 512-token vocabulary decodes to one), so that GRPO's advantages and gradients are non-zero
and the second step samples from updated weights. (A count of digits, 10 tokens of 512, left every group of
4 samples without spread for some seeds.) Loaded by verl from this file (reward.custom_reward_function.path)
in test_verl_main_ppo.py."""


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    return float(sum(c.isascii() for c in solution_str))
