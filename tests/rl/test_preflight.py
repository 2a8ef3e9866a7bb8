"""Bad input stops ``zmrl train`` before any heavy work, with one line naming the recipe key, the file and
the line or tensor, and no traceback (``--debug`` shows it)."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from zmrl import train

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "aime_lora.yaml"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A tiny byte-tokenizer checkpoint (untrained: only its files are under test)."""
    from zmrl.model import build_model, save_pretrained
    from zmrl.rl.bootstrap import tiny_byte_config
    from zmrl.rl.tokenizer import write_byte_tokenizer_marker

    folder = tmp_path_factory.mktemp("ckpt")
    save_pretrained(build_model(tiny_byte_config(), seed=0, dtype="float32"), folder)
    write_byte_tokenizer_marker(folder)
    return folder


@pytest.fixture
def no_heavy_work(monkeypatch):
    """Fail the test if the run gets as far as bootstrapping or building a model."""
    def heavy(*args, **kwargs):
        raise AssertionError("heavy work started before the input was checked")

    monkeypatch.setattr("zmrl.rl.bootstrap.bootstrap_model", heavy)
    monkeypatch.setattr("zmrl.rl.workers.TrainerWorker.__init__", heavy)
    monkeypatch.setattr("zmrl.rl.workers.RolloutWorker.__init__", heavy)


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def _cases(tmp: Path, ckpt: Path) -> list[tuple[list[str], str]]:
    """(overrides, a regex the one-line message must match) per user error."""
    no_answer = tmp / "no_answer.jsonl"
    no_answer.write_text(json.dumps({"question": "What is 1 + 1?", "answer": 2}) + "\n"
                         + json.dumps({"question": "What is 2 + 2?"}) + "\n")
    broken = tmp / "broken.jsonl"
    broken.write_text(json.dumps({"question": "q", "answer": 1}) + "\n" + '{"question": "q2", "answer": \n')
    empty_dir = tmp / "empty_model"
    empty_dir.mkdir()
    bad_config = _copy(ckpt, tmp / "bad_config")
    (bad_config / "config.json").write_text("{not json")
    truncated = _copy(ckpt, tmp / "truncated")
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[: len(data) // 2])
    return [
        ([f"data.train={tmp}/nope.jsonl"], r"^data\.train=.*nope\.jsonl: file not found"),
        ([f"data.train={no_answer}"], r"^data\.train=.*no_answer\.jsonl: line 2 has no 'answer' field"),
        ([f"data.train={broken}"], r"^data\.train=.*broken\.jsonl: line 2 is not valid JSON"),
        ([f"data.eval={tmp}/missing_eval.jsonl"], r"^data\.eval=.*missing_eval\.jsonl: file not found"),
        ([f"model.path={empty_dir}"], r"^model\.path=.*empty_model: no config\.json"),
        ([f"model.path={tmp}/no_such_model"], r"^model\.path=.*no_such_model: folder not found"),
        ([f"model.path={bad_config}"], r"^model\.path=.*bad_config: .*config\.json"),
        ([f"model.path={truncated}"],
         r"^model\.path=.*truncated: .*truncated/model\.safetensors is not a readable safetensors file"),
        (['model.path=""'], r"^recipe key 'model\.path': is empty"),
        (["rollout.temperature=-1"], r"^recipe key 'rollout\.temperature': must be >= 0"),
        (["rollout.top_p=2"], r"^recipe key 'rollout\.top_p': must be in \(0, 1\]"),
        (["rollout.max_tokens=0"], r"^recipe key 'rollout\.max_tokens': must be an integer >= 1, got 0"),
        (["lora.r=0"], r"^recipe key 'lora\.r': must be an integer >= 1, got 0"),
        (["trainer.lr=-0.001"], r"^recipe key 'trainer\.lr': must be > 0"),
        (["algorithm.adv_estimator=bogus"], r"^recipe key 'algorithm\.adv_estimator': 'bogus' is not one of verl's "
                                            r"advantage estimators.*grpo.*rloo"),
        (["algorithm.adv_estimator=gae"], r"algorithm\.adv_estimator': 'gae'"),  # needs a critic
        (["algorithm.policy_loss=bogus"], r"^recipe key 'algorithm\.policy_loss': 'bogus' is not one of verl's"),
        (["trainer.total_steps=abc"], r"^recipe key 'trainer\.total_steps': .*'abc'.*\(expected int\)"),
        (["eval.every=-1"], r"^recipe key 'eval\.every': must be >= 0"),
        (["rollout.temprature=0.5"], r"^override .*unknown recipe key 'rollout\.temprature'; did you mean "
                                     r"'rollout\.temperature'"),
    ]


def test_every_user_error_is_one_line_before_heavy_work(tmp_path, checkpoint, no_heavy_work, capsys):
    for overrides, pattern in _cases(tmp_path, checkpoint):
        args = [str(RECIPE), *overrides, f"trainer.out_dir={tmp_path}/run", "logging.wandb_mode=disabled"]
        assert train.main(args) == 2, overrides
        err = capsys.readouterr().err
        assert err.startswith("zmrl train: error: ") and err.count("\n") == 1, (overrides, err)
        message = err.removeprefix("zmrl train: error: ")
        assert re.search(pattern, message), (overrides, message)
        assert "Traceback" not in err and "SamplingParams" not in err, message
        if overrides == ["eval.every=-1"]:
            assert "save_every" not in message, message


def test_debug_shows_the_traceback(tmp_path):
    r = subprocess.run([sys.executable, "-m", "zmrl.train", str(RECIPE), "lora.r=0"], capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "zmrl train: error: recipe key 'lora.r': must be an integer >= 1, got 0"]
    r = subprocess.run([sys.executable, "-m", "zmrl.train", str(RECIPE), "lora.r=0", "--debug"], capture_output=True,
                       text=True)
    assert r.returncode != 0 and "Traceback" in r.stderr and "RecipeError" in r.stderr
