"""Axolotl configs per command: every key of Axolotl's schema is implemented, ignored or refused
by name; a near miss of a known key is an error with a suggestion of the same level, any other
key of neither schema is ignored (as Axolotl ignores it); the docs table is the code's table;
the corpus of Axolotl-shaped configs loads as each command expects."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
import yaml

from helpers.corpus import corpus, expectation, materialize
from shardforge.config import load_cfg
from shardforge.config.axolotl import (
    COMMAND_KEYS,
    compatibility_table,
    known_top_level_keys,
    sort_keys,
)
from shardforge.config.axolotl_keys import AXOLOTL_VERSION
from shardforge.config.axolotl_status import LEGACY_TOP_LEVEL
from shardforge.config.schema import ShardforgeConfig
from shardforge.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, data: dict[str, object]) -> Path:
    p = tmp_path / "cfg.yml"
    p.write_text(yaml.safe_dump(data))
    return p


def test_train_refuses_unsupported_features_one_line_each(tmp_path: Path) -> None:
    p = write(
        tmp_path,
        {
            "base_model": "m",
            "adapter": "lora",
            "peft_use_dora": True,  # the key is implemented, this value is not
            "relora": True,
            "lisa_n_layers": 4,
            "deepspeed": "zero3.json",
            "comet_project_name": "",  # an empty placeholder
            "load_in_8bit": False,  # Axolotl's default: changes nothing
            "special_tokens": None,
        },
    )
    with pytest.raises(ConfigError) as err:
        load_cfg(p, command="train")
    problems = err.value.problems
    assert len(problems) == 4, problems
    assert any(
        re.match(
            r"lisa_n_layers: LISA layer sampling.* not supported by shardforge train yet; "
            "remove",
            p,
        )
        for p in problems
    ), problems
    for key in ("peft_use_dora", "relora", "deepspeed"):
        assert any(p.startswith(f"{key}: ") and "not supported" in p for p in problems), key
    # the default (all commands) accepts them with one notice
    cfg = load_cfg(p)
    assert cfg.base_model == "m"


def test_ignored_keys_get_one_notice(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    p = write(
        tmp_path,
        {
            "base_model": "m",
            "use_comet": True,
            "dataset_num_proc": 4,
            "strict": True,
        },
    )
    with caplog.at_level(logging.WARNING, logger="shardforge"):
        load_cfg(p, command="train")
    lines = [r.getMessage() for r in caplog.records if "ignored" in r.getMessage()]
    assert len(lines) == 1, caplog.text
    for key in ("use_comet", "dataset_num_proc", "strict"):
        assert key in lines[0]


def test_attention_flags_set_attn_implementation(tmp_path: Path) -> None:
    assert (
        load_cfg(write(tmp_path, {"base_model": "m", "sdp_attention": True})).attn_implementation
        == "sdpa"
    )
    p = write(tmp_path, {"base_model": "m", "flash_attention": False})
    assert load_cfg(p).attn_implementation is None


def test_near_misses_are_errors_suggesting_keys_of_the_same_level(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A near miss of a known key is an error with a did-you-mean among keys of its level; any
    other key of neither schema is ignored with one notice, as Axolotl ignores (drops) a key
    its schema does not define."""
    p = write(
        tmp_path,
        {
            "base_model": "m",
            "learnig_rate": 1e-4,
            "zzz_not_a_key": 1,
            "fsdp": {"reshard_after_forwrd": False, "qqq_knob": 2},
            "datasets": [{"path": "d.jsonl", "feild": "text", "my_note": "x"}],
        },
    )
    with caplog.at_level(logging.WARNING, logger="shardforge"), pytest.raises(ConfigError) as err:
        load_cfg(p, command="train")
    assert err.value.problems == [
        "learnig_rate: unknown key; did you mean 'learning_rate'?",
        "fsdp.reshard_after_forwrd: unknown key; did you mean 'reshard_after_forward'?",
        "datasets[0].feild: unknown key; did you mean 'field'?",
    ]
    [notice] = [r.getMessage() for r in caplog.records if "neither shardforge's" in r.getMessage()]
    assert "zzz_not_a_key, fsdp.qqq_knob, datasets[0].my_note" in notice
    assert f"Axolotl {AXOLOTL_VERSION}'s" in notice


