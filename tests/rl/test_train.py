"""The RL loop end to end on CPU: recipe handling, parity metrics every step, checkpoints, resume
after a kill (bitwise the same as an uninterrupted run), and the Ray mode."""
import json
import os
import signal
import subprocess
import tempfile
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from zmrl.rl.config import RecipeError, load_recipe

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "aime_lora.yaml"


def small_overrides(out_dir, bootstrap_dir, steps=3, save_every=1):
    return [f"trainer.out_dir={out_dir}", f"model.bootstrap_dir={bootstrap_dir}", "model.bootstrap_steps=10",
            f"trainer.total_steps={steps}", f"trainer.save_every={save_every}", "data.prompts_per_step=2",
            "rollout.n=2", "rollout.max_tokens=6", "eval.every=2", "eval.n=2", "eval.limit=2", "eval.max_tokens=4",
            "logging.wandb_mode=disabled", "trainer.num_threads=1"]


@pytest.fixture(scope="module")
def bootstrap_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("bootstrap")


def test_default_recipe_loads():
    cfg = load_recipe(str(RECIPE))
    assert cfg.trainer.total_steps == 30 and cfg.lora.r == 32 and cfg.model.path is None


def test_unknown_key_lists_valid_keys(tmp_path):
    with pytest.raises(RecipeError, match=r"unknown recipe key 'trainer.totl_steps'.*trainer.total_steps"):
        load_recipe(str(RECIPE), ["trainer.totl_steps=3"])
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer:\n  learning_rate: 0.1\n")
    with pytest.raises(RecipeError, match=r"unknown recipe key 'trainer.learning_rate'"):
        load_recipe(str(bad))


