"""``zmrl convert`` (also ``python -m zmrl.model.convert``): what a checkpoint folder maps to in zmrl, and a
zmrl-ready copy only when something must change.

The folder is read as it is: ``config.json`` through the same readers as ``load_pretrained`` (zmrl's own
format, the released Kimi K3 / Kimi-Linear format of k3_release.py, transformers configs of the model types
hf_config.py supports) and the ``*.safetensors`` files, sharded or not (an index file is followed when
there is one). Only the safetensors headers are read for the report.

The report lists each config field and the zmrl field it becomes, and the tensor names grouped by pattern
(``{L}`` a layer, ``{E}`` an expert) with how each becomes zmrl's tensor (``plain``: as stored; ``mxfp4``:
dequantised; ``row``: ``[1, D]`` to ``[D]``; ``a_log``: the first ``num_heads`` entries), and the tensors that
are not part of the text model (vision tower, MTP layers: dropped).

Something must change when a tensor is renamed, changes layout or is dropped. Then ``--out DIR`` writes
zmrl's ``config.json`` and the converted tensors (streamed shard by shard, never the whole model in memory;
MXFP4 experts dequantised exactly into the checkpoint's dtype), and copies the other files (tokenizer,
generation config, license) except Python files (remote code, never run by zmrl). When nothing must change,
nothing is written: ``load_pretrained`` and ``model.path`` read the folder as it is.

Bad input stops with one line naming the file, the field or the tensors: a ``model_type`` without an adapter,
missing / unexpected / mis-shaped tensors, pickled weights (``*.bin``, ``*.pt``: never loaded), a shard the
index lists but the folder lacks.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import re
import shutil
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .checkpoint import INDEX_NAME, WEIGHTS_NAME, CheckpointError, _plan, check_checkpoint
from .config import ConfigError, LinearAttnConfig, ModelConfig
from .k3_release import TEXT_FIELDS, Source, convert_tensor, is_release_config, text_config_of

__all__ = ["ConversionReport", "FieldMapping", "TensorMapping", "add_convert_subcommand", "convert_checkpoint",
           "inspect_checkpoint", "main"]

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
DEFAULT_SHARD_BYTES = 5 * 1024**3
DESCRIPTION = "What a checkpoint folder maps to in zmrl, and a zmrl-ready copy only when something must change."


@dataclass(frozen=True)
class FieldMapping:
    """One config field: ``source`` (dotted for nested fields) becomes zmrl's ``target``; None: the adapter
    checks it against what zmrl supports, or it is bookkeeping (``architectures``, token ids)."""

    source: str
    target: str | None
    value: Any


@dataclass(frozen=True)
class TensorMapping:
    """One zmrl tensor and where it comes from (``Source`` of k3_release.py) with the stored shape / dtype."""

    target: str
    sources: tuple[str, ...]
    kind: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def unchanged(self) -> bool:
        return self.kind == "plain" and self.sources == (self.target,)


@dataclass
class ConversionReport:
    path: Path
    config_format: str  # "zmrl" | "hf" (a transformers model type) | "release" (Kimi K3 / Kimi-Linear)
    model_type: str
    config: ModelConfig
    fields: list[FieldMapping]
    tensors: list[TensorMapping]
    dropped: dict[str, list[str]]  # reason -> checkpoint tensors outside the text model
    weight_files: list[str]
    other_files: list[str]
    ignored_pickles: list[str] = field(default_factory=list)

    @property
    def changes(self) -> list[str]:
        """Why the folder needs a converted copy (empty: zmrl reads it as it is)."""
        out = []
        renamed = sum(1 for t in self.tensors if t.kind == "plain" and t.sources != (t.target,))
        if renamed:
            out.append(f"{renamed} tensor(s) renamed")
        for kind, n in sorted(Counter(t.kind for t in self.tensors if t.kind != "plain").items()):
            out.append(f"{n} tensor(s) change layout ({kind})")
        n_dropped = sum(len(v) for v in self.dropped.values())
        if n_dropped:
            out.append(f"{n_dropped} tensor(s) outside the text model dropped")
        return out

    @property
    def copied_files(self) -> list[str]:
        """The files a converted copy carries along: all but the weights, config.json and Python files
        (remote code, never run)."""
        return [n for n in self.other_files if not n.endswith(".py")]

    @property
    def tokenizer(self) -> str:
        names = set(self.other_files)
        if "zmrl_tokenizer.json" in names:
            return "zmrl byte tokenizer (zmrl_tokenizer.json)"
        if "tiktoken.model" in names:
            return "tiktoken.model + tokenizer_config.json (zmrl's tiktoken loader)"
        if "tokenizer.json" in names or "tokenizer_config.json" in names:
            return "tokenizer.json / tokenizer_config.json (transformers AutoTokenizer, no remote code)"
        return "none found (model.path needs tokenizer files)"

    def lines(self) -> list[str]:
        """The human-readable report."""
        cfg = self.config
        out = [f"checkpoint {self.path}",
               f"  config: {self.config_format} format, model_type {self.model_type!r} -> zmrl {cfg.num_hidden_layers} "
               f"layers ({len(cfg.linear_attn_config.kda_layers)} KDA, {len(cfg.linear_attn_config.full_attn_layers)} "
               f"MLA), hidden {cfg.hidden_size}, vocab {cfg.vocab_size}, {cfg.n_routed_experts} routed experts, "
               f"dtype {cfg.torch_dtype}",
               f"  weights: {len(self.weight_files)} safetensors file(s), {len(self.tensors)} zmrl tensors",
               f"  tokenizer: {self.tokenizer}"]
        remote = [n for n in self.other_files if n.endswith(".py")]
        if remote:
            out.append(f"  Python files (remote code: never run, not copied): {', '.join(remote)}")
        if self.ignored_pickles:
            out.append(f"  ignored (pickled, never loaded): {', '.join(self.ignored_pickles)}")
        out.append("config fields (checkpoint -> zmrl; * = another name, - = read by the adapter: checked against "
                   "what zmrl supports, or bookkeeping):")
        width = max((len(f.source) for f in self.fields), default=0)
        for f in self.fields:
            leaf = f.source.removeprefix("text_config.")
            mark = "-" if f.target is None else " " if f.target == leaf else "*"
            target = "" if f.target is None else f" -> {f.target}"
            out.append(f"  {mark} {f.source:<{width}}{target} = {json.dumps(f.value, default=str)}")
        out.append("tensors (checkpoint -> zmrl; {L} layer, {E} expert; * = renamed or converted):")
        for (src, dst, kind), n in _tensor_groups(self.tensors).items():
            mark = " " if kind == "plain" and src == dst else "*"
            out.append(f"  {mark} {n:>6} x {src} -> {dst}" + ("" if kind == "plain" else f"  [{kind}]"))
        for reason, names in self.dropped.items():
            out.append(f"  * {len(names):>6} x dropped ({reason}), e.g. {names[0]}")
        changes = self.changes
        out.append("must change: " + "; ".join(changes) if changes else
                   "nothing must change: load_pretrained / model.path read this folder as it is")
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"path": str(self.path), "config_format": self.config_format, "model_type": self.model_type,
                "zmrl_config": self.config.to_dict(), "fields": [dataclasses.asdict(f) for f in self.fields],
                "tensors": [dataclasses.asdict(t) for t in self.tensors], "dropped": self.dropped,
                "weight_files": self.weight_files, "other_files": self.other_files, "tokenizer": self.tokenizer,
                "ignored_pickles": self.ignored_pickles, "changes": self.changes}


def _pattern(name: str) -> str:
    name = re.sub(r"\.layers\.\d+\.", ".layers.{L}.", name)
    return re.sub(r"\.experts\.\d+\.", ".experts.{E}.", name)


def _tensor_groups(tensors: list[TensorMapping]) -> dict[tuple[str, str, str], int]:
    groups: Counter[tuple[str, str, str]] = Counter()
    for t in tensors:
        groups[("+".join(_pattern(s) for s in t.sources), _pattern(t.target), t.kind)] += 1
    return dict(groups)


# ----------------------------------------------------------------------------- reading

def _read_config(root: Path) -> dict[str, Any]:
    if not root.is_dir():
        raise CheckpointError(f"{root}: {'not a folder' if root.exists() else 'folder not found'} (expected a "
                              "checkpoint folder: config.json + *.safetensors)")
    path = root / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{root}: no config.json")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    return raw


def _config_format(raw: dict[str, Any], path: Path) -> str:
    """zmrl / release / hf; a model_type no reader supports is a ConfigError naming it."""
    from .hf_config import config_from_hf, is_hf_config

    if is_release_config(raw):
        return "release"
    if is_hf_config(raw):
        return "hf"
    if "linear_attn_config" in raw:
        return "zmrl"
    try:  # the HF adapter's own message names the model_type and the supported ones
        config_from_hf(raw)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None
    raise ConfigError(f"{path}: model_type {raw.get('model_type')!r} is not a format zmrl reads")


def _check_weight_files(root: Path) -> tuple[list[str], list[str]]:
    """(safetensors files, pickled files present but ignored); pickles alone, or a shard the index lists but
    the folder lacks, stop with a message naming them."""
    pickles = sorted(p.name for p in root.iterdir() if p.is_file() and p.name.endswith(PICKLE_SUFFIXES))
    index = root / INDEX_NAME
    if index.is_file():
        try:
            listed = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{index}: not a safetensors index (needs a 'weight_map': {e})") from None
        missing = [f for f in listed if not (root / f).is_file()]
        if missing:
            raise CheckpointError(f"{index}: lists shard(s) the folder lacks: {missing[:5]}")
        bad = [f for f in listed if not f.endswith(".safetensors")]
        if bad:
            raise CheckpointError(f"{index}: lists non-safetensors file(s) {bad[:5]}; only safetensors are read")
        return listed, pickles
    files = sorted(p.name for p in root.glob("*.safetensors"))
    if not files:
        what = f"only pickled weights ({', '.join(pickles[:5])})" if pickles else "no weight files"
        raise CheckpointError(f"{root}: {what}; zmrl reads *.safetensors only and never unpickles: save the "
                              "weights as safetensors (e.g. transformers save_pretrained(safe_serialization=True))")
    return files, pickles


def _field_table(raw: dict[str, Any], fmt: str) -> dict[str, str]:
    """checkpoint config field -> zmrl field, for the formats whose adapter keeps a table (hf_config.py may
    publish one per model_type as ``FIELD_TABLES``); other fields map to the zmrl field of the same name."""
    if fmt == "release":
        return dict(TEXT_FIELDS)
    from . import hf_config

    tables = getattr(hf_config, "FIELD_TABLES", None)  # per model_type, where the adapter exposes them
    if isinstance(tables, dict) and raw.get("model_type") in tables:
        return dict(tables[raw["model_type"]])
    return dict(getattr(hf_config, "_DS_FIELDS", {})) if raw.get("model_type") == "deepseek_v3" else {}


def _fields(raw: dict[str, Any], fmt: str) -> list[FieldMapping]:
    zmrl_fields = {f.name for f in dataclasses.fields(ModelConfig)}
    la_fields = {f.name for f in dataclasses.fields(LinearAttnConfig)}
    if fmt == "zmrl":
        out = [FieldMapping(k, k if k in zmrl_fields else None, v) for k, v in raw.items() if k != "linear_attn_config"]
        out += [FieldMapping(f"linear_attn_config.{k}", f"linear_attn_config.{k}", v)
                for k, v in (raw.get("linear_attn_config") or {}).items()]
        return out
    table = _field_table(raw, fmt)
    text = text_config_of(raw) if fmt == "release" else raw
    prefix = "text_config." if text is not raw else ""
    out = []
    if text is not raw:
        out += [FieldMapping(k, None, v) for k, v in raw.items() if k != "text_config"]
    for k, v in text.items():
        if k == "linear_attn_config" and isinstance(v, dict):
            out += [FieldMapping(f"{prefix}{k}.{kk}", f"linear_attn_config.{kk}" if kk in la_fields else kk
                                 if kk in zmrl_fields else None, vv) for kk, vv in v.items()]
            continue
        target = table.get(k, k if k in zmrl_fields and k != "model_type" else None)
        out.append(FieldMapping(prefix + k, target, v))
    return out


def inspect_checkpoint(path: str | Path) -> ConversionReport:
    """The mapping report of a checkpoint folder, from ``config.json`` and the safetensors headers only."""
    from safetensors import safe_open

    root = Path(path).expanduser()
    raw = _read_config(root)
    fmt = _config_format(raw, root / "config.json")
    weight_files, pickles = _check_weight_files(root)
    cfg = check_checkpoint(root)  # config, missing / unexpected / mis-shaped tensors: one-line errors
    _, expected, files, sources = _plan(root)
    header: dict[str, tuple[tuple[int, ...], str]] = {}
    for f in sorted(set(files.values())):
        try:
            with safe_open(str(f), framework="pt") as sf:
                for n in sf.keys():
                    s = sf.get_slice(n)
                    header[n] = (tuple(s.get_shape()), str(s.get_dtype()))
        except Exception as e:  # noqa: BLE001 -- safetensors' errors do not name the file
            raise CheckpointError(f"{f}: not a readable safetensors file ({' '.join(str(e).split())})") from None
    tensors = [TensorMapping(k, src.names, src.kind, header[src.names[0]][0], header[src.names[0]][1])
               for k, src in sources.items()]
    used = {n for src in sources.values() for n in src.names}
    dropped: dict[str, list[str]] = {}
    if fmt == "release":
        from .k3_release import skip_reason

        for n in sorted(set(files) - used):
            dropped.setdefault(skip_reason(cfg, n) or "not part of the text model", []).append(n)
    weights = {*weight_files, INDEX_NAME}
    others = sorted(p.name for p in root.iterdir() if p.is_file() and p.name not in weights
                    and p.name != "config.json" and not p.name.endswith(PICKLE_SUFFIXES))
    mt = str(text_config_of(raw).get("model_type", raw.get("model_type"))) if fmt == "release" else \
        str(raw.get("model_type"))
    if fmt == "release" and raw.get("model_type") != mt:
        mt = f"{raw.get('model_type')} / {mt}"
    return ConversionReport(root, fmt, mt, cfg, _fields(raw, fmt), tensors, dropped, weight_files, others, pickles)


# ----------------------------------------------------------------------------- writing

def _out_dtype(src: Source, cfg: ModelConfig):
    """The dtype a converted tensor is written in: as stored, or the checkpoint's dtype for dequantised MXFP4
    (e2m1 values times a power of two: exact in bfloat16 and float32)."""
    import torch

    from .model import DTYPES

    if src.kind == "mxfp4":
        want = DTYPES.get(cfg.torch_dtype, torch.float32)
        return want if want in (torch.bfloat16, torch.float32) else torch.float32
    return None  # as stored


def convert_checkpoint(path: str | Path, out: str | Path, max_shard_bytes: int = DEFAULT_SHARD_BYTES,
                       report: ConversionReport | None = None) -> tuple[ConversionReport, bool]:
    """Write the zmrl-ready copy of ``path`` into ``out`` when something must change; (report, written)."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    report = report or inspect_checkpoint(path)
    if not report.changes:
        return report, False
    dst = Path(out).expanduser()
    if dst.resolve() == report.path.resolve():
        raise CheckpointError(f"--out {dst}: is the checkpoint folder itself; pick a new folder")
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise CheckpointError(f"--out {dst}: exists and is not an empty folder; pick a new folder")
    if max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes must be >= 1, got {max_shard_bytes}")
    cfg = report.config
    _, expected, files, sources = _plan(report.path)
    num_heads = cfg.linear_attn_config.num_heads
    dtypes = {t.target: t.dtype for t in report.tensors}
    # shard plan from the zmrl shapes and output dtypes, so that every shard name knows the shard count
    sizes = {}
    for k, src in sources.items():
        dt = _out_dtype(src, cfg)
        itemsize = dt.itemsize if dt is not None else _stored_itemsize(dtypes[k])
        n = 1
        for d in expected[k]:
            n *= d
        sizes[k] = n * itemsize
    shards: list[list[str]] = [[]]
    total = 0
    for k in sources:
        if shards[-1] and total + sizes[k] > max_shard_bytes:
            shards.append([])
            total = 0
        shards[-1].append(k)
        total += sizes[k]
    names = [WEIGHTS_NAME] if len(shards) == 1 else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                                                     for i in range(len(shards))]
    dst.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    handles: dict[Path, Any] = {}
    try:
        def read(name: str) -> torch.Tensor:
            f = files[name]
            if f not in handles:
                handles[f] = safe_open(str(f), framework="pt", device="cpu")
            return handles[f].get_tensor(name)

        for shard, fname in zip(shards, names):
            state = {}
            for k in shard:
                src = sources[k]
                t = convert_tensor(src, read, num_heads)
                dt = _out_dtype(src, cfg)
                if dt is not None and t.dtype != dt:
                    cast = t.to(dt)
                    if not torch.equal(cast.to(t.dtype), t):
                        raise CheckpointError(f"{'+'.join(src.names)}: not exact in {dt} (a bug: MXFP4 values are)")
                    t = cast
                if tuple(t.shape) != expected[k]:
                    raise CheckpointError(f"{'+'.join(src.names)}: converted shape {tuple(t.shape)} vs model "
                                          f"{expected[k]}")
                state[k] = t.contiguous()
                weight_map[k] = fname
            save_file(state, str(dst / fname), metadata={"format": "pt"})
            del state
    finally:
        handles.clear()
    if len(shards) > 1:
        (dst / INDEX_NAME).write_text(json.dumps({"metadata": {"converted_from": str(report.path)},
                                                  "weight_map": weight_map}, indent=2) + "\n")
    cfg.to_json(dst / "config.json")
    for name in report.copied_files:
        shutil.copy2(report.path / name, dst / name)
    check_checkpoint(dst)  # what was written reads back: names and shapes
    return report, True


