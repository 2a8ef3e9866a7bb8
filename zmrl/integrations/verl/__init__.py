"""zmrl inside verl: ``actor_rollout_ref.actor.strategy=zmrl`` (training engine) and
``actor_rollout_ref.rollout.name=zmrl`` (rollout), registered through the ``verl.plugins`` entry point
(pyproject.toml), which verl imports in every process on ``import verl``.

``register()`` adds, without changing any of verl's code: the ``zmrl`` engine to ``EngineRegistry`` (for the
CPU and CUDA devices), the ``zmrl`` rollout replica to ``RolloutReplicaRegistry`` and its worker-side adapter
to the rollout adapter table, the ``cpu`` platform (``VERL_PLATFORM=cpu``, platform.py), and zmrl's model
types to ``AutoConfig`` (hf.py). README.md ("verl") has the command line.
"""
from __future__ import annotations

__all__ = ["register"]

_registered = False


def register() -> None:
    """The entry point's target; idempotent. Errors propagate (verl logs plugin import errors only at
    DEBUG level, so ``python -c "import zmrl.integrations.verl as z; z.register()"`` shows them)."""
    global _registered
    if _registered:
        return
    from . import platform  # noqa: F401 -- registers the cpu platform, before any verl module asks for one

    from verl.workers.engine.base import EngineRegistry
    from verl.workers.rollout import base as rollout_base
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    from .engine import ENGINE_NAME, ZmrlEngine
    from .hf import register_auto_config
    from .rollout import ROLLOUT_NAME

    register_auto_config()
    engines = EngineRegistry._engines.get("language_model", {}).get(ENGINE_NAME, {})
    devices = [d for d in ("cpu", "cuda") if d not in engines]
    if devices:
        EngineRegistry.register(model_type="language_model", backend=ENGINE_NAME, device=devices)(ZmrlEngine)

    def _replica():
        from .rollout import ZmrlReplica

        return ZmrlReplica

    RolloutReplicaRegistry.register(ROLLOUT_NAME, _replica)
    # verl has no register function for rollout adapters: its table maps (name, mode) to a class path
    rollout_base._ROLLOUT_REGISTRY[(ROLLOUT_NAME, "async")] = "zmrl.integrations.verl.rollout.ZmrlRolloutAdapter"
    _registered = True
