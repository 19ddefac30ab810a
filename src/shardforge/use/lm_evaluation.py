"""`lm_evaluate`: lm-evaluation-harness over the trained model, in this process (Axolotl's
`lm-eval`, which runs the `lm_eval` command once per few-shot count and loads the model each
time): the weights picked as `inference` picks them and loaded once, handed to lm_eval's `HFLM`,
every task group run by `lm_eval.simple_evaluate`.

    from shardforge.config import load_cfg
    from shardforge.use.lm_evaluation import lm_evaluate
    out = lm_evaluate(load_cfg("cfg.yml"))    # out.results (lm_eval's), out.path, out.table

The config's keys are Axolotl's: `lm_eval_tasks` (`name` or `name:num_fewshot`; the tasks of
one few-shot count run together), `lm_eval_batch_size`, `lm_eval_model` (a model directory
instead of the run's own), `apply_chat_template`, `fewshot_as_multiturn`; and shardforge's
`lm_eval_include_path`, a folder of task YAML files (tasks without the hub). The results go to
`output_dir/lm_eval_results/results-<time>.json`, one JSON document for every group.
"""

from __future__ import annotations

import json
import logging
import os
from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from shardforge.config import coerce_cfg
from shardforge.config.schema import ShardforgeConfig, names_object_storage
from shardforge.errors import ConfigError, ShardforgeError
from shardforge.io.publish import atomic_file
from shardforge.use.model import Loaded, load_model, pick
from shardforge.use.request import ModelRequest

log = logging.getLogger("shardforge")

RESULTS_DIR = "lm_eval_results"
# what lm_eval's results hold per task; merged over the groups into one document
PER_TASK = (
    "results",
    "group_subtasks",
    "configs",
    "versions",
    "n-shot",
    "higher_is_better",
    "n-samples",
)


@dataclass(frozen=True)
class LmEvalResult:
    results: dict[str, Any]  # lm_eval's document: "results", "n-shot", "configs", ...
    path: Path | None  # where it was written (None: no output_dir to write to)
    table: str  # lm_eval's summary table (markdown)


def task_groups(tasks: list[str]) -> dict[int | None, list[str]]:
    """`name` or `name:num_fewshot` entries, grouped by few-shot count (None: the task's own)."""
    out: dict[int | None, list[str]] = defaultdict(list)
    for i, entry in enumerate(tasks):
        name, _, shots = entry.partition(":")
        if not name.strip() or (shots and not shots.strip().isdigit()):
            raise ConfigError(
                f"lm_eval_tasks[{i}]",
                [f"{entry!r}: expected a task name or name:num_fewshot (e.g. hellaswag:10)"],
            )
        out[int(shots) if shots else None].append(name.strip())
    return dict(out)


def import_lm_eval() -> Any:
    """lm_eval; one error line naming the extra where it is not installed."""
    try:
        import lm_eval
    except ImportError:
        raise ShardforgeError(
            "lm-eval needs lm-evaluation-harness, which is not installed: pip install "
            "'shardforge[eval]'"
        ) from None
    return lm_eval


def _check(cfg: ShardforgeConfig) -> dict[int | None, list[str]]:
    if not cfg.lm_eval_tasks:
        raise ConfigError(
            "lm_eval_tasks", ["no tasks: list them (e.g. lm_eval_tasks: [hellaswag, arc_easy:25])"]
        )
    if cfg.fewshot_as_multiturn and not cfg.apply_chat_template:
        raise ConfigError(
            "fewshot_as_multiturn", ["the few-shot turns need apply_chat_template: true"]
        )
    path = cfg.lm_eval_include_path
    if path is not None and not Path(path).is_dir():
        raise ConfigError("lm_eval_include_path", [f"{path}: no such folder of task YAML files"])
    return task_groups(cfg.lm_eval_tasks)


def task_manager(lm_eval: Any, include: str | None, names: list[str]) -> Any:
    """lm_eval's task index: the local folder alone where it holds every task asked for (no
    scan of lm_eval's thousands of task files), else with lm_eval's own tasks too."""
    from lm_eval.tasks import TaskManager

    if include is not None:
        local = TaskManager(include_path=include, include_defaults=False)
        if all(n in local.all_tasks for n in names):
            return local
    manager = TaskManager(include_path=include)
    unknown = [n for n in names if n not in manager.all_tasks]
    if unknown:
        raise ConfigError(
            "lm_eval_tasks",
            [f"unknown task {', '.join(unknown)}: neither lm_eval's nor in lm_eval_include_path"],
        )
    return manager


def _merge(groups: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {key: {} for key in PER_TASK}
    for one in groups:
        for key in PER_TASK:
            out[key].update(one.get(key) or {})
    first = groups[0]
    for key, value in first.items():
        if key not in PER_TASK and key != "samples":
            out[key] = value
    return out


def _write(cfg: ShardforgeConfig, results: dict[str, Any]) -> Path | None:
    if names_object_storage(cfg.output_dir):
        log.warning("output_dir is object storage: the lm-eval results are printed only")
        return None
    folder = Path(cfg.output_dir) / RESULTS_DIR
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"results-{datetime.now().strftime('%Y%m%d-%H%M%S-%f')}.json"
    text = json.dumps(results, indent=2, default=str, ensure_ascii=False) + "\n"
    with atomic_file(path) as tmp:
        (tmp / path.name).write_text(text, encoding="utf-8")
    return path


def run_groups(
    lm_eval: Any, loaded: Loaded, cfg: ShardforgeConfig, groups: dict[int | None, list[str]]
) -> list[dict[str, Any]]:
    """lm_eval.simple_evaluate for each few-shot group, over the one loaded model."""
    from lm_eval.models.huggingface import HFLM

    names = [n for tasks in groups.values() for n in tasks]
    manager = task_manager(lm_eval, cfg.lm_eval_include_path, names)
    model = HFLM(
        pretrained=loaded.model,
        tokenizer=loaded.tokenizer,
        batch_size=cfg.lm_eval_batch_size or 1,
        device=str(loaded.device),
    )
    out = []
    for shots, tasks in groups.items():
        log.info(
            "lm-eval: %s (%s)",
            ", ".join(tasks),
            "default shots" if shots is None else f"{shots}-shot",
        )
        one = lm_eval.simple_evaluate(
            model=model,
            tasks=tasks,
            num_fewshot=shots,
            batch_size=cfg.lm_eval_batch_size,
            task_manager=manager,
            apply_chat_template=cfg.apply_chat_template,
            fewshot_as_multiturn=cfg.fewshot_as_multiturn,
            log_samples=False,
            random_seed=cfg.seed,
        )
        if one is None:  # not rank 0 of a distributed lm_eval: never here
            raise ShardforgeError("lm_eval returned no results")
        out.append(one)
    return out


def lm_evaluate(cfg: Any, named_base: bool = False, **options: Any) -> LmEvalResult:
    """Run the config's lm_eval_tasks over the weights `options` name (`ModelRequest`'s fields;
    none: lm_eval_model, else as `inference` picks them); the results written under
    output_dir/lm_eval_results/ and lm_eval's summary table."""
    config = coerce_cfg(cfg)
    groups = _check(config)
    if config.lm_eval_model is not None and not options:
        options = {"model_dir": config.lm_eval_model}
    picked = pick(config, ModelRequest(**options), named_base)
    lm_eval = import_lm_eval()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    loaded = load_model(config, picked)
    results = _merge(run_groups(lm_eval, loaded, config, groups))
    from lm_eval.utils import make_table

    path = _write(config, results)
    if path is not None:
        log.info("lm-eval results: %s", path)
    return LmEvalResult(results, path, make_table(results))
