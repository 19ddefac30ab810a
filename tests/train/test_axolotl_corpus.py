"""The Axolotl-shaped configs of tests/config/axolotl_corpus, end to end: every `train-ok` config
trains on 2 gloo ranks and its checkpoint merges into a model transformers loads; every
`train-unsupported` config is refused by `shardforge train` before any rank starts, one
line per unsupported key, and still drives the merge."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from train_helpers import train_configs

from helpers import children
from helpers import corpus as axolotl
from helpers.dist import run_on_ranks
from helpers.tiny import make_model

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("axolotl")
    make_model(root / "base", "llama", vocab_size=320, seed=0)
    axolotl.write_data(root)
    configs = {
        p.stem: axolotl.materialize(
            p, root / "configs", root / "base", root / "runs" / p.stem, data=root, tiny_llama=True
        )
        for p in axolotl.corpus()
    }
    expect = {p.stem: axolotl.expectation(p) for p in axolotl.corpus()}
    return {"root": root, "configs": configs, "expect": expect}


def _train_all(rank: int, world: int, paths: list[str], stores: str) -> None:
    """Train every config in turn on these ranks (`train_configs`)."""
    # relative paths of the configs (dataset_prepared_path: last_run_prepared) land in the
    # test's folder, as they land in the folder Axolotl users start from
    os.chdir(Path(stores).parent)
    train_configs(rank, world, [(path, None) for path in paths], stores)


def test_train_ok_configs_train_on_two_ranks_and_merge(corpus: dict[str, Any]) -> None:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from shardforge.cli.main import cli
    from shardforge.config import load_cfg
    from shardforge.train.preflight import preflight

    ok = [name for name, (kind, _) in corpus["expect"].items() if kind == "ok"]
    assert len(ok) >= 5
    paths = [str(corpus["configs"][name]) for name in ok]
    for path in paths:  # what the launcher checks before starting ranks
        preflight(load_cfg(path, command="train").to_model(), path)
    stores = corpus["root"] / "stores"
    stores.mkdir()
    run_on_ranks(_train_all, 2, paths, str(stores))
    for name, path in zip(ok, paths, strict=True):
        cfg = load_cfg(path, command="train")
        out_dir = Path(cfg.output_dir)
        merged = corpus["root"] / "merged" / name
        full = cfg.fsdp.state_dict_type == "FULL_STATE_DICT"
        if full and not cfg.adapter:
            merged = out_dir  # the final save is the full model already
        else:
            # an adapter run's final save is the PEFT adapter: merge-lora fuses it into the base
            command = "merge-lora" if full else "merge-sharded-fsdp-weights"
            result = CliRunner().invoke(
                cli, [command, path, "--output_path", str(merged), "--quiet"]
            )
            assert result.exit_code == 0, (name, result.output)
        model = AutoModelForCausalLM.from_pretrained(merged)
        assert model.config.vocab_size == model.get_input_embeddings().weight.shape[0]
        files = list(merged.glob("*.safetensors"))
        assert files and all(load_file(str(f)) for f in files), name


def test_unsupported_configs_are_refused_by_train_and_merge_reads_them(
    corpus: dict[str, Any],
) -> None:
    """Through the CLI in this process (`validate` for each config, `train` for one): exit 2
    before any rank, one error line with every unsupported key on its own detail line, nothing
    written to output_dir."""
    from shardforge.cli.main import cli
    from shardforge.cli.validate import command as validate

    for name, (kind, keys) in corpus["expect"].items():
        if kind != "unsupported":
            continue
        path = corpus["configs"][name]
        checked = CliRunner().invoke(validate, [str(path), "--for", "merge"])
        assert checked.exit_code == 0, (name, checked.output)
        refused = CliRunner().invoke(validate, [str(path), "--for", "train"])
        assert refused.exit_code == 2, name
        for key in keys:
            # one problem is on the error line itself, several on detail lines
            line = rf"(^  - |\.yml: ){re.escape(key)}: .*not supported"
            assert re.search(line, refused.output, re.M), (
                name,
                key,
                refused.output,
            )
    # the train command itself, once (in this process: its own process's exit status and
    # stderr are read in tests/cli/test_train_cli.py and test_preflight.py): refused before
    # any rank starts, no process started at all, one error line naming the key
    name, (_, keys) = next((n, e) for n, e in corpus["expect"].items() if e[0] == "unsupported")
    with children.watching() as started:
        result = CliRunner().invoke(cli, ["train", str(corpus["configs"][name])])
    assert not started, started
    assert result.exit_code == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and len(errors[0]) <= 300, result.stderr
    assert "Traceback" not in result.stderr and "launching" not in result.stderr
    assert f"{keys[0]}: " in result.stderr and "not supported" in result.stderr, result.stderr
    assert not (corpus["root"] / "runs" / name).exists()
