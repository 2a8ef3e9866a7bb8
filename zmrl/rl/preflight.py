"""Every input of a run checked before any heavy work (bootstrap, model build, rollout).

``check_inputs(cfg)`` reads the problem files, the checkpoint's config and tensor headers and the
tokenizer, and returns what it loaded (``RunInputs``) so nothing is read twice. A problem is an
``InputError`` whose one-line message starts with the recipe key (``data.train=...``), then names the
file and the line or tensor; ``zmrl train`` prints it without a traceback (``--debug`` shows one).

Recipe *values* (ranges, names) are checked when the recipe is loaded (``zmrl.rl.config``); this module
checks what those values point at.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .config import RecipeConfig, RecipeError, eval_set

__all__ = ["InputError", "RunInputs", "check_checkpoint", "check_inputs", "check_out_dir",
           "clear_run"]

from .run_files import RUN_FILES


class InputError(RecipeError):
    """A file or folder named by the recipe is missing or unreadable; the message names the key."""


@dataclass
class RunInputs:
    """What ``check_inputs`` loaded: the problem sets and the tokenizer."""

    train_problems: list[dict] | None  # None: the embedded synthetic task (generated, nothing to read)
    eval_problems: list[dict]
    tokenizer: Any


def _problems(key: str, spec: str, limit: int | None = None) -> list[dict]:
    from .data import AIME_SETS, default_aime_path, load_problems

    path = default_aime_path(spec) if spec in AIME_SETS else Path(spec).expanduser()
    try:
        problems = load_problems(path)
    except FileNotFoundError:
        hint = ("'synthetic' or a .jsonl/.json/.parquet file" if key == "data.train"
                else "aime24, aime25, synthetic, none or a .jsonl/.json/.parquet file")
        raise InputError(f"{key}={spec}: file not found ({path}); expected {hint}") from None
    except ValueError as e:
        raise InputError(f"{key}={spec}: {e}") from None
    return problems[:limit] if limit else problems


def check_checkpoint(path: str) -> None:
    """``model.path`` is a folder with a readable ``config.json`` and safetensors files whose headers
    hold exactly the tensors (names and shapes) that config builds. Reads headers only, no weights."""
    from safetensors import safe_open

    from zmrl.model import ModelConfig
    from zmrl.model.checkpoint import check_checkpoint as check_tensors

    root = Path(path).expanduser()
    key = f"model.path={path}"
    if not root.is_dir():
        raise InputError(f"{key}: {'not a folder' if root.exists() else 'folder not found'} (expected an "
                         f"HF-style checkpoint folder: config.json + *.safetensors + tokenizer files)")
    config = root / "config.json"
    if not config.is_file():
        contents = sorted(p.name for p in root.iterdir())[:8]
        raise InputError(f"{key}: no config.json in the folder (it holds {contents or 'nothing'})")
    try:
        ModelConfig.from_json(config)  # a one-line error about the config before the tensor check
    except (ValueError, TypeError, KeyError, OSError) as e:  # json.JSONDecodeError is a ValueError
        raise InputError(f"{key}: {config}: {' '.join(str(e).split())}") from None
    index = root / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise InputError(f"{key}: {index}: not a safetensors index ({e})") from None
        files = sorted({root / f for f in weight_map.values()})
    else:
        files = sorted(root.glob("*.safetensors"))
    if not files:
        raise InputError(f"{key}: no *.safetensors files (pickled checkpoints are never loaded)")
    shapes: dict[str, tuple[int, ...]] = {}
    for f in files:
        if not f.is_file():
            raise InputError(f"{key}: {f} is listed in {index.name} but missing")
        try:
            with safe_open(str(f), framework="pt") as sf:
                for name in sf.keys():
                    shapes[name] = tuple(sf.get_slice(name).get_shape())
        except Exception as e:  # noqa: BLE001 -- safetensors' errors do not name the file
            raise InputError(f"{key}: {f} is not a readable safetensors file (truncated or corrupted? "
                             f"{' '.join(str(e).split())})") from None
    try:  # names and shapes in any layout load_pretrained reads (zmrl, released K3 + MXFP4, HF), headers only
        check_tensors(root)
    except ValueError as e:  # CheckpointError, ConfigError, MXFP4Error
        raise InputError(f"{key}: the safetensors files do not match config.json: "
                         f"{' '.join(str(e).split())}") from None


def _describe_run(out: Path) -> str:
    """What an existing run folder holds, in a few words (steps logged, newest checkpoint)."""
    facts = []
    metrics = out / "metrics.jsonl"
    if metrics.is_file():
        from .run_files import read_metrics

        facts.append(f"{len({r['step'] for r in read_metrics(out)})} logged steps")
    latest = out / "checkpoints" / "latest"
    if latest.is_file():
        facts.append(f"checkpoint {latest.read_text().strip()}")
    other = sorted(p.name for p in out.iterdir() if p.name not in RUN_FILES)
    if other:
        facts.append(f"other files: {', '.join(other[:5])}{' ...' if len(other) > 5 else ''}")
    return ", ".join(facts) or "files"


def check_out_dir(cfg: RecipeConfig) -> None:
    """A new run never writes over an old one: an ``out_dir`` that is not empty needs ``trainer.resume=true``
    (continue it) or ``trainer.overwrite=true`` (delete that run's files first; other files are kept)."""
    tc = cfg.trainer
    out = Path(tc.out_dir).expanduser()
    if out.exists() and not out.is_dir():
        raise InputError(f"trainer.out_dir={tc.out_dir}: exists and is not a folder")
    if tc.resume or not out.is_dir() or not any(out.iterdir()):
        return
    if tc.overwrite:
        other = sorted(p.name for p in out.iterdir() if p.name not in RUN_FILES)
        if other:
            raise InputError(f"trainer.out_dir={tc.out_dir}: trainer.overwrite=true deletes only a run's files, and "
                             f"this folder holds others ({', '.join(other[:5])}): pick another trainer.out_dir")
        return
    raise InputError(f"trainer.out_dir={tc.out_dir}: already holds a run ({_describe_run(out)}); continue it with "
                     f"trainer.resume=true, start a new one elsewhere with trainer.out_dir=NEW_DIR, or replace it "
                     f"with trainer.overwrite=true")


def clear_run(out_dir: str) -> list[str]:
    """Delete the run files of ``out_dir`` (``trainer.overwrite=true``); returns what was deleted."""
    import shutil

    out = Path(out_dir).expanduser()
    gone = []
    for name in RUN_FILES:
        p = out / name
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        elif p.exists() or p.is_symlink():
            p.unlink()
        else:
            continue
        gone.append(name)
    return gone


def check_inputs(cfg: RecipeConfig) -> RunInputs:
    """Read and check every file the recipe names; raises ``InputError`` naming the key, file and line."""
    check_out_dir(cfg)
    if cfg.model.path:
        check_checkpoint(cfg.model.path)
    else:
        _check_bootstrap_dir(cfg.model.bootstrap_dir)
    tokenizer = _tokenizer(cfg)
    train = None if cfg.data.train == "synthetic" else _problems("data.train", cfg.data.train)
    spec = eval_set(cfg)
    if spec == "none":
        evals: list[dict] = []
    elif spec == "synthetic":
        from .synthetic import heldout_problems

        evals = heldout_problems(cfg.eval.limit)
    else:
        evals = _problems("data.eval", spec, cfg.eval.limit)
    return RunInputs(train, evals, tokenizer)


def _tokenizer(cfg: RecipeConfig) -> Any:
    """The checkpoint's tokenizer with ``data.prompt_format`` applied; its ids must fit the model's vocabulary
    and its stop ids must be token ids."""
    from .tokenizer import NoChatTemplateError, load_tokenizer

    path = cfg.model.path
    try:
        tokenizer = load_tokenizer(path, cfg.data.prompt_format)
    except NoChatTemplateError as e:
        raise InputError(f"data.prompt_format={cfg.data.prompt_format}: {' '.join(str(e).split())}; use auto or "
                         "plain, or give the checkpoint a chat template") from None
    except (ValueError, OSError) as e:
        raise InputError(f"model.path={path}: tokenizer: {' '.join(str(e).split())}") from None
    if path:
        from zmrl.model import ModelConfig

        vocab = ModelConfig.from_json(Path(path).expanduser() / "config.json").vocab_size
        if tokenizer.vocab_size > vocab:
            raise InputError(f"model.path={path}: the tokenizer has {tokenizer.vocab_size} token ids but config.json "
                             f"vocab_size is {vocab}: the tokenizer does not belong to this model")
        bad = [i for i in tokenizer.stop_token_ids if not 0 <= i < vocab]
        if bad:
            raise InputError(f"model.path={path}: stop token id(s) {bad} (tokenizer eos / generation_config.json) "
                             f"are outside the model's vocabulary (vocab_size {vocab})")
    return tokenizer


def _check_bootstrap_dir(folder: str) -> None:
    """The embedded default is cached in ``model.bootstrap_dir``: it must be a cache or free to become one."""
    from .bootstrap import BOOTSTRAP_FILE

    cache = Path(folder).expanduser()
    if cache.exists() and not (cache / BOOTSTRAP_FILE).exists() and (not cache.is_dir() or any(cache.iterdir())):
        raise InputError(f"model.bootstrap_dir={folder}: exists and is not a bootstrap cache (no {BOOTSTRAP_FILE}); "
                         f"pick another folder or empty it")
