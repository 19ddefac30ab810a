"""`lora_target_parameters`: a LoRA on the fused experts of a mixture-of-experts model (peft's
`ParamWrapper`, which parametrizes the experts' `gate_up_proj` / `down_proj` during each
forward) trained under FSDP2 on 2 gloo ranks.

A DeepSeek-V2 saved by `save_pretrained` (per-expert weights, fused at load; its first block
dense, a shared expert beside the routed ones) trains 3 steps with a LoRA on its fused experts,
its router and `q_proj` (as Axolotl's MoE examples name them), a checkpoint at step 2, in one
launch of 2 ranks: the loss falls, the adapter is trained, the adapter loads in peft over the
base and gives the trained logits, `merge-lora` of it equals peft's `merge_and_unload` and
loads in transformers, and a run resumed from step 2 (on 1 rank, in this process) gives the
uninterrupted run's loss.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from train_helpers import losses, read_metrics, train_configs, write_config

from helpers.dist import run_on_ranks
from helpers.tiny import make_model, tiny_texts, write_jsonl
from shardforge.formats.dcp.metadata import read_metadata

MODELS = ("deepseek_v2",)
TARGETS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj", "mlp.gate.weight"]
IDS = torch.randint(4, 300, (2, 12), generator=torch.Generator().manual_seed(0))


def test_lora_target_parameters_reach_peft_and_what_peft_refuses_is_one_error() -> None:
    """The key is peft's target_parameters (a string is one name); what peft's ParamWrapper
    cannot do is refused by validate, a name that matches no parameter by the injection."""
    from transformers import AutoModelForCausalLM

    from helpers.tiny import make_config
    from shardforge.config import validate_cfg
    from shardforge.config.peft import lora_config
    from shardforge.errors import ConfigError
    from shardforge.train.lora import add_lora

    given = {"base_model": "unused", "adapter": "lora", "lora_target_parameters": TARGETS[1]}
    config = lora_config(validate_cfg(given))
    assert config.target_parameters == [TARGETS[1]] and not config.target_modules
    with pytest.raises(ConfigError, match=r"lora_target_parameters: .* set lora_dropout: 0"):
        validate_cfg({**given, "lora_dropout": 0.05})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(make_config("qwen3_moe"))
    add_lora(model, validate_cfg(given))
    adapted = {n for n, p in model.named_parameters() if p.requires_grad}
    assert len(adapted) == 2 * 2 and all(".mlp.experts.lora_" in n for n in adapted), adapted
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(make_config("qwen3_moe"))
    with pytest.raises(ConfigError, match="lora_target_parameters"):
        add_lora(model, validate_cfg({**given, "lora_target_parameters": ["mlp.nothing"]}))


def _config(root: Path, kind: str) -> dict[str, Any]:
    return {
        "base_model": str(root / kind / "base"),
        "output_dir": str(root / kind / "out"),
        "seed": 7,
        # one text repeated: every step sees the same batch, so the loss falls when it learns
        "datasets": [{"path": str(root / "data.jsonl"), "type": "completion"}],
        "sequence_len": 32,
        "micro_batch_size": 2,
        "max_steps": 3,
        "save_steps": 2,
        "learning_rate": 2e-2,
        "logging_steps": 1,
        "gradient_checkpointing": True,  # the forward peft parametrizes runs again in backward
        "adapter": "lora",
        "lora_r": 4,
        "lora_alpha": 8,
        "lora_target_parameters": TARGETS,
        "lora_target_modules": ["q_proj"],
    }


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("lora-experts")
    write_jsonl(root / "data.jsonl", [{"text": tiny_texts(1, seed=1)[0]}] * 8)
    runs = []
    for kind in MODELS:
        make_model(root / kind / "base", kind)
        config = write_config(root / f"{kind}.yml", _config(root, kind))
        runs.append((str(config), None))
    (root / "stores").mkdir()
    run_on_ranks(train_configs, 2, runs, str(root / "stores"))
    return root


def _trained(root: Path, kind: str, checkpoint: str) -> torch.nn.Module:
    """The base model with the adapter of the DCP `checkpoint` (torch's own loader)."""
    import torch.distributed.checkpoint as dcp
    from transformers import AutoModelForCausalLM

    from shardforge.config import validate_cfg
    from shardforge.train.lora import add_lora

    cfg = validate_cfg(_config(root, kind))
    model = AutoModelForCausalLM.from_pretrained(cfg.base_model)
    add_lora(model, cfg)
    state = {n: torch.empty_like(p) for n, p in model.named_parameters() if p.requires_grad}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=str(root / kind / "out" / checkpoint / "model"), no_dist=True)
    model.load_state_dict(state, strict=False)
    return model.eval()


