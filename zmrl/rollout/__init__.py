"""Rollout engine: paged cache, continuous batching, prefix caching, preemption, deterministic sampling.

Roles: ``request.py`` (a request's state and its output), ``scheduler.py`` (what runs next; no tensors),
``model_runner.py`` (the forward: eager, and fixed-shape decode from ``graph_runner.py``), ``sampler.py``
(logits -> tokens, with ``sampling.py``'s arithmetic), ``engine.py`` (composes them). Imports are lazy so
that ``import zmrl.rollout`` stays light.
"""
from __future__ import annotations

from typing import Any

__all__ = ["EngineConfig", "RolloutEngine", "RolloutOutput", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name == "EngineConfig":
        from .config import EngineConfig

        return EngineConfig
    if name in ("RolloutEngine", "RolloutOutput"):
        from . import engine

        return getattr(engine, name)
    if name == "SamplingParams":
        from .sampling import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'zmrl.rollout' has no attribute {name!r}")