def test_malformed_recipe(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer: [1, 2\n")
    with pytest.raises(RecipeError, match="malformed recipe"):
        load_recipe(str(bad))
    with pytest.raises(RecipeError, match="not found"):
        load_recipe(str(tmp_path / "missing.yaml"))
    with pytest.raises(RecipeError, match="trainer.total_steps"):
        load_recipe(str(RECIPE), ["trainer.total_steps=0"])
    with pytest.raises(RecipeError, match=r"recipe key 'trainer.total_steps': .*'many'"):
        load_recipe(str(RECIPE), ["trainer.total_steps=many"])
    with pytest.raises(RecipeError, match="rollout.decode_graphs.*auto, off, static or cuda"):
        load_recipe(str(RECIPE), ["rollout.decode_graphs=yes"])
    assert load_recipe(str(RECIPE), ["rollout.decode_graphs=static"]).rollout.decode_graphs == "static"
    for bad in ("[0,2]", "[100000]"):
        with pytest.raises(RecipeError, match=r"rollout.decode_graph_batch_sizes.*integers in \[1, rollout.max_num_seqs"):
            load_recipe(str(RECIPE), [f"rollout.decode_graph_batch_sizes={bad}"])
    with pytest.raises(RecipeError, match=r"recipe key 'rollout.decode_graph_batch_sizes': .*list"):
        load_recipe(str(RECIPE), ["rollout.decode_graph_batch_sizes=16"])
    sized = load_recipe(str(RECIPE), ["rollout.decode_graph_batch_sizes=[1,2,4,8,12,16]"]).rollout
    assert sized.engine_config("bitwise").decode_graph_batch_sizes == (1, 2, 4, 8, 12, 16)


def test_missing_data_file(tmp_path, bootstrap_dir):
    from zmrl.rl.loop import RLRunner
    from zmrl.rl.preflight import InputError

    cfg = load_recipe(str(RECIPE), small_overrides(tmp_path / "run", bootstrap_dir) + [f"data.train={tmp_path}/nope.jsonl"])
    with pytest.raises(InputError, match=r"data.train=.*nope.jsonl: file not found"):
        RLRunner(cfg)


def _run(args, env=None, timeout=900):
    return subprocess.run([sys.executable, "-m", "zmrl.train", str(RECIPE), *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def _metrics(run_dir):
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def full_run(tmp_path_factory, bootstrap_dir):
    out = tmp_path_factory.mktemp("full")
    r = _run(small_overrides(out, bootstrap_dir, steps=4, save_every=1))
    assert r.returncode == 0, r.stderr[-3000:]
    return out


def test_every_step_is_bitwise_on_policy(full_run):
    rows = _metrics(full_run)
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]  # step 0: the held-out eval before any update
    assert set(rows[0]) == {"step", "time", "eval/heldout_mean@2"}
    rows = rows[1:]
    for r in rows:
        assert r["mismatch/tokens_compared"] > 0 and r["rollout/errors"] == 0
        assert r["mismatch/bitwise_equal_frac"] == 1.0
        assert r["mismatch/kl_k3"] == 0.0 and r["mismatch/kl_k1"] == 0.0 and r["mismatch/max_abs_dlogp"] == 0.0
    assert any("eval/heldout_mean@2" in r for r in rows)  # data.eval=auto: the held-out split of the tiny task
    assert (Path(full_run) / "dashboard.html").exists()
    ckpt = Path(full_run) / "checkpoints"
    assert (ckpt / "latest").read_text() == "step_4"
    assert (ckpt / "step_4" / "adapter" / "adapter_model.safetensors").exists()


def test_kill_and_resume_is_bitwise_identical(full_run, tmp_path, bootstrap_dir):
    out = tmp_path / "killed"
    args = small_overrides(out, bootstrap_dir, steps=4, save_every=1)
    proc = subprocess.Popen([sys.executable, "-m", "zmrl.train", str(RECIPE), *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 600
    while not (out / "checkpoints" / "step_2").exists():
        assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
        assert time.time() < deadline
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    r = _run(args + ["trainer.resume=true"])
    assert r.returncode == 0, r.stderr[-3000:]
    a, b = _metrics(full_run), _metrics(out)
    assert [x["step"] for x in b] == [0, 1, 2, 3, 4]
    for x, y in zip(a[1:], b[1:]):
        for k in ("reward/mean", "loss/policy", "response/length_mean", "mismatch/bitwise_equal_frac"):
            assert x[k] == y[k], (x["step"], k)
    wa = load_file(str(Path(full_run) / "checkpoints/step_4/adapter/adapter_model.safetensors"))
    wb = load_file(str(out / "checkpoints/step_4/adapter/adapter_model.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_resume_rejects_mismatched_checkpoint(full_run, tmp_path, bootstrap_dir):
    import shutil

    out = tmp_path / "mismatch"
    shutil.copytree(Path(full_run) / "checkpoints", out / "checkpoints")
    r = _run(small_overrides(out, bootstrap_dir, steps=5) + ["trainer.resume=true", "lora.r=8"])
    assert r.returncode != 0 and "does not match" in r.stderr


def test_ray_mode(tmp_path, bootstrap_dir):
    pytest.importorskip("ray")
    out = tmp_path / "ray"
    r = _run(small_overrides(out, bootstrap_dir, steps=1, save_every=0) +
             ["distributed.ray=true", "distributed.ray_num_cpus=2", "eval.every=0"],
             env={"RAY_TMPDIR": tempfile.mkdtemp(prefix="ray", dir="/tmp")})  # short: unix socket paths
    assert r.returncode == 0, r.stderr[-3000:]
    assert _metrics(out)[0]["mismatch/bitwise_equal_frac"] == 1.0


def test_recompute_policy_is_validated():
    assert load_recipe(str(RECIPE), ["trainer.recompute=layer"]).trainer.recompute == "layer"
    with pytest.raises(RecipeError, match=r"recipe key 'trainer.recompute': must be one of none, layer, "
                                          r"selective, attention, got 'full'"):
        load_recipe(str(RECIPE), ["trainer.recompute=full"])


def test_backward_matmul_precision_is_validated():
    assert load_recipe(str(RECIPE), ["trainer.backward_matmul_precision=bf16"]).trainer.backward_matmul_precision == "bf16"
    with pytest.raises(RecipeError, match=r"recipe key 'trainer.backward_matmul_precision': must be one of tf32, bf16, "
                                          r"ieee, got 'fp8'"):
        load_recipe(str(RECIPE), ["trainer.backward_matmul_precision=fp8"])
