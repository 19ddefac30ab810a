"""`shardforge merge-lora`: the adapter from output_dir into <output_dir>/merged; bad inputs each
give one `error:` line, a non-zero exit and no output; --help with examples; the fire entry
point."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from click.testing import CliRunner
from safetensors.torch import load_file

from helpers.tiny import make_model
from shardforge.cli.main import cli

CMD = "merge-lora"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny base model, an adapter with random factors (peft's B starts at zeros) and the
    merge_and_unload weights to compare with."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("cli-lora")
    base = make_model(root / "base", "llama")
    make_model(root / "other", "llama", hidden_size=32, num_attention_heads=2)
    pm = get_peft_model(
        AutoModelForCausalLM.from_pretrained(base),
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    )
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    pm.save_pretrained(root / "run")
    torch.save(pm.merge_and_unload().state_dict(), root / "merged.pt")
    return root


@pytest.fixture
def env(pristine: Path, tmp_path: Path) -> Path:
    shutil.copytree(pristine / "run", tmp_path / "run")
    cfg = {"base_model": str(pristine / "base"), "output_dir": str(tmp_path / "run")}
    (tmp_path / "cfg.yml").write_text(yaml.safe_dump(cfg))
    return tmp_path


def tree_hash(root: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        h.update(str(p.relative_to(root)).encode())
        if p.is_file():
            h.update(p.read_bytes())
    return h.hexdigest()


def invoke(env: Path, *args: str) -> Any:
    return CliRunner().invoke(cli, [CMD, str(env / "cfg.yml"), "--quiet", *args])


def one_line_error(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert sum(line.startswith("error") for line in lines) == 1, stderr
    at = next(i for i, line in enumerate(lines) if line.startswith("error: "))
    assert all(d.startswith("  ") for d in lines[at + 1 :]), stderr
    assert len(lines[at]) <= 300 and "Traceback" not in stderr
    return "\n".join(lines[at:])


def assert_refused(env: Path, result: Any, before: str, *words: str) -> None:
    assert result.exit_code != 0, result.output
    error = one_line_error(result.stderr)
    for w in words:
        assert w in error, (w, error)
    assert not (env / "out").exists() and not (env / "run" / "merged").exists()
    assert not list(env.glob(".out.*")) and not list((env / "run").glob(".merged.*"))
    assert tree_hash(env / "run") == before


def test_merges_into_output_dir_merged(env: Path, pristine: Path) -> None:
    result = invoke(env, "--verify")
    assert result.exit_code == 0, result.output
    out = env / "run" / "merged"
    assert result.stdout.strip() == str(out)
    assert "adapter:" in result.stderr
    # what it compared with: no checkpoint is involved
    assert (
        "tensors: identical to the base model and the adapter, read by safetensors and fused"
        in (result.stderr)
    )
    assert "checkpoint" not in result.stderr
    want = torch.load(pristine / "merged.pt", weights_only=True)
    for key, tensor in load_file(str(out / "model.safetensors")).items():
        assert torch.equal(tensor, want[key]), key
    assert (out / "tokenizer.json").is_file() and (out / "config.json").is_file()


def test_options_and_spellings(env: Path) -> None:
    result = invoke(
        env,
        "--lora-model-dir",
        str(env / "run"),
        "--output-path",
        str(env / "out"),
        "--dtype",
        "bf16",
        "--max_shard_size",
        "100000",
        "--no_save_tokenizer",
    )
    assert result.exit_code == 0, result.output
    assert (env / "out" / "model.safetensors.index.json").is_file()
    assert not (env / "out" / "tokenizer.json").exists()
    shards = sorted((env / "out").glob("model-*.safetensors"))
    assert len(shards) > 1
    for shard in shards:
        for tensor in load_file(str(shard)).values():
            assert tensor.dtype == torch.bfloat16


def test_help_shows_examples() -> None:
    result = CliRunner().invoke(cli, [CMD, "--help"])
    assert result.exit_code == 0
    assert "Examples:" in result.output
    for option in ("--lora_model_dir", "--output_path", "--dtype", "--verify", "--overwrite"):
        assert option in result.output
    assert "merged" in result.output


def test_bad_adapter_dir(env: Path) -> None:
    before = tree_hash(env / "run")
    result = invoke(
        env, "--lora_model_dir", str(env / "nowhere"), "--output_path", str(env / "out")
    )
    assert_refused(env, result, before, "nowhere", "adapter directory not found")


def test_not_an_adapter(env: Path, pristine: Path) -> None:
    before = tree_hash(env / "run")
    result = invoke(env, "--lora_model_dir", str(pristine / "base"))
    assert_refused(env, result, before, "adapter_config.json")


def test_pickled_adapter(env: Path) -> None:
    (env / "run" / "adapter_model.safetensors").rename(env / "run" / "adapter_model.bin")
    before = tree_hash(env / "run")
    assert_refused(env, invoke(env), before, "adapter_model.bin", "pickle")


def test_damaged_adapter_weights(env: Path) -> None:
    path = env / "run" / "adapter_model.safetensors"
    data = bytearray(path.read_bytes())
    data[:8] = (1 << 40).to_bytes(8, "little")
    path.write_bytes(bytes(data))
    before = tree_hash(env / "run")
    assert_refused(env, invoke(env), before, "adapter_model.safetensors", "header length")


def test_adapter_of_another_base_model(env: Path, pristine: Path) -> None:
    before = tree_hash(env / "run")
    result = invoke(env, "--base_model", str(pristine / "other"))  # a config override
    assert_refused(env, result, before, "does not fit the base model")


def test_existing_output(env: Path) -> None:
    (env / "out").mkdir()
    (env / "out" / "keep.txt").write_text("mine")
    result = invoke(env, "--output_path", str(env / "out"))
    assert result.exit_code != 0
    assert "--overwrite" in one_line_error(result.stderr)
    assert (env / "out" / "keep.txt").read_text() == "mine"
    # --overwrite replaces a model only; --overwrite_non_model anything
    result = invoke(env, "--output_path", str(env / "out"), "--overwrite")
    assert "holds more than a model (keep.txt)" in one_line_error(result.stderr)
    assert (env / "out" / "keep.txt").read_text() == "mine"
    result = invoke(env, "--output_path", str(env / "out"), "--overwrite", "--overwrite_non_model")
    assert result.exit_code == 0, result.output
    assert not (env / "out" / "keep.txt").exists()
    result = invoke(env, "--output_path", str(env / "out"), "--overwrite")  # a model: replaced
    assert result.exit_code == 0, result.output


def test_a_mistyped_option_is_an_option_error(env: Path) -> None:
    result = invoke(env, "--verfy")
    assert result.exit_code == 2
    assert "did you mean --verify" in one_line_error(result.stderr)


def test_python_module_entry_point(env: Path) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "shardforge.cli.merge_lora",
            str(env / "cfg.yml"),
            "--output_path",
            str(env / "out"),
            "--dtype",
            "bfloat16",
            "--verify",
            "--quiet",
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith(str(env / "out"))
    assert (env / "out" / "model.safetensors").is_file()
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "shardforge.cli.merge_lora",
            str(env / "cfg.yml"),
            "--lora_model_dir",
            str(env / "nowhere"),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert bad.returncode == 1
    assert "adapter directory not found" in one_line_error(bad.stderr)


def test_axolotl_do_merge_lora_reads_only_its_keys(env: Path, pristine: Path) -> None:
    """Axolotl's `do_merge_lora(cfg=load_cfg(...))`: into <output_dir>/merged; the adapter's
    settings come from its adapter_config.json, so the config's lora_* values (and training's)
    are not read; a template name it cannot render keeps the tokenizer's own."""
    from shardforge.cli.config import load_cfg
    from shardforge.cli.merge_lora import do_merge_lora

    extras = {
        "adapter": "lora",
        "lora_r": "sixteen",
        "lora_alpha": 0.5,
        "optimizer": "adamw_anyprecision",
        "chat_template": "gemma9",
    }
    cfg = yaml.safe_load((env / "cfg.yml").read_text()) | extras
    (env / "cfg.yml").write_text(yaml.safe_dump(cfg))
    out = do_merge_lora(cfg=load_cfg(env / "cfg.yml"), quiet=True)
    assert out == env / "run" / "merged"
    want = torch.load(pristine / "merged.pt", weights_only=True)
    for key, tensor in load_file(str(out / "model.safetensors")).items():
        assert torch.equal(tensor, want[key]), key
    result = invoke(env, "--output_path", str(env / "out"))
    assert result.exit_code == 0, result.output
    assert result.stderr.count("unknown template name 'gemma9'") == 1


