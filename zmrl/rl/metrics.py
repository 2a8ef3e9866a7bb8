"""Per-step metrics: a local JSONL history, wandb (offline by default), and the HTML dashboard.

One record per ``log`` call, one JSON object per line of ``run_dir/metrics.jsonl``::

    {"step": 12, "time": 1732900000.5, "reward/mean": 0.41, "mismatch/kl_k3": 0.0, ...}

Each line is flushed as it is written, so a killed run keeps its history up to the last
completed step. Several ``log`` calls may share one step (e.g. training metrics, then eval
metrics for the same step); readers merge them, later values winning. Non-finite floats are
written as Python's json does (``NaN``, ``Infinity``), which ``read_metrics`` reads back.

Files under ``run_dir``::

    metrics.jsonl    the history (source of truth for the dashboard)
    run.json         project, run name, config, start time, wandb run id (kept on resume, so wandb
                     continues the same run); read by the dashboard header
    dashboard.html   self-contained dashboard, rebuilt every ``dashboard_every`` steps
    wandb/           wandb's offline run files (``wandb sync run_dir/wandb/offline-run-*``)
"""
from __future__ import annotations

import json
import logging
import numbers
import os
import time
from pathlib import Path
from typing import Any, Mapping

from .run_files import METRICS_FILE, RUN_FILE, read_metrics

logger = logging.getLogger(__name__)

WANDB_MODES = ("offline", "online", "disabled")

_warned_no_wandb = False


def _scalar(value: Any) -> float | int | bool | str | None:
    """A JSON-able scalar from a python/numpy/torch scalar; ``None`` when ``value`` isn't one."""
    if isinstance(value, (bool, str)):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    item = getattr(value, "item", None)  # numpy scalars, 0-d arrays, one-element tensors
    size = getattr(value, "numel", None) or getattr(value, "size", None)
    size = size() if callable(size) else size
    if callable(item) and size == 1:
        return _scalar(item())
    return None


