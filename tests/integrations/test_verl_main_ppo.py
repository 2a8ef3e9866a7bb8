"""verl's own trainer (``python -m verl.trainer.main_ppo``, recipes/verl_grpo.yaml) with
``actor.strategy=zmrl`` and ``rollout.name=zmrl`` on a local Ray cluster, CPU only, tiny model: from verl's
logged metrics, the rollout/trainer mismatch is exactly zero at every step, and the first step's rollouts
are, token for token and log-prob for log-prob, the ones zmrl's own RL loop (zmrl/rl/loop.py) samples at its
first step with the same seed."""
from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

import zmrl  # noqa: F401 -- before verl (MKL's reproducible mode is read at the first GEMM)

pytest.importorskip("verl")
pytest.importorskip("ray")
for _dep in ("cachetools", "fastapi", "uvicorn"):  # verl's rollout server imports them (pyproject: rl extra)
    pytest.importorskip(_dep)

REPO = Path(__file__).resolve().parents[2]
STEPS = 2
PROMPTS_PER_STEP = 2
SAMPLES_PER_PROMPT = 4
RESPONSE_LENGTH = 16


def _plugin_path(tmp: Path) -> list[str]:
    """sys.path entries that make verl find the plugin: none when zmrl is installed with its entry point,
    else a minimal dist-info declaring it (a source checkout run without `pip install -e .`)."""
    eps = importlib.metadata.entry_points(group="verl.plugins")
    if any(ep.value == "zmrl.integrations.verl.plugin" for ep in eps):
        return []
    info = tmp / "entry_point" / "zmrl_verl_plugin-0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: zmrl-verl-plugin\nVersion: 0\n")
    (info / "entry_points.txt").write_text("[verl.plugins]\nzmrl = zmrl.integrations.verl.plugin\n")
    return [str(info.parent)]


