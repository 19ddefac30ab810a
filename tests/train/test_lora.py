"""`adapter: lora` training under FSDP2 on gloo ranks: a tiny Llama (q/v adapters) and a
tied-embedding Qwen2 with `lora_modules_to_save: [embed_tokens, lm_head]`.

Each is trained once on 2 gloo ranks (both in one launch: `train_helpers.shared_run`) and once
on 1 rank in this process; the losses agree,
a run resumed (at the other world size) equals the uninterrupted one, checkpoints hold only the
trainable parameters, and the exported PEFT adapter loaded with `PeftModel.from_pretrained`
gives the same logits as the trained weights read back from the DCP checkpoint.
"""

from __future__ import annotations

import json
import math
import shutil
import stat
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from train_helpers import Run as SharedRun
from train_helpers import losses, read_metrics, shared_run, write_config

from helpers.tiny import make_model
from shardforge.formats.dcp.metadata import read_metadata
from shardforge.io.publish import current_umask

ADAPTER_FILES = ("adapter_model.safetensors", "adapter_config.json")

RTOL = 1e-6  # 1 vs 2 ranks, resumed vs uninterrupted, fp32 (see test_loop.py)


def _train_here(cfg: dict[str, Any], config: Path) -> None:
    """One rank in this process (real gloo, DCP)."""
    from shardforge.train.launch import do_train

    assert do_train(write_config(config, cfg), [], "python") == 0


def _same(got: dict[int, float], want: dict[int, float], steps: range) -> None:
    for s in steps:
        assert math.isclose(got[s], want[s], rel_tol=RTOL, abs_tol=0.0), (s, got[s], want[s])


class Run:
    """One config trained on 2 ranks (`shared_run`: gloo ranks, one launch for both configs)
    and on 1 rank (in this process)."""

    def __init__(self, root: Path, two: SharedRun) -> None:
        self.root, self.cfg, self.two, self.config = root, two.cfg, two.out, two.config
        self.one = root / "one"
        cfg = self.cfg
        one = {**cfg, "output_dir": str(self.one), "micro_batch_size": 2 * cfg["micro_batch_size"]}
        _train_here(one, root / "one.yml")


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Run:
    return Run(tmp_path_factory.mktemp("lora-llama"), shared_run(tmp_path_factory, "lora-llama"))


