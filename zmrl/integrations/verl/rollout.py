"""``rollout.name=zmrl``: verl's rollout replica, its server actor and the worker-side adapter, over zmrl's
``RolloutEngine``.

* ``ZmrlReplica`` (verl's ``RolloutReplica``) starts one ``ZmrlServer`` Ray actor per replica, on the node of
  its worker.
* ``ZmrlServer`` owns a ``RolloutEngine`` over its own copy of the model (base + LoRA). verl's agent loop
  calls ``generate`` once per sample; concurrent calls are batched into one engine run, and each returns the
  sampled tokens with the log-probs the engine recorded (the ones the zmrl trainer reproduces bit for bit).
* ``ZmrlRolloutAdapter`` (verl's ``BaseRollout``) lives in the hybrid actor/rollout worker; verl hands it
  the training engine's weights after every update, and it forwards them, with the training process's
  numerics fingerprint, to the server, which refuses weights from another engine or other numerics.

Seeds: zmrl's one rule (``rollout_seed`` in zmrl/rollout/sampling.py), the one zmrl's RL loop uses. verl
sends each sample as its own request, with a fresh request id; the server gives it the seed of
(``engine_kwargs.zmrl.seed``, the global step verl sent with the weights now loaded -- 0 for the initial
weights, s after the s-th update, the same again on a resume -- and the prompt's tokens) and, as
``SamplingParams.first_sample_index``, how many requests with that prompt it already served on these
weights (the sample index within the GRPO group). One-sample requests with indices 0 .. n-1 sample what
one n-sample request samples, so the set of samples of a prompt is a function of the seed, the weights
and the prompt, whatever order the requests arrive in, and equal to the zmrl loop's with the same seed.

``engine_kwargs.zmrl.record_dir``, when set, makes each server append every request it served to
``record_dir/server_<rank>.jsonl`` (weights step, prompt and response ids, seed, sample index and the
recorded log-probs), to replay or compare a run's rollouts outside verl.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import ray
import torch

from verl.workers.rollout.base import BaseRollout
from verl.workers.rollout.replica import RolloutReplica, TokenOutput

from zmrl.kernels_batch_invariant import NumericsError, check_same_numerics, fingerprint

from .settings import ModelSettings, RolloutSettings, ZmrlSettingError

log = logging.getLogger(__name__)

ROLLOUT_NAME = "zmrl"


def server_name(replica_rank: int, suffix: str = "") -> str:
    return f"zmrl_rollout_server_{replica_rank}{suffix}"


def prompt_key(prompt_ids: list[int]) -> str:
    return hashlib.blake2b(",".join(map(str, prompt_ids)).encode(), digest_size=8).hexdigest()


def _stop_token_ids(model_config: Any, path: str) -> tuple[int, ...]:
    """The tokenizer's EOS (and the generation config's): from the loaded tokenizer when verl passes an
    ``HFModelConfig``, else read from the checkpoint folder (verl hands the replica the raw model config)."""
    ids: set[int] = set()
    tok = getattr(model_config, "tokenizer", None)
    if tok is None:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(getattr(model_config, "tokenizer_path", None) or path,
                                            local_files_only=True)
    if tok.eos_token_id is not None:
        ids.add(int(tok.eos_token_id))
    gen = getattr(model_config, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None) if gen is not None else None
    if eos is not None:
        ids.update(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]))
    if not ids:
        raise ZmrlSettingError(f"actor_rollout_ref.model.path={path!r}: its tokenizer defines no eos_token_id; "
                               f"rollout.name=zmrl needs one to stop responses")
    return tuple(sorted(ids))


class ZmrlServer:
    """A Ray actor (async): ``generate`` per sample, batched into engine runs; weight updates; the
    control calls verl makes around them (sleep, wake-up, cache release: no-ops for a CPU-resident engine
    whose cache is allocated once)."""

    def __init__(self, config: Any, model_config: Any, replica_rank: int = 0):
        from zmrl.model.checkpoint import check_checkpoint
        from zmrl.rl.workers import ModelSpec
        from zmrl.rollout import RolloutEngine

        self.config = config
        self.model_settings = ModelSettings.from_model_config(model_config)
        self.settings = RolloutSettings.from_rollout_config(config, self.model_settings)
        try:
            check_checkpoint(self.model_settings.path)
        except Exception as e:  # noqa: BLE001 -- one line naming the setting
            raise ZmrlSettingError(f"actor_rollout_ref.model.path={self.model_settings.path!r}: zmrl cannot load "
                                   f"it: {e}") from None
        device = "cuda" if torch.cuda.is_available() else "cpu"
        self.engine = RolloutEngine(ModelSpec(self.model_settings.path, None, self.model_settings.lora, device).load(),
                                    self.settings.engine)
        self.replica_rank = replica_rank
        self.response_length = int(getattr(config, "response_length", 0) or 0) or None
        self.stop_token_ids = _stop_token_ids(model_config, self.model_settings.path)
        self.global_steps: int | None = None
        self._seen: Counter[tuple[int, str]] = Counter()
        self._queue: list[tuple[list[int], Any, asyncio.Future]] = []
        self._draining = False
        self._engine_lock = threading.Lock()
        self.weights_checked = False

    # ------------------------------------------------------------------ numerics / weights
    def numerics_fingerprint(self):
        return fingerprint(self.engine.numerics)

    def update_weights(self, state: dict[str, torch.Tensor], trainer_numerics, global_steps: int | None = None) -> int:
        """LoRA tensors from the training engine; ``trainer_numerics`` is its process's fingerprint."""
        try:
            check_same_numerics({"the trainer (actor.strategy=zmrl)": trainer_numerics,
                                 f"the rollout server {self.replica_rank} (rollout.name=zmrl)": self.numerics_fingerprint()})
        except NumericsError as e:
            raise NumericsError(f"{e}. Set the same actor_rollout_ref.model.override_config.zmrl_kernel_mode for "
                                f"both sides (and drop actor_rollout_ref.rollout.engine_kwargs.zmrl.kernel_mode), and "
                                f"run every process with the same MKL_CBWR / ZMRL_KDA_DOT_PRECISION") from None
        with self._engine_lock:
            version = self.engine.update_weights(state)
        self._seen.clear()  # sample indices count per weights version; the old version's are done
        self.global_steps = None if global_steps is None else int(global_steps)
        self.weights_checked = True
        return version

    # ------------------------------------------------------------------ generation
    @property
    def weights_step(self) -> int:
        """The global step verl sent with the weights now loaded (the engine's weights version if none)."""
        return self.global_steps if self.global_steps is not None else self.engine.weights_version

    def _params(self, prompt_ids: list[int], sampling_params: dict[str, Any]):
        from zmrl.rollout import SamplingParams
        from zmrl.rollout.sampling import rollout_seed

        version = self.engine.weights_version
        step = self.weights_step
        key = (version, prompt_key(prompt_ids))
        index = self._seen[key]  # the sample index within the prompt's group
        self._seen[key] += 1
        max_tokens = sampling_params.get("max_tokens") or sampling_params.get("max_new_tokens") or self.response_length
        limit = self.engine.max_model_len - len(prompt_ids)
        max_tokens = max(1, min(int(max_tokens or limit), limit))
        top_k = int(sampling_params.get("top_k", -1) or -1)
        return SamplingParams(temperature=float(sampling_params.get("temperature", 1.0)),
                              top_p=float(sampling_params.get("top_p", 1.0)), top_k=-1 if top_k <= 0 else top_k,
                              max_tokens=max_tokens, stop_token_ids=self.stop_token_ids,
                              seed=rollout_seed(self.settings.seed, step, prompt_ids), first_sample_index=index)

    async def generate(self, prompt_ids: list[int], sampling_params: dict[str, Any], request_id: str,
                       image_data: Any = None, video_data: Any = None, **kwargs: Any) -> TokenOutput:
        if image_data or video_data:
            raise ValueError("rollout.name=zmrl generates text only (got image/video data)")
        if not self.weights_checked:
            raise ZmrlSettingError("rollout.name=zmrl received a request before any weights from the trainer: it "
                                   "needs actor_rollout_ref.actor.strategy=zmrl and verl's weight sync before rollout")
        prompt = [int(t) for t in prompt_ids]
        weights_step = self.weights_step
        params = self._params(prompt, sampling_params)
        future = asyncio.get_running_loop().create_future()
        self._queue.append((prompt, params, future))
        if not self._draining:
            self._draining = True
            asyncio.get_running_loop().create_task(self._drain())
        out = await future
        if self.settings.record_dir:
            self._record(weights_step, out)
        return TokenOutput(token_ids=list(out.token_ids), log_probs=out.logprobs.float().tolist(),
                           stop_reason="completed", num_preempted=int(out.num_preemptions),
                           extra_fields={"global_steps": self.global_steps})

    def _record(self, weights_step: int, out: Any) -> None:
        """One JSON line per served request (log-probs as float32 values: they read back bit for bit)."""
        path = Path(self.settings.record_dir) / f"server_{self.replica_rank}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        line = {"weights_step": weights_step, "prompt_ids": list(out.prompt_token_ids), "seed": out.seed,
                "sample_index": out.sample_index, "token_ids": list(out.token_ids),
                "logprobs": out.logprobs.float().tolist(), "finish_reason": out.finish_reason}
        with path.open("a") as f:
            f.write(json.dumps(line) + "\n")

    def _run(self, prompts: list[list[int]], params: list[Any]):
        with self._engine_lock:
            return self.engine.generate(prompts, params, request_ids=[f"r{i}" for i in range(len(prompts))])

    async def _drain(self) -> None:
        """Run whatever is queued as one engine batch, until the queue is empty. The outputs of a request
        do not depend on what it was batched with."""
        try:
            while self._queue:
                await asyncio.sleep(0.05)  # let the other samples of this step arrive
                batch, self._queue = self._queue, []
                try:
                    outs = await asyncio.to_thread(self._run, [b[0] for b in batch], [b[1] for b in batch])
                except Exception as e:  # noqa: BLE001 -- every waiting request gets the error
                    for _, _, fut in batch:
                        if not fut.done():
                            fut.set_exception(e)
                    continue
                for (_, _, fut), out in zip(batch, outs):
                    if not fut.done():
                        fut.set_result(out)
        finally:
            self._draining = False

    # ------------------------------------------------------------------ control calls verl makes
    async def wake_up(self):
        return None

    async def sleep(self):
        return None

    async def wait_for_requests_to_drain(self):
        while self._queue or self._draining:
            await asyncio.sleep(0.05)

    async def clear_kv_cache(self):
        return None

    async def release_kv_cache(self):
        return None

    async def resume_kv_cache(self):
        return None

    async def abort_all_requests(self, reject_request: bool = False) -> dict[str, Any]:
        return {"aborted_count": 0, "request_ids": []}

    async def resume_generation(self):
        return None

    async def start_profile(self, **kwargs: Any):
        return None

    async def stop_profile(self):
        return None

    def ready(self) -> bool:
        return True


