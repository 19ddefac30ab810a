"""`merge-sharded-fsdp-weights` of LoRA checkpoints: shardforge's own (adapter only, from a
real `adapter: lora` training run) and a PEFT-wrapped model's full FSDP2 state dict saved the
way accelerate / HF Trainer save it (2 gloo ranks, `base_layer` / `lora_A` / `lora_B` names),
each merged to a PEFT adapter directory and, with `--merge_lora`, to the fused model.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from safetensors.torch import load_file

from helpers.dist import run_on_ranks
from helpers.tiny import make_model, tiny_texts, write_jsonl
from shardforge.config import load_cfg
from shardforge.merge.api import merge_fsdp_weights

LORA = {
    "adapter": "lora",
    "lora_r": 4,
    "lora_alpha": 8,
    "lora_target_modules": ["q_proj", "v_proj"],
}


def _ids() -> torch.Tensor:
    return torch.randint(4, 300, (2, 12), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def ours(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 1-rank `adapter: lora` run (real gloo, DCP) of a tiny Llama: its config path."""
    from shardforge.train.launch import do_train

    root = tmp_path_factory.mktemp("lora-ours")
    base = make_model(root / "base", "llama", vocab_size=320, seed=0)
    data = write_jsonl(root / "data.jsonl", [{"text": t} for t in tiny_texts(24, seed=1)])
    cfg = {
        "base_model": str(base),
        "output_dir": str(root / "out"),
        "datasets": [{"path": str(data)}],
        "sequence_len": 32,
        "micro_batch_size": 4,
        "max_steps": 3,
        "learning_rate": 2.0e-2,
        "fsdp": {"transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]},
        **LORA,
    }
    config = root / "cfg.yml"
    config.write_text(yaml.safe_dump(cfg))
    assert do_train(config, [], "python") == 0
    return config


def test_our_checkpoint_merges_to_the_adapter_training_exported(ours: Path, tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    cfg = load_cfg(ours, command="merge")
    out = merge_fsdp_weights(cfg, tmp_path / "adapter", verify=True, quiet=True)
    exported = Path(cfg.output_dir)
    got = load_file(str(out / "adapter_model.safetensors"))
    want = load_file(str(exported / "adapter_model.safetensors"))
    assert sorted(got) == sorted(want) and len(got) == 8
    assert all(torch.equal(got[k], want[k]) for k in want)
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["r"] == 4 and sorted(config["target_modules"]) == ["q_proj", "v_proj"]
    base = AutoModelForCausalLM.from_pretrained(cfg.base_model)
    with torch.no_grad():
        logits = PeftModel.from_pretrained(base, out).eval()(input_ids=_ids()).logits
        plain = AutoModelForCausalLM.from_pretrained(cfg.base_model)(input_ids=_ids()).logits
    assert not torch.equal(logits, plain)  # the adapter changes the model


def test_a_dry_run_describes_the_adapter_directory_it_would_write(
    ours: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Bug: --dry_run on a LoRA checkpoint described model.safetensors, config.json and the
    base model's parameter count; the merge writes an adapter directory."""
    cfg = load_cfg(ours, command="merge")
    out = merge_fsdp_weights(cfg, tmp_path / "adapter", dry_run=True, quiet=True)
    text = capsys.readouterr().out
    assert not out.exists()
    assert "adapter_model.safetensors: 8 tensors" in text and "adapter_config.json" in text
    assert "model.safetensors:" not in text.replace("adapter_model.safetensors", "")
    assert "config.json" not in text.replace("adapter_config.json", "")
    real = merge_fsdp_weights(cfg, tmp_path / "real", quiet=True)
    adapter = load_file(str(real / "adapter_model.safetensors"))
    parameters = sum(t.numel() for t in adapter.values())
    assert f"parameters: {parameters:,}" in text, text


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_merge_lora_equals_peft_merge_and_unload(ours: Path, tmp_path: Path, dtype: str) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    cfg = load_cfg(ours, command="merge")
    out = merge_fsdp_weights(
        cfg, tmp_path / "fused", merge_lora=True, verify=True, quiet=True, dtype=dtype
    )
    base = AutoModelForCausalLM.from_pretrained(cfg.base_model)
    reference = PeftModel.from_pretrained(base, cfg.output_dir).merge_and_unload()
    want = {k: v for k, v in reference.state_dict().items()}
    _, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    got = load_file(str(out / "model.safetensors"))
    assert set(got) <= set(want)
    for name, tensor in got.items():
        if dtype == "float32":
            assert torch.equal(tensor, want[name]), name
        else:  # we round the float32 sum once; peft's bf16 path rounds the delta and the sum
            ref = want[name].to(torch.bfloat16).float()
            ulp = torch.ldexp(
                torch.tensor(torch.finfo(torch.bfloat16).eps), torch.frexp(ref).exponent - 1
            )
            diff = (tensor.float() - ref).abs()
            assert bool((diff <= ulp).all()), (name, float((diff / ulp).max()))


# -- a PEFT-wrapped model saved as accelerate / HF Trainer save it ----------------------------


def _save_peft_fsdp(rank: int, world: int, base: str, step_dir: str) -> None:
    """get_peft_model + fully_shard on every rank, one optimizer step, then accelerate's
    SHARDED_STATE_DICT save: dcp.save({"model": state_dict}) in pytorch_model_fsdp_0/."""
    import torch.distributed.checkpoint as dcp
    from peft import LoraConfig, get_peft_model
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(base),
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"),
    )
    for layer in model.base_model.model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.05)
    ids = torch.randint(4, 300, (2, 16), generator=torch.Generator().manual_seed(rank))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(
            {"model": get_model_state_dict(model)},
            checkpoint_id=str(Path(step_dir) / "pytorch_model_fsdp_0"),
        )
    if rank == 0:
        model.peft_config["default"].save_pretrained(step_dir)  # HF Trainer writes it too


@pytest.fixture(scope="module")
def trainer_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("lora-trainer")
    base = make_model(root / "base", "llama", vocab_size=320, seed=0)
    step = root / "run" / "checkpoint-1"
    step.mkdir(parents=True)
    run_on_ranks(_save_peft_fsdp, 2, str(base), str(step))
    # the trained weights, read back by torch's DCP loader into a PEFT model (the reference)
    import torch.distributed.checkpoint as dcp
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(base),
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"),
    )
    state = {"model": {k: torch.empty_like(v) for k, v in model.state_dict().items()}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, checkpoint_id=str(step / "pytorch_model_fsdp_0"), no_dist=True)
    model.load_state_dict(state["model"])
    cfg = root / "cfg.yml"
    cfg.write_text(yaml.safe_dump({"base_model": str(base), "output_dir": str(root / "run")}))
    return {"cfg": cfg, "model": model.eval(), "base": base}


