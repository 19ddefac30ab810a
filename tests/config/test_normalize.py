from __future__ import annotations

import logging
from pathlib import Path

import pytest

from shardforge.config import load_cfg
from shardforge.config.normalize import normalize_axolotl
from shardforge.errors import ConfigError


def test_axolotl_list_and_prefixed_block(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    p = tmp_path / "cfg.yml"
    p.write_text(
        "base_model: m\n"
        "fsdp: [full_shard, auto_wrap]\n"
        "fsdp_config:\n"
        "  fsdp_version: 2\n"
        "  fsdp_offload_params: true\n"
        "  fsdp_transformer_layer_cls_to_wrap: LlamaDecoderLayer\n"
        "  fsdp_state_dict_type: FULL_STATE_DICT\n"
        "  fsdp_activation_checkpointing: true\n"
        "  fsdp_use_orig_params: false\n"
        "  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP\n"
    )
    with caplog.at_level(logging.DEBUG, logger="shardforge"):
        cfg = load_cfg(p)
    assert cfg.fsdp.offload_params is True
    assert cfg.fsdp.reshard_after_forward is True
    assert cfg.fsdp.transformer_layer_cls_to_wrap == ["LlamaDecoderLayer"]
    assert cfg.fsdp.state_dict_type == "FULL_STATE_DICT"
    assert cfg.fsdp.activation_checkpointing is True
    text = caplog.text
    assert "Axolotl list form" in text
    assert "fsdp_config (Axolotl spelling)" in text
    assert "fsdp_auto_wrap_policy, fsdp_use_orig_params" in text
    # how the spellings were read is a debug line (validate shows it), not a warning
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


def test_newer_axolotl_unprefixed_keys_and_top_level_version() -> None:
    data, notices, problems = normalize_axolotl(
        {
            "base_model": "m",
            "fsdp_version": 2,
            "fsdp_config": {"reshard_after_forward": False, "offload_params": True},
        }
    )
    assert data["fsdp"] == {
        "reshard_after_forward": False,
        "offload_params": True,
        "fsdp_version": 2,
    }
    assert "fsdp_config" not in data and "fsdp_version" not in data
    assert notices and not problems


def test_shard_grad_op_and_offload_options() -> None:
    data, _, problems = normalize_axolotl({"fsdp": "shard_grad_op offload auto_wrap"})
    assert data["fsdp"] == {"reshard_after_forward": False, "offload_params": True}
    assert problems == []


def test_native_block_is_left_alone() -> None:
    raw = {"base_model": "m", "fsdp": {"offload_params": True}}
    data, notices, problems = normalize_axolotl(raw)
    assert data == raw and notices == [] and problems == []


def test_unknown_option_and_unknown_prefixed_key_are_errors(tmp_path: Path) -> None:
    p = tmp_path / "cfg.yml"
    p.write_text(
        "base_model: m\nfsdp: [full_shard, sharded_magic]\nfsdp_config:\n  fsdp_ofload_params: true\n"
    )
    with pytest.raises(ConfigError) as info:
        load_cfg(p)
    problems = info.value.problems
    assert any("fsdp: unknown option 'sharded_magic'" in q for q in problems)
    assert "fsdp.ofload_params: unknown key; did you mean 'offload_params'?" in problems


@pytest.mark.parametrize(
    ("strategy", "reshard", "hybrid"),
    [
        ("FULL_SHARD", True, False),
        ("SHARD_GRAD_OP", False, False),
        ("HYBRID_SHARD", True, True),
        ("HYBRID_SHARD_ZERO2", False, True),
        (2, False, False),
    ],
)
def test_sharding_strategy_is_mapped_never_dropped(
    tmp_path: Path, strategy: object, reshard: bool, hybrid: bool
) -> None:
    p = tmp_path / "cfg.yml"
    p.write_text(f"base_model: m\nfsdp_config:\n  fsdp_sharding_strategy: {strategy}\n")
    cfg = load_cfg(p)
    assert cfg.fsdp.reshard_after_forward is reshard
    assert cfg.fsdp.hybrid_shard is hybrid


def test_hybrid_shard_list_option_and_no_shard(tmp_path: Path) -> None:
    p = tmp_path / "cfg.yml"
    p.write_text("base_model: m\nfsdp: [hybrid_shard, auto_wrap]\n")
    assert load_cfg(p).fsdp.hybrid_shard is True
    p.write_text("base_model: m\nfsdp_config:\n  fsdp_sharding_strategy: NO_SHARD\n")
    with pytest.raises(ConfigError, match="NO_SHARD"):
        load_cfg(p)
