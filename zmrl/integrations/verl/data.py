"""``zmrl verl-prepare``: everything ``python -m verl.trainer.main_ppo`` needs to run zmrl, in one folder.

* ``train.parquet`` / ``val.parquet``: problem sets (``synthetic``, ``aime24``, ``aime25`` or a
  jsonl/json/parquet file of ``question``/``answer`` rows, zmrl/rl/data.py) in verl's RL dataset format: a
  one-message chat ``prompt`` (the question), ``reward_model.ground_truth`` (the answer), ``data_source``
  and ``extra_info.index``. The prompt text the model sees comes from the tokenizer's chat template (the
  byte tokenizer's renders exactly the zmrl loop's prompt).
* ``model/``: a copy of the checkpoint (the embedded default model, from the bootstrap cache ``zmrl train``
  uses -- built there first if missing -- or ``--model``), made readable by verl's model config path
  (hf.py ``prepare_checkpoint``).

It prints the ``main_ppo`` command line (README.md, "verl").
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

DATA_SOURCE = "zmrl"


def problems_for(spec: str, limit: int | None, seed: int = 0) -> list[dict]:
    """The rows of ``spec`` as ``zmrl train`` reads them (zmrl/rl/sources.py)."""
    from zmrl.rl.sources import load_eval_problems, load_train_source

    if spec == "heldout":
        rows = load_eval_problems("synthetic", limit)
    else:
        rows = load_train_source(spec, synthetic_pool=limit or 40, seed=seed).problems
    return rows[:limit] if limit else rows


def to_verl_rows(problems: list[dict], split: str, data_source: str = DATA_SOURCE) -> list[dict]:
    return [{"data_source": data_source, "prompt": [{"role": "user", "content": p["question"]}], "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": str(p["answer"])},
             "extra_info": {"split": split, "index": i, "question": p["question"], "answer": str(p["answer"])}}
            for i, p in enumerate(problems)]


def write_parquet(rows: list[dict], path: str | Path) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), str(path))
    return path


def main_ppo_command(out: Path, model: Path, steps: int = 2) -> list[str]:
    """The ``main_ppo`` overrides of the README's CPU run (recipes/verl_grpo.yaml holds the same)."""
    return ["python", "-m", "verl.trainer.main_ppo", f"--config-path={Path(__file__).resolve().parents[3] / 'recipes'}",
            "--config-name=verl_grpo", f"data.train_files={out / 'train.parquet'}",
            f"data.val_files={out / 'val.parquet'}", f"actor_rollout_ref.model.path={model}",
            f"trainer.total_training_steps={steps}", f"trainer.default_local_dir={out / 'checkpoints'}"]


def prepare(out: str | Path, model: str | None = None, train: str = "synthetic", val: str = "heldout",
            train_limit: int | None = 40, val_limit: int | None = 16, seed: int = 0, bootstrap_steps: int | None = None,
            bootstrap_dir: str | None = None) -> dict[str, Path]:
    from .hf import prepare_checkpoint

    out = Path(out).expanduser().resolve()
    out.mkdir(parents=True, exist_ok=True)
    paths = {"train": write_parquet(to_verl_rows(problems_for(train, train_limit, seed), "train"), out / "train.parquet"),
             "val": write_parquet(to_verl_rows(problems_for(val, val_limit, seed), "test"), out / "val.parquet")}
    if model is None:
        from zmrl.rl.bootstrap import bootstrap_model
        from zmrl.rl.config import ModelSection

        src = bootstrap_model(Path(bootstrap_dir or ModelSection.bootstrap_dir).expanduser(), max_steps=bootstrap_steps)
    else:
        src = Path(model).expanduser()
        if not (src / "config.json").exists():
            raise FileNotFoundError(f"--model {str(src)!r}: no config.json (not a checkpoint folder)")
    dst = out / "model"
    if dst.resolve() != src.resolve():
        shutil.rmtree(dst, ignore_errors=True)
        shutil.copytree(src, dst)
    paths["model"] = prepare_checkpoint(dst)
    return paths


def add_verl_prepare_subcommand(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("verl-prepare", help="parquet data + a verl-readable checkpoint for verl's main_ppo")
    p.add_argument("--out", required=True, help="output folder (train.parquet, val.parquet, model/)")
    p.add_argument("--model", default=None, help="zmrl checkpoint folder (default: bootstrap the embedded model)")
    p.add_argument("--train", default="synthetic", help="synthetic | aime24 | aime25 | FILE (default synthetic)")
    p.add_argument("--val", default="heldout", help="heldout | aime24 | aime25 | synthetic | FILE (default heldout)")
    p.add_argument("--train-limit", type=int, default=40, help="rows of the training set (default 40)")
    p.add_argument("--val-limit", type=int, default=16, help="rows of the validation set (default 16)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bootstrap-steps", type=int, default=None, help="SFT steps of the default model's bootstrap")
    p.add_argument("--bootstrap-dir", default=None, help="bootstrap cache (default: zmrl train's, "
                   "~/.cache/zmrl/bootstrap)")
    p.set_defaults(func=_run)
    return p


def _run(args: argparse.Namespace) -> int:
    paths = prepare(args.out, args.model, args.train, args.val, args.train_limit or None, args.val_limit or None,
                    args.seed, args.bootstrap_steps, args.bootstrap_dir)
    print(json.dumps({k: str(v) for k, v in paths.items()}, indent=2))
    print("VERL_PLATFORM=cpu " + " ".join(main_ppo_command(Path(args.out).expanduser().resolve(), paths["model"])))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m zmrl.integrations.verl.data")
    sub = parser.add_subparsers(dest="command", required=True)
    add_verl_prepare_subcommand(sub)
    args = parser.parse_args(argv if argv is not None and argv[:1] == ["verl-prepare"] else
                             ["verl-prepare", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