class MetricsLogger:
    """Append-only per-step metrics log with optional wandb forwarding and a live HTML dashboard.

    Args:
        run_dir: directory of the run (created). Re-using it appends to the existing history;
            call ``truncate_from(step)`` (or pass ``resume_step``) when resuming from a checkpoint
            so that steps redone after the checkpoint are not duplicated.
        project, run_name, config: passed to wandb and recorded in ``run_dir/run.json``.
        wandb_mode: ``"offline"`` (no network, files under ``run_dir/wandb/``), ``"online"`` or
            ``"disabled"``. ``None`` reads ``$WANDB_MODE`` and falls back to ``"offline"``.
        dashboard_every: rebuild ``run_dir/dashboard.html`` after every this many ``log`` calls
            (0 = only on ``close``).
        resume_step: if given, drop records with ``step >= resume_step`` before logging.
    """

    def __init__(self, run_dir: str | os.PathLike, project: str = "zmrl", run_name: str | None = None,
                 config: Mapping[str, Any] | None = None, wandb_mode: str | None = None,
                 dashboard_every: int = 1, resume_step: int | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / METRICS_FILE
        self.project = project
        self.run_name = run_name or self.run_dir.resolve().name
        self.config = dict(config or {})
        mode = wandb_mode if wandb_mode is not None else os.environ.get("WANDB_MODE", "offline")
        mode = {"dryrun": "offline", "run": "online"}.get(mode, mode)  # wandb's legacy spellings
        if mode not in WANDB_MODES:
            raise ValueError(f"wandb_mode must be one of {WANDB_MODES}, got {mode!r}")
        self.wandb_mode = mode
        self.dashboard_every = int(dashboard_every)
        self._n_logged = 0
        self._closed = False
        self._warned_keys: set[str] = set()

        self._repair_tail()
        if resume_step is not None:
            self.truncate_from(resume_step)
        self._fh = open(self.path, "a", encoding="utf-8")
        self._write_run_info()
        self._wandb_run = self._init_wandb() if mode != "disabled" else None

    # ------------------------------------------------------------------ history file
    def _repair_tail(self) -> None:
        """Cut a partial last line (killed mid-write) so the next append starts on a fresh line."""
        if not self.path.exists():
            return
        data = self.path.read_bytes()
        if not data or data.endswith(b"\n"):
            return
        good = data.rfind(b"\n") + 1
        tail = data[good:]
        try:  # a complete record that only lacks its newline is kept
            json.loads(tail)
            keep = data + b"\n"
        except ValueError:
            keep = data[:good]
        self._atomic_write(keep)

    def _atomic_write(self, data: bytes) -> None:
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, self.path)

    def truncate_from(self, step: int) -> int:
        """Drop every record with ``step >= step``; returns how many were dropped.

        ``step`` is the first step the resumed run will log again: if the checkpoint was saved
        after logging step ``N`` (records labelled with completed steps), pass ``N + 1`` so step
        ``N`` is kept. Safe to call while the logger is open; later ``log`` calls append.
        """
        if not self.path.exists():
            return 0
        records = read_metrics(self.run_dir)
        kept = [r for r in records if not (isinstance(r.get("step"), (int, float)) and r["step"] >= step)]
        fh = getattr(self, "_fh", None)
        if fh is not None:
            fh.close()
        self._atomic_write("".join(json.dumps(r) + "\n" for r in kept).encode("utf-8"))
        if fh is not None:
            self._fh = open(self.path, "a", encoding="utf-8")
        return len(records) - len(kept)

    def _write_run_info(self) -> None:
        path = self.run_dir / RUN_FILE
        started = time.time()
        try:
            previous = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            previous = {}
        if not isinstance(previous, dict):
            previous = {}
        try:  # on resume keep when the run first started
            started = float(previous["started"])
        except (KeyError, TypeError, ValueError):
            pass
        # One wandb run id per run folder, kept across resumes: wandb then continues the same run.
        wandb_id = previous.get("wandb_id")
        if not (isinstance(wandb_id, str) and wandb_id.isalnum()):
            import uuid

            wandb_id = uuid.uuid4().hex[:12]
        self.wandb_id = wandb_id
        self.resumed = bool(previous)
        info = {"project": self.project, "run_name": self.run_name, "started": started, "wandb_id": wandb_id,
                "wandb_mode": self.wandb_mode, "config": self.config}
        try:
            text = json.dumps(info, indent=2, default=str)
        except (TypeError, ValueError):  # a config json can't express (e.g. circular): keep the rest
            info["config"] = repr(self.config)
            text = json.dumps(info, indent=2)
        path.write_text(text + "\n", encoding="utf-8")

    # ------------------------------------------------------------------ wandb
    def _init_wandb(self) -> Any:
        global _warned_no_wandb
        try:
            import wandb  # lazy: heavy import, and optional
        except ImportError:
            if not _warned_no_wandb:
                logger.warning("wandb is not installed; metrics go to %s only", self.path)
                _warned_no_wandb = True
            return None
        os.environ["WANDB_DIR"] = str(self.run_dir)  # also where wandb puts its own caches/logs
        os.environ.setdefault("WANDB_SILENT", "true")
        try:
            settings = wandb.Settings(silent=True, console="off")
            return wandb.init(project=self.project, name=self.run_name, config=self.config,
                              dir=str(self.run_dir), mode=self.wandb_mode, settings=settings,
                              id=self.wandb_id, resume="allow",
                              reinit="create_new")
        except Exception as exc:  # a logging backend must never take the training run down
            logger.warning("wandb.init failed (%s: %s); metrics go to %s only",
                           type(exc).__name__, exc, self.path)
            return None

    # ------------------------------------------------------------------ logging
    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        """Append ``{"step": step, "time": now, **metrics}`` (scalars only) and forward it.

        Values may be python/numpy/torch scalars; anything else is skipped with a one-time warning.
        """
        if self._closed:
            raise RuntimeError("MetricsLogger.log after close()")
        record: dict[str, Any] = {"step": int(step), "time": time.time()}
        for key, value in metrics.items():
            if key == "step":
                continue
            v = _scalar(value)
            if v is None:
                if key not in self._warned_keys:
                    logger.warning("metric %r is not a scalar (%s); not logged", key, type(value).__name__)
                    self._warned_keys.add(key)
                continue
            record[str(key)] = v
        self._fh.write(json.dumps(record) + "\n")
        self._fh.flush()

        if self._wandb_run is not None:
            payload = {k: v for k, v in record.items() if k not in ("step", "time")}
            try:
                self._wandb_run.log(payload, step=int(step))
            except Exception as exc:
                logger.warning("wandb log failed (%s: %s); disabling wandb for this run", type(exc).__name__, exc)
                self._wandb_run = None

        self._n_logged += 1
        if self.dashboard_every > 0 and self._n_logged % self.dashboard_every == 0:
            self.rebuild_dashboard(live=True)

    def rebuild_dashboard(self, live: bool = False) -> Path | None:
        """Write ``run_dir/dashboard.html``; failures are logged, never raised (it's a side view)."""
        from .dashboard import build_dashboard

        try:
            return build_dashboard(self.run_dir, live=live)
        except Exception as exc:
            logger.warning("dashboard rebuild failed (%s: %s)", type(exc).__name__, exc)
            return None

    def close(self) -> None:
        """Flush and close the history, finish the wandb run, write the final dashboard."""
        if self._closed:
            return
        self._closed = True
        self._fh.close()
        if self._wandb_run is not None:
            try:
                self._wandb_run.finish()
            except Exception as exc:
                logger.warning("wandb finish failed (%s: %s)", type(exc).__name__, exc)
            self._wandb_run = None
        self.rebuild_dashboard(live=False)

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