@pytest.mark.slow
@pytest.mark.parametrize("kind", MODELS)
def test_a_lora_on_fused_experts_trains_on_two_ranks(root: Path, kind: str) -> None:
    from safetensors.torch import load_file

    out = root / kind / "out"
    got = losses(out)
    assert sorted(got) == [1, 2, 3] and got[3] < got[1], got
    config = json.loads((out / "adapter_config.json").read_text())
    assert sorted(config["target_parameters"]) == sorted(TARGETS)
    assert config["target_modules"] == ["q_proj"]
    adapter = load_file(str(out / "adapter_model.safetensors"))
    # block 1's experts and router (block 0 is dense): (gate_up_proj, down_proj, gate) x (A, B)
    moe = sorted(k for k in adapter if ".mlp." in k)
    assert len(moe) == 6 and all(".layers.1." in k for k in moe), sorted(adapter)
    assert len(adapter) == 6 + 2 * 2  # and q_proj's A and B in both blocks
    assert all(v.abs().max() > 0 for k, v in adapter.items() if "lora_B" in k)  # B starts at 0
    # the checkpoint holds the adapter only, under the names of the wrapped model
    saved = set(read_metadata(out / "checkpoint-2" / "model").tensors)
    assert len(saved) == len(adapter) and all(".lora_" in k for k in saved), sorted(saved)
    assert "model.layers.1.mlp.experts.base_layer.lora_A.default.weight" in saved


@pytest.mark.slow
@pytest.mark.parametrize("kind", MODELS)
def test_the_experts_adapter_loads_in_peft_and_merges_as_peft_merges_it(
    root: Path, kind: str, tmp_path: Path
) -> None:
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from shardforge.merge.lora import merge_lora

    out, base = root / kind / "out", root / kind / "base"
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), out).eval()
    with torch.no_grad():
        want = _trained(root, kind, "checkpoint-3")(input_ids=IDS).logits
        assert torch.equal(loaded(input_ids=IDS).logits, want)
    loaded.merge_and_unload().save_pretrained(tmp_path / "peft")
    merged = merge_lora(
        {"base_model": str(base), "output_dir": str(out)}, tmp_path / "merged", dtype="float32"
    )
    got, expected = (load_file(str(d / "model.safetensors")) for d in (merged, tmp_path / "peft"))
    assert set(got) == set(load_file(str(base / "model.safetensors")))  # the saved names
    assert [k for k in expected if not torch.equal(got[k], expected[k])] == []
    model, info = AutoModelForCausalLM.from_pretrained(merged, output_loading_info=True)
    assert not any(info.values()), info
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(input_ids=IDS).logits, want)


@pytest.mark.slow
def test_a_resumed_experts_lora_run_equals_the_uninterrupted_one(
    root: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The 2-rank run resumed from its step-2 checkpoint on 1 rank: step 3's loss."""
    from shardforge.train.launch import do_train

    kind = MODELS[0]
    out = Path(shutil.copytree(root / kind / "out", tmp_path / "out"))
    shutil.rmtree(out / "checkpoint-3")
    kept = [m for m in read_metrics(out) if m["step"] <= 2]
    (out / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in kept))
    cfg = {
        **_config(root, kind),
        "output_dir": str(out),
        "micro_batch_size": 4,
        "resume_from_checkpoint": "auto",
    }
    with caplog.at_level(logging.INFO, logger="shardforge"):
        assert do_train(write_config(tmp_path / "cfg.yml", cfg), [], "python") == 0
    assert "resumed from" in caplog.text and "at step 2" in caplog.text, caplog.text[-500:]
    assert [m["step"] for m in read_metrics(out)] == [1, 2, 3]
    got, want = losses(out)[3], losses(root / kind / "out")[3]
    assert math.isclose(got, want, rel_tol=1e-6, abs_tol=0.0), (got, want)
