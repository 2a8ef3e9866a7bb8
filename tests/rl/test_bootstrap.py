"""The SFT bootstrap of the embedded default model: a loadable checkpoint with the byte tokenizer, a
cache hit on the second call, a rebuild for another recipe, determinism, and a budget in steps only.
Tiny recipes (a few steps of batch 4) keep this file to a few tens of seconds on 2 cores."""
import json
import shutil

import pytest
import torch

from zmrl.model import load_pretrained
from zmrl.rl.bootstrap import BOOTSTRAP_FILE, BootstrapRecipe, bootstrap_model, main
from zmrl.rl.tokenizer import ByteTokenizer, load_tokenizer


def tiny_recipe(**kw) -> BootstrapRecipe:
    base = dict(max_steps=3, batch_size=4, warmup_steps=1, eval_problems=4, eval_max_tokens=4)
    base.update(kw)
    return BootstrapRecipe(**base)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    path = tmp_path_factory.mktemp("boot") / "model"
    return bootstrap_model(path, recipe=tiny_recipe(), progress=False)


def test_checkpoint_is_loadable(built):
    path = built
    meta = json.loads((path / BOOTSTRAP_FILE).read_text())
    assert meta["steps"] == 3
    assert 0.0 <= meta["greedy_accuracy"] <= 1.0 and 0.0 <= meta["sampled_accuracy"] <= 1.0
    assert meta["first_loss"] > meta["final_loss"]  # three steps already move the loss
    model = load_pretrained(path)
    assert model.config.vocab_size == 512 and model.config.num_hidden_layers == 4
    assert isinstance(load_tokenizer(path), ByteTokenizer)
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".")]  # no temp folders left behind


def test_second_call_is_a_cache_hit(built, monkeypatch):
    """A hit neither trains nor rewrites: proven by the trainer raising if called, not by wall time
    (a fast machine trains the tiny recipe in under a second)."""
    import zmrl.rl.bootstrap as bootstrap

    path = built
    weights = path / "model.safetensors"
    mtime = weights.stat().st_mtime_ns

    def no_training(*args, **kwargs):
        raise AssertionError("a cache hit must not train")

    monkeypatch.setattr(bootstrap, "train_sft", no_training)
    assert bootstrap_model(path, recipe=tiny_recipe(), progress=False) == path
    assert weights.stat().st_mtime_ns == mtime
    with pytest.raises(AssertionError, match="must not train"):  # the patch is live: another recipe trains
        bootstrap_model(path, recipe=tiny_recipe(seed=7), progress=False)
    assert weights.stat().st_mtime_ns == mtime  # ... and a failed rebuild leaves the cache as it was


def test_deterministic_and_rebuilt_for_another_recipe(built, tmp_path):
    path = built
    again = bootstrap_model(tmp_path / "again", recipe=tiny_recipe(), progress=False, evaluate=False)
    a, b = load_pretrained(path).state_dict(), load_pretrained(again).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)  # same seed, same steps -> the same weights, bitwise
    # another recipe in the same folder: retrained and swapped in atomically
    other = bootstrap_model(again, recipe=tiny_recipe(seed=1, max_steps=1), progress=False, evaluate=False)
    meta = json.loads((other / BOOTSTRAP_FILE).read_text())
    assert other == again and meta["steps"] == 1 and meta["recipe"]["seed"] == 1
    c = load_pretrained(other).state_dict()
    assert not torch.equal(a["lm_head.weight"], c["lm_head.weight"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["again"]


def test_the_budget_is_steps_not_time():
    """The machine's speed must not change the model: no field of the recipe (the cache key) is a time,
    and the teacher boxes only a fraction of its answers."""
    from dataclasses import fields

    names = {f.name for f in fields(BootstrapRecipe)}
    assert not {n for n in names if "time" in n or n.endswith("_s")}, names
    assert BootstrapRecipe().max_steps >= 1 and 0 < BootstrapRecipe().boxed_frac < 1


def test_thread_count_is_restored(tmp_path):
    before = torch.get_num_threads()
    bootstrap_model(tmp_path / "m", recipe=tiny_recipe(max_steps=1, num_threads=1), progress=False, evaluate=False)
    assert torch.get_num_threads() == before


def test_vocab_too_small_is_refused(tmp_path):
    with pytest.raises(ValueError, match="259"):
        bootstrap_model(tmp_path / "m", recipe=tiny_recipe(vocab_size=200), progress=False)
    assert not (tmp_path / "m").exists()


def test_cli_reports_the_cached_model(built, tmp_path, capsys):
    """The CLI on a folder that already holds the default-recipe result is a cache hit."""
    path = tmp_path / "copy"
    shutil.copytree(built, path)
    meta = json.loads((path / BOOTSTRAP_FILE).read_text())
    default = BootstrapRecipe(seed=0, max_steps=3)
    meta["recipe_hash"] = default.hash()  # pretend the folder holds what the CLI would build
    (path / BOOTSTRAP_FILE).write_text(json.dumps(meta))
    assert main(["--out", str(path), "--steps", "3"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["path"] == str(path) and out["steps"] == 3


def test_foreign_folder_is_not_replaced(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "precious.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="not a bootstrap cache"):
        bootstrap_model(tmp_path / "m", recipe=tiny_recipe(max_steps=1), progress=False, evaluate=False)
    assert (tmp_path / "m" / "precious.txt").read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]  # the temp folder was cleaned up
    (tmp_path / "e").mkdir()  # an existing empty folder is fine (pytest's tmp dirs, mkdir -p)
    assert (bootstrap_model(tmp_path / "e", recipe=tiny_recipe(max_steps=1), progress=False, evaluate=False)
            / "config.json").exists()
