"""The GPU layout of the Ray loop: rollout on one GPU, trainer on another (separate placement groups of
{"GPU": 1} bundles), bitwise parity at every step, and a resume on the GPU trainer.

Needs 2 CUDA devices (e.g. ``nvidia-h200-x2``); runs in about a minute there:
``python -m pytest -q tests/rl/test_cluster_gpu.py -x``."""
from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from zmrl.rl.config import load_recipe

pytestmark = [pytest.mark.gpu]
log = logging.getLogger(__name__)

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "aime_lora.yaml"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from zmrl.rl.bootstrap import bootstrap_model

    return bootstrap_model(tmp_path_factory.mktemp("boot") / "model", max_steps=2, evaluate=False, progress=False)


@pytest.fixture(scope="module")
def gpu_ray():
    ray = pytest.importorskip("ray")
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 CUDA devices, found {torch.cuda.device_count()}")
    if ray.is_initialized():
        pytest.skip("a Ray session is already running in this process")
    tmp = tempfile.mkdtemp(prefix="zr", dir="/tmp")  # short: Ray's unix socket paths
    os.environ["RAY_TMPDIR"] = tmp
    ray.init(num_cpus=4, num_gpus=2, include_dashboard=False, log_to_driver=False, _temp_dir=tmp)
    yield ray
    ray.shutdown()
    os.environ.pop("RAY_TMPDIR", None)
    shutil.rmtree(tmp, ignore_errors=True)


def _overrides(out_dir, model_dir, steps: int) -> list[str]:
    return [f"trainer.out_dir={out_dir}", f"model.path={model_dir}", f"trainer.total_steps={steps}",
            "trainer.save_every=1", "data.prompts_per_step=4", "rollout.n=2", "rollout.max_tokens=8",
            "eval.every=0", "logging.wandb_mode=disabled", "trainer.num_threads=1",
            "distributed.ray=true", "distributed.rollout.num_gpus=1", "distributed.trainer.num_gpus=1",
            "distributed.placement_timeout_s=60"]


def test_one_gpu_rollout_one_gpu_trainer(gpu_ray, model_dir, tmp_path):
    from ray.util.placement_group import placement_group_table

    from zmrl.rl.loop import RLRunner

    out = tmp_path / "run"
    runner = RLRunner(load_recipe(str(RECIPE), _overrides(out, model_dir, steps=2)))
    infos = {i["role"]: i for i in runner.cluster.describe()}
    for role, info in infos.items():
        log.info("%s: pid %d, GPU ids %s, CUDA_VISIBLE_DEVICES %s, %s", role, info["pid"], info["gpu_ids"],
                 info["cuda_visible_devices"], info.get("cuda_device"))
        assert info["device"] == "cuda" and len(info["gpu_ids"]) == 1
        assert info["placement_group_id"] == runner.cluster.groups[role].placement_group_id
    assert infos["rollout"]["gpu_ids"] != infos["trainer"]["gpu_ids"]  # two different GPUs
    assert infos["rollout"]["pid"] != infos["trainer"]["pid"]
    pg_ids = runner.cluster.placement_group_ids
    history = runner.run()
    for h in history:
        log.info("%s", {k: h[k] for k in ("step", "reward/mean", "mismatch/bitwise_equal_frac",
                                          "mismatch/max_abs_dlogp", "perf/step_s")})
        assert h["mismatch/bitwise_equal_frac"] == 1.0 and h["mismatch/max_abs_dlogp"] == 0.0
    table = placement_group_table()
    assert all(table[p]["state"] == "REMOVED" for p in pg_ids)

    # Resume on the GPU trainer (optimizer moments back onto its device), weights pushed to the rollout GPU.
    resumed = RLRunner(load_recipe(str(RECIPE), _overrides(out, model_dir, steps=3) + ["trainer.resume=true"]))
    assert resumed.start_step == 2
    last = resumed.run()
    assert [h["step"] for h in last] == [3] and last[0]["mismatch/bitwise_equal_frac"] == 1.0
