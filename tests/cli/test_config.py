"""`shardforge.cli.config.load_cfg`, Axolotl's import path: the config as written with the
caller's overrides, as an Axolotl `DictDefault`, validated where it is used; and the
programmatic example of Axolotl's merge docs run with `axolotl` replaced by `shardforge`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from shardforge.cli.config import DictDefault, load_cfg
from shardforge.config import coerce_cfg
from shardforge.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
# Axolotl's docs of merge-sharded-fsdp-weights, "Programmatic Usage" (the seed's reference,
# copied into tests/cli/reference/axolotl-merge-fsdp-weights.txt, lines 69-73), verbatim
AXOLOTL_EXAMPLE = """\
from axolotl.cli.config import load_cfg
from axolotl.cli.merge_sharded_fsdp_weights import merge_fsdp_weights

cfg = load_cfg("examples/llama-3/fft-8b.yaml")
merge_fsdp_weights(cfg, output_path="./merged_model", save_tokenizer=True)
"""
# a copy inside the repository, so the test runs on a clone alone
REFERENCE = ROOT / "tests" / "cli" / "reference" / "axolotl-merge-fsdp-weights.txt"
CORPUS = ROOT / "tests" / "config" / "axolotl_corpus"


def write(path: Path, data: dict[str, object]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data))
    return path


def test_the_config_as_written_read_as_attributes(tmp_path: Path) -> None:
    p = write(
        tmp_path / "cfg.yml",
        {
            "base_model": "m",
            "optimizer": "adamw_anyprecision",  # not shardforge's: read, not refused here
            "datasets": [{"path": "d.jsonl", "type": "alpaca"}],
            "fsdp_config": {"offload_params": False},
        },
    )
    cfg = load_cfg(p, learning_rate=1e-4, fsdp_config__offload_params=True)
    assert isinstance(cfg, DictDefault) and cfg.source == str(p)
    assert (cfg.optimizer, cfg.learning_rate, cfg["base_model"]) == (
        "adamw_anyprecision",
        1e-4,
        "m",
    )
    assert cfg.datasets[0].path == "d.jsonl" and cfg.fsdp_config.offload_params is True
    assert cfg.no_such_key is None  # Axolotl's DictDefault: a missing key reads as None
    cfg.lora_model_dir = "adapter"  # a dict, as Axolotl's: writes are allowed
    assert cfg["lora_model_dir"] == "adapter"
    assert cfg.to_dict()["datasets"] == [{"path": "d.jsonl", "type": "alpaca"}]


def test_a_mapping_a_directory_and_errors(tmp_path: Path) -> None:
    raw = {"base_model": "m", "fsdp_config": {"offload_params": False}}
    cfg = load_cfg(raw, output_dir="o", fsdp_config__offload_params=True)
    assert cfg.output_dir == "o" and raw == {
        "base_model": "m",
        "fsdp_config": {"offload_params": False},
    }
    assert load_cfg(cfg).output_dir == "o"  # a DictDefault again: read as it is
    write(tmp_path / "one" / "only.yaml", {"base_model": "m"})
    assert load_cfg(tmp_path / "one").source == str(tmp_path / "one" / "only.yaml")
    write(tmp_path / "one" / "second.yml", {"base_model": "n"})
    with pytest.raises(ConfigError, match="a directory: name one of its config files"):
        load_cfg(tmp_path / "one")
    with pytest.raises(ConfigError, match="config file not found"):
        load_cfg(tmp_path / "missing.yml")


def test_each_command_validates_what_it_reads(tmp_path: Path) -> None:
    """The merge reads a few keys (a value only training knows does not stop it); train reads
    every key and refuses it; errors name the file."""
    p = write(
        tmp_path / "cfg.yml",
        {"base_model": "m", "optimizer": "adamw_anyprecision", "chat_template": "gemma9"},
    )
    cfg = load_cfg(p)
    assert coerce_cfg(cfg, "merge").base_model == "m"
    with pytest.raises(ConfigError) as err:
        coerce_cfg(cfg, "train")
    assert str(err.value).startswith(f"{p}: 2 problems")
    assert {line.split(":")[0] for line in err.value.problems} == {"optimizer", "chat_template"}


def test_the_example_is_the_references() -> None:
    assert AXOLOTL_EXAMPLE in REFERENCE.read_text() + "\n"


@pytest.mark.slow  # the checkpoint is written by 2 gloo ranks (a shared folder)
def test_the_seed_programmatic_example_runs_with_shardforge(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As written, on a tiny model's real 2-rank checkpoint: examples/llama-3/fft-8b.yaml is
    Axolotl's own config (a paged 8-bit optimizer train refuses), pointed at the checkpoint."""
    from merge.test_merge_sources import LMMS_STEPS, build_sources, delta, expected_state

    built = build_sources(tmp_path_factory)
    text = (CORPUS / "llama3-fft-8b.yml").read_text()
    text = text.replace("TINY_MODEL", str(built.base)).replace("DATA_DIR", str(tmp_path))
    config = tmp_path / "examples" / "llama-3" / "fft-8b.yaml"
    config.parent.mkdir(parents=True)
    config.write_text(text.replace("OUTPUT_DIR", str(built.root / "lmms")))
    monkeypatch.chdir(tmp_path)
    code = AXOLOTL_EXAMPLE.replace("axolotl", "shardforge")
    exec(compile(code, "axolotl-example", "exec"), {})
    merged = tmp_path / "merged_model"
    want = expected_state(built.base, delta("model", LMMS_STEPS[-1]))
    got = load_file(str(merged / "model.safetensors"))
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert (merged / "config.json").is_file() and (merged / "tokenizer.json").is_file()


def test_the_three_spellings_of_load_cfg_are_what_docs_config_md_says(tmp_path: Path) -> None:
    import shardforge
    import shardforge.config
    from shardforge.config.schema import ShardforgeConfig
    from shardforge.config.view import ConfigReadOnlyError

    root = Path(__file__).resolve().parents[2]
    text = (root / "docs" / "config.md").read_text()
    table = text[text.index("### The three spellings of `load_cfg`") :]
    for module in ("shardforge", "shardforge.config", "shardforge.cli.config"):
        assert f"| `from {module} import load_cfg` |" in table, module
    assert shardforge.load_cfg is shardforge.config.load_cfg
    path = tmp_path / "cfg.yml"
    path.write_text(yaml.safe_dump({"base_model": "org/model", "optimizer": "adamw_anyprecision"}))
    axolotl_style = load_cfg(path)  # not validated: a value train refuses is kept
    assert isinstance(axolotl_style, DictDefault) and axolotl_style.gptq is None
    axolotl_style.seed = 3  # writable
    with pytest.raises(ConfigError, match="optimizer"):
        shardforge.load_cfg(path)  # every key validated at once
    path.write_text(yaml.safe_dump({"base_model": "org/model"}))
    typed = shardforge.load_cfg(path)
    assert isinstance(typed, ShardforgeConfig) and typed.get("gptq") is None
    with pytest.raises(AttributeError, match="did you mean"):
        typed.seeed  # noqa: B018
    with pytest.raises(ConfigReadOnlyError):
        typed.seed = 3  # type: ignore[misc]
    assert coerce_cfg(load_cfg(path)).base_model == typed.base_model  # either is taken
