"""Bad configs fail before any process group starts, naming the config key (real CLI)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from train_helpers import train_env, untimed, write_config

from helpers import children
from shardforge.cli.main import cli
from shardforge.config import validate_cfg
from shardforge.config.schema import ShardforgeConfig
from shardforge.errors import ConfigError
from shardforge.train import preflight as preflight_module
from shardforge.train.launch import LaunchOptions, do_train
from shardforge.train.preflight import CHECKS, Problem, check_attention, preflight


def _bad(cfg: dict[str, Any], tmp: Path, name: str) -> dict[str, Any]:
    """Each case: (key that must be named, text that must appear, config change)."""
    cases: dict[str, dict[str, Any]] = {
        "missing_data": {"datasets": [{"path": str(tmp / "nope.jsonl")}]},
        "no_data": {"datasets": []},
        "wrap_class": {"fsdp": {"transformer_layer_cls_to_wrap": ["GPT2Block"]}},
        "sequence_len": {"sequence_len": 0},
        "base_model": {"base_model": str(tmp / "no-model")},
        "resume": {"resume_from_checkpoint": str(tmp)},
        "stale": {"output_dir": str(_fake_checkpoint(tmp / "old", 8))},
        "fp16_on_cpu": {"fp16": True},
        "flex_on_cpu": {"flex_attention": True},  # Axolotl's flag
    }
    return {**cfg, "output_dir": str(tmp / "out"), **cases[name]}


def _fake_checkpoint(output_dir: Path, step: int) -> Path:
    (output_dir / f"checkpoint-{step}" / "model").mkdir(parents=True)
    (output_dir / f"checkpoint-{step}" / "model" / ".metadata").write_bytes(b"")
    (output_dir / f"checkpoint-{step}" / "trainer_state.json").write_text("{}")
    return output_dir


CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="a check for machines without GPU")

CASES = [
    ("missing_data", "datasets[0].path", "nope.jsonl not found"),
    ("no_data", "datasets", "no training data"),
    ("wrap_class", "fsdp.transformer_layer_cls_to_wrap", "GPT2Block not in the model"),
    ("sequence_len", "sequence_len", "must be > 0"),
    ("base_model", "base_model", "no-model"),
    ("resume", "resume_from_checkpoint", "not a complete checkpoint"),
    ("stale", "output_dir", "already holds checkpoints (checkpoint-8); set resume_from_checkpoint"),
    pytest.param("fp16_on_cpu", "fp16", "needs a GPU", marks=CPU_ONLY),
]


# every case runs the command in this process (a process of its own costs seconds of imports),
# where that no child process at all is started is checked directly; the command's own process
# (exit status, stderr) is read by test_an_error_found_by_the_ranks_is_printed_once_as_the_last_line
# (below), tests/cli/test_train_cli.py and tests/train/test_axolotl_corpus.py
@pytest.mark.parametrize("name,key,text", CASES)
def test_bad_config_fails_before_launch(
    base_cfg: dict[str, Any], tmp_path: Path, name: str, key: str, text: str
) -> None:
    config = write_config(tmp_path / "bad.yml", _bad(base_cfg, tmp_path, name))
    with children.watching() as started:
        result = CliRunner().invoke(cli, ["train", str(config), "--nproc_per_node", "2"])
    assert not started, started  # no torchrun, no process at all
    status, stderr = result.exit_code, result.stderr
    assert status == 2, stderr
    errors = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, stderr
    assert key in errors[0] and text in errors[0], errors[0]
    assert "Traceback" not in stderr
    assert "launching" not in stderr  # torchrun was never started
    assert not (tmp_path / "out").exists()  # nothing was written


def test_every_problem_is_reported_at_once(base_cfg: dict[str, Any], tmp_path: Path) -> None:
    raw = {
        **base_cfg,
        "datasets": [{"path": str(tmp_path / "a.jsonl")}, {"path": str(tmp_path / "b.parquet")}],
        "fsdp": {"transformer_layer_cls_to_wrap": ["Qwen2DecoderLayer"]},
    }
    with pytest.raises(ConfigError) as info:
        preflight(validate_cfg(raw), "cfg.yml")
    text = str(info.value)
    assert "3 problems" in text
    for key in ("datasets[0].path", "datasets[1].path", "fsdp.transformer_layer_cls_to_wrap"):
        assert key in text


def _passing_checks(cfg: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Run preflight on `cfg`, which must pass: what each of its checks returned, by name."""
    results: dict[str, Any] = {}

    def recorded(check: Callable[[ShardforgeConfig], list[Problem]]) -> Any:
        def run(cfg: ShardforgeConfig) -> list[Problem]:
            results[check.__name__] = check(cfg)
            return results[check.__name__]

        return run

    monkeypatch.setattr(preflight_module, "CHECKS", tuple(map(recorded, CHECKS)))
    assert preflight(validate_cfg(cfg), "cfg.yml") is None  # raises on any problem
    return results