def run_main_ppo(tmp: Path, device: str = "cpu") -> dict:
    """``main_ppo`` with recipes/verl_grpo.yaml on a fresh tiny checkpoint; verl's per-step metrics."""
    from zmrl.integrations.verl.data import prepare
    from zmrl.model import build_model, save_pretrained
    from zmrl.rl.bootstrap import tiny_byte_config
    from zmrl.rl.tokenizer import write_byte_tokenizer_marker

    ckpt = tmp / "tiny"
    save_pretrained(build_model(tiny_byte_config(512), seed=0, dtype="float32"), ckpt)
    write_byte_tokenizer_marker(ckpt)
    paths = prepare(tmp / "run", model=str(ckpt), train_limit=PROMPTS_PER_STEP * STEPS, val_limit=2)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RAY_DEDUP_LOGS": "0",
           "VERL_FILE_LOGGER_PATH": str(tmp / "metrics.jsonl"), "HYDRA_FULL_ERROR": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), *_plugin_path(tmp), os.environ.get("PYTHONPATH", "")])}
    env.pop("RAY_ADDRESS", None)  # a fresh local cluster
    if device == "cpu":
        env["VERL_PLATFORM"] = "cpu"
    else:
        env.pop("VERL_PLATFORM", None)
    cmd = [sys.executable, "-m", "verl.trainer.main_ppo", f"--config-path={REPO / 'recipes'}", "--config-name=verl_grpo",
           f"data.train_files={paths['train']}", f"data.val_files={paths['val']}", f"trainer.device={device}",
           f"actor_rollout_ref.model.path={paths['model']}", f"trainer.total_training_steps={STEPS}",
           f"data.train_batch_size={PROMPTS_PER_STEP}", f"actor_rollout_ref.actor.ppo_mini_batch_size={PROMPTS_PER_STEP}",
           f"actor_rollout_ref.rollout.n={SAMPLES_PER_PROMPT}", f"data.max_response_length={RESPONSE_LENGTH}",
           "actor_rollout_ref.actor.optim.lr=1e-2",  # visible updates in two steps
           f"reward.custom_reward_function.path={Path(__file__).with_name('verl_ascii_reward.py')}",
           f"trainer.rollout_data_dir={tmp / 'rollouts'}", f"trainer.default_local_dir={tmp / 'checkpoints'}",
           f"+actor_rollout_ref.rollout.engine_kwargs.zmrl.record_dir={tmp / 'served'}"]
    proc = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=540)
    log = proc.stdout + proc.stderr
    (tmp / "main_ppo.log").write_text(log)
    assert proc.returncode == 0, f"main_ppo exited {proc.returncode}; log tail:\n{log[-6000:]}"
    metrics = [json.loads(line) for line in (tmp / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {"tmp": tmp, "paths": paths, "metrics": {m["step"]: m["data"] for m in metrics}}


@pytest.fixture(scope="module")
def verl_run(tmp_path_factory):
    return run_main_ppo(tmp_path_factory.mktemp("verl"))


def assert_zero_mismatch(metrics: dict) -> None:
    assert sorted(metrics) == list(range(1, STEPS + 1))
    for step, m in metrics.items():
        assert m["training/rollout_probs_diff_valid"] == 1, step
        assert m["training/rollout_probs_diff_max"] == 0.0, step
        assert m["training/rollout_probs_diff_mean"] == 0.0, step
        assert m["rollout_corr/k3_kl"] == 0.0, step
        assert m["rollout_corr/kl"] == 0.0, step
        assert m["rollout_corr/log_ppl_abs_diff"] == 0.0, step


def test_verl_reports_zero_rollout_trainer_mismatch_every_step(verl_run):
    metrics = verl_run["metrics"]
    assert_zero_mismatch(metrics)
    # the first update moved the weights (non-zero reward spread -> gradient), so step 2's zero mismatch
    # also covers the weight sync from the training engine to the rollout server
    assert metrics[1]["actor/grad_norm"] > 0
    assert metrics[1]["critic/score/max"] > metrics[1]["critic/score/min"]


def test_dashboard_of_the_verl_run_shows_kl_zero(verl_run):
    from zmrl.integrations.verl.dashboard import build_verl_dashboard

    page = build_verl_dashboard(verl_run["tmp"] / "metrics.jsonl").read_text()
    assert 'id="kl-badge" data-status="ok"' in page


def test_first_step_rollouts_equal_the_zmrl_loops_with_the_same_seed(verl_run):
    """zmrl's RL loop (RLRunner, one n-sample request per prompt) on the same checkpoint, problems and seed
    samples, at its first step, exactly what verl's first step got from the zmrl rollout server (one request
    per sample): every token and every log-prob, sample by sample (the server's record_dir)."""
    import torch

    from zmrl.integrations.verl.data import problems_for

    from tests.integrations.zmrl_loop import groups_of, loop_runner

    tmp = verl_run["tmp"]
    served = [json.loads(line) for f in sorted((tmp / "served").glob("*.jsonl")) for line in f.read_text().splitlines()]
    first = {(tuple(r["prompt_ids"]), r["sample_index"]): r for r in served if r["weights_step"] == 0}
    assert len(first) == PROMPTS_PER_STEP * SAMPLES_PER_PROMPT  # every (prompt, sample index) once
    runner = loop_runner(verl_run["paths"]["model"], problems_for("synthetic", PROMPTS_PER_STEP * STEPS),
                         tmp / "zmrl_loop", PROMPTS_PER_STEP, SAMPLES_PER_PROMPT, RESPONSE_LENGTH, seed=0)
    try:
        loop = groups_of(runner.rollout_step(0).samples)
    finally:
        runner.close()
    assert sorted(first) == sorted((p, k) for p, g in loop.items() for k in range(len(g)))
    for prompt, samples in loop.items():
        assert len({tuple(s.response_ids) for s in samples}) > 1, "a group's samples must differ"
        for k, s in enumerate(samples):
            theirs = first[prompt, k]
            assert theirs["seed"] == s.seed, (prompt, k)
            assert theirs["token_ids"] == s.response_ids, (prompt, k)
            assert torch.equal(torch.tensor(theirs["logprobs"], dtype=torch.float32), s.logprobs.cpu()), (prompt, k)
    # verl's own dump of its first step (decoded text) holds the same samples
    tok = runner.tokenizer
    dumped = [json.loads(line) for line in (tmp / "rollouts" / "1.jsonl").read_text().splitlines()]
    ours = Counter((tok.decode(list(p)), tok.decode(s.response_ids)) for p, g in loop.items() for s in g)
    assert Counter((d["input"], d["output"]) for d in dumped) == ours


@pytest.mark.gpu
def test_verl_on_a_gpu_reports_zero_mismatch(tmp_path):
    """The same run with verl's CUDA platform: the engine and the rollout server share the worker's GPU."""
    pytest.importorskip("triton")
    run = run_main_ppo(tmp_path, device="cuda")
    assert_zero_mismatch(run["metrics"])
    assert run["metrics"][1]["actor/grad_norm"] > 0
