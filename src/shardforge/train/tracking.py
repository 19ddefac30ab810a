"""Where the metrics of a run go: output_dir/metrics.jsonl, TensorBoard, Weights & Biases.

Rank 0 opens one `Tracker` per row of `TRACKERS` that the config turns on; the loop hands every
metrics row (a training step, an evaluation) to all of them. A resumed run continues each one
from the step it resumed at, so the steps redone after a crash are not recorded twice:

    metrics.jsonl   the rows after the resumed step are dropped (the file is rewritten, then
                    appended to); the redone steps are written again
    TensorBoard     the writer starts with purge_step = resumed step + 1, which makes
                    TensorBoard drop the earlier events of the redone steps
    W&B             the same run id (output_dir/tracking.json) with resume="allow"; W&B keeps
                    the steps it has, so the redone steps it already holds are not sent again

TensorBoard and W&B are optional packages (`pip install 'shardforge[tracking]'`), imported only
when a config asks for them.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from shardforge.config.schema import ShardforgeConfig
from shardforge.errors import ConfigError

log = logging.getLogger("shardforge")

METRICS_FILE = "metrics.jsonl"
TRACKING_FILE = "tracking.json"  # the W&B run id, so that a resumed run continues it
TENSORBOARD_DIR = "runs"
TENSORBOARD_DIR_ENV = "TENSORBOARD_LOGGING_DIR"  # as transformers' TensorBoardCallback
INSTALL_HINT = "pip install 'shardforge[tracking]'"

# metrics row key -> the name TensorBoard and W&B show (the Hugging Face Trainer's names)
TAGS: dict[str, str] = {
    "loss": "train/loss",
    "lr": "train/learning_rate",
    "grad_norm": "train/grad_norm",
    "tokens_per_s": "train/tokens_per_second",
    "peak_memory_mib": "train/peak_memory_mib",
    "epoch": "train/epoch",
    "eval_loss": "eval/loss",
    "eval_perplexity": "eval/perplexity",
}


def scalars(row: Mapping[str, Any]) -> dict[str, float]:
    """The row's values under their tracker names (only those in TAGS)."""
    return {TAGS[k]: float(v) for k, v in row.items() if k in TAGS and v is not None}


@dataclass(frozen=True)
class Start:
    """Where the trackers begin: step 0 of a fresh run, or the step a run resumed at;
    `last_logged` is the last step the run logged before it stopped."""

    step: int = 0
    resumed: bool = False
    last_logged: int = 0


