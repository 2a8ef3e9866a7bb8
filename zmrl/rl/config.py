"""The RL recipe: dataclass sections (torchtitan style), loaded from YAML with ``key=value`` overrides."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from zmrl.lora import LoraConfig
    from zmrl.rollout import EngineConfig, SamplingParams
    from zmrl.trainer import Objective, TrainerConfig

from zmrl.extras import require

from zmrl.kernels_batch_invariant.numerics import BACKWARD_MATMUL_PRECISIONS, FIELD_CHOICES
from zmrl.model.recompute import RECOMPUTE_POLICIES


class RecipeError(ValueError):
    """A recipe key or value is wrong; the message names it and lists what is allowed."""


@dataclass
class ModelSection:
    path: str | None = None  # HF-style folder (config.json + safetensors + tokenizer); None = embedded default
    dtype: str = "float32"
    bootstrap_dir: str = "~/.cache/zmrl/bootstrap"  # where the embedded default model is built and cached
    bootstrap_steps: int = 80  # SFT steps of the embedded default (a step budget: the same model everywhere)
    # "bitwise": batch-invariant kernels, rollout log-probs equal the trainer's bit for bit (the
    # contract). "fast": stock kernels where an op has them, for measuring what bitwise costs; the
    # rollout/trainer parity metrics are then expected to be < 1. Applies to the engine and the trainer.
    kernel_mode: str = "bitwise"
    # The arithmetic of the GPU's KDA ops (Numerics.kda_form): "recurrent" (token by token: fast decode, the
    # RL default) or "chunk" (chunked: faster prefill of long prompts, slower decode); null keeps the
    # process's default ($ZMRL_KDA_FORM, else "recurrent"). The same on every process of the run; CPU runs
    # are unaffected (the CPU backend is chunked either way).
    kda_form: str | None = None
    # The recurrent KDA kernel's launch configuration (Numerics.kda_recurrent_launch, "BVxW": state columns x
    # warps per program; shared numerics, a speed choice); null keeps the process's default
    # ($ZMRL_KDA_RECURRENT_LAUNCH, else zmrl's). The same on every process of the run.
    kda_recurrent_launch: str | None = None
    # The rows of the sparse MLA kernel's MMAs (Numerics.mla_mma_rows): "heads" or "keys" (the transposed
    # products, warpgroup MMAs on Hopper); shared numerics, a speed choice; null keeps the process's default
    # ($ZMRL_MLA_MMA_ROWS, else "heads"). The same on every process of the run.
    mla_mma_rows: str | None = None
    # How the GPU's MLA kernel multiplies the fp32 query and probabilities by the bf16 latent cache
    # (Numerics.mla_operands): "hi_lo" (bf16 hi + lo halves, ~16 bits) or "bf16" (rounded once: half the kernel's
    # tensor work, 8 bits); shared numerics, a speed-for-accuracy choice; null keeps the process's default
    # ($ZMRL_MLA_OPERANDS, else "hi_lo"). The same on every process of the run.
    mla_operands: str | None = None


# The model's numerics choices a recipe may set (null: the process's own): field -> allowed values.
MODEL_NUMERICS_CHOICES: dict[str, tuple[str, ...]] = {
    name: FIELD_CHOICES[name] for name in ("kda_form", "kda_recurrent_launch", "mla_mma_rows", "mla_operands")}


@dataclass
class DataSection:
    train: str = "synthetic"  # "synthetic" (embedded arithmetic task) or a jsonl/parquet path
    # "auto": the synthetic task's held-out split for the embedded default model, aime25 for a real one;
    # or "aime24" | "aime25" | "synthetic" | "none" | a .jsonl/.json/.parquet path
    eval: str = "auto"
    prompts_per_step: int = 8
    synthetic_pool: int = 40  # data.train=synthetic: problems per epoch (40 = an epoch every 5 steps)
    # How a problem becomes prompt text (zmrl/rl/chat_template.py): "auto" (the tokenizer's chat template
    # when model.path has one, else a plain one-line prompt), "chat_template" (the chat template; an error
    # when the tokenizer has none) or "plain" (the one-line prompt, e.g. for a base model).
    prompt_format: str = "auto"


@dataclass
class LoraSection:
    r: int = 32
    alpha: float = 32.0

    def lora_config(self) -> "LoraConfig":
        from zmrl.lora import LoraConfig

        return LoraConfig(r=self.r, alpha=self.alpha)


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
    prefix_cache_kda_gib: float = 4.0  # most GiB of KDA state snapshots the prefix cache keeps (LRU)
    latent_format: str = "native"
    # "auto": CUDA-graph decode when rolling out on a GPU, eager on CPU; "cuda" / "static" (the fixed-shape
    # path uncaptured) / "off" (eager) force one. Bitwise the same rollouts in every setting.
    decode_graphs: str = "auto"
    # With the fixed-shape decode: steps whose rows share one temperature and no top-k / top-p draw their tokens
    # inside the decode graph (EngineConfig.sample_in_graph); false samples eagerly. Same bits either way.
    sample_in_graph: bool = True
    # Batch sizes of the decode graphs (EngineConfig.decode_graph_batch_sizes); null: 1, 2, 4, ... max_num_seqs.
    decode_graph_batch_sizes: list[int] | None = None
    # A step where more than this fraction of the rollouts ended in an error (non-finite logits, a
    # request that cannot fit the cache) stops the run with the first error; 1.0 never stops.
    max_error_frac: float = 0.5

    def engine_config(self, kernel_mode: str) -> "EngineConfig":
        from zmrl.rollout import EngineConfig

        return EngineConfig(block_size=self.block_size, num_blocks=self.num_blocks, max_num_seqs=self.max_num_seqs,
                            max_num_batched_tokens=self.max_num_batched_tokens,
                            enable_prefix_caching=self.enable_prefix_caching,
                            prefix_cache_kda_gib=self.prefix_cache_kda_gib, latent_format=self.latent_format,
                            kernel_mode=kernel_mode, decode_graphs=self.decode_graphs,
                            sample_in_graph=self.sample_in_graph,
                            decode_graph_batch_sizes=self.decode_graph_batch_sizes).validate()

    def sampling(self, seed: int, stop_token_ids: tuple[int, ...]) -> "SamplingParams":
        from zmrl.rollout import SamplingParams

        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                              max_tokens=self.max_tokens, n=self.n, seed=seed, stop_token_ids=stop_token_ids)


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

    def objective(self) -> "Objective":
        """The trainer's loss: verl's policy loss and KL penalty by name, over ``ppo_epochs`` passes."""
        from zmrl.trainer import Objective

        from .algorithms import KLPenalty, PolicyLoss

        return Objective(PolicyLoss(self.policy_loss, self.clip_ratio), kl_coef=self.kl_coef,
                         kl_penalty=KLPenalty(self.kl_penalty), epochs=self.ppo_epochs)


@dataclass
class TrainerSection:
    total_steps: int = 30
    lr: float = 2e-3
    weight_decay: float = 0.0
    micro_batch_tokens: int | None = 2048
    seed: int = 0
    out_dir: str = "runs/aime_lora"
    save_every: int = 10
    resume: bool = False  # continue the run in out_dir from its latest checkpoint
    # A new run refuses an out_dir that already holds a run (resume it, or pick another out_dir);
    # overwrite=true deletes that run's files first.
    overwrite: bool = False
    num_threads: int | None = None  # torch CPU threads; None = torch's default
    # Activation recompute of the training forward: none | layer | selective | attention
    # (zmrl/model/recompute.py). Changes memory and time, never the forward bits or the gradients.
    recompute: str = "none"
    # Operands of the hand-written backwards' GEMMs with an fp32 operand: tf32 (CUDA) | bf16 (the MLA attention
    # backward on any device and the Triton MoE expert backward round them to bf16, twice TF32's rate; the
    # rest runs TF32) | ieee (fp32 FMA). Gradient bits only: the forward, and so rollout/trainer parity, never
    # reads it (zmrl/kernels_batch_invariant/numerics.py).
    backward_matmul_precision: str = "tf32"
    # Rows per lm_head + log-prob chunk (bounds the logits memory; null = a micro-batch at once).
    logprob_chunk_tokens: int | None = 1024

    def trainer_config(self, latent_format: str) -> "TrainerConfig":
        from zmrl.trainer import TrainerConfig

        return TrainerConfig(lr=self.lr, weight_decay=self.weight_decay, micro_batch_tokens=self.micro_batch_tokens,
                             latent_format=latent_format, recompute=self.recompute,
                             logprob_chunk_tokens=self.logprob_chunk_tokens)


@dataclass
class EvalSection:
    every: int = 15  # steps; 0 = never
    before_training: bool = True  # also evaluate the policy before the first update (step 0 of the curve)
    n: int = 8  # mean@n
    max_tokens: int = 20
    temperature: float = 1.0
    limit: int | None = None  # evaluate the first `limit` problems only

    def sampling(self, seed: int, stop_token_ids: tuple[int, ...]) -> "SamplingParams":
        from zmrl.rollout import SamplingParams

        return SamplingParams(temperature=self.temperature, max_tokens=self.max_tokens, n=self.n, seed=seed,
                              stop_token_ids=stop_token_ids)


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


def eval_set(cfg: RecipeConfig) -> str:
    """``data.eval`` with ``auto`` resolved: the synthetic held-out split for the embedded default model
    (AIME is far beyond it), aime25 for a real checkpoint."""
    if cfg.data.eval != "auto":
        return cfg.data.eval
    return "synthetic" if cfg.model.path is None else "aime25"


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


def _unknown_key(key: str, where: str) -> RecipeError:
    """The error for an unknown key: the closest valid keys ("did you mean"), then the keys of its
    section (all keys when the section is unknown too)."""
    import difflib

    keys = valid_keys()
    close = difflib.get_close_matches(key, keys, n=2, cutoff=0.6)
    if not close:  # a right leaf under a wrong section
        leaf = key.rsplit(".", 1)[-1]
        close = [k for k in keys if k.rsplit(".", 1)[-1] == leaf][:2]
    hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    section = key.rsplit(".", 1)[0] + "." if "." in key else ""
    same = [k for k in keys if section and k.startswith(section)]
    listing = f"keys of '{section[:-1]}': {', '.join(same)}" if same else f"valid keys: {', '.join(keys)}"
    return RecipeError(f"{where}unknown recipe key {key!r}{hint} ({listing})")


def _check_keys(data: Any, cls: type, prefix: str, source: str) -> None:
    if not isinstance(data, dict):
        raise RecipeError(f"{source}: {prefix.rstrip('.') or 'recipe'} must be a mapping, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key, value in data.items():
        if key not in fields:
            raise _unknown_key(prefix + str(key), f"{source}: ")
        sub = fields[key].default_factory
        if isinstance(sub, type) and dataclasses.is_dataclass(sub):
            _check_keys(value if value is not None else {}, sub, f"{prefix}{key}.", source)


def _type_error(e: Exception) -> RecipeError:
    """OmegaConf's conversion error as one line naming the recipe key and the expected type."""
    key = getattr(e, "full_key", None) or ""
    msg = str(e).split("\n")[0]
    if key:
        section, _, name = key.rpartition(".")
        cls = {f.name: f.default_factory for f in dataclasses.fields(RecipeConfig)}.get(section.split(".")[0])
        expected = ""
        if isinstance(cls, type) and dataclasses.is_dataclass(cls):
            for sub in section.split(".")[1:]:
                cls = {f.name: f.default_factory for f in dataclasses.fields(cls)}.get(sub, cls)
            ftype = {f.name: f.type for f in dataclasses.fields(cls)}.get(name)
            expected = f" (expected {ftype})" if ftype else ""
        return RecipeError(f"recipe key {key!r}: {msg}{expected}")
    return RecipeError(f"bad recipe value: {msg}")


