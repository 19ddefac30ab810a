from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest

from shardforge.config import coerce_cfg, load_cfg, parse_override_args
from shardforge.config.loader import MAX_CONFIG_BYTES
from shardforge.config.schema import ShardforgeConfig
from shardforge.errors import ConfigError


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "cfg.yml"
    p.write_text(text)
    return p


def test_minimal_config_gets_defaults(tmp_path: Path) -> None:
    cfg = load_cfg(write(tmp_path, "base_model: some/model\n"))
    assert isinstance(cfg, ShardforgeConfig)  # the typed config itself, not a copy
    assert cfg.base_model == "some/model"
    assert cfg.output_dir == "./model-out"
    assert cfg.trust_remote_code is False
    assert cfg.fsdp.fsdp_version == 2
    assert cfg.fsdp.state_dict_type == "SHARDED_STATE_DICT"
    assert cfg.fsdp.mixed_precision.param_dtype is None


def test_attribute_view_refuses_unknown_attribute(tmp_path: Path) -> None:
    cfg = load_cfg(write(tmp_path, "base_model: m\n"))
    with pytest.raises(AttributeError, match="did you mean 'base_model'"):
        _ = cfg.base_modle
    with pytest.raises(KeyError):
        _ = cfg["nope"]


def test_view_round_trips_to_model(tmp_path: Path) -> None:
    cfg = load_cfg(write(tmp_path, "base_model: m\nlearning_rate: 0.1\n"))
    model = coerce_cfg(cfg)
    assert isinstance(model, ShardforgeConfig)
    assert model.learning_rate == 0.1
    assert coerce_cfg(str(tmp_path / "cfg.yml")).base_model == "m"
    assert coerce_cfg({"base_model": "x"}).base_model == "x"
    with pytest.raises(TypeError):
        coerce_cfg(42)


def test_all_problems_reported_at_once_with_user_keys(tmp_path: Path) -> None:
    p = write(
        tmp_path,
        "learnig_rate: 1\n"
        "fsdp:\n  reshard_after_forward: maybe\n"
        "sequence_len: 0\n"
        "datasets:\n  - path: a.jsonl\n    typ: completion\n",
    )
    with pytest.raises(ConfigError) as info:
        load_cfg(p)
    problems = info.value.problems
    assert "base_model: required key is missing" in problems
    assert "learnig_rate: unknown key; did you mean 'learning_rate'?" in problems
    assert "fsdp.reshard_after_forward: expected a boolean (true/false), got 'maybe'" in problems
    assert "sequence_len: must be > 0, got 0" in problems
    assert "datasets[0].typ: unknown key; did you mean 'type'?" in problems
    assert len(problems) == 5
    assert str(p) in str(info.value)