class Tracker(Protocol):
    def log(self, step: int, row: Mapping[str, Any]) -> None: ...

    def flush(self) -> None: ...

    def close(self, failed: bool = False) -> None: ...


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of a metrics.jsonl file; a line cut off by a crash is skipped."""
    rows = []
    with contextlib.suppress(FileNotFoundError):
        for line in path.read_text(encoding="utf-8").splitlines():
            with contextlib.suppress(json.JSONDecodeError):
                row = json.loads(line)
                if isinstance(row, dict) and isinstance(row.get("step"), int):
                    rows.append(row)
    return rows


def trim_metrics(path: Path, step: int) -> int:
    """Keep only the rows up to `step` (rewritten atomically); return the last step the file
    held before."""
    rows = read_rows(path)
    last = max((r["step"] for r in rows), default=0)
    kept = "".join(json.dumps(r) + "\n" for r in rows if r["step"] <= step)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(kept, encoding="utf-8")
    os.replace(tmp, path)
    return last


class MetricsFile:
    """output_dir/metrics.jsonl: one JSON object per row, flushed at once."""

    def __init__(self, path: Path, append: bool) -> None:
        self.file = path.open("a" if append else "w", encoding="utf-8")

    @classmethod
    def open(cls, cfg: ShardforgeConfig, out: Path, start: Start) -> MetricsFile:
        return cls(out / METRICS_FILE, append=start.resumed)

    def log(self, step: int, row: Mapping[str, Any]) -> None:
        self.file.write(json.dumps(dict(row)) + "\n")
        self.file.flush()

    def flush(self) -> None:
        self.file.flush()

    def close(self, failed: bool = False) -> None:
        self.file.close()


class TensorBoard:
    """Event files under output_dir/runs (or $TENSORBOARD_LOGGING_DIR)."""

    def __init__(self, writer: Any) -> None:
        self.writer = writer

    @classmethod
    def open(cls, cfg: ShardforgeConfig, out: Path, start: Start) -> TensorBoard:
        from torch.utils.tensorboard import SummaryWriter

        logdir = os.environ.get(TENSORBOARD_DIR_ENV) or str(out / TENSORBOARD_DIR)
        # purge_step: TensorBoard hides the earlier events of every step from here on
        purge = start.step + 1 if start.resumed else 0
        return cls(SummaryWriter(log_dir=logdir, purge_step=purge, flush_secs=10))

    def log(self, step: int, row: Mapping[str, Any]) -> None:
        for tag, value in scalars(row).items():
            self.writer.add_scalar(tag, value, step)

    def flush(self) -> None:
        self.writer.flush()

    def close(self, failed: bool = False) -> None:
        self.writer.close()


def wandb_run_id(cfg: ShardforgeConfig, out: Path, start: Start) -> str:
    """wandb_run_id, else $WANDB_RUN_ID, else (resuming) the id kept in tracking.json, else a
    new one; kept in tracking.json."""
    path = out / TRACKING_FILE
    kept: dict[str, Any] = {}
    with contextlib.suppress(FileNotFoundError, json.JSONDecodeError):
        loaded = json.loads(path.read_text(encoding="utf-8"))
        kept = loaded if isinstance(loaded, dict) else {}
    run_id = cfg.wandb_run_id or os.environ.get("WANDB_RUN_ID")
    if not run_id and start.resumed and isinstance(kept.get("wandb_run_id"), str):
        run_id = kept["wandb_run_id"]
    if not run_id:
        run_id = secrets.token_hex(4)  # W&B's own ids are 8 characters of [a-z0-9] too
    if kept.get("wandb_run_id") != run_id:
        path.write_text(json.dumps({**kept, "wandb_run_id": run_id}) + "\n", encoding="utf-8")
    return run_id


class WandB:
    """A Weights & Biases run; with wandb_mode: offline it is written under output_dir/wandb
    (or $WANDB_DIR) without any network access, for `wandb sync` later."""

    def __init__(self, run: Any, skip_through: int) -> None:
        self.run = run
        self.skip_through = skip_through

    @classmethod
    def open(cls, cfg: ShardforgeConfig, out: Path, start: Start) -> WandB:
        import wandb

        kwargs: dict[str, Any] = {
            "project": cfg.wandb_project,
            "entity": cfg.wandb_entity,
            "name": cfg.wandb_name,
            "id": wandb_run_id(cfg, out, start),
            "resume": "allow",
            "config": cfg.model_dump(mode="json"),
            # the training log stays on the terminal; W&B does not wrap stdout/stderr
            "settings": wandb.Settings(console="off"),
        }
        if cfg.wandb_mode is not None:
            kwargs["mode"] = cfg.wandb_mode
        if not os.environ.get("WANDB_DIR"):
            kwargs["dir"] = str(out)
        try:
            run = wandb.init(**kwargs)
        except Exception as exc:  # wandb's errors (login, network, settings) have no common base
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise ConfigError(
                "wandb_project",
                [
                    f"W&B could not start a run ({first}); run `wandb login`, or set "
                    "wandb_mode: offline"
                ],
            ) from None
        # resumed: the steps W&B already holds stay as they are (its steps only increase)
        return cls(run, start.last_logged if start.resumed else -1)

    def log(self, step: int, row: Mapping[str, Any]) -> None:
        if step > self.skip_through:
            self.run.log(scalars(row), step=step)

    def flush(self) -> None:
        pass  # the W&B service writes on its own

    def close(self, failed: bool = False) -> None:
        self.run.finish(exit_code=1 if failed else 0)


@dataclass(frozen=True)
class TrackerKind:
    """One row of the tracker table: what turns it on, what it needs, how it opens."""

    name: str
    key: str  # the config key that asks for it ("": always on)
    package: str | None  # the module it imports (None: nothing to install)
    wanted: Callable[[ShardforgeConfig], bool]
    open: Callable[[ShardforgeConfig, Path, Start], Tracker]


TRACKERS: tuple[TrackerKind, ...] = (
    TrackerKind(METRICS_FILE, "", None, lambda cfg: True, MetricsFile.open),
    TrackerKind(
        "tensorboard",
        "use_tensorboard",
        "tensorboard",
        lambda cfg: cfg.use_tensorboard,
        TensorBoard.open,
    ),
    TrackerKind(
        "wandb",
        "wandb_project",
        "wandb",
        lambda cfg: bool(cfg.wandb_project) and cfg.wandb_mode != "disabled",
        WandB.open,
    ),
)


def installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


def check_trackers(
    cfg: ShardforgeConfig, kinds: tuple[TrackerKind, ...] = TRACKERS
) -> list[tuple[str, str]]:
    """(key, problem) for each tracker the config asks for whose package is not installed."""
    return [
        (kind.key, f"{kind.name} is not installed; {INSTALL_HINT}")
        for kind in kinds
        if kind.wanted(cfg) and kind.package is not None and not installed(kind.package)
    ]


class Trackers:
    """Every tracker of this rank (none but on rank 0): each row goes to all of them."""

    def __init__(self, trackers: list[Tracker]) -> None:
        self.trackers = trackers

    def log(self, row: Mapping[str, Any]) -> None:
        for tracker in self.trackers:
            tracker.log(int(row["step"]), row)

    def flush(self) -> None:
        for tracker in self.trackers:
            tracker.flush()

    def close(self, failed: bool = False) -> None:
        for tracker in self.trackers:
            tracker.close(failed)
        self.trackers = []


def open_trackers(
    cfg: ShardforgeConfig,
    out: Path,
    is_main: bool,
    resumed_step: int | None,
    kinds: tuple[TrackerKind, ...] = TRACKERS,
) -> Trackers:
    """Rank 0: the trackers the config asks for, continuing from `resumed_step` (None: a fresh
    run). Other ranks: none."""
    if not is_main:
        return Trackers([])
    problems = check_trackers(cfg, kinds)
    if problems:
        key, problem = problems[0]
        raise ConfigError(key, [problem])
    start = Start()
    if resumed_step is not None:
        last = trim_metrics(out / METRICS_FILE, resumed_step)
        start = Start(resumed_step, True, last)
    opened = Trackers([])
    try:
        for kind in kinds:
            if kind.wanted(cfg):
                opened.trackers.append(kind.open(cfg, out, start))
    except BaseException:
        opened.close(failed=True)
        raise
    return opened
