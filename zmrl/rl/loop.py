"""The RL loop: rollout -> reward -> advantages -> trainer log-probs (parity) -> update -> push weights.

Single process by default; with ``distributed.ray=true`` the rollout workers and the trainer are Ray
actors on separate placement groups (``zmrl.rl.cluster``), driven by the same code through handles."""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from zmrl.kernels_batch_invariant import Numerics, apply_numerics, check_same_numerics, current_numerics
from zmrl.parity import ParityReport
from zmrl.rollout import SamplingParams
from zmrl.rollout.sampling import rollout_seed
from zmrl.trainer import Sample, TrainBatch

from .cluster import ActorEnv, LocalHandle, RayCluster, gather, shard
from .config import MODEL_NUMERICS_CHOICES, RecipeConfig, eval_set
from .workers import ModelSpec, RolloutHandle, RolloutWorker, TrainerHandle, TrainerWorker

log = logging.getLogger(__name__)


class RolloutFailure(RuntimeError):
    """Too many of a step's rollouts ended in an error (``rollout.max_error_frac``); the message says how
    many and quotes the first error."""


@dataclass
class StepRollouts:
    """One batch of rollouts: the samples (errored ones included, with reward 0) and the engine's error
    message of every rollout that ended in an error, in sample order."""

    samples: list[Sample]
    errors: list[str]

    @property
    def error_frac(self) -> float:
        return len(self.errors) / len(self.samples) if self.samples else 0.0


def _parity_metrics(report: ParityReport) -> dict[str, float]:
    return {"mismatch/bitwise_equal_frac": report.bitwise_equal_frac, "mismatch/max_abs_dlogp": report.max_abs_dlogp,
            "mismatch/kl_k1": report.kl_k1, "mismatch/kl_k3": report.kl_k3,
            "mismatch/tokens_compared": report.tokens_compared,
            "mismatch/sequences_compared": report.sequences_compared}


def run_numerics(cfg: RecipeConfig) -> Numerics:
    """The run's numerics contract: this process's, with what the recipe sets (kernel mode, the model's numerics
    choices of ``MODEL_NUMERICS_CHOICES``, thread count, backward GEMM precision)."""
    n = current_numerics()
    choices = {name: getattr(cfg.model, name) or getattr(n, name) for name in MODEL_NUMERICS_CHOICES}
    return n.replace(kernel_mode=cfg.model.kernel_mode, cpu_threads=cfg.trainer.num_threads,
                     backward_matmul_precision=cfg.trainer.backward_matmul_precision, **choices)


