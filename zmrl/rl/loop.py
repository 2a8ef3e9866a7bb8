"""The RL loop: rollout -> reward -> advantages -> trainer log-probs (parity) -> update -> push weights."""
from __future__ import annotations

import hashlib
import json
import logging
import time
from pathlib import Path

import torch

from zmrl.lora import LoraConfig
from zmrl.rollout import EngineConfig, SamplingParams

from .config import RecipeConfig
from .workers import RolloutWorker, Sample, TrainerWorker

log = logging.getLogger(__name__)


class _Local:
    """Calls a worker in this process."""

    def __init__(self, obj):
        self.obj = obj

    def call(self, method: str, *args, **kwargs):
        return getattr(self.obj, method)(*args, **kwargs)


class _RayActor:
    """Calls a worker living in a Ray actor."""

    def __init__(self, cls, num_cpus: float, *args, **kwargs):
        import ray

        self.ray = ray
        self.actor = ray.remote(num_cpus=num_cpus)(cls).remote(*args, **kwargs)

    def call(self, method: str, *args, **kwargs):
        return self.ray.get(getattr(self.actor, method).remote(*args, **kwargs))


def _step_seed(seed: int, step: int, what: str) -> int:
    h = hashlib.blake2b(f"{seed}:{step}:{what}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") >> 2


