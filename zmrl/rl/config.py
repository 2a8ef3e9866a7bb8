"""The RL recipe: dataclass sections (torchtitan style), loaded from YAML with ``key=value`` overrides."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from zmrl.model.recompute import RECOMPUTE_POLICIES


class RecipeError(ValueError):
    """A recipe key or value is wrong; the message names it and lists what is allowed."""


@dataclass
class ModelSection:
    path: str | None = None  # HF-style folder (config.json + safetensors + tokenizer); None = embedded default
    dtype: str = "float32"
    bootstrap_dir: str = "~/.cache/zmrl/bootstrap"  # where the embedded default model is built and cached
    bootstrap_time_s: float = 150.0
    # "bitwise": batch-invariant kernels, rollout log-probs equal the trainer's bit for bit (the
    # contract). "fast": stock kernels where an op has them, for measuring what bitwise costs; the
    # rollout/trainer parity metrics are then expected to be < 1. Applies to the engine and the trainer.
    kernel_mode: str = "bitwise"


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
    # "auto": CUDA-graph decode when rolling out on a GPU, eager on CPU; "cuda" / "static" (the fixed-shape
    # path uncaptured) / "off" (eager) force one. Bitwise the same rollouts in every setting.
    decode_graphs: str = "auto"


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
    # Activation recompute of the training forward: none | layer | selective | attention
    # (zmrl/model/recompute.py). Changes memory and time, never the forward bits or the gradients.
    recompute: str = "none"


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


PLACEMENT_STRATEGIES: tuple[str, ...] = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


@dataclass
class RoleSection:
    """One role's resource group (distributed.ray=true): ``workers`` Ray actors, each pinned to its own
    placement-group bundle of ``num_gpus`` GPUs and ``num_cpus`` CPUs (per worker, as Ray's actor options)."""

    workers: int = 1  # rollout: data-parallel engines (the step's prompts are split); trainer: must be 1
    num_gpus: int = 0  # 0: the worker runs on CPU; 1: on its own GPU
    num_cpus: float = 1.0
    strategy: str = "PACK"  # placement of this role's bundles: PACK | SPREAD | STRICT_PACK | STRICT_SPREAD


@dataclass
class DistributedSection:
    ray: bool = False  # rollout and trainer as Ray actors on separate placement groups
    ray_address: str | None = None  # None: start a local Ray; "auto" / "host:port": join a running cluster
    ray_num_cpus: int | None = None  # local Ray only: CPUs it may use (None: all)
    ray_num_gpus: int | None = None  # local Ray only: GPUs it may use (None: all it detects)
    placement_timeout_s: float = 120.0  # wait this long for the placement groups, then stop with an error
    rollout: RoleSection = field(default_factory=RoleSection)
    trainer: RoleSection = field(default_factory=RoleSection)


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
    need(cfg.rollout.decode_graphs in ("auto", "off", "static", "cuda"), "rollout.decode_graphs",
         f"must be auto, off, static or cuda, got {cfg.rollout.decode_graphs!r}")
    need(cfg.model.kernel_mode in ("bitwise", "fast"), "model.kernel_mode",
         f"must be 'bitwise' (rollout/trainer parity) or 'fast' (stock kernels, no parity), "
         f"got {cfg.model.kernel_mode!r}")
    need(cfg.trainer.save_every >= 0 and cfg.eval.every >= 0, "trainer.save_every", "must be >= 0")
    need(cfg.trainer.recompute in RECOMPUTE_POLICIES, "trainer.recompute",
         f"must be one of {', '.join(RECOMPUTE_POLICIES)}, got {cfg.trainer.recompute!r}")
    _validate_distributed(cfg.distributed)


def _validate_distributed(dc: DistributedSection) -> None:
    """Static checks of the distributed section; whether the cluster can host it is checked when the
    runner connects to Ray (zmrl.rl.cluster.check_resources)."""
    def need(cond: bool, key: str, msg: str) -> None:
        if not cond:
            raise RecipeError(f"recipe key 'distributed.{key}': {msg}")

    if not dc.ray:
        # Resource settings without Ray would be silently ignored: a GPU asked for would never be used.
        changed = [k for k in ("ray_address", "ray_num_cpus", "ray_num_gpus", "placement_timeout_s")
                   if getattr(dc, k) != getattr(DistributedSection, k)]
        changed += [f"{role}.{f.name}" for role in ("rollout", "trainer") for f in dataclasses.fields(RoleSection)
                    if getattr(getattr(dc, role), f.name) != f.default]
        need(not changed, changed[0] if changed else "ray",
             f"only used with distributed.ray=true (set it, or drop {', '.join('distributed.' + c for c in changed)})")
        return
    need(dc.placement_timeout_s > 0, "placement_timeout_s", "must be > 0")
    need(dc.ray_address is None or (dc.ray_num_cpus is None and dc.ray_num_gpus is None), "ray_address",
         "ray_num_cpus/ray_num_gpus size a local Ray only; a running cluster (ray_address) brings its own resources")
    for name in ("ray_num_cpus", "ray_num_gpus"):
        value = getattr(dc, name)
        need(value is None or value >= 0, name, f"must be >= 0, got {value}")
    for role in ("rollout", "trainer"):
        rs: RoleSection = getattr(dc, role)
        need(rs.workers >= 1, f"{role}.workers", f"must be >= 1, got {rs.workers}")
        need(rs.num_gpus in (0, 1), f"{role}.num_gpus",
             f"must be 0 (CPU) or 1 (one GPU per worker; a worker spanning GPUs needs tensor parallelism, not "
             f"implemented here): use distributed.{role}.workers for more GPUs; got {rs.num_gpus}")
        need(rs.num_cpus >= 0, f"{role}.num_cpus", f"must be >= 0, got {rs.num_cpus}")
        need(rs.num_cpus > 0 or rs.num_gpus > 0, f"{role}.num_cpus",
             "a worker needs num_cpus > 0 when num_gpus = 0 (a bundle cannot be empty)")
        need(rs.strategy in PLACEMENT_STRATEGIES, f"{role}.strategy",
             f"must be one of {', '.join(PLACEMENT_STRATEGIES)}, got {rs.strategy!r}")
    need(dc.trainer.workers == 1, "trainer.workers",
         f"must be 1 (the trainer is one process; data-parallel training is not implemented), got {dc.trainer.workers}")
