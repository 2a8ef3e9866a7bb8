"""Rollout and trainer on separate Ray placement groups (zmrl.rl.cluster), on CPU with a local Ray.

A short RL run whose rollout workers and trainer live in their own placement groups of CPU bundles must
keep bitwise parity at every step, run every worker in its own process pinned to its group, give the
same numbers as the single-process loop, and leave no placement group behind; the distributed recipe
keys are validated with messages that name the key."""
from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from zmrl.rl.cluster import ClusterError, bundle_of, check_resources, shard
from zmrl.rl.config import RecipeError, RoleSection, load_recipe

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "aime_lora.yaml"


# ------------------------------------------------------------------------------------ no Ray needed
@pytest.mark.parametrize("overrides, match", [
    (["distributed.rollout.num_gpus=1"], r"'distributed.rollout.num_gpus': only used with distributed.ray=true"),
    (["distributed.ray=true", "distributed.trainer.workers=2"], r"distributed.trainer.workers.*must be 1"),
    (["distributed.ray=true", "distributed.rollout.workers=0"], r"distributed.rollout.workers.*>= 1"),
    (["distributed.ray=true", "distributed.rollout.num_gpus=2"], r"distributed.rollout.num_gpus.*0 \(CPU\) or 1"),
    (["distributed.ray=true", "distributed.trainer.num_cpus=0"], r"distributed.trainer.num_cpus.*cannot be empty"),
    (["distributed.ray=true", "distributed.rollout.strategy=EVERYWHERE"],
     r"distributed.rollout.strategy.*PACK, SPREAD, STRICT_PACK, STRICT_SPREAD"),
    (["distributed.ray=true", "distributed.placement_timeout_s=0"], r"placement_timeout_s.*> 0"),
    (["distributed.ray=true", "distributed.ray_address=auto", "distributed.ray_num_cpus=4"],
     r"distributed.ray_address.*local Ray only"),
    (["distributed.ray=true", "distributed.rollout.num_gpu=1"],
     r"unknown recipe key 'distributed.rollout.num_gpu'.*distributed.rollout.num_gpus"),
])
def test_distributed_recipe_validation(overrides, match):
    with pytest.raises(RecipeError, match=match):
        load_recipe(str(RECIPE), overrides)


