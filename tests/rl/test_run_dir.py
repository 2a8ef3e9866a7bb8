"""Runs are never overwritten: a new run refuses an out_dir holding a run unless it resumes it
(``trainer.resume=true``) or replaces it explicitly (``trainer.overwrite=true``); a resumed run keeps
its wandb run id."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from zmrl import train
from zmrl.rl.config import RecipeError, load_recipe
from zmrl.rl.metrics import MetricsLogger
from zmrl.rl.preflight import InputError, check_out_dir

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "aime_lora.yaml"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from zmrl.model import build_model, save_pretrained
    from zmrl.rl.bootstrap import tiny_byte_config
    from zmrl.rl.tokenizer import write_byte_tokenizer_marker

    folder = tmp_path_factory.mktemp("model")
    save_pretrained(build_model(tiny_byte_config(), seed=0, dtype="float32"), folder)
    write_byte_tokenizer_marker(folder)
    return folder


def _args(out: Path, model: Path, *extra: str) -> list[str]:
    return [str(RECIPE), f"trainer.out_dir={out}", f"model.path={model}", "trainer.total_steps=1",
            "trainer.save_every=1", "data.prompts_per_step=1", "rollout.n=2", "rollout.max_tokens=3", "eval.every=0",
            "logging.wandb_mode=disabled", "trainer.num_threads=1", *extra]


def test_rerun_refuses_the_old_run_and_keeps_it(tmp_path, model_dir, capsys):
    out = tmp_path / "run"
    assert train.main(_args(out, model_dir)) == 0
    before = (out / "metrics.jsonl").read_bytes()
    assert before and (out / "checkpoints" / "latest").read_text() == "step_1"
    capsys.readouterr()
    assert train.main(_args(out, model_dir)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "trainer.out_dir=" in err and "already holds a run (1 logged steps, " \
        "checkpoint step_1)" in err and "trainer.resume=true" in err and "trainer.overwrite=true" in err, err
    assert (out / "metrics.jsonl").read_bytes() == before  # untouched
    # an explicit overwrite starts afresh
    assert train.main(_args(out, model_dir, "trainer.overwrite=true")) == 0
    assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()] == [1]
    # resume of a finished run is allowed (nothing left to do)
    assert train.main(_args(out, model_dir, "trainer.resume=true")) == 0


def test_out_dir_rules(tmp_path):
    def cfg(out, *extra):
        return load_recipe(str(RECIPE), [f"trainer.out_dir={out}", *extra])

    check_out_dir(cfg(tmp_path / "new"))  # missing: fine
    (tmp_path / "empty").mkdir()
    check_out_dir(cfg(tmp_path / "empty"))  # empty: fine
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    with pytest.raises(InputError, match=r"already holds a run \(other files: notes.txt\)"):
        check_out_dir(cfg(mine))
    with pytest.raises(InputError, match=r"overwrite=true deletes only a run's files.*notes.txt"):
        check_out_dir(cfg(mine, "trainer.overwrite=true"))
    with pytest.raises(RecipeError, match=r"trainer.overwrite.*contradict"):
        cfg(mine, "trainer.overwrite=true", "trainer.resume=true")


def test_wandb_id_is_kept_on_resume(tmp_path):
    a = MetricsLogger(tmp_path / "a", wandb_mode="disabled")
    a.close()
    again = MetricsLogger(tmp_path / "a", wandb_mode="disabled")
    again.close()
    other = MetricsLogger(tmp_path / "b", wandb_mode="disabled")
    other.close()
    assert again.wandb_id == a.wandb_id != other.wandb_id
    assert json.loads((tmp_path / "a" / "run.json").read_text())["wandb_id"] == a.wandb_id


def test_wandb_offline_resume_continues_the_same_run(tmp_path):
    pytest.importorskip("wandb")
    ids = []
    for step in (1, 2):
        with MetricsLogger(tmp_path, wandb_mode="offline") as lg:
            assert lg._wandb_run is not None
            ids.append(lg._wandb_run.id)
            lg.log({"x": float(step)}, step=step)
    assert ids[0] == ids[1] == json.loads((tmp_path / "run.json").read_text())["wandb_id"]
    # wandb's offline folders are named by start second and run id (plus -N within one second)
    runs = sorted(p.name for p in (tmp_path / "wandb").glob("offline-run-*"))
    assert runs and all(r.split("-")[3] == ids[0] for r in runs), runs
