"""FSDP diagnostics: the first lines of a real 2-rank run (settings, FSDP units and shards per
rank, per-phase memory) and the warnings for a wrap that matches no block and for dtypes that
are not what mixed precision implies (real fully_shard on a 1-rank gloo group)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from train_helpers import launch_train, write_config

from shardforge.config import validate_cfg
from shardforge.train.diagnostics import (
    RankShards,
    dtype_warnings,
    report_sharding,
    sharding_warnings,
    wrap_warning,
)
from shardforge.train.model import build_meta_model, materialize_and_load, shard_model
from shardforge.train.runtime import Runtime, device_mesh, init_distributed

RANK_LINE = re.compile(
    r"^fsdp rank (\d): (\d+) FSDP units \((\d+) LlamaDecoderLayer \+ root\), (\d+) "
    r"activation-checkpointed blocks, local parameters ([\d.]+) MiB of ([\d.]+) MiB"
)
MEMORY_LINE = re.compile(
    r"^fsdp memory step (\d+): peak RSS MiB after forward / backward / optimizer step: "
    r"rank 0: (\d+) / (\d+) / (\d+); rank 1: (\d+) / (\d+) / (\d+)$"
)


def _base_parameters(base: Path) -> int:
    """Parameter elements of the base model, counted from its safetensors header."""
    raw = (base / "model.safetensors").read_bytes()
    header = json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])
    total = 0
    for name, entry in header.items():
        if name != "__metadata__":
            count = 1
            for dim in entry["shape"]:
                count *= dim
            total += count
    return total


def test_a_run_starts_with_the_sharding_and_logs_phase_memory(
    base_cfg: dict[str, Any], tmp_path: Path
) -> None:
    cfg = {
        **base_cfg,
        "output_dir": str(tmp_path / "out"),
        "fsdp": {"activation_checkpointing": True},  # the wrap from _no_split_modules
        "fsdp_diagnostics": True,
        "fsdp_diagnostics_steps": 2,
        "max_steps": 3,
        "save_steps": None,
    }
    lines = launch_train(write_config(tmp_path / "cfg.yml", cfg)).splitlines()
    layers = json.loads((Path(base_cfg["base_model"]) / "config.json").read_text())[
        "num_hidden_layers"
    ]

    settings = [line for line in lines if line.startswith("fsdp: ")]
    assert settings == [
        "fsdp: FULL_SHARD on 2 rank(s) (reshard_after_forward true, offload_params false); wrap "
        "LlamaDecoderLayer (the model's _no_split_modules); activation checkpointing on; mixed "
        "precision param_dtype none, reduce_dtype none (trainable parameters stored in float32); "
        "state_dict_type SHARDED_STATE_DICT"
    ]
    ranks = [m for line in lines if (m := RANK_LINE.match(line))]
    assert [int(m[1]) for m in ranks] == [0, 1]
    full = _base_parameters(Path(base_cfg["base_model"])) * 4 / 2**20  # float32
    for m in ranks:
        assert int(m[2]) == layers + 1 and int(m[3]) == layers  # the blocks plus the root
        assert int(m[4]) == layers  # every block recomputes its activations
        assert float(m[6]) == pytest.approx(full, abs=0.01)
    assert sum(float(m[5]) for m in ranks) == pytest.approx(full, abs=0.02)
    # the first lines of the run, before training starts
    first_step = next(i for i, line in enumerate(lines) if line.startswith("step 1/"))
    assert lines.index(settings[0]) < first_step

    memory = [m for line in lines if (m := MEMORY_LINE.match(line))]
    assert [int(m[1]) for m in memory] == [1, 2]  # fsdp_diagnostics_steps
    assert all(int(v) > 0 for m in memory for v in m.groups()[1:])
    assert not [line for line in lines if line.startswith("warning: fsdp")]


@pytest.fixture
def one_rank() -> Iterator[Runtime]:
    """A 1-rank gloo process group in this process (as `--launcher python` makes one)."""
    import torch.distributed as dist

    rt = init_distributed()
    try:
        yield rt
    finally:
        dist.destroy_process_group()


def _sharded(rt: Runtime, cfg: Any, dtype: torch.dtype | None = None) -> torch.nn.Module:
    model = build_meta_model(cfg)
    if dtype is not None:
        model = model.to(dtype)
    shard_model(model, cfg, device_mesh(rt, (1,)))
    materialize_and_load(model, cfg, rt.device, rt.rank)
    return model


def test_a_wrap_that_matches_no_block_is_a_warning(
    base_cfg: dict[str, Any], one_rank: Runtime, caplog: pytest.LogCaptureFixture
) -> None:
    """Classes the model has, but not its transformer blocks: a module without parameters
    leaves the whole model in the root unit; a part of each block leaves the rest of it there."""

    def cfg(*wrap: str) -> Any:
        return validate_cfg(
            {"base_model": base_cfg["base_model"], "fsdp": {"transformer_layer_cls_to_wrap": wrap}}
        )

    nothing = _sharded(one_rank, cfg("LlamaRotaryEmbedding"))
    warning = wrap_warning(nothing)
    assert warning is not None
    assert warning.startswith("fsdp: the wrap matched no block: the wrapped modules")
    assert "whole model is one FSDP unit" in warning and "(LlamaDecoderLayer)" in warning
    assert RankShards.of(nothing, 0).wrapped == {"LlamaRotaryEmbedding": 1}

    part = _sharded(one_rank, cfg("LlamaMLP"))
    warning = wrap_warning(part)
    assert warning is not None
    assert warning.startswith("fsdp: the wrap matched no transformer block (LlamaDecoderLayer)")
    assert "the units are LlamaMLP x2" in warning

    blocks = _sharded(one_rank, cfg("LlamaDecoderLayer"))
    assert sharding_warnings(blocks, cfg("LlamaDecoderLayer")) == []
    with caplog.at_level("INFO", logger="shardforge"):
        report_sharding(part, cfg("LlamaMLP"), one_rank, (1,))
    logged = [r.getMessage() for r in caplog.records]
    assert [m for m in logged if m.startswith("warning: fsdp: the wrap matched")] == [
        f"warning: {wrap_warning(part)}"
    ]
    assert any(m.startswith("fsdp rank 0: 3 FSDP units (2 LlamaMLP + root)") for m in logged)


def test_dtypes_unlike_mixed_precision_implies_are_warnings(
    base_cfg: dict[str, Any], one_rank: Runtime
) -> None:
    plain = validate_cfg({"base_model": base_cfg["base_model"]})
    bf16 = validate_cfg({"base_model": base_cfg["base_model"], "bf16": True})

    stored_bf16 = _sharded(one_rank, bf16, torch.bfloat16)
    warnings = dtype_warnings(stored_bf16, bf16)
    assert len(warnings) == 1
    assert (
        "stored in bfloat16; mixed precision (param_dtype bfloat16) implies float32"
        in (warnings[0])
    )

    # sharded without mixed precision, but the config asks for bf16: the policy did not apply
    fp32 = _sharded(one_rank, plain)
    assert dtype_warnings(fp32, plain) == []
    (warning,) = dtype_warnings(fp32, bf16)
    units = RankShards.of(fp32, 0).units
    assert warning == (
        f"fsdp: mixed precision did not apply to {units} of {units} FSDP units (their "
        "param_dtype none, reduce_dtype none; configured bfloat16, float32)"
    )