class RLRunner:
    def __init__(self, cfg: RecipeConfig):
        from .preflight import check_inputs, clear_run
        from .sources import ProblemSource, load_train_source

        self.cfg = cfg
        tc = cfg.trainer
        # Every file the recipe names is read and checked before anything heavy (bootstrap, models).
        inputs = check_inputs(cfg)
        self.tokenizer = inputs.tokenizer
        self.train_source = (ProblemSource(inputs.train_problems) if inputs.train_problems is not None
                             else load_train_source("synthetic", cfg.data.synthetic_pool, tc.seed))
        self.eval_problems = inputs.eval_problems
        if tc.overwrite and (gone := clear_run(tc.out_dir)):
            log.warning("trainer.overwrite=true: deleted the previous run's %s in %s", ", ".join(gone), tc.out_dir)
        # The numerics contract of the run: this process's, carried to every Ray actor (ActorEnv).
        self.numerics = run_numerics(cfg)
        apply_numerics(self.numerics)
        self.out_dir = Path(tc.out_dir).expanduser()
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.ckpt_dir = self.out_dir / "checkpoints"
        self.model_path = self._model_path()
        model = ModelSpec(self.model_path, cfg.model.dtype, cfg.lora.lora_config())
        trainer_args = (model, tc.trainer_config(cfg.rollout.latent_format), cfg.algorithm.objective(),
                        cfg.model.kernel_mode)
        rollout_args = (model, cfg.rollout.engine_config(cfg.model.kernel_mode))
        self.cluster: RayCluster | None = None
        self.trainer: TrainerHandle
        self.rollouts: list[RolloutHandle]
        t0 = time.perf_counter()
        log.info("loading %s into the trainer and the rollout engine%s", self.model_path,
                 " (Ray actors)" if cfg.distributed.ray else "")
        if cfg.distributed.ray:
            self._start_cluster(trainer_args, rollout_args)
        else:
            self.trainer = TrainerHandle(LocalHandle(TrainerWorker(*trainer_args)))
            self.rollouts = [RolloutHandle(LocalHandle(RolloutWorker(*rollout_args)))]
        log.info("workers ready in %.0f s", time.perf_counter() - t0)
        try:
            self._finish_init()
        except BaseException:
            self.close()  # placement groups and actors are not left behind by a failed start
            raise

    def _finish_init(self) -> None:
        from .metrics import MetricsLogger

        cfg, tc = self.cfg, self.cfg.trainer
        # Before the first step: every rollout process runs the trainer's numerics, or the run stops here.
        check_same_numerics({"trainer": self.trainer.numerics_fingerprint(),
                             **{f"rollout worker {i}": r.numerics_fingerprint() for i, r in enumerate(self.rollouts)}})
        self.start_step = 0
        self.initial_eval: dict[str, float] | None = None
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
            envs = {name: ActorEnv(device="cuda" if r.num_gpus else "cpu",
                                   numerics=self.numerics.replace(cpu_threads=threads)) for name, r in roles.items()}
            # Both groups reserved first (a cluster that cannot host them fails before any model loads),
            # then every worker started; they build their models in parallel.
            trainer, rollout = cluster.reserve("trainer", dc.trainer), cluster.reserve("rollout", dc.rollout)
            # each role loads the model onto its own device
            cluster.launch(trainer, dc.trainer, envs["trainer"], TrainerWorker,
                           (dataclasses.replace(trainer_args[0], device=envs["trainer"].device), *trainer_args[1:]))
            cluster.launch(rollout, dc.rollout, envs["rollout"], RolloutWorker,
                           (dataclasses.replace(rollout_args[0], device=envs["rollout"].device), *rollout_args[1:]))
            cluster.wait_ready()
        except BaseException:
            cluster.close()
            raise
        self.cluster = cluster
        self.trainer = TrainerHandle(trainer.handles[0])
        self.rollouts = [RolloutHandle(h) for h in rollout.handles]

    def close(self) -> None:
        """Release the Ray actors and placement groups (nothing to do in single-process mode)."""
        if self.cluster is not None:
            self.cluster.close()

    def _push_weights(self) -> int:
        """Trainer LoRA state -> every rollout engine. Through Ray the state is one object in the store,
        fetched by each rollout worker from there (it never passes through the driver)."""
        state = self.trainer.lora_state()
        versions = gather([r.update_weights(state) for r in self.rollouts])
        if len(set(versions)) != 1:
            raise RuntimeError(f"rollout workers disagree on the weights version after an update: {versions}")
        return versions[0]

    def _generate(self, prompts: list[list[int]], sampling: list[SamplingParams], request_ids: list[str],
                  progress: bool = False) -> list[Sample]:
        """The prompts split contiguously over the rollout workers (run in parallel), samples in prompt
        order, each with its prompt's index as its group; each prompt's randomness is its own seed, so the
        samples do not depend on the number of workers.
        ``progress``: a bar of finished requests (in-process workers; Ray actors do not show theirs)."""
        pending = [self.rollouts[w].generate([prompts[i] for i in part], list(part), [sampling[i] for i in part],
                                             [request_ids[i] for i in part], use_tqdm=progress and self.cluster is None)
                   for w, part in enumerate(shard(len(prompts), len(self.rollouts)))]
        return [o for outs in gather(pending) for o in outs]

    def _model_path(self) -> str:
        if self.cfg.model.path:
            return str(Path(self.cfg.model.path).expanduser())  # checked by check_inputs
        from .bootstrap import bootstrap_model

        return str(bootstrap_model(Path(self.cfg.model.bootstrap_dir).expanduser(),
                                   max_steps=self.cfg.model.bootstrap_steps))

    # ------------------------------------------------------------------ checkpoints
    def _resume(self) -> None:
        from .checkpoint import latest_checkpoint

        path = latest_checkpoint(self.ckpt_dir)
        if path is None:
            log.info("trainer.resume=true but no checkpoint under %s: starting from step 0", self.ckpt_dir)
            return
        state = self.trainer.restore(str(path))
        self.start_step = int(state["step"])
        self._push_weights()
        log.info("resumed from %s at step %d", path, self.start_step)

    # ------------------------------------------------------------------ one step
    def _prompts(self, step: int) -> list[dict]:
        return self.train_source.batch(step, self.cfg.data.prompts_per_step)

    def _rollout(self, problems: list[dict], sampling: SamplingParams, tag: str, weights_step: int,
                 progress: bool = False) -> StepRollouts:
        from .reward import aime_reward

        prompts = [self.tokenizer.encode(self.tokenizer.apply_chat_template(p["question"])) for p in problems]
        # One seed rule (rollout_seed): a prompt's group samples with the seed of (recipe seed, weights step,
        # prompt tokens), sample j with index j -- the same tokens on any rollout worker, in any batch, after a
        # resume, and in verl's rollout (zmrl/integrations/verl/rollout.py), which sends the samples one by
        # one. A prompt that comes again in the batch continues its numbering (indices n .. 2n-1, ...), as
        # verl's server counts them, so the copies do not repeat each other's samples.
        copies: Counter[tuple[int, ...]] = Counter()
        params = []
        for prompt in prompts:
            copy = copies[tuple(prompt)]
            copies[tuple(prompt)] += 1
            params.append(dataclasses.replace(sampling, seed=rollout_seed(self.cfg.trainer.seed, weights_step, prompt),
                                              first_sample_index=copy * sampling.n))
        samples = self._generate(prompts, params, [f"{tag}-{i}" for i in range(len(prompts))], progress)
        errors = []
        for s in samples:
            failed = s.error is not None or s.finish_reason == "error"
            s.reward = 0.0 if failed else aime_reward(self.tokenizer.decode(s.response_ids), problems[s.group]["answer"])
            if failed:
                errors.append(str(s.error or "unknown error"))
        return StepRollouts(samples, errors)

    def rollout_step(self, step: int) -> StepRollouts:
        """The rollouts of RL step ``step`` (0-based): its prompts, sampled by the weights after ``step``
        updates (``weights_step = step``), with their rewards."""
        rc = self.cfg.rollout
        sampling = SamplingParams(temperature=rc.temperature, top_p=rc.top_p, top_k=rc.top_k,
                                  max_tokens=rc.max_tokens, n=rc.n, stop_token_ids=tuple(self.tokenizer.stop_token_ids))
        return self._rollout(self._prompts(step), sampling, f"s{step}", step)

    def train_step(self, step: int) -> dict[str, float]:
        """One RL step (0-based ``step``); its metrics. The parity numbers come from the update's own
        training forward (the same bits as a separate recompute: one forward per update). Raises
        ``RolloutFailure`` before any update when more than ``rollout.max_error_frac`` of the rollouts failed;
        the step's metrics (with a no-grad parity check of what did come back) are on the exception
        (``.metrics``) so the caller can still log them."""
        from .algorithms import compute_advantages

        rc, ac = self.cfg.rollout, self.cfg.algorithm
        t0 = time.perf_counter()
        batch = self.rollout_step(step)
        samples = batch.samples
        t_rollout = time.perf_counter() - t0
        rewards = [s.reward for s in samples]
        health = {
            "reward/mean": sum(rewards) / len(rewards), "reward/max": max(rewards),
            "response/length_mean": sum(len(s.response_ids) for s in samples) / len(samples),
            "rollout/errors": len(batch.errors), "rollout/error_frac": batch.error_frac,
        }
        if batch.errors:
            log.warning("step %d: %d of %d rollouts ended in an error; first: %s", step + 1, len(batch.errors),
                        len(samples), batch.errors[0])
        if batch.error_frac > rc.max_error_frac:
            failure = RolloutFailure(
                f"step {step + 1}: {len(batch.errors)} of {len(samples)} rollouts failed ({batch.error_frac:.0%} > "
                f"rollout.max_error_frac={rc.max_error_frac:g}); first error: {batch.errors[0]}")
            failure.metrics = {**health, **_parity_metrics(self.trainer.parity(samples)),  # type: ignore[attr-defined]
                               "perf/rollout_s": t_rollout}
            raise failure
        advantages = compute_advantages([s.reward for s in samples], [len(s.response_ids) for s in samples],
                                        [s.group for s in samples], ac.adv_estimator, ac.norm_adv_by_std_in_grpo)
        ref = self.trainer.reference_logprobs(samples) if ac.kl_coef else None
        result = self.trainer.train(TrainBatch(samples, advantages, ref))
        self._push_weights()
        elapsed = time.perf_counter() - t0
        n_tokens = sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)
        return {**health, **_parity_metrics(result.parity), "perf/tokens_per_s": n_tokens / elapsed,
                "perf/rollout_s": t_rollout, "perf/step_s": elapsed, **result.stats}

    def evaluate(self, step: int) -> dict[str, float]:
        ec = self.cfg.eval
        sampling = SamplingParams(temperature=ec.temperature, max_tokens=ec.max_tokens, n=ec.n,
                                  stop_token_ids=tuple(self.tokenizer.stop_token_ids))
        t0 = time.perf_counter()
        # weights_step 0 at every evaluation: each one draws the same noise (common random numbers), so the
        # held-out curve moves with the weights, not with the draw
        samples = self._rollout(self.eval_problems, sampling, f"e{step}", 0, progress=True).samples
        spec = eval_set(self.cfg)
        name = {"synthetic": "heldout"}.get(spec, spec) if spec in ("aime24", "aime25", "synthetic") else Path(spec).stem
        key, value = f"eval/{name}_mean@{ec.n}", sum(s.reward for s in samples) / max(len(samples), 1)
        log.info("eval at step %d: %s = %.3f (%d problems x %d samples, %.0f s)", step, key, value,
                 len(self.eval_problems), ec.n, time.perf_counter() - t0)
        return {key: value}

    # ------------------------------------------------------------------ loop
    def run(self) -> list[dict[str, float]]:
        """All steps from ``start_step``; the Ray actors and placement groups are released at the end, on
        an error and on Ctrl-C alike (a runner runs once)."""
        try:
            return self._run()
        finally:
            self.close()

    def _status(self, state: str, step: int, message: str = "") -> None:
        from .run_files import RunStatus, write_status

        write_status(self.out_dir, RunStatus(state, step=step, total_steps=self.cfg.trainer.total_steps,
                                             updated=time.time(), message=message, pid=os.getpid()))

    def _eval_due(self, done: int) -> bool:
        ec = self.cfg.eval
        if not (ec.every and self.eval_problems):
            return False
        if done == 0:
            return ec.before_training
        return done % ec.every == 0 or done == self.cfg.trainer.total_steps

    def _run(self) -> list[dict[str, float]]:
        from tqdm import tqdm

        cfg = self.cfg
        history: list[dict[str, float]] = []
        done = self.start_step
        self._status("running", done)
        try:
            if done == 0 and self._eval_due(0):  # where the held-out curve starts: the policy before any update
                self.initial_eval = self.evaluate(0)
                self.metrics.log(self.initial_eval, step=0)
            bar = tqdm(range(self.start_step, cfg.trainer.total_steps), desc="rl", unit="step",
                       initial=self.start_step, total=cfg.trainer.total_steps, dynamic_ncols=True)
            for step in bar:
                try:
                    m = self.train_step(step)
                except RolloutFailure as failure:  # log what the failed step saw, then stop with the cause
                    self.metrics.log(failure.metrics, step=step + 1)  # type: ignore[attr-defined]
                    raise
                done = step + 1
                if self._eval_due(done):
                    m.update(self.evaluate(done))
                self.metrics.log(m, step=done)
                history.append({"step": done, **m})
                bar.set_postfix(reward=f"{m['reward/mean']:.3f}", eq=f"{m['mismatch/bitwise_equal_frac']:.3f}",
                                k3=f"{m['mismatch/kl_k3']:.1e}", err=int(m["rollout/errors"]))
                if cfg.trainer.save_every and (done % cfg.trainer.save_every == 0 or done == cfg.trainer.total_steps):
                    self.trainer.save(str(self.ckpt_dir), done)
            bar.close()
        except KeyboardInterrupt:
            self._status("interrupted", done, "continue with trainer.resume=true")
            raise
        except BaseException as e:
            self._status("failed", done, " ".join(f"{type(e).__name__}: {e}".split())[:500])
            raise
        else:
            self._status("finished", done)
        finally:
            self.metrics.close()  # the final dashboard, with the status just written
        return history
