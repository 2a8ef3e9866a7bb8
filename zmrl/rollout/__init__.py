"""Rollout engine: paged cache, continuous batching, prefix caching, preemption, deterministic sampling.

Imports are lazy so that light tools (``zmrl plan``) do not load the engine.
"""
from __future__ import annotations

from typing import Any

__all__ = ["EngineConfig", "RolloutEngine", "RolloutOutput", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name in ("EngineConfig", "RolloutEngine", "RolloutOutput"):
        from . import engine

        return getattr(engine, name)
    if name == "SamplingParams":
        from .sampling import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'zmrl.rollout' has no attribute {name!r}")
