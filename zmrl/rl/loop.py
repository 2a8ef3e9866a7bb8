"""The RL loop: rollout -> reward -> advantages -> trainer log-probs (parity) -> update -> push weights.

Single process by default; with ``distributed.ray=true`` the rollout workers and the trainer are Ray
actors on separate placement groups (``zmrl.rl.cluster``), driven by the same code through handles."""
from __future__ import annotations

import hashlib
import json
import logging
import time
from pathlib import Path

import torch

from zmrl.lora import LoraConfig
from zmrl.rollout import EngineConfig, SamplingParams

from .cluster import ActorEnv, LocalHandle, RayCluster, WorkerHandle, gather, shard
from .config import RecipeConfig
from .workers import RolloutWorker, Sample, TrainerWorker

log = logging.getLogger(__name__)


def _step_seed(seed: int, step: int, what: str) -> int:
    h = hashlib.blake2b(f"{seed}:{step}:{what}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") >> 2


class RLRunner:
    def __init__(self, cfg: RecipeConfig):
        from .sources import load_eval_problems, load_train_source
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
                              enable_prefix_caching=rc.enable_prefix_caching, latent_format=rc.latent_format,
                              kernel_mode=cfg.model.kernel_mode, decode_graphs=rc.decode_graphs)
        trainer_args = (self.model_path, cfg.model.dtype, lora, tc.lr, tc.weight_decay, tc.micro_batch_tokens,
                        rc.latent_format, tc.num_threads, cfg.model.kernel_mode)
        rollout_args = (self.model_path, cfg.model.dtype, lora, engine, tc.num_threads)
        self.cluster: RayCluster | None = None
        self.trainer: WorkerHandle
        self.rollouts: list[WorkerHandle]
        if cfg.distributed.ray:
            self._start_cluster(trainer_args, rollout_args)
        else:
            self.trainer = LocalHandle(TrainerWorker(*trainer_args, recompute=tc.recompute))
            self.rollouts = [LocalHandle(RolloutWorker(*rollout_args))]
        try:
            self._finish_init()
        except BaseException:
            self.close()  # placement groups and actors are not left behind by a failed start
            raise

    def _finish_init(self) -> None:
        from .algorithms import KLPenalty, PolicyLoss
        from .metrics import MetricsLogger

        cfg, tc = self.cfg, self.cfg.trainer
        self.policy_loss = PolicyLoss(cfg.algorithm.policy_loss, cfg.algorithm.clip_ratio)
        self.kl_penalty = KLPenalty(cfg.algorithm.kl_penalty)
        self.start_step = 0
        if tc.resume:
            self._resume()
        self.metrics = MetricsLogger(self.out_dir, project=cfg.logging.project, run_name=cfg.logging.run_name,
                                     config=cfg.to_dict(), wandb_mode=cfg.logging.wandb_mode)
        self.metrics.truncate_from(self.start_step + 1)  # records up to the checkpoint step are kept
        (self.out_dir / "recipe.json").write_text(json.dumps(cfg.to_dict(), indent=2))

    def _start_cluster(self, trainer_args: tuple, rollout_args: tuple) -> None:
        """One placement group per role, workers pinned to its bundles; every actor runs the same kernel
        mode and thread count, so the two sides stay bitwise equal across processes."""
        cfg, dc = self.cfg, self.cfg.distributed
        roles = {"rollout": dc.rollout, "trainer": dc.trainer}
        # Same thread count on both sides: the recipe's, else what the smaller bundle holds.
        threads = cfg.trainer.num_threads or max(1, int(min(r.num_cpus for r in roles.values())))
        cluster = RayCluster(dc)
        try:
            cluster.check(roles)
            envs = {name: ActorEnv(device="cuda" if r.num_gpus else "cpu", num_threads=threads,
                                   kernel_mode=cfg.model.kernel_mode) for name, r in roles.items()}
            # Both groups reserved first (a cluster that cannot host them fails before any model loads),
            # then every worker started; they build their models in parallel.
            trainer, rollout = cluster.reserve("trainer", dc.trainer), cluster.reserve("rollout", dc.rollout)
            cluster.launch(trainer, dc.trainer, envs["trainer"], TrainerWorker, trainer_args,
                           {"device": envs["trainer"].device, "recompute": cfg.trainer.recompute})
            cluster.launch(rollout, dc.rollout, envs["rollout"], RolloutWorker, rollout_args,
                           {"device": envs["rollout"].device})
            cluster.wait_ready()
        except BaseException:
            cluster.close()
            raise
        self.cluster = cluster
        self.trainer = trainer.handles[0]
        self.rollouts = list(rollout.handles)

    def close(self) -> None:
        """Release the Ray actors and placement groups (nothing to do in single-process mode)."""
        if self.cluster is not None:
            self.cluster.close()

    def _push_weights(self) -> int:
        """Trainer LoRA state -> every rollout engine. Through Ray the state is one object in the store,
        fetched by each rollout worker from there (it never passes through the driver)."""
        state = self.trainer.submit("lora_state")
        versions = gather([r.submit("update_weights", state) for r in self.rollouts])
        if len(set(versions)) != 1:
            raise RuntimeError(f"rollout workers disagree on the weights version after an update: {versions}")
        return versions[0]

    def _generate(self, prompts: list[list[int]], sampling: SamplingParams, request_ids: list[str]) -> list[dict]:
        """The prompts split contiguously over the rollout workers (run in parallel), outputs in prompt
        order; request ids are global, so the samples do not depend on the number of workers."""
        pending = [self.rollouts[w].submit("generate", [prompts[i] for i in part], sampling,
                                           [request_ids[i] for i in part])
                   for w, part in enumerate(shard(len(prompts), len(self.rollouts)))]
        return [o for outs in gather(pending) for o in outs]

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
        self._push_weights()
        log.info("resumed from %s at step %d", path, self.start_step)

    # ------------------------------------------------------------------ one step
    def _prompts(self, step: int) -> list[dict]:
        return self.train_source.batch(step, self.cfg.data.prompts_per_step)

    def _rollout(self, problems: list[dict], sampling: SamplingParams, tag: str) -> list[Sample]:
        from .reward import aime_reward

        prompts = [self.tokenizer.encode(self.tokenizer.apply_chat_template(p["question"])) for p in problems]
        outs = self._generate(prompts, sampling, [f"{tag}-{i}" for i in range(len(prompts))])
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
        self._push_weights()
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
        """All steps from ``start_step``; the Ray actors and placement groups are released at the end, on
        an error and on Ctrl-C alike (a runner runs once)."""
        try:
            return self._run()
        finally:
            self.close()

    def _run(self) -> list[dict[str, float]]:
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
