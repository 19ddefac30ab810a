"""`shardforge quantize`: torchao int8 weights of a tiny model (built here, bf16) written as a
Hugging Face folder that transformers loads and generates from, at most 0.55x the bf16 size;
Axolotl's flags with dashes or underscores; int4 refused on a machine without a CUDA GPU; bad
options as one error line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner

from helpers.tiny import make_model
from shardforge.cli.main import cli
from shardforge.errors import ShardforgeError
from shardforge.use.quantize import weight_bytes
from shardforge.use.request import QuantizeRequest


@pytest.fixture(scope="module")
def bf16_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny llama in bf16 whose linear layers hold most of its weights."""
    out = tmp_path_factory.mktemp("bf16") / "model"
    return make_model(out, hidden_size=256, intermediate_size=1024, dtype="bfloat16")


@pytest.fixture
def cfg(bf16_model: Path, tmp_path: Path) -> Path:
    path = tmp_path / "cfg.yml"
    path.write_text(
        yaml.safe_dump({"base_model": str(bf16_model), "output_dir": str(tmp_path / "out")})
    )
    return path


def test_int8_loads_in_transformers_generates_and_is_at_most_055x(
    bf16_model: Path, cfg: Path, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    args = ["quantize", str(cfg), "--base-model", str(bf16_model), "--weight_dtype", "int8"]
    result = CliRunner().invoke(
        cli, [*args, "--quantize-embedding", "--output_dir", str(tmp_path / "q")]
    )
    assert result.exit_code == 0, result.output
    out = tmp_path / "q" / "quantized"
    assert result.stdout.splitlines()[0] == f"quantized: {out}"
    assert weight_bytes(out) <= 0.55 * weight_bytes(bf16_model), result.stdout
    assert "-> " in result.stdout.splitlines()[1] and "x)" in result.stdout.splitlines()[1]
    assert (
        json.loads((out / "config.json").read_text())["quantization_config"]["quant_method"]
        == "torchao"
    )

    model = AutoModelForCausalLM.from_pretrained(out)
    weight = model.model.layers[0].mlp.up_proj.weight
    assert type(weight).__name__ == "Int8Tensor" and weight.qdata.dtype == torch.int8
    assert type(model.lm_head.weight).__name__ == "Int8Tensor"
    new = model.generate(torch.tensor([[1, 5, 6, 7]]), max_new_tokens=6, do_sample=False)
    assert new.shape == (1, 10)
    # the run's output_dir is where it goes by default (Axolotl's OUTPUT_DIR/quantized)
    again = CliRunner().invoke(cli, ["quantize", str(cfg), "--base_model", str(bf16_model)])
    assert again.exit_code == 0, again.output
    assert (tmp_path / "out" / "quantized" / "model.safetensors").is_file()
    assert (tmp_path / "out" / "quantized" / "tokenizer.json").is_file()


def test_int4_without_a_gpu_is_one_error_line(bf16_model: Path, cfg: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA GPU: int4 is allowed")
    result = CliRunner().invoke(
        cli, ["quantize", str(cfg), "--base_model", str(bf16_model), "--weight-dtype", "int4"]
    )
    assert result.exit_code == 1 and result.stdout == ""
    assert result.stderr.strip() == (
        "error: --weight_dtype int4 needs a CUDA GPU (torchao's int4 kernels); use "
        "--weight_dtype int8 on this machine"
    )


@pytest.mark.parametrize(
    "options,message",
    [
        ({"base_model": "a", "model_dir": "b"}, "--base_model and --model_dir each name the model"),
        ({"weight_dtype": "int8", "group_size": 64}, "--group_size applies to --weight_dtype int4"),
        ({"weight_dtype": "int4", "group_size": 0}, "--group_size 0: expected 1 or more"),
    ],
)
def test_conflicting_options(options: dict[str, object], message: str) -> None:
    with pytest.raises(ShardforgeError, match=message):
        QuantizeRequest(**options)  # type: ignore[arg-type]


def test_the_quantization_block_fills_what_the_flags_leave_open(tmp_path: Path) -> None:
    from shardforge.config import load_cfg
    from shardforge.use.quantize import settled

    path = tmp_path / "q.yml"
    block = {"weight_dtype": "int4", "group_size": 64, "quantize_embedding": True}
    path.write_text(yaml.safe_dump({"base_model": "m", "quantization": block}))
    cfg = load_cfg(path)
    got = settled(cfg, QuantizeRequest())
    assert (got.weight_dtype, got.group_size, got.quantize_embedding) == ("int4", 64, True)
    flags = settled(cfg, QuantizeRequest(weight_dtype="int8"))  # a flag wins; int8 has no groups
    assert (flags.weight_dtype, flags.group_size) == ("int8", None)
    plain = settled(load_cfg(path, quantization=None), QuantizeRequest())
    assert (plain.weight_dtype, plain.activation_dtype, plain.quantize_embedding) == (
        "int8",
        None,
        False,
    )
    path.write_text(yaml.safe_dump({"base_model": "m", "quantization": {"weight_dtype": "nvfp4"}}))
    with pytest.raises(ShardforgeError, match=r"quantization\.weight_dtype"):
        load_cfg(path)


def test_without_torchao_one_error_line_names_the_extra(
    bf16_model: Path, cfg: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "torchao", None)  # import torchao: ImportError
    result = CliRunner().invoke(cli, ["quantize", str(cfg), "--base_model", str(bf16_model)])
    assert result.exit_code == 1 and result.stdout == ""
    assert result.stderr.strip().endswith(
        "error: quantize needs torchao, which is not installed: pip install 'shardforge[quant]'"
    )
