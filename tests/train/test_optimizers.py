"""The low-bit, Muon, GaLore and APOLLO optimizers on 2 gloo ranks: each trains, resumes exactly
at the same world size, and resumes at another (1 rank: the float32 states resharded, quantized
again; GaLore's / APOLLO's whole projected states loaded as they are).

One launch of 2 ranks trains every optimizer in turn (`train_configs`): run `a` 4 steps with a
checkpoint at 2, run `b` resumed from a's checkpoint-2; the 1-rank resumes run in this process.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from train_helpers import losses, train_configs, write_config

from helpers.dist import run_on_ranks
from shardforge.train import checkpointing as ckpt

pytestmark = pytest.mark.slow

OPTIMIZERS = [
    "adamw_torch_8bit",
    "adamw_torch_4bit",
    "adamw_bnb_8bit",
    "muon",
    "galore_adamw",
    "galore_adamw_8bit",
    "galore_adafactor",
    "apollo_adamw",
]
# GaLore/APOLLO: a projection of rank 4, renewed every 2 steps (at steps 1 and 3: a resume from
# checkpoint-2 renews it from the restored state)
_PROJECTED = {
    "optim_target_modules": ["self_attn", "mlp"],
    "optim_args": {"rank": 4, "update_proj_gap": 2},
}


def _configs(base: dict[str, Any], root: Path, name: str) -> dict[str, dict[str, Any]]:
    a = {
        **base,
        "optimizer": name,
        **(_PROJECTED if name.startswith(("galore", "apollo")) else {}),
        "max_steps": 4,
        "save_steps": 2,
        "warmup_steps": 1,
        "output_dir": str(root / name / "a"),
    }
    resumed = {"resume_from_checkpoint": str(root / name / "a" / "checkpoint-2")}
    return {
        "a": a,
        "b": {**a, **resumed, "output_dir": str(root / name / "b")},
        "c": {**a, **resumed, "output_dir": str(root / name / "c"), "micro_batch_size": 6},
    }


@pytest.fixture(scope="module")
def trained(base_cfg: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("optimizers")
    runs = []
    for name in OPTIMIZERS:
        (root / name).mkdir()
        for run, cfg in _configs(base_cfg, root, name).items():
            config = write_config(root / name / f"{run}.yml", cfg)
            if run != "c":
                runs.append((str(config), None))
    (root / "stores").mkdir()
    run_on_ranks(train_configs, 2, runs, str(root / "stores"))
    return root


def _train_here(config: Path) -> None:
    from shardforge.train.launch import do_train

    assert do_train(config, [], "python") == 0


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_trains_and_resumes_exactly_and_at_another_world_size(trained: Path, name: str) -> None:
    a, b = losses(trained / name / "a"), losses(trained / name / "b")
    assert sorted(a) == [1, 2, 3, 4] and a[4] < a[1]
    # at 2 ranks: the raw quantized states come back, so steps 3 and 4 are the same numbers
    assert sorted(b) == [3, 4] and b == {s: a[s] for s in (3, 4)}
    _train_here(trained / name / "c.yml")  # at 1 rank: the float32 states, quantized again
    c = losses(trained / name / "c")
    assert sorted(c) == [3, 4] and math.isclose(c[3], a[3], rel_tol=1e-5)
    assert math.isclose(c[4], a[4], rel_tol=2e-3), (c, a)
    state = ckpt.TrainerState.read(trained / name / "c" / "checkpoint-4")
    assert state.world_size == 1 and state.step == 4


def test_a_low_bit_checkpoint_holds_float32_states_and_each_ranks_raw_ones(trained: Path) -> None:
    """adamw_torch_4bit's checkpoint: float32 exp_avg of the parameter's full shape (any world
    size can load it) and the raw 4-bit codes of each of the 2 ranks."""
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(
        str(trained / "adamw_torch_4bit" / "a" / "checkpoint-2" / "optimizer")
    ).read_metadata()
    key = "state.model.layers.0.mlp.gate_proj.weight"
    full = meta.state_dict_metadata[f"{key}.exp_avg"]
    assert full.properties.dtype == torch.float32 and len(full.size) == 2  # type: ignore[union-attr]
    raw = [k for k in meta.state_dict_metadata if k.startswith(f"{key}.raw.exp_avg.codes")]
    assert sorted(raw) == [f"{key}.raw.exp_avg.codes.rank0", f"{key}.raw.exp_avg.codes.rank1"]


def test_a_galore_checkpoint_holds_the_projection_and_the_low_rank_states(trained: Path) -> None:
    """galore_adamw's checkpoint: a projected weight's projection (its orthogonal matrix, rank 4)
    and its AdamW states of the projected gradient's shape; an unprojected weight's states of
    its own shape."""
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(
        str(trained / "galore_adamw" / "a" / "checkpoint-2" / "optimizer")
    ).read_metadata()
    sizes = {k: list(v.size) for k, v in meta.state_dict_metadata.items() if hasattr(v, "size")}
    key = "state.model.layers.0.mlp.gate_proj.weight"  # [128, 64]: projected from the right
    assert sizes[f"{key}.projector.ortho_matrix"] == [4, 64]
    assert sizes[f"{key}.exp_avg"] == sizes[f"{key}.exp_avg_sq"] == [128, 4]
    assert sizes["state.model.embed_tokens.weight.exp_avg"] == [320, 64]  # not projected
