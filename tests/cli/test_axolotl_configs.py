"""The corpus of Axolotl-shaped configs (tests/config/axolotl_corpus) through the commands an
Axolotl user types: `validate` for each command, and `merge-sharded-fsdp-weights` on a tiny
model's real 2-rank checkpoint (the shared merge-sources fixture) with every corpus config and
every chat template name of Axolotl 0.21; a name it cannot render keeps the tokenizer's own."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from helpers.corpus import CORPUS, corpus, expectation, materialize, write_data
from helpers.tiny import CHAT_TEMPLATE, make_model
from shardforge.cli.main import cli
from shardforge.config import load_cfg
from shardforge.config.chat_templates import CHAT_TEMPLATE_NAMES, CHAT_TEMPLATES
from shardforge.errors import ConfigError

JINJA = "{% for message in messages %}{{ message['content'] }}{% endfor %}"  # the corpus's


def validate(cfg: Path, *args: str) -> Any:
    return CliRunner().invoke(cli, ["validate", str(cfg), *args])


@pytest.fixture(scope="module")
def local(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama and the data files the corpus names: what `validate` for train checks
    exists, as train does before it starts."""
    root = tmp_path_factory.mktemp("corpus")
    make_model(root / "base", "llama", vocab_size=320, seed=0)
    write_data(root)
    return root


def on_local(path: Path, local: Path, tmp_path: Path, **kw: Any) -> Path:
    return materialize(path, tmp_path, local / "base", data=local, tiny_llama=True, **kw)


@pytest.mark.parametrize("path", corpus(), ids=lambda p: p.stem)
def test_validate_for_each_command(path: Path, local: Path, tmp_path: Path) -> None:
    """merge and inspect: every config passes; train: as the file's first line expects, each
    refused key one line of one error; a config train takes passes train's own checks too."""
    kind, keys = expectation(path)
    cfg = on_local(path, local, tmp_path)
    for command in ("merge", "inspect"):
        result = validate(cfg, "--for", command)
        assert result.exit_code == 0, (command, result.output)
    result = validate(cfg)
    if kind == "ok":
        assert result.exit_code == 0, result.output
        return
    assert result.exit_code == 2
    error = result.stderr.split("error: ", 1)[1]
    assert "error:" not in error
    for key in keys:
        assert f"{key}: " in error, (key, error)


def test_validate_runs_the_checks_train_runs_before_it_starts(local: Path, tmp_path: Path) -> None:
    """What `train` refuses before starting a rank, `validate` refuses too, all at once: a
    missing data file, a block class the model lacks, an output_dir holding a saved model."""
    cfg = on_local(CORPUS / "alpaca-sdpa.yml", local, tmp_path)
    assert validate(cfg).exit_code == 0
    text = cfg.read_text().replace(str(local / "alpaca.jsonl"), str(tmp_path / "gone.jsonl"))
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "model.safetensors").write_bytes(b"")  # a saved model a run would replace
    cfg.write_text(text.replace("LlamaDecoderLayer", "NoSuchLayer"))
    result = validate(cfg)
    assert result.exit_code == 2, result.output
    for words in ("gone.jsonl", "NoSuchLayer", "output_dir"):
        assert words in result.stderr, (words, result.stderr)


def test_legacy_keys_are_named_in_one_notice(local: Path, tmp_path: Path) -> None:
    result = validate(on_local(CORPUS / "legacy-keys.yml", local, tmp_path))
    assert result.exit_code == 0, result.output
    [notice] = [line for line in result.stderr.splitlines() if "are ignored" in line]
    for key in ("gptq_groupsize", "gptq_model_v1", "sample_packing_seq_len_multiplier"):
        assert key in notice


@pytest.mark.parametrize("name", CHAT_TEMPLATE_NAMES)
def test_train_accepts_every_template_name(name: str, tmp_path: Path) -> None:
    cfg = materialize(CORPUS / "every-chat-template.yml", tmp_path, chat_template=name)
    load_cfg(cfg, command="train")
    bad = materialize(CORPUS / "every-chat-template.yml", tmp_path, chat_template=name + "9")
    with pytest.raises(ConfigError, match="unknown template name"):
        load_cfg(bad, command="train")


# --- the merge of a real 2-rank checkpoint ------------------------------------------------------


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """merge-sources: a tiny Llama's checkpoints written by 2 gloo ranks; lmms/ is a run of
    checkpoint-N/pytorch_model_fsdp_0 folders, as Axolotl's output_dir holds them."""
    from merge.test_merge_sources import LMMS_STEPS, build_sources, delta, expected_state

    built = build_sources(tmp_path_factory)
    return built, expected_state(built.base, delta("model", LMMS_STEPS[-1]))


