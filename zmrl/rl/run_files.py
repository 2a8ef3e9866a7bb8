"""The files of a run folder (``trainer.out_dir``) and how to read them; shared by the metrics logger,
the dashboard and the loop, so that none of them imports another to find a file.

::

    metrics.jsonl    one JSON record per log call: {"step": 12, "time": ..., "reward/mean": 0.41, ...}
    run.json         project, run name, config, start time, wandb run id
    status.json      running | finished | failed | interrupted, the last step, when, why (the loop writes it)
    dashboard.html   the self-contained dashboard
    recipe.json      the recipe the run was started with
    checkpoints/     step_N/ folders and ``latest``
    wandb/           wandb's offline files
"""
from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
RUN_FILE = "run.json"
STATUS_FILE = "status.json"
DASHBOARD_FILE = "dashboard.html"
RECIPE_FILE = "recipe.json"
CHECKPOINTS_DIR = "checkpoints"
WANDB_DIR = "wandb"
# Everything a run writes (trainer.overwrite=true deletes exactly these).
RUN_FILES = (METRICS_FILE, METRICS_FILE + ".tmp", RUN_FILE, STATUS_FILE, STATUS_FILE + ".tmp", RECIPE_FILE,
             DASHBOARD_FILE, DASHBOARD_FILE + ".tmp", CHECKPOINTS_DIR, WANDB_DIR)

RUN_STATES = ("running", "finished", "failed", "interrupted")


def _parse_lines(text: str, path: Path) -> tuple[list[dict], int]:
    """Records of a JSONL text, and the byte length of its complete lines (those ending in a newline).

    A final fragment without a newline (a run killed mid-write) is returned as a record when it
    happens to be valid JSON and dropped otherwise; malformed complete lines are skipped with a
    warning (someone edited the file).
    """
    records: list[dict] = []
    *complete, fragment = text.split("\n")
    good_bytes = sum(len(line.encode()) + 1 for line in complete)
    for i, line in enumerate(complete + [fragment]):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            rec = None
        if not isinstance(rec, dict) or "step" not in rec:
            if i < len(complete):
                logger.warning("%s: skipping malformed line %d", path, i + 1)
            continue
        records.append(rec)
    return records, good_bytes


def read_metrics(run_dir: str | os.PathLike) -> list[dict]:
    """All records of ``run_dir/metrics.jsonl`` in file order; a truncated last line is dropped.

    Raises ``FileNotFoundError`` when the file is missing.
    """
    path = Path(run_dir) / METRICS_FILE
    records, _ = _parse_lines(path.read_text(encoding="utf-8", errors="replace"), path)
    return records


@dataclass
class RunStatus:
    """What the loop says about its run: ``state`` is one of ``RUN_STATES``; ``step`` the last completed
    step; ``updated`` a unix time; ``message`` why it failed or how to resume; ``pid`` the writer."""

    state: str
    step: int = 0
    total_steps: int = 0
    updated: float = 0.0
    message: str = ""
    pid: int = 0

    def is_stale(self, now: float | None = None, max_age_s: float = 3600.0) -> bool:
        """A "running" status whose process is gone (same host) or silent for ``max_age_s``: the run
        died without saying so (killed with SIGKILL, machine lost)."""
        if self.state != "running":
            return False
        if self.pid and self.pid != os.getpid():
            try:
                os.kill(self.pid, 0)
            except ProcessLookupError:
                return True
            except PermissionError:
                pass
        return (now if now is not None else time.time()) - self.updated > max_age_s


def write_status(run_dir: str | os.PathLike, status: RunStatus) -> None:
    """Replace ``run_dir/status.json`` atomically (a reader never sees half a file)."""
    path = Path(run_dir) / STATUS_FILE
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(asdict(status), indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def read_status(run_dir: str | os.PathLike) -> RunStatus | None:
    """The run's status, or None when it has none (a run of an older zmrl, or not started)."""
    try:
        data = json.loads((Path(run_dir) / STATUS_FILE).read_text(encoding="utf-8"))
        if data.get("state") not in RUN_STATES:
            return None
        return RunStatus(**{k: data[k] for k in RunStatus.__dataclass_fields__ if k in data})
    except (OSError, ValueError, TypeError, AttributeError):
        return None
