"""QLoRA (`adapter: qlora`, `load_in_4bit`: NF4 base weights) and 8-bit LoRA (`load_in_8bit`)
under FSDP2: a tiny Llama (q/v adapters) and a tied-embedding Qwen2 (every linear layer adapted,
the embedding trained), each trained on 2 gloo ranks (`train_helpers.shared_run`: qlora-llama,
qlora-qwen, int8-llama, int8-qwen, in the launch every training test shares).

The loss falls and differs from the same run over float weights (the quantization is real); a
run resumed on 1 rank from checkpoint-2 gives the uninterrupted run's losses; the PEFT adapter
loads over the unquantized base; `merge_lora` fuses it into the unquantized base and the result
loads in transformers and generates; `merge_fsdp_weights` of a checkpoint gives the adapter.
The in-process tests check what is quantized and how many bytes it holds, and the config's
errors.
"""

from __future__ import annotations

import json
import math
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from train_helpers import Run, losses, read_metrics, shared_run, write_config

from shardforge.config import load_cfg
from shardforge.errors import ConfigError

RUNS = ["qlora-llama", "qlora-qwen", "int8-llama", "int8-qwen"]
PLAIN = {"llama": "lora-llama", "qwen": "lora-qwen"}  # the same runs over float weights


def _run(tmp_path_factory: pytest.TempPathFactory, name: str) -> Run:
    return shared_run(tmp_path_factory, name)


