"""Rollout/trainer log-prob parity, measured (never assumed). ``compare_logprobs`` is the one place that turns
two lists of per-token log-probs into the numbers every RL step logs: the fraction of response
tokens whose log-probs are bitwise equal, max |Δlogp|, and the k1 / k3 KL estimators between the
rollout policy (the sampler) and the trainer policy,

    k1 = mean(lp_roll - lp_train)
    k3 = mean(exp(lp_train - lp_roll) - (lp_train - lp_roll) - 1)

over all response tokens (Schulman's estimators of KL(roll || train) from samples of the rollout
policy). With bitwise parity every Δ is exactly 0, so both are exactly 0.0.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

__all__ = ["ParityReport", "compare_logprobs"]


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