def merge(cfg: Path, out: Path, *args: str) -> Any:
    return CliRunner().invoke(
        cli, ["merge-sharded-fsdp-weights", str(cfg), "--output_path", str(out), "--quiet", *args]
    )


@pytest.mark.slow
@pytest.mark.parametrize("path", corpus(), ids=lambda p: p.stem)
def test_every_corpus_config_merges(path: Path, ckpt: Any, tmp_path: Path) -> None:
    built, want = ckpt
    cfg = materialize(path, tmp_path, built.base, built.root / "lmms")
    result = merge(cfg, tmp_path / "out")
    assert result.exit_code == 0, result.output
    got = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)


def saved_template(out: Path) -> str:
    from transformers import AutoTokenizer

    return str(AutoTokenizer.from_pretrained(out).chat_template)


@pytest.mark.slow
def test_the_merged_tokenizer_gets_every_template(ckpt: Any, tmp_path: Path) -> None:
    built, _ = ckpt
    for name in CHAT_TEMPLATE_NAMES:
        cfg = materialize(
            CORPUS / "every-chat-template.yml",
            tmp_path,
            built.base,
            built.root / "lmms",
            chat_template=name,
        )
        out = tmp_path / f"out-{name}"
        result = merge(cfg, out)
        assert result.exit_code == 0, (name, result.output)
        want = {"tokenizer_default": CHAT_TEMPLATE, "jinja": JINJA}.get(
            name, CHAT_TEMPLATES.get(name)
        )
        assert saved_template(out) == want, name


@pytest.mark.slow
def test_a_name_the_merge_cannot_render_keeps_the_tokenizers_own(ckpt: Any, tmp_path: Path) -> None:
    """The merge does not need a chat template: one notice, the tokenizer's own template."""
    built, want = ckpt
    cfg = materialize(
        CORPUS / "every-chat-template.yml",
        tmp_path,
        built.base,
        built.root / "lmms",
        chat_template="gemma9",
    )
    result = merge(cfg, tmp_path / "out")
    assert result.exit_code == 0, result.output
    notices = [line for line in result.stderr.splitlines() if "gemma9" in line]
    assert notices == [
        "notice: chat_template: unknown template name 'gemma9' (docs/config.md); the tokenizer "
        "keeps its own chat template (it has one)"
    ]
    assert saved_template(tmp_path / "out") == CHAT_TEMPLATE
    got = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.slow  # one real train run (in this process), the only one of these tests
def test_train_then_merge_with_gemma3s_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Axolotl's Gemma 3 FSDP2 config trains (2 steps, one CPU rank, the chat template Gemma
    3's, <end_of_turn> added), and its checkpoint merges with the same config: the saved and
    the merged tokenizer both carry the template. (`train` as typed, in this process: the
    command's own process has its tests in tests/cli/test_train_cli.py and tests/train.)"""
    from helpers.tiny import make_model, tiny_conversations, write_jsonl

    base = make_model(tmp_path / "base", "llama")
    write_jsonl(tmp_path / "chats.jsonl", [{"messages": m} for m in tiny_conversations(16)])
    cfg = materialize(CORPUS / "gemma3-fft-fsdp2.yml", tmp_path, base, tmp_path / "run")
    # the tiny model is a Llama on a CPU: its block class, an attention kernel CPUs have
    cpu = ["--attn_implementation", "sdpa", "--fsdp.transformer_layer_cls_to_wrap"]
    monkeypatch.chdir(tmp_path)  # dataset_prepared_path: last_run_prepared is relative to it
    argv = ["train", str(cfg), "--launcher", "python", "--max_steps", "2", *cpu]
    trained = CliRunner().invoke(cli, [*argv, "LlamaDecoderLayer"])
    assert trained.exit_code == 0, trained.output[-3000:]
    assert (tmp_path / "last_run_prepared").is_dir()
    assert "step 2/2" in trained.stderr and (tmp_path / "run" / "checkpoint-2").is_dir()
    assert saved_template(tmp_path / "run") == CHAT_TEMPLATES["gemma3"]
    result = merge(cfg, tmp_path / "merged")
    assert result.exit_code == 0, result.output
    assert saved_template(tmp_path / "merged") == CHAT_TEMPLATES["gemma3"]
    from transformers import AutoTokenizer

    assert len(AutoTokenizer.from_pretrained(tmp_path / "merged").encode("<end_of_turn>")) == 1