def test_distributed_recipe_from_yaml(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("distributed:\n  ray: true\n  rollout: {workers: 2, num_gpus: 1, num_cpus: 2, strategy: SPREAD}\n"
                      "  trainer: {num_gpus: 1}\n")
    dc = load_recipe(str(recipe)).distributed
    assert dc.rollout == RoleSection(workers=2, num_gpus=1, num_cpus=2.0, strategy="SPREAD")
    assert dc.trainer == RoleSection(num_gpus=1)
    bad = tmp_path / "bad.yaml"
    bad.write_text("distributed:\n  ray: true\n  rollout: {gpus: 1}\n")
    with pytest.raises(RecipeError, match=r"unknown recipe key 'distributed.rollout.gpus'"):
        load_recipe(str(bad))


def test_check_resources_refuses_what_the_cluster_cannot_host():
    cpu, gpu = RoleSection(num_cpus=1), RoleSection(num_gpus=1, num_cpus=1)
    node = {"CPU": 2.0}
    check_resources({"rollout": cpu, "trainer": cpu}, node, [node])  # fits exactly
    with pytest.raises(ClusterError, match=r"asks for 1 GPU .*has 0 GPU.*no GPU is visible"):
        check_resources({"rollout": gpu, "trainer": cpu}, node, [node])
    with pytest.raises(ClusterError, match=r"asks for 3 CPU \(rollout: 2 x 1, trainer: 1 x 1.*has 2 CPU"):
        check_resources({"rollout": replace(cpu, workers=2), "trainer": cpu}, node, [node])
    two_nodes = [{"CPU": 4.0, "GPU": 1.0}, {"CPU": 4.0, "GPU": 1.0}]
    wide = RoleSection(num_gpus=1, num_cpus=6)  # 2 GPUs and 8 CPUs in all, but no node has 6 CPUs
    with pytest.raises(ClusterError, match=r"distributed.rollout: one worker's bundle .* does not fit on any node"):
        check_resources({"rollout": wide, "trainer": RoleSection(num_cpus=1)}, {"CPU": 8.0, "GPU": 2.0}, two_nodes)
    assert bundle_of(RoleSection(num_gpus=1, num_cpus=0)) == {"GPU": 1.0}


def test_shard_keeps_order_and_drops_empty_parts():
    assert shard(5, 2) == [range(0, 3), range(3, 5)]
    assert shard(2, 4) == [range(0, 1), range(1, 2)]
    assert [i for part in shard(7, 3) for i in part] == list(range(7))


# ------------------------------------------------------------------------------------ with a local Ray
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny checkpoint + tokenizer (a few SFT steps of the embedded default: the pipeline is under
    test, not the policy)."""
    from zmrl.rl.bootstrap import bootstrap_model

    return bootstrap_model(tmp_path_factory.mktemp("boot") / "model", max_steps=2, evaluate=False, progress=False)


@pytest.fixture(scope="module")
def local_ray():
    ray = pytest.importorskip("ray")
    if ray.is_initialized():
        pytest.skip("a Ray session is already running in this process")
    # Short temp dir: Ray's unix socket paths must stay under ~107 characters (pytest's tmp paths are long).
    tmp = tempfile.mkdtemp(prefix="zr", dir="/tmp")
    os.environ["RAY_TMPDIR"] = tmp
    # num_gpus=0: a CPU cluster even on a GPU machine (the GPU layout is tests/rl/test_cluster_gpu.py)
    ray.init(num_cpus=2, num_gpus=0, include_dashboard=False, log_to_driver=False, _temp_dir=tmp)
    yield ray
    ray.shutdown()
    os.environ.pop("RAY_TMPDIR", None)
    shutil.rmtree(tmp, ignore_errors=True)


def _overrides(out_dir, model_dir, ray: bool) -> list[str]:
    base = [f"trainer.out_dir={out_dir}", f"model.path={model_dir}", "trainer.total_steps=2", "trainer.save_every=0",
            "data.prompts_per_step=3", "rollout.n=2", "rollout.max_tokens=4", "eval.every=0",
            "logging.wandb_mode=disabled", "trainer.num_threads=1"]
    if ray:  # 2 rollout workers (0.5 CPU each) + 1 trainer (1 CPU): the 2 CPUs of the local Ray
        base += ["distributed.ray=true", "distributed.rollout.workers=2", "distributed.rollout.num_cpus=0.5",
                 "distributed.placement_timeout_s=60"]
    return base


def _zmrl_groups(ray) -> dict[str, dict]:
    from ray.util.placement_group import placement_group_table

    return {pid: t for pid, t in placement_group_table().items() if str(t.get("name", "")).startswith("zmrl-")}


def _perturb_lora(runner) -> None:
    """Give the trainer's LoRA random non-zero values (B starts at zero) and push them to the rollout
    side: from then on parity holds only if the weights really arrived in every engine."""
    gen = torch.Generator().manual_seed(0)
    state = runner.trainer.lora_state().result()
    runner.trainer.load_lora_state({k: v + 0.05 * torch.randn(v.shape, generator=gen)
                                    for k, v in sorted(state.items())})
    runner._push_weights()


def test_rollout_and_trainer_on_separate_placement_groups(local_ray, model_dir, tmp_path):
    from zmrl.rl.loop import RLRunner

    ray = local_ray
    runner = RLRunner(load_recipe(str(RECIPE), _overrides(tmp_path / "ray", model_dir, ray=True)))
    infos = runner.cluster.describe()
    groups = runner.cluster.groups
    assert sorted(groups) == ["rollout", "trainer"] and len(groups["rollout"].handles) == 2
    assert groups["rollout"].placement_group_id != groups["trainer"].placement_group_id
    for info in infos:  # every worker runs in its own group, on its own bundle, set up like the other side
        assert info["placement_group_id"] == groups[info["role"]].placement_group_id
        assert info["bundle_index"] == info["rank"]
        assert info["torch_threads"] == 1 and info["kernel_mode"] == "bitwise" and info["device"] == "cpu"
    pids = {info["pid"] for info in infos}
    assert len(pids) == 3 and os.getpid() not in pids
    pg_ids = runner.cluster.placement_group_ids
    assert all(_zmrl_groups(ray)[p]["state"] == "CREATED" for p in pg_ids)

    _perturb_lora(runner)  # trainer -> object store -> both rollout workers
    history = runner.run()
    assert [h["step"] for h in history] == [1, 2]
    for h in history:  # trainer recompute in one process == engine log-probs recorded in others
        assert h["mismatch/bitwise_equal_frac"] == 1.0
        assert h["mismatch/max_abs_dlogp"] == 0.0 and h["mismatch/kl_k1"] == 0.0 and h["mismatch/kl_k3"] == 0.0
    after = _zmrl_groups(ray)
    assert all(after[p]["state"] == "REMOVED" for p in pg_ids)  # released at the end of the run
    assert ray.is_initialized()  # the runner did not start this Ray session, so it leaves it running

    # The same recipe in one process: sharding the prompts over two engines in other processes changes
    # nothing (request ids are global, sampling depends on (seed, request id, position) only).
    local_runner = RLRunner(load_recipe(str(RECIPE), _overrides(tmp_path / "local", model_dir, ray=False)))
    _perturb_lora(local_runner)
    local = local_runner.run()
    assert local[0]["mismatch/bitwise_equal_frac"] == 1.0
    for a, b in zip(history, local):
        for key in ("reward/mean", "response/length_mean", "loss/policy", "train/grad_norm"):
            assert a[key] == b[key], (a["step"], key)


def test_unsatisfiable_placement_group_times_out_and_is_removed(local_ray, model_dir, tmp_path):
    from zmrl.rl.loop import RLRunner

    before = set(_zmrl_groups(local_ray))
    # STRICT_SPREAD wants each bundle on a different node: never possible on this one-node cluster.
    cfg = load_recipe(str(RECIPE), _overrides(tmp_path / "spread", model_dir, ray=True) +
                      ["distributed.rollout.strategy=STRICT_SPREAD", "distributed.placement_timeout_s=1"])
    with pytest.raises(ClusterError, match=r"distributed.rollout: placement group of 2 x \{'CPU': 0.5\} "
                                           r"\(STRICT_SPREAD\) not ready after 1 s"):
        RLRunner(cfg)
    new = {p: t for p, t in _zmrl_groups(local_ray).items() if p not in before}
    assert len(new) == 2 and all(t["state"] == "REMOVED" for t in new.values())  # trainer's group too


def test_more_gpus_than_the_cluster_has(local_ray, model_dir, tmp_path):
    from zmrl.rl.loop import RLRunner

    before = set(_zmrl_groups(local_ray))
    cfg = load_recipe(str(RECIPE), _overrides(tmp_path / "gpu", model_dir, ray=True) +
                      ["distributed.trainer.num_gpus=1"])
    with pytest.raises(ClusterError, match=r"asks for 1 GPU.*has 0 GPU"):
        RLRunner(cfg)
    assert set(_zmrl_groups(local_ray)) == before  # refused before anything was reserved
