"""Every config shipped in examples/ validates, the tiny example's files are present, and each
example whose model ships with it runs through every command as a user types them: preprocess,
train (2 ranks), merge, inference and evaluate (its held-out data)."""

from __future__ import annotations

import json
import os
import runpy
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner

from shardforge.config import load_cfg

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").rglob("*.yml")) + sorted((ROOT / "examples").rglob("*.yaml"))
# the examples whose base model and data ship in examples/ (the others download theirs)
RUNNABLE = [
    p for p in EXAMPLES if yaml.safe_load(p.read_text())["base_model"].startswith("examples/")
]
# what each runnable example's run changes: a few steps (the chat example's own 20 steps: its
# answers need them), checkpoints at two steps
STEPS = {"tiny-llama.yml": ["--max_steps", "6", "--save_steps", "3"], "tiny-llama-chat.yml": []}
PROMPTS = {"tiny-llama.yml": "The robot", "tiny-llama-chat.yml": "Tell me a story."}
# the example whose train and inference run in a process of their own, as a user types them
# (their exit status and stderr: no transformers' bars or warnings); every other command, and
# the other example's train launcher, run in this process (the same click commands, without an
# interpreter's seconds of start-up: merge's and verify's own processes are tested in
# tests/cli); torchrun and its 2 ranks are always real processes
IN_PROCESSES = "tiny-llama.yml"


def test_there_are_examples() -> None:
    assert len(EXAMPLES) >= 3
    assert sorted(p.name for p in RUNNABLE) == sorted(STEPS)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_validates(path: Path) -> None:
    cfg = load_cfg(path)
    assert cfg.base_model
    assert cfg.val_set_size or cfg.test_datasets, "evaluate needs held-out data"


def test_tiny_example_ships_its_model_and_data() -> None:
    cfg = load_cfg(ROOT / "examples" / "tiny-llama.yml")
    base = ROOT / cfg.base_model
    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json"):
        assert (base / name).is_file(), name
    for ds in cfg.datasets:
        assert (ROOT / ds.path).is_file(), ds.path


def _env() -> dict[str, str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1")
    return {**env, "TOKENIZERS_PARALLELISM": "false"}


def _shardforge(*args: Any) -> subprocess.CompletedProcess[str]:
    """The real `shardforge` command in a process of its own, from the repository's root (the
    examples' paths are relative to it)."""
    argv = [sys.executable, "-m", "shardforge", *map(str, args)]
    proc = subprocess.run(argv, capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=300)
    assert proc.returncode == 0, f"{args[0]} failed:\n{proc.stderr[-4000:]}"
    return proc


def _invoke(*args: Any) -> Any:
    """`shardforge ARGS` in this process (the same click command, without an interpreter's
    start-up)."""
    from shardforge.cli.main import cli

    result = CliRunner().invoke(cli, list(map(str, args)))
    assert result.exit_code == 0, result.output
    return result


def _train(example: Path, args: list[Any], own: bool, capfd: pytest.CaptureFixture[str]) -> str:
    """`shardforge train EXAMPLE --nproc_per_node 2 ARGS`: what it printed on stderr. `own`: the
    command in a process of its own; else its launcher in this process (`do_train`, the
    command's body), with torchrun and the ranks real child processes writing to this
    process's stderr."""
    if own:
        return _shardforge("train", example, "--nproc_per_node", "2", *args).stderr
    from shardforge.train.launch import LaunchOptions, do_train

    with pytest.MonkeyPatch.context() as env:
        for key, value in _env().items():
            env.setenv(key, value)
        capfd.readouterr()
        assert do_train(example, list(map(str, args)), "torchrun", LaunchOptions(2)) == 0
    return capfd.readouterr().err


def _run_script(script: Path) -> None:
    """`python SCRIPT sys.argv[1:]` in this process; transformers' progress bars as they were
    (generate.py turns them off: the later commands' output must show they are off by
    themselves)."""
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    try:
        runpy.run_path(str(script), run_name="__main__")
    finally:
        (hf_logging.enable_progress_bar if bars else hf_logging.disable_progress_bar)()


def _same_as_checkpoint(merged: Path, checkpoint: Path) -> None:
    """The merged model computes what the checkpoint's weights compute."""
    import torch
    import torch.distributed.checkpoint as dcp
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(merged)
    trained = AutoModelForCausalLM.from_pretrained(ROOT / "examples" / "tiny-llama" / "base")
    state = trained.state_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=str(checkpoint / "model"), no_dist=True)
    trained.load_state_dict(state)
    ids = torch.tensor([[40, 50, 60, 70, 80]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, trained(ids).logits)


@pytest.mark.slow  # train under torchrun, the other commands in processes of their own
@pytest.mark.parametrize("path", RUNNABLE, ids=lambda p: p.name)
def test_example_runs_every_command(
    path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(ROOT)
    example = path.relative_to(ROOT)
    out, merged, prepared = tmp_path / "out", tmp_path / "merged", tmp_path / "prepared"
    where = ["--output_dir", out, "--dataset_prepared_path", prepared]

    result = _invoke("preprocess", example, *where)
    assert "(written)" in result.stdout and "evaluation sequences (val_set_size)" in result.stdout

    own = path.name == IN_PROCESSES
    train = _train(example, [*where, *STEPS[path.name]], own, capfd)
    assert "using prepared dataset at" in train
    last = max(int(p.name.split("-")[1]) for p in out.glob("checkpoint-*"))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    logged = next(r for r in rows if r.get("step") == last and "eval_loss" in r)

    _invoke("merge-sharded-fsdp-weights", example, *where, "--output_path", merged, "--quiet")
    _same_as_checkpoint(merged, out / f"checkpoint-{last}")
    _invoke("verify", merged, "--checkpoint", out)

    if path.name == "tiny-llama.yml":  # the README's story: plain transformers generates
        # the script as `python examples/generate.py MERGED ...` runs it, in this process
        argv = ["examples/generate.py", merged, "--prompt", "The robot", "--max_new_tokens", "8"]
        monkeypatch.setattr(sys, "argv", list(map(str, argv)))
        capfd.readouterr()
        _run_script(ROOT / "examples" / "generate.py")
        gen = capfd.readouterr().out
        assert gen.startswith("The robot") and len(gen.strip()) > len("The robot")

    prompt = ["--prompt", PROMPTS[path.name], "--max_new_tokens", "16"]
    answer = _invoke("inference", example, *where, *prompt).stdout  # the run's latest checkpoint
    assert answer.strip(), "an empty answer"
    # as Axolotl names the model; the answer and shardforge's lines, not transformers' bars
    named = (_shardforge if own else _invoke)("inference", example, "--base-model", merged, *prompt)
    assert named.stdout == answer and f"model: {merged} (--base_model)" in named.stderr
    for noise in ("Loading weights", "it/s]", "Warning", "warnings.warn"):
        assert noise not in named.stderr, named.stderr

    metrics = json.loads(_invoke("evaluate", example, *where, "--json").stdout)
    assert metrics["eval_loss"] == pytest.approx(logged["eval_loss"], abs=1e-5)
    assert metrics["eval_tokens"] == logged["eval_tokens"]