def test_a_key_of_neither_schema_is_ignored_with_a_notice(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """As Axolotl drops a key its schema does not define; a near miss stays an error."""
    with caplog.at_level(logging.WARNING, logger="shardforge"):
        cfg = load_cfg(write(tmp_path, "base_model: m\nzzz: 1\n"))
    assert "zzz" not in cfg
    assert "neither shardforge's nor Axolotl" in caplog.text and ": zzz" in caplog.text


def test_literal_and_cross_field_errors(tmp_path: Path) -> None:
    with pytest.raises(
        ConfigError,
        match="lr_scheduler: 'step' is not supported; expected one of 'cosine', 'linear', 'constant',",
    ):
        load_cfg(write(tmp_path, "base_model: m\nlr_scheduler: step\n"))
    with pytest.raises(ConfigError, match="bf16 and fp16 are both set"):
        load_cfg(write(tmp_path, "base_model: m\nbf16: true\nfp16: true\n"))


def test_yaml_syntax_error_names_line_and_column(tmp_path: Path) -> None:
    p = write(tmp_path, "base_model: m\nfsdp:\n  offload_params: [true\n")
    with pytest.raises(ConfigError) as info:
        load_cfg(p)
    assert f"{p}:4:1: invalid YAML" in str(info.value)


def test_a_file_larger_than_a_config_is_refused_before_parsing(tmp_path: Path) -> None:
    """The 1 GB one-line config is refused at once, unread; a valid one-line YAML just over
    the cap too (parsing it would take PyYAML minutes)."""
    huge = tmp_path / "huge.yml"
    with huge.open("wb") as f:  # sparse: refused by its size
        f.truncate(1 << 30)
    start = time.monotonic()
    with pytest.raises(ConfigError) as info:
        load_cfg(huge)
    assert time.monotonic() - start < 1.0
    assert info.value.lines()[0] == (
        f"error: {huge}: 1,073,741,824 bytes; a config file is at most 4 MiB (configs are "
        "kilobytes); give the YAML config, not a data file"
    )
    line = "base_model: m\nnotes: [" + "1, " * (MAX_CONFIG_BYTES // 3) + "1]\n"
    with pytest.raises(ConfigError, match="bytes; a config file is at most 4 MiB"):
        load_cfg(write(tmp_path, line))
    assert load_cfg(write(tmp_path, "base_model: m\n")).base_model == "m"


def test_non_mapping_and_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="expected a mapping of keys at the top, got list"):
        load_cfg(write(tmp_path, "- a\n- b\n"))
    with pytest.raises(ConfigError, match="config file not found"):
        load_cfg(tmp_path / "missing.yml")


def test_overrides_flat_nested_and_dotted(tmp_path: Path) -> None:
    p = write(tmp_path, "base_model: m\n")
    cfg = load_cfg(p, learning_rate=1e-4, fsdp={"offload_params": True})
    assert cfg.learning_rate == 1e-4
    assert cfg.fsdp.offload_params is True
    assert cfg.fsdp.reshard_after_forward is True
    cfg = load_cfg(p, **{"fsdp.reshard_after_forward": False})
    assert cfg.fsdp.reshard_after_forward is False


def test_overrides_are_validated(tmp_path: Path) -> None:
    p = write(tmp_path, "base_model: m\n")
    with pytest.raises(ConfigError, match=r"fsdp\.offload_params: expected a boolean"):
        load_cfg(p, **{"fsdp.offload_params": "maybe"})
    with pytest.raises(
        ConfigError, match="learnign_rate: unknown key; did you mean 'learning_rate'"
    ):
        load_cfg(p, learnign_rate=1.0)


def test_parse_override_args() -> None:
    assert parse_override_args(
        ["--learning_rate", "2e-5", "--fsdp.offload_params=true", "--bf16", "--max-steps", "3"]
    ) == {"learning_rate": 2e-5, "fsdp.offload_params": True, "bf16": True, "max_steps": 3}
    with pytest.raises(ConfigError, match="expected an override like --key value"):
        parse_override_args(["stray"])


def test_object_storage_is_refused_where_a_local_path_is_read(tmp_path: Path) -> None:
    """Only output_dir (and the merge's --checkpoint / --output_path) may name object storage:
    elsewhere `s3://` became a local folder named `s3:` (preprocess wrote its data there)."""
    text = (
        "base_model: s3://models/base\ndataset_prepared_path: s3://data/prepared\n"
        "lora_model_dir: s3://runs/adapter\noutput_dir: s3://runs/run-1\n"
        "datasets:\n  - path: s3://data/train.jsonl\n"
    )
    with pytest.raises(ConfigError) as info:
        load_cfg(write(tmp_path, text))
    problems = info.value.problems
    assert sorted(p.split(":")[0] for p in problems) == [
        "base_model",
        "dataset_prepared_path",
        "datasets[0].path",
        "lora_model_dir",
    ], problems
    assert all("(copy it down first)" in p and "give a local" in p for p in problems)
    assert load_cfg(write(tmp_path, "base_model: m\noutput_dir: s3://runs/run-1\n")).output_dir


def test_an_unquoted_save_strategy_no_is_no(tmp_path: Path) -> None:
    """YAML 1.1 reads `no` as false; Axolotl's configs write `save_strategy: no` unquoted."""
    path = tmp_path / "c.yml"
    path.write_text("base_model: m\nsave_strategy: no\n")
    assert load_cfg(path).save_strategy == "no"
    path.write_text("base_model: m\nsave_strategy: steps\nsave_steps: 2\n")
    assert load_cfg(path).save_strategy == "steps"


def _many(kind: str, n: int) -> str:
    if kind == "integers":
        return "base_model: m\nnotes: [" + "1," * (n - 1) + "1]\n"
    return "base_model: m\n" + "".join(f"k{i:x}: 1\n" for i in range(n))


@pytest.mark.parametrize(("kind", "n"), [("integers", 2_000_000), ("keys", 380_000)])
def test_a_config_of_millions_of_values_under_the_size_cap_is_refused_quickly(
    tmp_path: Path, kind: str, n: int
) -> None:
    """A 4 MB config of 2 million integers, or of 380,000 plain keys (minutes and 1.5 GB for
    the pure-Python parser, then a message about aliases the file does not have): refused
    once it holds more values than a config can (counted on libyaml's events, before a node
    is built), with a message that says so."""
    import resource

    path = write(tmp_path, _many(kind, n))
    assert path.stat().st_size <= MAX_CONFIG_BYTES
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.process_time()
    with pytest.raises(ConfigError) as info:
        load_cfg(path)
    assert time.process_time() - start < 5  # CPU seconds: about 0.3 on an idle machine
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 200 << 10  # KiB
    line = info.value.lines()[0]
    assert f"{path}: invalid YAML: the document holds more than 200,000 values" in line, line
    assert "alias" not in line, line
