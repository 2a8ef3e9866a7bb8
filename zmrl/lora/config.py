"""LoRA configuration."""
from __future__ import annotations

from dataclasses import dataclass, field

# Every attention projection: KDA, MLA and the DSA indexer (module names as in the checkpoint).
ATTENTION_TARGETS = (
    "q_proj", "k_proj", "v_proj", "f_a_proj", "f_b_proj", "g_a_proj", "g_b_proj", "g_proj", "b_proj", "o_proj",
    "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "wq_b", "wk", "weights_proj",
)
# Every routed and shared expert's projections.
EXPERT_TARGETS = ("gate_proj", "up_proj", "down_proj")


@dataclass
class LoraConfig:
    r: int = 32
    alpha: float = 32.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] = field(default_factory=lambda: ATTENTION_TARGETS + EXPERT_TARGETS)
    init_seed: int = 0
    # Standard LoRA starts with B = 0 (the adapter is a no-op); tests use a non-zero B.
    init_b_std: float = 0.0

    def __post_init__(self) -> None:
        if self.r < 1:
            raise ValueError(f"LoraConfig.r must be >= 1, got {self.r}")
        if self.dropout != 0.0:
            raise ValueError("LoraConfig.dropout must be 0.0: dropout would make the trainer's forward differ "
                             "from the engine's, breaking bitwise parity")
        unknown = sorted(set(self.target_modules) - set(ATTENTION_TARGETS) - set(EXPERT_TARGETS))
        if unknown:
            raise ValueError(f"LoraConfig.target_modules: unknown {unknown}; allowed "
                             f"{sorted(set(ATTENTION_TARGETS + EXPERT_TARGETS))}")
        self.target_modules = tuple(self.target_modules)

    @property
    def scale(self) -> float:
        return self.alpha / self.r
