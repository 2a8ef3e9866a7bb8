"""The RL recipe: dataclass sections (torchtitan style), loaded from YAML with ``key=value`` overrides."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


class RecipeError(ValueError):
    """A recipe key or value is wrong; the message names it and lists what is allowed."""


@dataclass
class ModelSection:
    path: str | None = None  # HF-style folder (config.json + safetensors + tokenizer); None = embedded default
    dtype: str = "float32"
    bootstrap_dir: str = "~/.cache/zmrl/bootstrap"  # where the embedded default model is built and cached
    bootstrap_time_s: float = 150.0


@dataclass
class DataSection:
    train: str = "synthetic"  # "synthetic" (embedded arithmetic task) or a jsonl/parquet path
    eval: str = "aime25"  # "aime24" | "aime25" | a path | "synthetic" | "none"
    prompts_per_step: int = 8
    synthetic_pool: int = 40  # data.train=synthetic: problems per epoch (40 = an epoch every 5 steps)


@dataclass
class LoraSection:
    r: int = 32
    alpha: float = 32.0


@dataclass
class RolloutSection:
    n: int = 4  # samples per prompt (the GRPO group)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 20
    block_size: int = 64
    num_blocks: int = 512
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 4096
    enable_prefix_caching: bool = True
    latent_format: str = "native"


@dataclass
class AlgorithmSection:
    adv_estimator: str = "grpo"  # any verl advantage estimator that needs no critic (grpo, rloo, ...)
    policy_loss: str = "vanilla"  # verl policy loss: "vanilla" = PPO clip
    clip_ratio: float = 0.2
    loss_agg_mode: str = "token-mean"
    ppo_epochs: int = 1
    kl_coef: float = 0.0  # KL to the reference policy (the base model, LoRA off); 0 = off
    kl_penalty: str = "low_var_kl"
    norm_adv_by_std_in_grpo: bool = True


@dataclass
class TrainerSection:
    total_steps: int = 30
    lr: float = 2e-3
    weight_decay: float = 0.0
    micro_batch_tokens: int | None = 2048
    seed: int = 0
    out_dir: str = "runs/aime_lora"
    save_every: int = 10
    resume: bool = False
    num_threads: int | None = None  # torch CPU threads; None = torch's default


@dataclass
class EvalSection:
    every: int = 15  # steps; 0 = never
    n: int = 8  # mean@n
    max_tokens: int = 20
    temperature: float = 1.0
    limit: int | None = None  # evaluate the first `limit` problems only


@dataclass
class LoggingSection:
    wandb_mode: str = "offline"  # offline | online | disabled
    project: str = "zmrl"
    run_name: str | None = None


@dataclass
class DistributedSection:
    ray: bool = False  # rollout and trainer as Ray actors (local ray.init)
    ray_num_cpus: int | None = None


@dataclass
class RecipeConfig:
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    lora: LoraSection = field(default_factory=LoraSection)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    algorithm: AlgorithmSection = field(default_factory=AlgorithmSection)
    trainer: TrainerSection = field(default_factory=TrainerSection)
    eval: EvalSection = field(default_factory=EvalSection)
    logging: LoggingSection = field(default_factory=LoggingSection)
    distributed: DistributedSection = field(default_factory=DistributedSection)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def valid_keys(cls: type = RecipeConfig, prefix: str = "") -> list[str]:
    keys = []
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(f.type if isinstance(f.type, type) else None):
            keys += valid_keys(f.type, f"{prefix}{f.name}.")
        elif isinstance(f.default_factory, type) and dataclasses.is_dataclass(f.default_factory):  # type: ignore[arg-type]
            keys += valid_keys(f.default_factory, f"{prefix}{f.name}.")  # type: ignore[arg-type]
        else:
            keys.append(prefix + f.name)
    return keys


def _check_keys(data: Any, cls: type, prefix: str, source: str) -> None:
    if not isinstance(data, dict):
        raise RecipeError(f"{source}: {prefix.rstrip('.') or 'recipe'} must be a mapping, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key, value in data.items():
        if key not in fields:
            raise RecipeError(f"{source}: unknown recipe key {prefix + str(key)!r}; valid keys: "
                              f"{', '.join(valid_keys())}")
        sub = fields[key].default_factory
        if isinstance(sub, type) and dataclasses.is_dataclass(sub):
            _check_keys(value if value is not None else {}, sub, f"{prefix}{key}.", source)


def load_recipe(path: str | None, overrides: list[str] | None = None) -> RecipeConfig:
    """YAML recipe (OmegaConf) + ``key=value`` overrides -> a typed RecipeConfig."""
    import yaml
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    schema = OmegaConf.structured(RecipeConfig)
    layers = []
    if path is not None:
        try:
            raw = OmegaConf.to_container(OmegaConf.load(path), resolve=True) or {}
        except FileNotFoundError:
            raise RecipeError(f"recipe file not found: {path}") from None
        except (OmegaConfBaseException, ValueError, yaml.YAMLError) as e:  # YAML syntax errors and friends
            raise RecipeError(f"{path}: malformed recipe: {e}") from None
        _check_keys(raw, RecipeConfig, "", path)
        layers.append(OmegaConf.create(raw))
    for item in overrides or []:
        if "=" not in item:
            raise RecipeError(f"override {item!r} must look like key=value")
        key = item.split("=", 1)[0]
        if key not in valid_keys():
            raise RecipeError(f"unknown recipe key {key!r} in override {item!r}; valid keys: {', '.join(valid_keys())}")
    if overrides:
        layers.append(OmegaConf.from_dotlist(overrides))
    try:
        merged = OmegaConf.merge(schema, *layers)
    except OmegaConfBaseException as e:
        raise RecipeError(f"bad recipe value: {e}".split("\n")[0]) from None
    cfg: RecipeConfig = OmegaConf.to_object(merged)  # type: ignore[assignment]
    _validate(cfg)
    return cfg


def _validate(cfg: RecipeConfig) -> None:
    def need(cond: bool, key: str, msg: str) -> None:
        if not cond:
            raise RecipeError(f"recipe key {key!r}: {msg}")

    need(cfg.trainer.total_steps >= 1, "trainer.total_steps", "must be >= 1")
    need(cfg.rollout.n >= 2 or cfg.algorithm.adv_estimator != "grpo", "rollout.n", "GRPO needs >= 2 samples per prompt")
    need(cfg.data.prompts_per_step >= 1, "data.prompts_per_step", "must be >= 1")
    need(cfg.model.dtype in ("float32", "bfloat16"), "model.dtype", "must be float32 or bfloat16")
    need(cfg.logging.wandb_mode in ("offline", "online", "disabled"), "logging.wandb_mode",
         "must be offline, online or disabled")
    need(cfg.rollout.latent_format in ("native", "fp8"), "rollout.latent_format", "must be native or fp8")
    need(cfg.trainer.save_every >= 0 and cfg.eval.every >= 0, "trainer.save_every", "must be >= 0")