def load_recipe(path: str | None, overrides: list[str] | None = None) -> RecipeConfig:
    """YAML recipe (OmegaConf) + ``key=value`` overrides -> a typed RecipeConfig, every value checked."""
    import yaml
    OmegaConf = require("omegaconf", "rl", "loading a recipe").OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    schema = OmegaConf.structured(RecipeConfig)
    layers = []
    if path is not None:
        try:
            raw = OmegaConf.to_container(OmegaConf.load(path), resolve=True) or {}
        except FileNotFoundError:
            raise RecipeError(f"recipe file not found: {path}") from None
        except (OmegaConfBaseException, ValueError, yaml.YAMLError) as e:  # YAML syntax errors and friends
            first = " ".join(str(e).split())
            raise RecipeError(f"{path}: malformed recipe: {first}") from None
        _check_keys(raw, RecipeConfig, "", path)
        try:
            layers.append(OmegaConf.merge(schema, OmegaConf.create(raw)))
        except OmegaConfBaseException as e:
            raise RecipeError(f"{path}: {_type_error(e)}") from None
    for item in overrides or []:
        if "=" not in item:
            raise RecipeError(f"override {item!r} must look like key=value")
        key = item.split("=", 1)[0]
        if key not in valid_keys():
            raise _unknown_key(key, f"override {item!r}: ")
    if overrides:
        layers.append(OmegaConf.from_dotlist(overrides))
    try:
        merged = OmegaConf.merge(schema, *layers)
    except OmegaConfBaseException as e:
        raise _type_error(e) from None
    cfg: RecipeConfig = OmegaConf.to_object(merged)  # type: ignore[assignment]
    _validate(cfg)
    return cfg