@pytest.mark.slow
@pytest.mark.parametrize("name", RUNS)
def test_the_loss_falls_over_quantized_weights(
    name: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    run = _run(tmp_path_factory, name)
    plain = _run(tmp_path_factory, PLAIN[name.split("-")[1]])
    got, float_weights = losses(run.out), losses(plain.out)
    assert sorted(got) == [1, 2, 3, 4]
    assert got[4] < got[1]  # the adapter learns
    # step 1 is the base model's loss (B starts at zero): close to the float run's, not equal
    assert got[1] != float_weights[1]
    assert math.isclose(got[1], float_weights[1], rel_tol=0.02), (got[1], float_weights[1])
    kind = "NF4 (4-bit)" if name.startswith("qlora") else "int8 (8-bit)"
    assert f"{kind} base weights: 14 linear layers quantized" in run.stderr


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qlora-llama", "int8-qwen"])
def test_a_resume_on_one_rank_gives_the_uninterrupted_losses(
    name: str, tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    from shardforge.train.launch import do_train

    run = _run(tmp_path_factory, name)
    out = Path(shutil.copytree(run.out, tmp_path / "out"))
    shutil.rmtree(out / "checkpoint-4")
    kept = [m for m in read_metrics(out) if m["step"] <= 2]
    (out / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in kept))
    cfg = {
        **run.cfg,
        "output_dir": str(out),
        "micro_batch_size": 2 * run.cfg["micro_batch_size"],
        "resume_from_checkpoint": "auto",
    }
    assert do_train(write_config(tmp_path / "cfg.yml", cfg), [], "python") == 0
    got, want = losses(out), losses(run.out)
    for step in (3, 4):  # 1 vs 2 ranks: the sums of the dequantized matmuls in another order
        assert math.isclose(got[step], want[step], rel_tol=1e-5), (step, got[step], want[step])


def _ids() -> torch.Tensor:
    return torch.randint(4, 300, (2, 12), generator=torch.Generator().manual_seed(0))


@pytest.mark.slow
@pytest.mark.parametrize("name", RUNS)
def test_the_adapter_loads_over_the_float_base_and_merge_lora_generates(
    name: str, tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from shardforge.merge.lora import merge_lora

    run = _run(tmp_path_factory, name)
    base = AutoModelForCausalLM.from_pretrained(run.cfg["base_model"])
    adapted = PeftModel.from_pretrained(base, run.out).eval()
    saved = load_file(str(run.out / "adapter_model.safetensors"))
    assert any(k.endswith("lora_B.weight") and v.abs().sum() > 0 for k, v in saved.items())
    merge_lora(load_cfg(run.config, command="merge"), tmp_path / "fused", quiet=True)
    fused = AutoModelForCausalLM.from_pretrained(tmp_path / "fused").eval()
    for key, tensor in fused.state_dict().items():
        assert tensor.dtype == torch.float32, key  # the float base, not dequantized weights
    with torch.no_grad():
        want = adapted(input_ids=_ids()).logits
        got = fused(input_ids=_ids()).logits
        plain = AutoModelForCausalLM.from_pretrained(run.cfg["base_model"])(input_ids=_ids())
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(got, plain.logits, atol=1e-4)  # the adapter changed it
    prompt = torch.tensor([[1, 40, 41, 42]])
    generated = fused.generate(prompt, max_new_tokens=5, do_sample=False, pad_token_id=3)
    assert generated.shape == (1, 9)


@pytest.mark.slow
def test_merging_a_qlora_checkpoint_gives_the_adapter(
    tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    from safetensors.torch import load_file

    from shardforge.merge.api import merge_fsdp_weights

    run = _run(tmp_path_factory, "qlora-llama")
    merge_fsdp_weights(load_cfg(run.config, command="merge"), tmp_path / "adapter", quiet=True)
    got = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    want = load_file(str(run.out / "adapter_model.safetensors"))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4


# -- in this process ---------------------------------------------------------------------------


def _cfg(tmp_path: Path, base: Path, **changes: Any) -> Any:
    data = {
        "base_model": str(base),
        "datasets": [{"path": "x.jsonl", "type": "completion"}],
        "adapter": "lora",
        "lora_r": 4,
        "lora_target_linear": True,
        **changes,
    }
    return load_cfg(write_config(tmp_path / "cfg.yml", data))


def _meta_model(cfg: Any) -> torch.nn.Module:
    from shardforge.train.lora import add_lora
    from shardforge.train.model import build_meta_model

    model = build_meta_model(cfg)
    add_lora(model, cfg)
    return model


@pytest.fixture(scope="module")
def qwen_base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from helpers.tiny import make_model

    return make_model(tmp_path_factory.mktemp("quant") / "qwen", "qwen2", with_tokenizer=False)


@pytest.mark.parametrize(
    ("changes", "per_element"),
    [({"adapter": "qlora", "load_in_4bit": True}, (0.5, 0.56)), ({"load_in_8bit": True}, (1, 1.1))],
)
def test_every_frozen_linear_is_quantized_and_holds_fewer_bytes(
    changes: dict[str, Any], per_element: tuple[float, float], tmp_path: Path, qwen_base: Path
) -> None:
    from shardforge.train.diagnostics import stored_bytes
    from shardforge.train.quant import quantize_base

    cfg = _cfg(tmp_path, qwen_base, **changes)
    model = _meta_model(cfg)
    names = quantize_base(model, cfg, (2,))
    assert len(names) == 14 and all(n.endswith(".base_layer.weight") for n in names)
    params = dict(model.named_parameters())
    embedding = params["model.embed_tokens.weight"]  # tied to lm_head: neither is quantized
    assert "lm_head.weight" not in names and type(embedding) is torch.nn.Parameter
    for name in names:
        weight = params[name]
        assert not weight.requires_grad
        low, high = per_element
        assert low <= stored_bytes(weight) / weight.numel() < high, name
    # llm_int8_skip_modules: those stay in float
    cfg = _cfg(
        tmp_path, qwen_base, **changes, bnb_config_kwargs={"llm_int8_skip_modules": ["o_proj"]}
    )
    assert len(quantize_base(_meta_model(cfg), cfg, (2,))) == 12


def test_nf4_scaler_blocks_fit_the_shards() -> None:
    from shardforge.train.quant import nf4_scaler_block

    assert nf4_scaler_block(torch.Size([2048, 2048]), 8) == 256  # bitsandbytes' default
    assert nf4_scaler_block(torch.Size([32, 64]), 2) == 16  # 32 blocks: 2 groups of 16
    assert nf4_scaler_block(torch.Size([33, 64]), 2) is None  # rows do not split evenly
    assert nf4_scaler_block(torch.Size([4, 10]), 1) is None  # not whole blocks


def test_quantized_runs_refuse_what_they_cannot_do(tmp_path: Path, qwen_base: Path) -> None:
    from shardforge.train.quant import check_quant, quantize_base

    bad = [
        ({"adapter": "qlora"}, "needs load_in_4bit"),
        ({"load_in_4bit": True}, "set adapter: qlora"),
        ({"adapter": "qlora", "load_in_4bit": True, "load_in_8bit": True}, "both set"),
        (
            {
                "adapter": "qlora",
                "load_in_4bit": True,
                "bnb_config_kwargs": {"bnb_4bit_quant_type": "fp4"},
            },
            "bnb_4bit_quant_type",
        ),
        ({"load_in_8bit": True, "bnb_config_kwargs": {"llm_int8_threshold": 6.0}}, "not a setting"),
    ]
    for changes, text in bad:
        with pytest.raises(ConfigError, match=text):
            _cfg(tmp_path, qwen_base, **changes)
    cfg = _cfg(
        tmp_path,
        qwen_base,
        adapter="qlora",
        load_in_4bit=True,
        bnb_config_kwargs={
            "bnb_4bit_compute_dtype": "bfloat16",
            "bnb_4bit_quant_storage": "bfloat16",
        },
    )
    assert "the run computes in torch.float32" in check_quant(cfg, None)[0][1]
    with pytest.raises(ConfigError, match="HSDP"):
        quantize_base(_meta_model(cfg), cfg, (2, 2))


def test_a_missing_torchao_names_the_extra(
    tmp_path: Path, qwen_base: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from shardforge.train.quant import check_quant

    cfg = _cfg(tmp_path, qwen_base, load_in_8bit=True)
    for module in [m for m in sys.modules if m == "torchao" or m.startswith("torchao.")]:
        monkeypatch.delitem(sys.modules, module)
    monkeypatch.setitem(sys.modules, "torchao", None)  # import torchao raises ImportError
    ((key, problem),) = check_quant(cfg, None)
    assert key == "load_in_8bit" and "pip install 'shardforge[quant]'" in problem
