"""Rollout/trainer parity: the metric (``metric.py``), the randomized audit behind ``zmrl parity``
(``audit.py``) and the 30-second ``zmrl smoke`` check (``smoke.py``)."""
from .audit import FEATURES, add_parity_subcommand, run_audit, trainer_logprobs
from .metric import ParityReport, compare_logprobs

__all__ = ["FEATURES", "ParityReport", "add_parity_subcommand", "compare_logprobs", "run_audit", "trainer_logprobs"]
