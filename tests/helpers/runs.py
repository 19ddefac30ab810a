"""Trained runs of the tiny example, built once per test session (`shared_folder`) for the tests of
`inference` and `evaluate`, which only read them:

    full/       examples/tiny-llama.yml, 4 steps on 2 gloo ranks (torchrun), val_set_size 0.1,
                evaluated every 2 steps, checkpoint-2 and checkpoint-4; config full.yml
    merged/     checkpoint-4 merged by `merge_fsdp_weights` (the example's merged output)
    lora/       the same with a LoRA adapter, 2 steps on 1 rank (in this process): the adapter
                in lora/ and checkpoint-2; config lora.yml
    fused/      that adapter fused into the base model by `merge_lora`

Tests that use it start child processes (the build's torchrun): mark them slow.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from helpers.shared import shared_folder

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "tiny-llama.yml"
# what the runs change in the example: short, evaluated, checkpointed at 2 and 4
EVALUATED = {"max_steps": 4, "save_steps": 2, "val_set_size": 0.1, "eval_steps": 2}
LORA = {
    "adapter": "lora",
    "lora_r": 4,
    "lora_alpha": 8,
    "lora_dropout": 0.0,
    "lora_target_linear": True,
    "max_steps": 2,
    "warmup_steps": 0,  # Axolotl's default warmup would make the first of two steps lr 0
}


@dataclass(frozen=True)
class Runs:
    root: Path

    @property
    def full_cfg(self) -> Path:
        return self.root / "full.yml"

    @property
    def lora_cfg(self) -> Path:
        return self.root / "lora.yml"

    @property
    def merged(self) -> Path:
        return self.root / "merged"

    @property
    def fused(self) -> Path:
        return self.root / "fused"

    def evals(self, run: str) -> dict[int, dict[str, Any]]:
        """The eval rows `train` logged for run `full` or `lora`, by step."""
        import json

        lines = (self.root / run / "metrics.jsonl").read_text().splitlines()
        rows = [json.loads(line) for line in lines if line.strip()]
        return {r["step"]: r for r in rows if "eval_loss" in r}


def _config(root: Path, name: str, **changes: Any) -> Path:
    data = yaml.safe_load(EXAMPLE.read_text())
    data["base_model"] = str(ROOT / data["base_model"])
    for ds in data["datasets"]:
        ds["path"] = str(ROOT / ds["path"])
    path = root / f"{name}.yml"
    path.write_text(yaml.safe_dump({**data, **changes, "output_dir": str(root / name)}))
    return path


def _build(root: Path) -> None:
    from shardforge.config import load_cfg
    from shardforge.merge.api import merge_fsdp_weights
    from shardforge.merge.lora import merge_lora
    from shardforge.train.launch import LaunchOptions, do_train

    root.mkdir(parents=True)
    full = _config(root, "full", **EVALUATED)
    assert do_train(full, [], "torchrun", LaunchOptions(nproc_per_node=2)) == 0
    merge_fsdp_weights(load_cfg(full, command="merge"), root / "merged", quiet=True)
    lora = _config(root, "lora", **{**EVALUATED, **LORA})
    assert do_train(lora, [], "python") == 0
    merge_lora(load_cfg(lora, command="merge"), root / "fused", quiet=True)


def trained_runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    return Runs(shared_folder(tmp_path_factory, "use-runs", _build))