@pytest.mark.slow
def test_a_trainer_peft_checkpoint_merges_to_an_adapter(
    trainer_run: dict[str, Any], tmp_path: Path
) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out = merge_fsdp_weights(trainer_run["cfg"], tmp_path / "adapter", verify=True, quiet=True)
    loaded = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(trainer_run["base"]), out
    ).eval()
    with torch.no_grad():
        assert torch.equal(
            loaded(input_ids=_ids()).logits, trainer_run["model"](input_ids=_ids()).logits
        )


@pytest.mark.slow
def test_a_trainer_peft_checkpoint_merges_fused(
    trainer_run: dict[str, Any], tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    out = merge_fsdp_weights(
        trainer_run["cfg"], tmp_path / "fused", merge_lora=True, verify=True, quiet=True
    )
    want = trainer_run["model"].merge_and_unload().state_dict()
    got = load_file(str(out / "model.safetensors"))
    assert got and all(torch.equal(t, want[n]) for n, t in got.items())
    _, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info


def test_the_plain_config_merges_with_the_runs_own_adapter_config(
    ours: Path, tmp_path: Path
) -> None:
    """A LoRA run's checkpoint with the config the run started from, without `adapter: lora`:
    the settings are the adapter_config.json the run exported to its output_dir."""
    from click.testing import CliRunner

    from shardforge.cli.main import cli

    data = yaml.safe_load(ours.read_text())
    plain = tmp_path / "plain.yml"
    plain.write_text(yaml.safe_dump({k: v for k, v in data.items() if k not in LORA}))
    exported = Path(data["output_dir"])
    assert (exported / "adapter_config.json").is_file()
    for extra in ([], ["--merge_lora"]):
        out = tmp_path / f"out{len(extra)}"
        args = ["merge-sharded-fsdp-weights", str(plain), "--output_path", str(out), *extra]
        result = CliRunner().invoke(cli, [*args, "--quiet"])
        assert result.exit_code == 0, result.output
    got = load_file(str(tmp_path / "out0" / "adapter_model.safetensors"))
    want = load_file(str(exported / "adapter_model.safetensors"))
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    fused = merge_fsdp_weights(load_cfg(ours, command="merge"), tmp_path / "f", merge_lora=True)
    same = load_file(str(fused / "model.safetensors"))
    assert all(
        torch.equal(t, same[k])
        for k, t in load_file(str(tmp_path / "out1" / "model.safetensors")).items()
    )