class RLRunner:
    def __init__(self, cfg: RecipeConfig):
        from .sources import load_eval_problems, load_train_source
        from .metrics import MetricsLogger
        from .tokenizer import load_tokenizer

        self.cfg = cfg
        tc = cfg.trainer
        if tc.num_threads:
            torch.set_num_threads(tc.num_threads)
        self.out_dir = Path(tc.out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.ckpt_dir = self.out_dir / "checkpoints"
        self.model_path = self._model_path()
        self.tokenizer = load_tokenizer(cfg.model.path)
        self.train_source = load_train_source(cfg.data.train, cfg.data.synthetic_pool, tc.seed)
        self.eval_problems = load_eval_problems(cfg.data.eval, cfg.eval.limit)
        lora = LoraConfig(r=cfg.lora.r, alpha=cfg.lora.alpha)
        rc = cfg.rollout
        engine = EngineConfig(block_size=rc.block_size, num_blocks=rc.num_blocks, max_num_seqs=rc.max_num_seqs,
                              max_num_batched_tokens=rc.max_num_batched_tokens,
                              enable_prefix_caching=rc.enable_prefix_caching, latent_format=rc.latent_format)
        trainer_args = (self.model_path, cfg.model.dtype, lora, tc.lr, tc.weight_decay, tc.micro_batch_tokens,
                        rc.latent_format, tc.num_threads)
        rollout_args = (self.model_path, cfg.model.dtype, lora, engine, tc.num_threads)
        if cfg.distributed.ray:
            import ray

            if not ray.is_initialized():
                ray.init(num_cpus=cfg.distributed.ray_num_cpus, include_dashboard=False, log_to_driver=False)
            self.trainer = _RayActor(TrainerWorker, 1, *trainer_args)
            self.rollout = _RayActor(RolloutWorker, 1, *rollout_args)
        else:
            self.trainer = _Local(TrainerWorker(*trainer_args))
            self.rollout = _Local(RolloutWorker(*rollout_args))
        from .algorithms import KLPenalty, PolicyLoss

        self.policy_loss = PolicyLoss(cfg.algorithm.policy_loss, cfg.algorithm.clip_ratio)
        self.kl_penalty = KLPenalty(cfg.algorithm.kl_penalty)
        self.start_step = 0
        if tc.resume:
            self._resume()
        self.metrics = MetricsLogger(self.out_dir, project=cfg.logging.project, run_name=cfg.logging.run_name,
                                     config=cfg.to_dict(), wandb_mode=cfg.logging.wandb_mode)
        self.metrics.truncate_from(self.start_step + 1)  # records up to the checkpoint step are kept
        (self.out_dir / "recipe.json").write_text(json.dumps(cfg.to_dict(), indent=2))

    def _model_path(self) -> str:
        if self.cfg.model.path:
            if not Path(self.cfg.model.path, "config.json").exists():
                raise FileNotFoundError(f"model.path={self.cfg.model.path!r} has no config.json")
            return self.cfg.model.path
        from .bootstrap import bootstrap_model

        return str(bootstrap_model(Path(self.cfg.model.bootstrap_dir).expanduser(),
                                   time_budget_s=self.cfg.model.bootstrap_time_s))

    # ------------------------------------------------------------------ checkpoints
    def _resume(self) -> None:
        from .checkpoint import latest_checkpoint

        path = latest_checkpoint(self.ckpt_dir)
        if path is None:
            log.info("trainer.resume=true but no checkpoint under %s: starting from step 0", self.ckpt_dir)
            return
        state = self.trainer.call("restore", str(path))
        self.start_step = int(state["step"])
        self.rollout.call("update_weights", self.trainer.call("lora_state"))
        log.info("resumed from %s at step %d", path, self.start_step)

    # ------------------------------------------------------------------ one step
    def _prompts(self, step: int) -> list[dict]:
        return self.train_source.batch(step, self.cfg.data.prompts_per_step)

    def _rollout(self, problems: list[dict], sampling: SamplingParams, tag: str) -> list[Sample]:
        from .reward import aime_reward

        prompts = [self.tokenizer.encode(self.tokenizer.apply_chat_template(p["question"])) for p in problems]
        outs = self.rollout.call("generate", prompts, sampling, [f"{tag}-{i}" for i in range(len(prompts))])
        samples = []
        for o in outs:
            group = int(o["request_id"].split("-")[1])
            text = self.tokenizer.decode(o["response_ids"])
            reward = aime_reward(text, problems[group]["answer"]) if o["error"] is None else 0.0
            samples.append(Sample(o["prompt_ids"], o["response_ids"], o["logprobs"], group, reward, o["finish_reason"]))
        return samples

    def train_step(self, step: int) -> dict[str, float]:
        from .algorithms import compute_advantages

        cfg, rc, ac = self.cfg, self.cfg.rollout, self.cfg.algorithm
        t0 = time.perf_counter()
        sampling = SamplingParams(temperature=rc.temperature, top_p=rc.top_p, top_k=rc.top_k,
                                  max_tokens=rc.max_tokens, n=rc.n, seed=_step_seed(cfg.trainer.seed, step, "sample"),
                                  stop_token_ids=(self.tokenizer.eos_token_id,))
        samples = self._rollout(self._prompts(step), sampling, f"s{step}")
        t_rollout = time.perf_counter() - t0
        report = self.trainer.call("parity", samples, rc.temperature)
        advantages = compute_advantages([s.reward for s in samples], [len(s.response_ids) for s in samples],
                                        [s.group for s in samples], ac.adv_estimator, ac.norm_adv_by_std_in_grpo)
        ref = self.trainer.call("reference_logprobs", samples, rc.temperature) if ac.kl_coef else None
        stats: dict[str, float] = {}
        for _ in range(ac.ppo_epochs):
            stats = self.trainer.call("update", samples, advantages, rc.temperature, self.policy_loss, ref,
                                      ac.kl_coef, self.kl_penalty)
        self.rollout.call("update_weights", self.trainer.call("lora_state"))
        elapsed = time.perf_counter() - t0
        n_tokens = sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)
        rewards = [s.reward for s in samples]
        return {
            "reward/mean": sum(rewards) / len(rewards), "reward/max": max(rewards),
            "response/length_mean": sum(len(s.response_ids) for s in samples) / len(samples),
            "mismatch/bitwise_equal_frac": report.bitwise_equal_frac, "mismatch/max_abs_dlogp": report.max_abs_dlogp,
            "mismatch/kl_k1": report.kl_k1, "mismatch/kl_k3": report.kl_k3,
            "perf/tokens_per_s": n_tokens / elapsed, "perf/rollout_s": t_rollout, "perf/step_s": elapsed,
            **stats,
        }

    def evaluate(self, step: int) -> dict[str, float]:
        ec = self.cfg.eval
        sampling = SamplingParams(temperature=ec.temperature, max_tokens=ec.max_tokens, n=ec.n,
                                  seed=_step_seed(self.cfg.trainer.seed, 0, "eval"),
                                  stop_token_ids=(self.tokenizer.eos_token_id,))
        samples = self._rollout(self.eval_problems, sampling, f"e{step}")
        name = Path(self.cfg.data.eval).stem if self.cfg.data.eval not in ("aime24", "aime25") else self.cfg.data.eval
        return {f"eval/{name}_mean@{ec.n}": sum(s.reward for s in samples) / max(len(samples), 1)}

    # ------------------------------------------------------------------ loop
    def run(self) -> list[dict[str, float]]:
        from tqdm import tqdm

        cfg = self.cfg
        history = []
        bar = tqdm(range(self.start_step, cfg.trainer.total_steps), desc="rl", unit="step",
                   initial=self.start_step, total=cfg.trainer.total_steps)
        for step in bar:
            m = self.train_step(step)
            done = step + 1
            if cfg.eval.every and self.eval_problems and (done % cfg.eval.every == 0 or done == cfg.trainer.total_steps):
                m.update(self.evaluate(done))
            self.metrics.log(m, step=done)
            history.append({"step": done, **m})
            bar.set_postfix(reward=f"{m['reward/mean']:.3f}", eq=f"{m['mismatch/bitwise_equal_frac']:.3f}",
                            k3=f"{m['mismatch/kl_k3']:.1e}")
            if cfg.trainer.save_every and (done % cfg.trainer.save_every == 0 or done == cfg.trainer.total_steps):
                self.trainer.call("save", str(self.ckpt_dir), done)
        self.metrics.close()
        return history
