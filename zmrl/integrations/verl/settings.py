"""The zmrl settings of a verl run, read from verl's own config objects (one place per side).

Both sides (``actor.strategy=zmrl`` and ``rollout.name=zmrl``) read the model-level settings from
``actor_rollout_ref.model``: the checkpoint (``path``), LoRA (``lora_rank``, ``lora_alpha``; rank 0 = zmrl's
default rank-32 LoRA) and the numerics (``override_config.zmrl_kernel_mode``,
``override_config.zmrl_latent_format``). The rollout engine's own settings come from
``actor_rollout_ref.rollout.engine_kwargs.zmrl`` (``block_size``, ``num_blocks``, ``max_num_seqs``,
``max_num_batched_tokens``, ``seed``, ``kernel_mode`` to override the model's, and ``record_dir``: a folder
where each rollout server appends every request it served, zmrl/integrations/verl/rollout.py).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from zmrl.lora import LoraConfig
from zmrl.rollout import EngineConfig
from zmrl.rollout.config import KERNEL_MODES

ROLLOUT_KWARGS_KEY = "actor_rollout_ref.rollout.engine_kwargs.zmrl"
DEFAULT_LORA_RANK = 32


class ZmrlSettingError(ValueError):
    """A verl setting that zmrl cannot run with; the message names the setting and what is allowed."""


def _get(obj: Any, key: str, default: Any = None) -> Any:
    """``key`` of a verl config in any of the forms verl hands over: a dataclass (``HFModelConfig``,
    ``RolloutConfig``), an omegaconf ``DictConfig`` or a plain dict."""
    if obj is None:
        return default
    if isinstance(obj, dict):
        return obj.get(key, default)
    try:
        return getattr(obj, key, default)
    except Exception:  # noqa: BLE001 -- omegaconf raises its own error types for a missing key in struct mode
        return default


@dataclass(frozen=True)
class ModelSettings:
    """What both sides must agree on: the checkpoint, the LoRA and the numerics."""

    path: str
    lora: LoraConfig
    kernel_mode: str = "bitwise"
    latent_format: str = "native"

    @classmethod
    def from_model_config(cls, model_config: Any) -> "ModelSettings":
        path = _get(model_config, "local_path") or _get(model_config, "path")
        if not path:
            raise ZmrlSettingError("actor_rollout_ref.model.path is not set: zmrl needs a checkpoint folder")
        rank = int(_get(model_config, "lora_rank", 0) or 0)
        alpha = float(_get(model_config, "lora_alpha", 0) or 0)
        lora = LoraConfig(r=rank or DEFAULT_LORA_RANK, alpha=alpha if rank else float(DEFAULT_LORA_RANK))
        override = _get(model_config, "override_config", {}) or {}
        kernel_mode = str(_get(override, "zmrl_kernel_mode", "bitwise"))
        if kernel_mode not in KERNEL_MODES:
            raise ZmrlSettingError(f"actor_rollout_ref.model.override_config.zmrl_kernel_mode={kernel_mode!r}: "
                                   f"allowed {', '.join(map(repr, KERNEL_MODES))}")
        latent_format = str(_get(override, "zmrl_latent_format", "native"))
        if latent_format not in ("native", "fp8"):
            raise ZmrlSettingError(f"actor_rollout_ref.model.override_config.zmrl_latent_format={latent_format!r}: "
                                   f"allowed 'native', 'fp8'")
        return cls(str(path), lora, kernel_mode, latent_format)


@dataclass(frozen=True)
class RolloutSettings:
    """The rollout engine's settings, from ``rollout.engine_kwargs.zmrl`` and the rollout config."""

    engine: EngineConfig
    seed: int = 0
    record_dir: str | None = None

    @classmethod
    def from_rollout_config(cls, rollout_config: Any, model: ModelSettings) -> "RolloutSettings":
        kwargs = dict(_get(_get(rollout_config, "engine_kwargs", {}) or {}, "zmrl", {}) or {})
        seed = int(kwargs.pop("seed", 0))
        record_dir = kwargs.pop("record_dir", None)
        record_dir = str(record_dir) if record_dir else None
        kwargs.setdefault("kernel_mode", model.kernel_mode)
        kwargs.setdefault("latent_format", model.latent_format)
        prompt_len = int(_get(rollout_config, "prompt_length", 0) or 0)
        response_len = int(_get(rollout_config, "response_length", 0) or 0)
        if prompt_len and response_len and "max_model_len" not in kwargs:
            kwargs["max_model_len"] = prompt_len + response_len + 1
        known = {f.name for f in dataclasses.fields(EngineConfig)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ZmrlSettingError(f"{ROLLOUT_KWARGS_KEY}.{unknown[0]}: unknown; allowed seed, record_dir, "
                                   f"{', '.join(sorted(known))}")
        try:
            engine = EngineConfig(**kwargs).validate()
        except ValueError as e:
            raise ZmrlSettingError(f"{ROLLOUT_KWARGS_KEY}: {e}") from e
        return cls(engine, seed, record_dir)
