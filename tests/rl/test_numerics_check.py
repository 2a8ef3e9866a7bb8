"""The RL driver compares the trainer's and every rollout worker's numerics fingerprint before the
first step, and stops naming the field that differs."""
from __future__ import annotations

import os

import pytest

import zmrl.kernels_batch_invariant as kbi
from zmrl.lora import LoraConfig
from zmrl.model import ModelConfig, build_model
from zmrl.model.checkpoint import save_pretrained
from zmrl.rl.cluster import ActorEnv, LocalHandle
from zmrl.rl.config import load_recipe
from zmrl.rl.loop import RLRunner
from zmrl.rl.workers import ModelSpec, RolloutHandle, RolloutWorker, TrainerHandle, TrainerWorker
from zmrl.rollout import EngineConfig
from zmrl.trainer import TrainerConfig


class _Reports:
    def __init__(self, fp: kbi.NumericsFingerprint):
        self.fp = fp

    def numerics_fingerprint(self) -> kbi.NumericsFingerprint:
        return self.fp


@pytest.fixture(autouse=True)
def _restore_numerics():
    before = kbi.current_numerics()
    yield
    kbi.apply_numerics(before)


def test_driver_stops_before_the_first_step_naming_the_field():
    runner = RLRunner.__new__(RLRunner)  # only the pre-step check: no model, no data
    runner.cfg = load_recipe(None)
    same = kbi.fingerprint(kbi.Numerics())
    other = kbi.fingerprint(kbi.Numerics(kda_dot_precision="ieee" if same.fields["kda_dot_precision"] != "ieee"
                                         else "tf32"))
    runner.trainer = TrainerHandle(LocalHandle(_Reports(same)))
    runner.rollouts = [RolloutHandle(LocalHandle(_Reports(same))), RolloutHandle(LocalHandle(_Reports(other)))]
    with pytest.raises(kbi.NumericsError, match=r"between trainer and rollout worker 1: kda_dot_precision is"):
        runner._finish_init()


def test_workers_report_the_contract_they_run(tmp_path):
    save_pretrained(build_model(ModelConfig.preset("tiny"), seed=0), tmp_path / "m")
    model = ModelSpec(str(tmp_path / "m"), "float32", LoraConfig(r=4))
    trainer = TrainerWorker(model, TrainerConfig(lr=1e-3), load_recipe(None).algorithm.objective(), kernel_mode="fast")
    assert trainer.numerics_fingerprint().fields["kernel_mode"] == "fast" and kbi.get_mode() == "fast"
    rollout = RolloutWorker(model, EngineConfig(num_blocks=8, kernel_mode="fast"))
    kbi.check_same_numerics({"trainer": trainer.numerics_fingerprint(), "rollout": rollout.numerics_fingerprint()})
    # the process contract changed under a built engine: its worker reports the engine's own contract
    kbi.set_mode("bitwise")
    with pytest.raises(kbi.NumericsError, match="kernel_mode is 'bitwise' in trainer and 'fast' in rollout"):
        kbi.check_same_numerics({"trainer": trainer.numerics_fingerprint(),
                                 "rollout": rollout.numerics_fingerprint()})


def test_actor_env_applies_the_drivers_contract():
    n = kbi.Numerics(kernel_mode="fast", kda_dot_precision="ieee")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")  # a CPU actor hides the GPUs: restore for later tests
    try:
        ActorEnv(device="cpu", numerics=n).apply()
    finally:
        if visible is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = visible
    assert kbi.current_numerics() == n