class ZmrlReplica(RolloutReplica):
    """One zmrl rollout server per replica, started beside its worker."""

    async def launch_servers(self) -> None:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from verl.utils.device import get_device_name, get_platform, get_resource_name

        options: dict[str, Any] = {"name": server_name(self.replica_rank, self.name_suffix), "num_cpus": 0,
                                   "max_concurrency": self.max_concurrency}
        if self.workers:
            resource = get_resource_name()
            node, devices = await self.workers[0].__ray_call__.remote(
                lambda w: (ray.get_runtime_context().get_node_id(),
                           ray.get_runtime_context().get_accelerator_ids().get(resource, [])))
            options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id=node, soft=False)
            if get_device_name() == "cuda" and devices:  # the server shares its worker's GPU (hybrid mode)
                platform = get_platform()
                options["runtime_env"] = {"env_vars": {**{v: "1" for v in platform.ray_noset_envvars()},
                                                       platform.visible_devices_envvar(): ",".join(map(str, devices))}}
        server = ray.remote(ZmrlServer).options(**options).remote(self.config, self.model_config, self.replica_rank)
        await server.ready.remote()  # surfaces a failed model load here, with its message
        self.servers = [server]
        self._server_handle = server
        self._server_address = f"zmrl-server-{self.replica_rank}{self.name_suffix}"

    def rollout_worker_use_gpu(self) -> bool:
        return False