def test_auto_detected_wrap_class_and_a_good_config_pass(
    base_cfg: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without fsdp.transformer_layer_cls_to_wrap the model check finds the block class in
    the model's _no_split_modules; every check runs and finds nothing."""
    real, detected = preflight_module.wrap_classes, []

    def wrap_classes(model: Any, names: list[str] | None) -> Any:
        classes = real(model, names)
        detected.append(({c.__name__ for c in classes}, names))
        return classes

    monkeypatch.setattr(preflight_module, "wrap_classes", wrap_classes)
    results = _passing_checks({**base_cfg, "fsdp": {}}, monkeypatch)
    assert detected == [({"LlamaDecoderLayer"}, None)]  # none named: found in the model
    assert results == {check.__name__: [] for check in CHECKS}


@pytest.mark.slow  # torchrun and 2 ranks
def test_an_error_found_by_the_ranks_is_printed_once_as_the_last_line(
    base_cfg: dict[str, Any], tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """Too little data for one whole global batch (dataloader_drop_last) is only known after
    tokenizing (on the ranks): one `error:` line, no traceback or torchrun failure report; the
    config's notice (Axolotl's fsdp_config spelling) is printed once, not once per rank.

    The command runs in this process (CliRunner: its exit status and what it prints), torchrun
    and its 2 ranks as real child processes, which write to this process's stderr (capfd);
    the command prints its error after torchrun has ended (nothing of theirs can follow it)."""
    cfg = {
        **{k: v for k, v in base_cfg.items() if k != "fsdp"},
        "fsdp_config": {"fsdp_transformer_layer_cls_to_wrap": "LlamaDecoderLayer"},
        "output_dir": str(tmp_path / "out"),
        "micro_batch_size": 500,
        "dataloader_drop_last": True,
    }
    config = write_config(tmp_path / "big.yml", cfg)
    capfd.readouterr()
    with pytest.MonkeyPatch.context() as env:  # the ranks' environment, as run_train gives it
        for key, value in train_env().items():
            env.setenv(key, value)
        result = CliRunner().invoke(cli, ["train", str(config), "--nproc_per_node", "2"])
    children_err = capfd.readouterr().err  # torchrun's and the ranks' output
    assert result.exit_code == 1, result.stderr
    lines = result.stderr.strip().splitlines()
    assert (
        lines[-1].startswith("error: datasets: ")
        and "fewer than one global batch (2000" in lines[-1]
    )
    everything = untimed(children_err) + result.stderr
    assert [line for line in lines if "error:" in line] == lines[-1:], result.stderr
    assert "error:" not in children_err, children_err
    assert "Traceback" not in everything and "ChildFailedError" not in everything
    notices = [line for line in everything.splitlines() if "notice:" in line]  # fsdp_config:
    assert len(notices) == len(set(notices)), notices  # a debug line now; never per rank


def _preflight_problem(cfg: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as info:
        preflight(validate_cfg(cfg), "cfg.yml")
    return str(info.value)


def test_output_dir_is_never_the_base_model(base_cfg: dict[str, Any], tmp_path: Path) -> None:
    base = Path(base_cfg["base_model"])
    (tmp_path / "link").symlink_to(base)
    for out in (base, base / "out", tmp_path / "link" / "out"):
        text = _preflight_problem({**base_cfg, "output_dir": str(out)})
        assert text.startswith("cfg.yml: output_dir: ") and "base model directory" in text, text


@pytest.mark.parametrize(
    "saved", ["model.safetensors", "model.safetensors.index.json", "pytorch_model-00001.bin"]
)
def test_a_fresh_run_never_overwrites_a_saved_model(
    base_cfg: dict[str, Any], tmp_path: Path, saved: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / saved).write_bytes(b"")
    text = _preflight_problem({**base_cfg, "output_dir": str(out)})
    assert (
        text.startswith("cfg.yml: output_dir: ")
        and f"already holds a saved model ({saved})" in text
    )
    resumed = {**base_cfg, "output_dir": str(out), "resume_from_checkpoint": "auto"}
    results = _passing_checks(resumed, monkeypatch)  # resuming may keep a saved model
    assert results["check_output"] == [] and results["check_resume"] == []


def test_attn_implementation_is_checked(base_cfg: dict[str, Any]) -> None:
    text = _preflight_problem({**base_cfg, "attn_implementation": "flash"})
    assert "attn_implementation: unknown value 'flash'; transformers accepts eager, " in text
    assert "sdpa" in text and "flash_attention_2" in text
    for impl in ("eager", "sdpa"):
        assert check_attention(validate_cfg({**base_cfg, "attn_implementation": impl})) == []


@CPU_ONLY
@pytest.mark.parametrize(
    ("impl", "why"),
    [
        ("flash_attention_2", "needs a CUDA GPU and the flash-attn package"),
        ("flash_attention_3", "needs a CUDA GPU and the flash-attn package"),
        ("flex_attention", "cannot train without a CUDA GPU (torch has no CPU backward for it)"),
    ],
)
def test_an_attention_that_cannot_run_here_is_replaced_with_a_notice(
    base_cfg: dict[str, Any], impl: str, why: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Axolotl's configs name flash_attention_2: on a machine without it the run goes on with
    sdpa (the same attention) and says so once, instead of a refusal."""
    from shardforge.train.model import build_meta_model

    cfg = validate_cfg({**base_cfg, "attn_implementation": impl})
    assert check_attention(cfg) == []
    with caplog.at_level("WARNING", logger="shardforge"):
        model = build_meta_model(cfg, announce=True)
    assert model.config._attn_implementation == "sdpa"
    notices = [r.getMessage() for r in caplog.records if r.name == "shardforge"]
    assert notices == [
        f"notice: attn_implementation: {impl} {why}; sdpa runs instead (same attention)"
    ]


def test_an_attention_the_model_lacks_is_replaced_by_one_it_has(tmp_path: Path) -> None:
    """gpt-oss has no sdpa: `sdpa` builds it with eager, with the notice naming the class."""
    from transformers import AutoConfig

    from shardforge.train.model import runnable_attention

    config = AutoConfig.for_model("gpt_oss", num_hidden_layers=1, num_local_experts=2)
    impl, notice = runnable_attention("sdpa", config)
    assert impl == "eager"
    assert notice == (
        "attn_implementation: sdpa is not supported by GptOssForCausalLM; eager runs instead "
        "(same attention)"
    )
    assert runnable_attention("eager", config) == ("eager", None)
    llama = AutoConfig.for_model("llama", num_hidden_layers=1)
    assert runnable_attention("sdpa", llama) == ("sdpa", None)


def test_chunked_cross_entropy_true_needs_a_model_it_is_exact_for(tmp_path: Path) -> None:
    """Gemma2 soft-caps its logits after the head: `true` is refused before launch, null
    trains with the plain loss."""
    from transformers import AutoConfig

    from shardforge.train.preflight import check_model

    base = tmp_path / "gemma2"
    AutoConfig.for_model("gemma2", num_hidden_layers=1, hidden_size=32).save_pretrained(base)
    (base / "model.safetensors").write_bytes(b"")  # only its presence is checked here
    cfg = {
        "base_model": str(base),
        "fsdp": {"transformer_layer_cls_to_wrap": ["Gemma2DecoderLayer"]},
    }
    [(key, problem)] = check_model(validate_cfg({**cfg, "chunked_cross_entropy": True}))
    assert key == "chunked_cross_entropy"
    assert "not be exact for Gemma2ForCausalLM: its forward changes the logits after" in problem
    assert check_model(validate_cfg(cfg)) == []


def test_mesh_sizes_are_checked_before_launch(base_cfg: dict[str, Any], tmp_path: Path) -> None:
    """The launcher knows the world size (nproc_per_node x nnodes) and checks the mesh."""
    cfg = {**base_cfg, "output_dir": str(tmp_path / "out"), "dp_shard_size": 3}
    config = write_config(tmp_path / "hsdp.yml", cfg)
    with pytest.raises(ConfigError, match="dp_shard_size: 3 does not divide the world size 4"):
        do_train(config, [], "torchrun", LaunchOptions(nproc_per_node=4))
    with pytest.raises(ConfigError, match="dp_shard_size: 4 does not divide the world size 6"):
        do_train(config, ["--dp_shard_size", "4"], "torchrun", LaunchOptions(2, nnodes="3"))
    assert not (tmp_path / "out").exists()


@CPU_ONLY
def test_offload_params_without_a_gpu_passes_with_a_notice(
    base_cfg: dict[str, Any], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """fsdp.offload_params, as most of Axolotl's FSDP examples set it: without a GPU the
    parameters are on the CPU already; the run goes on (no offload policy) with one notice."""
    cfg = {**base_cfg, "fsdp": {**base_cfg["fsdp"], "offload_params": True}}
    with caplog.at_level("WARNING", logger="shardforge"):
        results = _passing_checks(cfg, monkeypatch)
    assert results["check_device"] == []
    notices = [r.getMessage() for r in caplog.records if "offload_params" in r.getMessage()]
    assert notices == [
        "notice: fsdp.offload_params: no GPU here; the parameters stay on the CPU as they are "
        "(no offload policy needed)"
    ]