# Estimator arguments the loop provides (zmrl.rl.algorithms.compute_advantages): an estimator that needs
# more (a critic's values, reward baselines, per-token statistics) cannot run here.
_ADV_ARGS_PROVIDED = {"token_level_rewards", "response_mask", "index"}
# verl's kl_penalty names (core_algos.kl_penalty), "full" excluded: it needs whole-vocabulary log-probs.
KL_PENALTIES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")


def verl_advantage_estimators() -> list[str]:
    """verl's registered advantage estimators that run on outcome rewards and group ids alone."""
    import inspect

    core_algos = require("verl.trainer.ppo.core_algos", "rl", "checking the recipe's algorithm settings")
    usable = []
    for name, fn in core_algos.ADV_ESTIMATOR_REGISTRY.items():
        required = {n for n, p in inspect.signature(fn).parameters.items()
                    if p.default is inspect.Parameter.empty and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
        if required <= _ADV_ARGS_PROVIDED:
            usable.append(str(name))
    return usable


def verl_policy_losses() -> list[str]:
    core_algos = require("verl.trainer.ppo.core_algos", "rl", "checking the recipe's algorithm settings")
    return [str(n) for n in core_algos.POLICY_LOSS_REGISTRY]


def _validate(cfg: RecipeConfig) -> None:
    """Every value of the recipe, one message per problem naming the recipe key and what is allowed."""
    import math

    def need(cond: bool, key: str, msg: str) -> None:
        if not cond:
            raise RecipeError(f"recipe key {key!r}: {msg}")

    def at_least(key: str, value: Any, low: float, what: str = "an integer") -> None:
        need(value >= low, key, f"must be {what} >= {low:g}, got {value}")

    def finite(key: str, value: float) -> None:
        need(math.isfinite(value), key, f"must be a finite number, got {value}")

    m, d, lo, r, a, t, e = cfg.model, cfg.data, cfg.lora, cfg.rollout, cfg.algorithm, cfg.trainer, cfg.eval
    need(m.dtype in ("float32", "bfloat16"), "model.dtype", f"must be float32 or bfloat16, got {m.dtype!r}")
    need(m.kernel_mode in ("bitwise", "fast"), "model.kernel_mode",
         f"must be 'bitwise' (rollout/trainer parity) or 'fast' (stock kernels, no parity), got {m.kernel_mode!r}")
    for name, allowed in MODEL_NUMERICS_CHOICES.items():
        value = getattr(m, name)
        need(value is None or value in allowed, f"model.{name}",
             f"must be one of {', '.join(map(repr, allowed))} or null, got {value!r}")
    need(m.path is None or str(m.path).strip() != "", "model.path",
         "is empty: give a checkpoint folder, or leave it unset (null) for the embedded default model")
    at_least("model.bootstrap_steps", m.bootstrap_steps, 1)

    at_least("data.prompts_per_step", d.prompts_per_step, 1)
    at_least("data.synthetic_pool", d.synthetic_pool, 1)
    need(bool(str(d.train).strip()), "data.train", "is empty: 'synthetic' or a .jsonl/.json/.parquet file")
    need(bool(str(d.eval).strip()), "data.eval", "is empty: aime24, aime25, synthetic, none or a file")
    from .chat_template import PROMPT_FORMATS

    need(d.prompt_format in PROMPT_FORMATS, "data.prompt_format",
         f"must be one of {', '.join(PROMPT_FORMATS)}, got {d.prompt_format!r}")

    at_least("lora.r", lo.r, 1)
    finite("lora.alpha", lo.alpha)
    need(lo.alpha > 0, "lora.alpha", f"must be > 0, got {lo.alpha}")

    for prefix, temp, max_tokens, n in (("rollout", r.temperature, r.max_tokens, r.n),
                                        ("eval", e.temperature, e.max_tokens, e.n)):
        finite(f"{prefix}.temperature", temp)
        need(temp >= 0, f"{prefix}.temperature", f"must be >= 0 (0 = greedy), got {temp}")
        at_least(f"{prefix}.max_tokens", max_tokens, 1)
        at_least(f"{prefix}.n", n, 1)
    need(0 < r.top_p <= 1, "rollout.top_p", f"must be in (0, 1] (1 = off), got {r.top_p}")
    need(r.top_k == -1 or r.top_k >= 1, "rollout.top_k", f"must be -1 (off) or >= 1, got {r.top_k}")
    need(r.block_size >= 64 and r.block_size % 64 == 0, "rollout.block_size",
         f"must be a positive multiple of 64 (a KDA chunk), got {r.block_size}")
    at_least("rollout.num_blocks", r.num_blocks, 1)
    at_least("rollout.max_num_seqs", r.max_num_seqs, 1)
    at_least("rollout.max_num_batched_tokens", r.max_num_batched_tokens, 1)
    need(r.latent_format in ("native", "fp8"), "rollout.latent_format", f"must be native or fp8, got {r.latent_format!r}")
    need(r.decode_graphs in ("auto", "off", "static", "cuda"), "rollout.decode_graphs",
         f"must be auto, off, static or cuda, got {r.decode_graphs!r}")
    from zmrl.rollout.config import valid_graph_batch_sizes  # lazily, as the section's engine_config

    sizes = r.decode_graph_batch_sizes
    need(sizes is None or valid_graph_batch_sizes(sizes, r.max_num_seqs), "rollout.decode_graph_batch_sizes",
         f"must be null or a non-empty list of integers in [1, rollout.max_num_seqs = {r.max_num_seqs}], got {sizes!r}")
    need(0.0 <= r.max_error_frac <= 1.0, "rollout.max_error_frac", f"must be in [0, 1], got {r.max_error_frac}")
    need(r.prefix_cache_kda_gib >= 0, "rollout.prefix_cache_kda_gib",
         f"must be >= 0 (GiB of KDA snapshots; 0 = none), got {r.prefix_cache_kda_gib}")

    estimators = verl_advantage_estimators()
    need(a.adv_estimator in estimators, "algorithm.adv_estimator",
         f"{a.adv_estimator!r} is not one of verl's advantage estimators usable without a critic: "
         f"{', '.join(estimators)}")
    need(r.n >= 2 or a.adv_estimator in ("reinforce_plus_plus",), "rollout.n",
         f"algorithm.adv_estimator={a.adv_estimator} compares samples of a prompt: needs >= 2, got {r.n}")
    losses = verl_policy_losses()
    need(a.policy_loss in losses, "algorithm.policy_loss",
         f"{a.policy_loss!r} is not one of verl's policy losses: {', '.join(losses)}")
    finite("algorithm.clip_ratio", a.clip_ratio)
    need(a.clip_ratio > 0, "algorithm.clip_ratio", f"must be > 0, got {a.clip_ratio}")
    need(a.loss_agg_mode == "token-mean", "algorithm.loss_agg_mode",
         f"only 'token-mean' is implemented, got {a.loss_agg_mode!r}")
    at_least("algorithm.ppo_epochs", a.ppo_epochs, 1)
    finite("algorithm.kl_coef", a.kl_coef)
    need(a.kl_coef >= 0, "algorithm.kl_coef", f"must be >= 0 (0 = off), got {a.kl_coef}")
    need(a.kl_penalty in KL_PENALTIES, "algorithm.kl_penalty",
         f"must be one of verl's {', '.join(KL_PENALTIES)}, got {a.kl_penalty!r}")

    at_least("trainer.total_steps", t.total_steps, 1)
    finite("trainer.lr", t.lr)
    need(t.lr > 0, "trainer.lr", f"must be > 0, got {t.lr}")
    finite("trainer.weight_decay", t.weight_decay)
    need(t.weight_decay >= 0, "trainer.weight_decay", f"must be >= 0, got {t.weight_decay}")
    need(t.micro_batch_tokens is None or t.micro_batch_tokens >= 1, "trainer.micro_batch_tokens",
         f"must be >= 1 or null (one micro-batch), got {t.micro_batch_tokens}")
    need(t.logprob_chunk_tokens is None or t.logprob_chunk_tokens >= 1, "trainer.logprob_chunk_tokens",
         f"must be >= 1 or null (a micro-batch at once), got {t.logprob_chunk_tokens}")
    need(t.seed >= 0, "trainer.seed", f"must be >= 0, got {t.seed}")
    need(bool(str(t.out_dir).strip()), "trainer.out_dir", "is empty")
    need(t.save_every >= 0, "trainer.save_every", f"must be >= 0 (0 = never), got {t.save_every}")
    need(not (t.resume and t.overwrite), "trainer.overwrite",
         "and trainer.resume=true contradict each other: resume continues the run in out_dir, overwrite deletes it")
    need(t.num_threads is None or t.num_threads >= 1, "trainer.num_threads",
         f"must be >= 1 or null (torch's default), got {t.num_threads}")

    need(e.every >= 0, "eval.every", f"must be >= 0 (0 = never), got {e.every}")
    need(e.limit is None or e.limit >= 1, "eval.limit", f"must be >= 1 or null (all problems), got {e.limit}")
    need(cfg.logging.wandb_mode in ("offline", "online", "disabled"), "logging.wandb_mode",
         f"must be offline, online or disabled, got {cfg.logging.wandb_mode!r}")
    need(cfg.trainer.recompute in RECOMPUTE_POLICIES, "trainer.recompute",
         f"must be one of {', '.join(RECOMPUTE_POLICIES)}, got {cfg.trainer.recompute!r}")
    need(cfg.trainer.backward_matmul_precision in BACKWARD_MATMUL_PRECISIONS, "trainer.backward_matmul_precision",
         f"must be one of {', '.join(BACKWARD_MATMUL_PRECISIONS)}, got {cfg.trainer.backward_matmul_precision!r}")
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