class ZmrlRolloutAdapter(BaseRollout):
    """The hybrid worker's side: forwards the training engine's weights to this replica's server."""

    def __init__(self, config: Any, model_config: Any, device_mesh: Any, *args: Any, **kwargs: Any):
        super().__init__(config, model_config, device_mesh)
        from .engine import ZmrlEngine

        if not ZmrlEngine.instances_in_process:  # verl's hybrid worker builds its actor before the rollout
            raise ZmrlSettingError("actor_rollout_ref.rollout.name=zmrl needs actor_rollout_ref.actor.strategy=zmrl "
                                   "(this worker's training engine is not zmrl's)")
        self.sleep_level = 1
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        world = (self.config.tensor_model_parallel_size * self.config.data_parallel_size
                 * self.config.pipeline_model_parallel_size)
        self.replica_rank = rank // world
        self._server = None

    def _server_handle(self):
        if self._server is None:
            self._server = ray.get_actor(server_name(self.replica_rank))
        return self._server

    async def resume(self, tags: list[str]):
        return None

    async def release(self):
        return None

    async def update_weights(self, weights, wire_format: str = "named_tensors", **kwargs: Any):
        peft = kwargs.get("peft_config") or {}
        from .engine import PEFT_MARKER

        marker = peft.get(PEFT_MARKER) if isinstance(peft, dict) else None
        if marker is None:
            raise ZmrlSettingError("actor_rollout_ref.rollout.name=zmrl needs actor_rollout_ref.actor.strategy=zmrl: "
                                   "the weights it was sent come from another training engine")
        if wire_format != "named_tensors":
            raise ZmrlSettingError(f"actor_rollout_ref.rollout.checkpoint_engine: rollout.name=zmrl takes full "
                                   f"tensors (backend naive), got wire format {wire_format!r}")
        state = {name: t.detach().to("cpu") for name, t in weights}
        await self._server_handle().update_weights.remote(state, marker["numerics"], kwargs.get("global_steps"))