@pytest.fixture(scope="module")
def qwen(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """A tied-embedding Qwen2: every linear layer adapted, embed_tokens and lm_head trained."""
    return Run(tmp_path_factory.mktemp("lora-qwen"), shared_run(tmp_path_factory, "lora-qwen"))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama", "qwen"])
def test_one_and_two_ranks_compute_the_same_losses(
    name: str, request: pytest.FixtureRequest
) -> None:
    run: Run = request.getfixturevalue(name)
    two, one = losses(run.two), losses(run.one)
    assert sorted(two) == sorted(one) == list(range(1, run.cfg["max_steps"] + 1))
    _same(one, two, range(1, run.cfg["max_steps"] + 1))
    assert two[run.cfg["max_steps"]] < two[1]  # the adapter learns


def test_checkpoints_hold_only_the_trainable_parameters(llama: Run, qwen: Run) -> None:
    llama_keys = set(read_metadata(llama.two / "checkpoint-6" / "model").tensors)
    assert llama_keys and all(".lora_A." in k or ".lora_B." in k for k in llama_keys), llama_keys
    assert len(llama_keys) == 2 * 2 * 2  # 2 blocks x (q, v) x (A, B)
    qwen_keys = set(read_metadata(qwen.two / "checkpoint-4" / "model").tensors)
    saved = {k for k in qwen_keys if "modules_to_save" in k}
    assert saved and {k.split(".modules_to_save")[0] for k in saved} <= {
        "model.embed_tokens",
        "lm_head",
    }
    assert not any("base_layer" in k or "original_module" in k for k in qwen_keys)


def _trained_model(run: Run, checkpoint: str) -> torch.nn.Module:
    """The base model with the adapter of `checkpoint` (read back with torch's DCP loader)."""
    import torch.distributed.checkpoint as dcp
    from transformers import AutoModelForCausalLM

    from shardforge.config import load_cfg
    from shardforge.train.lora import add_lora

    assert run.config is not None
    cfg = load_cfg(run.config)
    model = AutoModelForCausalLM.from_pretrained(cfg.base_model)
    add_lora(model, cfg)
    trainable = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    state = {n: torch.empty_like(t) for n, t in trainable.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=str(run.two / checkpoint / "model"), no_dist=True)
    model.load_state_dict(state, strict=False)
    return model.eval()


@pytest.mark.parametrize("name", ["llama", "qwen"])
def test_the_exported_adapter_gives_the_trained_logits(
    name: str, request: pytest.FixtureRequest
) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    run: Run = request.getfixturevalue(name)
    last = f"checkpoint-{run.cfg['max_steps']}"
    trained = _trained_model(run, last)
    base = AutoModelForCausalLM.from_pretrained(run.cfg["base_model"])
    loaded = PeftModel.from_pretrained(base, run.two).eval()
    config = json.loads((run.two / "adapter_config.json").read_text())
    # the weights follow the umask as the config beside them does (save_file makes rw-------)
    modes = {stat.S_IMODE((run.two / f).stat().st_mode) for f in ADAPTER_FILES}
    assert modes == {0o666 & ~current_umask()}, modes
    assert config["r"] == 4 and config["lora_alpha"] == 8 and config["peft_type"] == "LORA"
    ids = torch.randint(4, 300, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = trained(input_ids=ids).logits
        got = loaded(input_ids=ids).logits
    assert torch.equal(got, want)
    if name == "qwen":  # the trained embedding is one matrix, tied to the output layer
        emb = loaded.get_input_embeddings().weight
        assert torch.equal(emb, loaded.get_output_embeddings().weight)
        fresh = AutoModelForCausalLM.from_pretrained(run.cfg["base_model"])
        assert not torch.equal(emb, fresh.get_input_embeddings().weight)  # it was trained


@pytest.mark.slow
def test_resume_at_another_world_size_equals_the_uninterrupted_run(
    llama: Run, tmp_path: Path
) -> None:
    """The 2-rank run stopped after step 4, resumed on 1 rank: steps 5 and 6 as before."""
    out = Path(shutil.copytree(llama.two, tmp_path / "out"))
    shutil.rmtree(out / "checkpoint-6")
    kept = [m for m in read_metrics(out) if m["step"] <= 4]
    (out / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in kept))
    cfg = {
        **llama.cfg,
        "output_dir": str(out),
        "micro_batch_size": 2 * llama.cfg["micro_batch_size"],
        "resume_from_checkpoint": "auto",
    }
    _train_here(cfg, tmp_path / "cfg.yml")
    _same(losses(out), losses(llama.two), range(5, 7))


def test_target_linear_with_names_is_saved_as_it_was_trained(tmp_path: Path) -> None:
    """lora_target_linear plus lora_target_modules targets every linear layer and the names:
    the config training injects, the one it saves and the one the merge writes agree."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from shardforge.config import validate_cfg
    from shardforge.config.peft import lora_config
    from shardforge.merge.check import build_expected
    from shardforge.train.lora import _peft_config, add_lora

    base = make_model(tmp_path / "base", "llama")
    cfg = validate_cfg(
        {
            "base_model": str(base),
            "adapter": "lora",
            "lora_target_linear": True,
            "lora_target_modules": ["q_proj", "v_proj"],
        }
    )
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(base))
    injected = set(add_lora(model, cfg).target_modules)
    linear = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert injected == linear
    # the config saved at the end is made from the injected model: the same targets, not the
    # LoRA layers' parts (base_layer, lora_A's "default"), which peft would target on loading
    assert set(_peft_config(model, cfg).target_modules) == linear
    expected = build_expected(AutoConfig.from_pretrained(base), False)
    assert set(lora_config(cfg, None, False, expected.linear_names).target_modules) == linear
    with pytest.raises(ValueError, match="linear_names"):
        lora_config(cfg)


def test_target_linear_of_a_moe_model_adapts_its_linear_layers_only(tmp_path: Path) -> None:
    """lora_target_linear on Mixtral adapts the linear layers, as Axolotl's
    find_all_linear_names names them: not the fused experts and the router, which peft's
    "all-linear" adds as parameter targets (and which then refuse lora_dropout, as Axolotl's
    Mixtral QLoRA example sets it)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from shardforge.config import validate_cfg
    from shardforge.train.lora import add_lora

    base = make_model(tmp_path / "base", "mixtral", with_tokenizer=False)
    cfg = validate_cfg(
        {
            "base_model": str(base),
            "adapter": "lora",
            "lora_target_linear": True,
            "lora_dropout": 0.05,
        }
    )
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(base))
    config = add_lora(model, cfg)
    assert set(config.target_modules) == {"q_proj", "k_proj", "v_proj", "o_proj"}
    assert not config.target_parameters
    adapted = {n for n, p in model.named_parameters() if p.requires_grad}
    assert adapted and all(".self_attn." in n and ".lora_" in n for n in adapted)