@pytest.fixture(scope="module")
def second_base(pristine: Path) -> Path:
    """Another base model of the same shapes (other values): its model.safetensors has the
    size of the first one's."""
    other = make_model(pristine / "second-base", "llama", seed=1)
    first, second = pristine / "base" / "model.safetensors", other / "model.safetensors"
    assert first.stat().st_size == second.stat().st_size
    assert first.read_bytes() != second.read_bytes()
    return other


@pytest.mark.parametrize("how", ["renamed", "in_place", "in_place_mtime_set_back"])
def test_a_base_model_replaced_while_merge_lora_runs_is_refused(
    env: Path, pristine: Path, second_base: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """The base model's weights replaced by another model's of the same shapes once the merge
    has planned, between two of its reads (by rename; in place; in place with the mtime set
    back, as `touch -r` does): one error line naming the file, nothing published."""
    from helpers.saves import change_after_plan, rewrite_in_place

    base = env / "base"
    shutil.copytree(pristine / "base", base)
    weights, other = base / "model.safetensors", second_base / "model.safetensors"

    def change() -> None:
        if how == "renamed":
            shutil.copyfile(other, base / ".new")
            os.replace(base / ".new", weights)
        else:
            rewrite_in_place(weights, other.read_bytes(), keep_mtime=how != "in_place")

    done = change_after_plan(monkeypatch, weights, change)
    result = invoke(env, "--base_model", str(base), "--output_path", str(env / "out"))
    assert done, result.output  # changed mid-run
    line = one_line_error(result.stderr)
    assert result.exit_code != 0
    assert "model.safetensors: changed while the merge read it" in line, line
    assert not (env / "out").exists() and not list(env.glob(".out*"))  # nothing published


def test_two_merge_lora_writers_to_one_output_are_kept_apart(
    env: Path, pristine: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A second merge-lora to the output of one that runs (started from within the first,
    between two of its reads: deterministic) is refused before it reads or writes anything;
    the first publishes its model."""
    from helpers.saves import change_after_plan
    from shardforge.io.lock import OutputLocked
    from shardforge.merge.lora import merge_lora

    out = env / "out"
    cfg = {"base_model": str(pristine / "base"), "output_dir": str(env / "run")}
    second: list[BaseException] = []

    def another_writer() -> None:
        try:
            merge_lora(cfg, out, quiet=True)
        except BaseException as exc:
            second.append(exc)

    done = change_after_plan(monkeypatch, pristine / "base" / "model.safetensors", another_writer)
    result = invoke(env, "--output_path", str(out))
    assert done and result.exit_code == 0, result.output
    assert len(second) == 1 and isinstance(second[0], OutputLocked), second
    assert "in use by shardforge merge-lora" in str(second[0])
    want = torch.load(pristine / "merged.pt", weights_only=True)
    for key, tensor in load_file(str(out / "model.safetensors")).items():
        assert torch.equal(tensor, want[key]), key
    assert not list(env.glob("out.shardforge.lock"))  # let go at the end