def _stored_itemsize(dtype: str) -> int:
    sizes = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2, "U16": 2,
             "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
    return sizes.get(dtype.upper(), 4)


# ----------------------------------------------------------------------------- command line

def _size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B?)\s*", text, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 5GB, 500MB, 1000000)")
    unit = m.group(2).upper().rstrip("B").rstrip("I")
    n = int(float(m.group(1)) * {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}[unit])
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least one byte, got {text!r}")
    return n


def add_convert_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("path", help="checkpoint folder: config.json + *.safetensors (sharded with an index, or not)")
    p.add_argument("--out", help="write the zmrl-ready copy here when something must change (a new or empty folder)")
    p.add_argument("--max-shard-size", type=_size, default=DEFAULT_SHARD_BYTES, metavar="SIZE",
                   help="largest output shard (default 5GiB; e.g. 2GB, 500MB)")
    p.add_argument("--report-json", metavar="FILE", help="also write the full report (every tensor) as JSON")
    p.set_defaults(func=run_convert)
    return p


def add_convert_subcommand(sub) -> None:
    add_convert_arguments(sub.add_parser("convert", help=DESCRIPTION, description=DESCRIPTION))


def run_convert(args: argparse.Namespace) -> int:
    try:
        report = inspect_checkpoint(args.path)
        for line in report.lines():
            print(line)
        written = False
        if args.out:
            report, written = convert_checkpoint(args.path, args.out, args.max_shard_size, report)
        if args.report_json:
            Path(args.report_json).write_text(json.dumps(report.to_dict(), indent=1, default=str) + "\n")
    except (ConfigError, CheckpointError, ValueError, OSError) as e:
        print(f"zmrl convert: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    if written:
        print(f"wrote {args.out}: zmrl config.json + converted safetensors + {len(report.copied_files)} other file(s); "
              f"use model.path={args.out}")
    elif args.out:
        print(f"nothing written: model.path={args.path} works as it is")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = add_convert_arguments(argparse.ArgumentParser(prog="python -m zmrl.model.convert",
                                                           description=DESCRIPTION))
    return run_convert(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
