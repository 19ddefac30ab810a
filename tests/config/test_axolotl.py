"""Axolotl configs: every key of Axolotl's schema is implemented, ignored or refused by name, per
command; a key of neither schema is an error with a suggestion of the same level; the docs table
is the code's table."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
import yaml

from shardforge.config import load_cfg
from shardforge.config.axolotl import (
    COMMAND_KEYS,
    compatibility_table,
    known_top_level_keys,
    sort_keys,
)
from shardforge.config.axolotl_keys import DATASET_KEYS, FSDP_CONFIG_KEYS, TOP_LEVEL
from shardforge.config.schema import DatasetConfig, FsdpConfig, ShardforgeConfig
from shardforge.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
CORPUS = Path(__file__).parent / "axolotl_corpus"


def write(tmp_path: Path, data: dict[str, object]) -> Path:
    p = tmp_path / "cfg.yml"
    p.write_text(yaml.safe_dump(data))
    return p


def test_every_implemented_key_exists_on_our_side() -> None:
    """An `implemented` row names a key of ours (same name or `ours`), or is understood
    without one (flags, model/tokenizer class names, the Axolotl fsdp spellings)."""
    from shardforge.config.axolotl import FLAG_VALUES, IMPLICIT

    top = set(ShardforgeConfig.model_fields)
    for table, ours in (
        (TOP_LEVEL, top),
        (DATASET_KEYS, set(DatasetConfig.model_fields)),
        (FSDP_CONFIG_KEYS, set(FsdpConfig.model_fields)),
    ):
        for key, row in table.items():
            if row.status != "implemented" or key in FLAG_VALUES or key in IMPLICIT:
                continue
            target = (row.ours or key).split(".")[-1]
            assert (
                key in ours
                or target in ours
                or target in top
                or key
                in (
                    "fsdp_config",
                    "fsdp_version",
                    "version",
                    "sharding_strategy",
                    "cpu_offload",
                    "message_field_role",
                    "message_field_content",
                )
            ), (key, row)


def test_our_keys_that_axolotl_has_are_marked_implemented() -> None:
    for key in set(ShardforgeConfig.model_fields) & set(TOP_LEVEL):
        assert TOP_LEVEL[key].status == "implemented", key


def test_the_table_is_large_and_classified() -> None:
    assert len(TOP_LEVEL) > 200  # Axolotl's schema, not a hand-picked sample
    statuses = {row.status for row in TOP_LEVEL.values()}
    assert statuses == {"implemented", "ignored", "unsupported"}
    for key in ("load_in_4bit", "rl", "plugins", "deepspeed", "early_stopping_patience"):
        assert TOP_LEVEL[key].status == "unsupported", key
    for key in ("use_comet", "dataset_num_proc", "strict"):
        assert TOP_LEVEL[key].status == "ignored", key


def test_train_refuses_unsupported_features_one_line_each(tmp_path: Path) -> None:
    p = write(
        tmp_path,
        {
            "base_model": "m",
            "adapter": "qlora",  # lora is implemented, qlora is not
            "load_in_4bit": True,
            "early_stopping_patience": 3,
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
            r"early_stopping_patience: early stopping.* not supported by shardforge train yet; "
            "remove",
            p,
        )
        for p in problems
    ), problems
    for key in ("adapter", "load_in_4bit", "deepspeed"):
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


def test_unknown_keys_suggest_only_keys_of_the_same_level(tmp_path: Path) -> None:
    p = write(
        tmp_path,
        {
            "base_model": "m",
            "learnig_rate": 1e-4,
            "zzz_not_a_key": 1,
            "fsdp": {"reshard_after_forwrd": False},
            "datasets": [{"path": "d.jsonl", "feild": "text"}],
        },
    )
    with pytest.raises(ConfigError) as err:
        load_cfg(p, command="train")
    text = "\n".join(err.value.problems)
    assert "learnig_rate: unknown key; did you mean 'learning_rate'?" in text
    assert (
        "zzz_not_a_key: unknown key" in text
        and "did you mean" not in text.split("zzz_not_a_key")[1].splitlines()[0]
    )
    assert "fsdp.reshard_after_forwrd: unknown key" in text and "'reshard_after_forward'" in text
    assert "datasets[0].feild: unknown key" in text and "'field'" in text


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
            "adapter": "qlora",
            "lr_scheduler": "one_cycle",  # an Axolotl value we do not support: not read here
            "fsdp_config": {"fsdp_sharding_strategy": "NO_SHARD"},
            "something_new_in_axolotl": 3,
        },
    )
    with caplog.at_level(logging.WARNING, logger="shardforge"):
        cfg = load_cfg(p, command=command)
    assert cfg.output_dir == "o"
    notices = [r.getMessage() for r in caplog.records]
    assert len(notices) == 1 and "of the config's 6 top-level keys" in notices[0], notices
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


def corpus() -> list[Path]:
    return sorted(CORPUS.glob("*.yml"))


def expectation(path: Path) -> tuple[str, list[str]]:
    first = path.read_text().splitlines()[0]
    m = re.match(r"#\s*expect:\s*(train-ok|train-unsupported:\s*(.*))$", first)
    assert m, f"{path.name}: first line must be '# expect: ...'"
    if m.group(1) == "train-ok":
        return "ok", []
    return "unsupported", [k.strip() for k in (m.group(2) or "").split(",") if k.strip()]


def materialize(path: Path, tmp_path: Path) -> Path:
    text = path.read_text()
    text = text.replace("TINY_MODEL", str(tmp_path / "base"))
    text = text.replace("OUTPUT_DIR", str(tmp_path / "out")).replace("DATA_DIR", str(tmp_path))
    out = tmp_path / path.name
    out.write_text(text)
    return out


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