def test_legacy_keys_of_axolotls_examples_are_ignored_with_a_notice(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Keys Axolotl 0.21 does not define but its own examples carry: no effect there (dropped),
    so none here, named in the ignored notice; `adam_eps` is not taken for adam_epsilon (of
    which it is a near miss), as Axolotl does not take it either."""
    legacy = {
        "debug": True,
        "eta_min": 7e-7,
        "adam_eps": 1e-6,
        "sample_packing_seq_len_multiplier": 2,
        "gptq_groupsize": 128,
        "gptq_model_v1": False,
    }
    p = write(tmp_path, {"base_model": "m", **legacy})
    for command in ("train", "all"):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="shardforge"):
            cfg = load_cfg(p, command=command)
        assert cfg.adam_epsilon == ShardforgeConfig.model_fields["adam_epsilon"].default
        [notice] = [r.getMessage() for r in caplog.records if "ignored" in r.getMessage()]
        assert "6 key(s)" in notice and all(k in notice for k in ("debug", "eta_min")), notice
    assert set(legacy) <= set(LEGACY_TOP_LEVEL)


def test_axolotl_keys_that_are_not_typos_are_not_suggested_away(tmp_path: Path) -> None:
    """Today's misleading hints: pretraining_dataset -> learning_rate, tokenizer_type ->
    tokenizer_config. Both are Axolotl keys: refused or accepted by name, never 'unknown'."""
    p = write(
        tmp_path,
        {
            "base_model": "m",
            "pretraining_dataset": [{"path": "x"}],
            "tokenizer_type": "AutoTokenizer",
        },
    )
    with pytest.raises(ConfigError) as err:
        load_cfg(p, command="train")
    assert err.value.problems == [
        p for p in err.value.problems if p.startswith("pretraining_dataset: ")
    ]
    assert "did you mean" not in str(err.value)


@pytest.mark.parametrize("command", ["merge", "inspect"])
def test_scoped_commands_read_only_their_keys(
    tmp_path: Path, command: str, caplog: pytest.LogCaptureFixture
) -> None:
    p = write(
        tmp_path,
        {
            "base_model": "m",
            "output_dir": "o",
            "rl": "dpo",  # a feature train does not have: not read here
            "lr_scheduler": "greedy",  # a value train refuses: not read here
            "fsdp_config": {"fsdp_sharding_strategy": "NO_SHARD"},
            "something_new_in_axolotl": 3,
        },
    )
    with caplog.at_level(logging.DEBUG, logger="shardforge"):
        cfg = load_cfg(p, command=command)
    assert cfg.output_dir == "o"
    notices = [r.getMessage() for r in caplog.records]
    assert len(notices) == 1 and "of the config's 6 top-level keys" in notices[0], notices
    # what a normal config does: a debug line (validate and --debug show it), not a warning
    assert caplog.records[0].levelno == logging.DEBUG
    assert set(COMMAND_KEYS[command] or ()) >= {"base_model", "output_dir"}


def test_a_misspelt_key_the_merge_needs_is_an_error(tmp_path: Path) -> None:
    p = write(tmp_path, {"base_model": "m", "output_dri": "o"})
    with pytest.raises(ConfigError, match="output_dri: unknown key; did you mean 'output_dir'"):
        load_cfg(p, command="merge")


def test_sort_keys_is_pure() -> None:
    data = {"base_model": "m", "wandb_project": "x", "datasets": [{"path": "p", "name": None}]}
    before = yaml.safe_dump(data)
    sort_keys(data, "train")
    assert yaml.safe_dump(data) == before


def test_known_keys_include_both_schemas() -> None:
    keys = known_top_level_keys()
    assert {"base_model", "adapter", "fsdp_config", "dp_shard_size"} <= keys


def test_docs_table_is_generated_from_the_code() -> None:
    text = (ROOT / "docs" / "config.md").read_text()
    start = text.index("<!-- axolotl-table:start -->") + len("<!-- axolotl-table:start -->")
    end = text.index("<!-- axolotl-table:end -->")
    assert text[start:end].strip() == compatibility_table().strip(), (
        "docs/config.md is stale: regenerate with `shardforge config-schema --axolotl-table`"
    )


def test_the_corpus_exists() -> None:
    assert len(corpus()) >= 8


@pytest.mark.parametrize("path", corpus(), ids=lambda p: p.stem)
def test_corpus_validates_per_command(path: Path, tmp_path: Path) -> None:
    kind, keys = expectation(path)
    cfg_path = materialize(path, tmp_path)
    for command in ("merge", "inspect"):
        load_cfg(cfg_path, command=command)  # any Axolotl config loads for these
    if kind == "ok":
        load_cfg(cfg_path, command="train")
        load_cfg(cfg_path)
        return
    with pytest.raises(ConfigError) as err:
        load_cfg(cfg_path, command="train")
    refused = {p.split(":", 1)[0] for p in err.value.problems}
    assert refused == set(keys), err.value.problems
