"""merge-lora against peft: a real adapter (random B, so the fuse is not vacuous) saved by
`save_pretrained` and fused by `merge_lora` equals `merge_and_unload()` of the same PeftModel
(bit for bit in float32, within one ulp in bfloat16), loads with from_pretrained with no
missing or unexpected keys and gives the merged model's logits; --verify catches a wrong fuse
and a wrong read; an adapter that does not fit the base model is refused before anything is
written."""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers.tiny import make_model
from shardforge.errors import CheckpointError, MergeError
from shardforge.formats.safetensors.reader import SafetensorsSource
from shardforge.formats.sources import FusedLoraSource
from shardforge.merge.lora import merge_lora

IDS = torch.tensor([[1, 5, 9, 17, 33, 65, 129, 200]])


@dataclass
class Case:
    base: Path
    adapter: Path
    state: dict[str, torch.Tensor]  # merge_and_unload()'s state dict
    saved: set[str]  # the names save_pretrained writes (tied targets dropped)
    tied: bool  # the merged model's tie_word_embeddings
    logits: torch.Tensor  # of the merged peft model
    peft_logits: torch.Tensor  # of the peft model before merging


CASES: dict[str, dict[str, Any]] = {
    # linear layers, an embedding LoRA (its base weight travels in the adapter), lm_head saved
    "llama": {
        "model_type": "llama",
        "lora": {
            "r": 4,
            "lora_alpha": 8,
            "target_modules": ["q_proj", "v_proj", "down_proj", "embed_tokens"],
            "modules_to_save": ["lm_head"],
        },
    },
    # tied embeddings, biases in q/k/v, rsLoRA with a per-module rank
    "qwen2-rslora": {
        "model_type": "qwen2",
        "lora": {
            "r": 4,
            "lora_alpha": 8,
            "use_rslora": True,
            "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj"],
            "rank_pattern": {"o_proj": 2},
        },
    },
    # a LoRA on a tied embedding: both ends of the tie change (one parameter)
    "qwen2-embedding-lora": {
        "model_type": "qwen2",
        "lora": {"r": 2, "lora_alpha": 4, "target_modules": ["embed_tokens", "v_proj"]},
    },
    # a saved copy of a tied embedding: peft unties the pair (copy in, original out)
    "qwen2-saved-embedding": {
        "model_type": "qwen2",
        "lora": {
            "r": 2,
            "lora_alpha": 4,
            "target_modules": ["q_proj"],
            "modules_to_save": ["embed_tokens"],
        },
    },
    # ... or of the tied output layer
    "qwen2-saved-lm-head": {
        "model_type": "qwen2",
        "lora": {
            "r": 2,
            "lora_alpha": 4,
            "target_modules": ["q_proj"],
            "modules_to_save": ["lm_head"],
        },
    },
    # ... kept tied by ensure_weight_tying (the adapter holds both copies)
    "qwen2-saved-embedding-tied": {
        "model_type": "qwen2",
        "lora": {
            "r": 2,
            "lora_alpha": 4,
            "target_modules": ["q_proj"],
            "modules_to_save": ["embed_tokens"],
            "ensure_weight_tying": True,
        },
    },
    # a bfloat16 base model, adapted in bfloat16
    "llama-bf16": {
        "model_type": "llama",
        "dtype": "bfloat16",
        "lora": {"r": 4, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj", "up_proj"]},
    },
}


def make_adapter(
    base: Path, adapter: Path, lora: dict[str, Any], dtype: torch.dtype = torch.float32
) -> Any:
    """A PeftModel on `base` with every LoRA factor and saved copy set to random values
    (peft initialises B to zeros: fusing that would change nothing), saved to `adapter`."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=dtype)
    pm = get_peft_model(model, LoraConfig(**lora))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_" in name or ".modules_to_save." in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    pm.save_pretrained(adapter)
    return pm


def _case(root: Path, name: str) -> Case:
    spec = CASES[name]
    dtype = spec.get("dtype", "float32")
    base = make_model(root / f"{name}-base", spec["model_type"], dtype=dtype)
    adapter = root / f"{name}-adapter"
    pm = make_adapter(base, adapter, spec["lora"], getattr(torch, dtype))
    pm.eval()
    with torch.no_grad():
        peft_logits = pm(IDS).logits
        merged = pm.merge_and_unload()
        logits = merged(IDS).logits
    state = {k: v.detach().clone() for k, v in merged.state_dict().items()}
    tied = bool(merged.config.tie_word_embeddings)
    saved = set(state) - ({"lm_head.weight"} if tied else set())
    return Case(base, adapter, state, saved, tied, logits, peft_logits)


@pytest.fixture(scope="module")
def cases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Case]:
    root = tmp_path_factory.mktemp("lora")
    return {name: _case(root, name) for name in CASES}


def _cfg(case: Case, tmp: Path) -> dict[str, Any]:
    return {"base_model": str(case.base), "output_dir": str(tmp / "run")}


def _load(out: Path) -> Any:
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert not info["mismatched_keys"] and not info.get("error_msgs"), info
    return model.eval()


def _written(out: Path) -> dict[str, torch.Tensor]:
    index = out / "model.safetensors.index.json"
    if index.is_file():
        files = set(json.loads(index.read_text())["weight_map"].values())
        return {k: v for f in files for k, v in load_file(str(out / f)).items()}
    return load_file(str(out / "model.safetensors"))


FLOAT32_CASES = [name for name, spec in CASES.items() if "dtype" not in spec]
# peft's own merged model differs from its unmerged forward here: the merge adds the embedding
# LoRA to the parameter the output layer shares, the unmerged forward only to the lookup
PEFT_INCONSISTENT = {"qwen2-embedding-lora"}


@pytest.mark.parametrize("name", FLOAT32_CASES)
def test_float32_fuse_equals_merge_and_unload(
    cases: dict[str, Case], tmp_path: Path, name: str
) -> None:
    case = cases[name]
    out = merge_lora(
        _cfg(case, tmp_path), tmp_path / "out", case.adapter, dtype="float32", verify=True
    )
    written = _written(out)
    assert set(written) == case.saved
    for key, tensor in written.items():
        assert tensor.dtype == torch.float32, key
        assert torch.equal(tensor, case.state[key]), key
    model = _load(out)
    assert model.config.tie_word_embeddings == case.tied
    with torch.no_grad():
        logits = model(IDS).logits
    assert torch.equal(logits, case.logits)  # same weights, same forward
    if name not in PEFT_INCONSISTENT:
        torch.testing.assert_close(logits, case.peft_logits, rtol=1e-4, atol=1e-5)
    for companion in ("config.json", "generation_config.json", "tokenizer.json"):
        assert (out / companion).is_file(), companion


def test_fan_in_fan_out_layers(tmp_path: Path) -> None:
    """GPT-2's Conv1D layers store the weight as (in, out): peft's fan_in_fan_out delta is
    (B @ A).T."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "gpt2",
        n_embd=64,
        n_layer=2,
        n_head=4,
        vocab_size=320,
        n_positions=64,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "base")
    lora = {"r": 4, "lora_alpha": 8, "target_modules": ["c_attn", "c_proj"], "fan_in_fan_out": True}
    pm = make_adapter(tmp_path / "base", tmp_path / "adapter", lora)
    state = pm.merge_and_unload().state_dict()
    cfg = {"base_model": str(tmp_path / "base"), "output_dir": str(tmp_path / "run")}
    out = merge_lora(cfg, tmp_path / "out", tmp_path / "adapter", verify=True, save_tokenizer=False)
    written = _written(out)
    assert set(written) == set(state) - {"lm_head.weight"}  # tied to the token embeddings
    for key, tensor in written.items():
        assert torch.equal(tensor, state[key]), key
    _load(out)


def test_adapted_weights_really_change(cases: dict[str, Case]) -> None:
    """The comparison above is not vacuous: the fused weights differ from the base's."""
    case = cases["llama"]
    base = load_file(str(case.base / "model.safetensors"))
    changed = {k for k in base if not torch.equal(base[k], case.state[k])}
    assert "model.layers.0.self_attn.q_proj.weight" in changed
    assert "model.embed_tokens.weight" in changed and "lm_head.weight" in changed
    assert "model.layers.0.self_attn.k_proj.weight" not in changed


def test_bfloat16_output_of_a_float32_base(cases: dict[str, Case], tmp_path: Path) -> None:
    """Cast once from the float32 fuse: exactly merge_and_unload's float32 weights, cast."""
    case = cases["llama"]
    out = merge_lora(_cfg(case, tmp_path), tmp_path / "out", case.adapter, dtype="bf16")
    written = _written(out)
    for key, tensor in written.items():
        assert tensor.dtype == torch.bfloat16, key
        assert torch.equal(tensor, case.state[key].to(torch.bfloat16)), key
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    _load(out)


def _ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """The largest distance in bfloat16 steps between `a` and `b`."""

    def ordered(t: torch.Tensor) -> torch.Tensor:
        bits = t.contiguous().view(torch.int16).to(torch.int32)
        return torch.where(bits < 0, -(bits & 0x7FFF), bits)

    return int((ordered(a) - ordered(b)).abs().max()) if a.numel() else 0


def test_bfloat16_base_within_one_ulp(cases: dict[str, Case], tmp_path: Path) -> None:
    case = cases["llama-bf16"]
    out = merge_lora(_cfg(case, tmp_path), tmp_path / "out", case.adapter, verify=True)
    written = _written(out)
    assert set(written) == case.saved
    worst = 0
    for key, tensor in written.items():
        assert tensor.dtype == torch.bfloat16, key  # the base model's dtype (config.json)
        worst = max(worst, _ulps(tensor, case.state[key]))
    assert worst <= 1
    _load(out)


def test_untying_is_said(
    cases: dict[str, Case], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    case = cases["qwen2-saved-embedding"]
    assert not case.tied  # peft's merged model is untied
    with caplog.at_level(logging.WARNING, logger="shardforge"):
        merge_lora(_cfg(case, tmp_path), tmp_path / "out", case.adapter)
    assert "unties" in caplog.text and "ensure_weight_tying" in caplog.text
    assert not json.loads((tmp_path / "out" / "config.json").read_text())["tie_word_embeddings"]


def test_sharded_output(cases: dict[str, Case], tmp_path: Path) -> None:
    case = cases["llama"]
    out = merge_lora(
        _cfg(case, tmp_path), tmp_path / "out", case.adapter, max_shard_size=200_000, verify=True
    )
    assert (out / "model.safetensors.index.json").is_file()
    for key, tensor in _written(out).items():
        assert torch.equal(tensor, case.state[key]), key
    _load(out)


def test_default_output_and_adapter_come_from_output_dir(
    cases: dict[str, Case], tmp_path: Path
) -> None:
    """As Axolotl: the adapter saved in output_dir, the model written to output_dir/merged."""
    case = cases["qwen2-rslora"]
    run = tmp_path / "run"
    shutil.copytree(case.adapter, run)
    out = merge_lora(_cfg(case, tmp_path), quiet=True)
    assert out == (run / "merged").absolute()
    assert torch.equal(
        _written(out)["model.layers.1.self_attn.o_proj.weight"],
        case.state["model.layers.1.self_attn.o_proj.weight"],
    )
    with pytest.raises(MergeError, match="not empty"):
        merge_lora(_cfg(case, tmp_path))
    merge_lora(_cfg(case, tmp_path), overwrite=True)


# ------------------------------------------------------------------------------ verification


def test_verify_catches_a_wrong_fuse(
    cases: dict[str, Case], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The write fuses with a wrong scale; verification recomputes it from the stored tensors."""
    case = cases["llama"]
    real = FusedLoraSource.read

    def doubled(self: FusedLoraSource, reader: Any) -> torch.Tensor:
        return real(dataclasses.replace(self, scale=2 * self.scale), reader)

    monkeypatch.setattr(FusedLoraSource, "read", doubled)
    with pytest.raises(MergeError, match=r"verification failed.*differs"):
        merge_lora(_cfg(case, tmp_path), tmp_path / "out", case.adapter, verify=True)
    assert not (tmp_path / "out").exists()
    assert not list(tmp_path.glob(".out.*"))


def test_verify_catches_swapped_factors(
    cases: dict[str, Case], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A and B of a square module swapped (B.T @ A.T has the right shape, not the value)."""
    case = cases["llama"]
    real = FusedLoraSource.read

    def swapped(self: FusedLoraSource, reader: Any) -> torch.Tensor:
        a, b = self.lora_a.read(reader), self.lora_b.read(reader)
        if a.shape[1] != b.shape[0]:
            return real(self, reader)
        base = self.base.read(reader).float()
        return base + (a.T.float() @ b.T.float()) * self.scale

    monkeypatch.setattr(FusedLoraSource, "read", swapped)
    with pytest.raises(MergeError, match="verification failed"):
        merge_lora(_cfg(case, tmp_path), tmp_path / "out", case.adapter, verify=True)


def test_verify_reads_through_the_safetensors_library(
    cases: dict[str, Case], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fault in shardforge's own safetensors reader (here: the last byte of every read
    flipped) is caught: verification does not read through it."""
    case = cases["qwen2-rslora"]
    real = SafetensorsSource.read

    def faulty(self: SafetensorsSource, reader: Any) -> torch.Tensor:
        t = real(self, reader).clone()
        raw = t.reshape(-1).view(torch.uint8)
        if raw.numel():
            raw[-1] ^= 0x01
        return t

    monkeypatch.setattr(SafetensorsSource, "read", faulty)
    with pytest.raises(MergeError, match="verification failed"):
        merge_lora(_cfg(case, tmp_path), tmp_path / "out", case.adapter, dtype="bf16", verify=True)


# -------------------------------------------------------------------------------- refusals


def _copy_adapter(case: Case, tmp_path: Path) -> Path:
    return Path(shutil.copytree(case.adapter, tmp_path / "adapter"))


def _edit_config(adapter: Path, **changes: Any) -> None:
    path = adapter / "adapter_config.json"
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def _refused(case: Case, tmp_path: Path, adapter: Path, error: type, words: str) -> None:
    with pytest.raises(error, match=words):
        merge_lora(_cfg(case, tmp_path), tmp_path / "out", adapter)
    assert not (tmp_path / "out").exists()
    assert not list(tmp_path.glob(".out.*"))


def test_adapter_of_another_base_model(cases: dict[str, Case], tmp_path: Path) -> None:
    other = make_model(tmp_path / "other", "llama", hidden_size=32, num_attention_heads=2)
    case = cases["llama"]
    cfg = {"base_model": str(other), "output_dir": str(tmp_path / "run")}
    with pytest.raises(MergeError, match="does not fit the base model") as info:
        merge_lora(cfg, tmp_path / "out", case.adapter)
    assert any("LoRA A is [4, 64], expected [4, 32]" in d for d in info.value.details)
    assert not (tmp_path / "out").exists()


def test_untargeted_module(cases: dict[str, Case], tmp_path: Path) -> None:
    case = cases["llama"]
    adapter = _copy_adapter(case, tmp_path)
    _edit_config(adapter, target_modules=["q_proj", "embed_tokens", "down_proj"])
    _refused(case, tmp_path, adapter, MergeError, "does not fit")


def test_saved_module_not_named(cases: dict[str, Case], tmp_path: Path) -> None:
    case = cases["llama"]
    adapter = _copy_adapter(case, tmp_path)
    _edit_config(adapter, modules_to_save=None)
    _refused(case, tmp_path, adapter, MergeError, "does not fit")


def test_wrong_rank(cases: dict[str, Case], tmp_path: Path) -> None:
    case = cases["qwen2-rslora"]
    adapter = _copy_adapter(case, tmp_path)
    _edit_config(adapter, rank_pattern={})  # o_proj's factors are r=2, the config now says 4
    _refused(case, tmp_path, adapter, MergeError, "does not fit")


def test_dora_adapter_refused(cases: dict[str, Case], tmp_path: Path) -> None:
    case = cases["llama"]
    adapter = _copy_adapter(case, tmp_path)
    _edit_config(adapter, use_dora=True)
    _refused(case, tmp_path, adapter, CheckpointError, "DoRA")


def test_lora_on_both_tied_weights_refused(cases: dict[str, Case], tmp_path: Path) -> None:
    """ensure_weight_tying with an embedding LoRA gives lm_head a tied LoRA too: two changes
    of one stored weight, not fused."""
    case = cases["qwen2-rslora"]
    adapter = make_adapter(
        case.base,
        tmp_path / "adapter",
        {"r": 2, "lora_alpha": 4, "target_modules": ["embed_tokens"], "ensure_weight_tying": True},
    )
    del adapter
    _refused(case, tmp_path, tmp_path / "adapter", MergeError, "does not fit")


def test_differing_tied_copies_refused(cases: dict[str, Case], tmp_path: Path) -> None:
    case = cases["qwen2-saved-embedding-tied"]
    adapter = _copy_adapter(case, tmp_path)
    weights = adapter / "adapter_model.safetensors"
    tensors = load_file(str(weights))
    tensors["base_model.model.lm_head.weight"] = tensors["base_model.model.lm_head.weight"] * 2
    save_file(tensors, str(weights))
    _refused(case, tmp_path, adapter, MergeError, "does not fit")


def test_pickled_adapter_refused(cases: dict[str, Case], tmp_path: Path) -> None:
    case = cases["llama"]
    adapter = _copy_adapter(case, tmp_path)
    (adapter / "adapter_model.safetensors").rename(adapter / "adapter_model.bin")
    _refused(case, tmp_path, adapter, CheckpointError, "pickle")


def test_missing_adapter(cases: dict[str, Case], tmp_path: Path) -> None:
    case = cases["llama"]
    _refused(case, tmp_path, tmp_path / "nowhere", CheckpointError, "adapter directory not found")
    (tmp_path / "empty").mkdir()
    _refused(case, tmp_path, tmp_path / "empty", CheckpointError, "adapter_config.json")


def test_missing_base_model(cases: dict[str, Case], tmp_path: Path) -> None:
    case = cases["llama"]
    cfg = {"base_model": str(tmp_path / "nothing"), "output_dir": str(tmp_path / "run")}
    with pytest.raises(MergeError, match="base_model"):
        merge_lora(cfg, tmp_path / "out", case.adapter)


def test_output_containing_an_input_refused(cases: dict[str, Case], tmp_path: Path) -> None:
    case = cases["llama"]
    adapter = _copy_adapter(case, tmp_path)
    with pytest.raises(MergeError, match="holds more than a model"):
        merge_lora(_cfg(case, tmp_path), tmp_path, adapter, overwrite=True)
    with pytest.raises(MergeError, match="contains the input"):
        merge_lora(
            _cfg(case, tmp_path), tmp_path, adapter, overwrite=True, overwrite_non_model=True
        )
    assert (adapter / "adapter_config.json").is_file()


def test_object_storage_adapter_or_output_is_refused_before_reading(tmp_path: Path) -> None:
    """merge-lora reads and writes local files: an s3:// adapter (the run's output_dir) or
    output is one error naming both, instead of a local folder named `s3:`."""
    cfg = {"base_model": str(tmp_path / "base"), "output_dir": "s3://runs/lora-1"}
    with pytest.raises(MergeError) as err:
        merge_lora(cfg)
    assert err.value.message.startswith(
        "adapter s3://runs/lora-1 and output s3://runs/lora-1: merge-lora reads the adapter"
    )
    with pytest.raises(MergeError, match=r"^output s3://models/m: .*--merge_lora"):
        merge_lora({**cfg, "output_dir": str(tmp_path)}, "s3://models/m")
    assert not list(tmp_path.iterdir()) and not Path("s3:").exists()


def test_a_moe_base_is_fused_under_the_names_it_is_saved_with(tmp_path: Path) -> None:
    """Mixtral's experts are fused in memory and saved per expert: an adapter on the linear
    layers (what lora_target_linear adapts there) is fused into the base files' tensors, the
    output has the base model's names, loads, and gives peft's merged logits."""
    base = make_model(tmp_path / "base", "mixtral")
    lora = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "o_proj"]}
    pm = make_adapter(base, tmp_path / "adapter", lora).eval()
    with torch.no_grad():
        want = pm.merge_and_unload()(IDS).logits
    cfg = {"base_model": str(base), "output_dir": str(tmp_path / "run")}
    out = merge_lora(cfg, tmp_path / "out", tmp_path / "adapter", dtype="float32", verify=True)
    assert set(_written(out)) == set(load_file(str(base / "model.safetensors")))
    with torch.no_grad():
        torch.testing.assert_close(_load(out)(IDS).logits, want, rtol=1e-5, atol=1e-6)


# a LoRA on fused MoE experts (peft's ParamWrapper): the per-expert names peft rewrites to
# target_parameters on transformers 5 (gate_up_proj with twice the rank and alpha), rsLoRA
MOE_LORA: dict[str, dict[str, Any]] = {
    "deepseek_v2": {"target_modules": ["q_proj", "gate_proj", "up_proj", "down_proj"]},
    "mixtral": {"target_modules": ["o_proj", "w1", "w2", "w3", "gate"]},
}


@pytest.mark.parametrize("model_type", sorted(MOE_LORA))
def test_a_lora_on_fused_experts_is_fused_as_peft_merges_it(
    tmp_path: Path, model_type: str
) -> None:
    """A LoRA on the fused experts (and Mixtral's router) is fused into the per-expert
    tensors the base model is saved as: bit for bit `merge_and_unload` then `save_pretrained`,
    the base model's names, --verify; the same from the adapter config as peft writes it
    (target_parameters, rank and alpha patterns) and as training writes it (the per-expert
    names peft rewrites when it loads the adapter)."""
    base = make_model(tmp_path / "base", model_type)
    lora = {"r": 4, "lora_alpha": 8, "use_rslora": True, **MOE_LORA[model_type]}
    pm = make_adapter(base, tmp_path / "adapter", lora).eval()
    pm.merge_and_unload().save_pretrained(tmp_path / "peft")
    want = _written(tmp_path / "peft")
    stored = load_file(str(base / "model.safetensors"))
    changed = {k for k in want if not torch.equal(want[k], stored[k])}
    assert any(".experts.3." in k for k in changed)  # the experts changed, not only attention
    cfg = {"base_model": str(base), "output_dir": str(tmp_path / "run")}
    as_trained = shutil.copytree(tmp_path / "adapter", tmp_path / "as-trained")
    peft_written = json.loads((as_trained / "adapter_config.json").read_text())
    assert peft_written["target_parameters"]  # peft's rewrite, saved
    _edit_config(as_trained, target_parameters=None, rank_pattern={}, alpha_pattern={}, **lora)
    for i, adapter in enumerate((tmp_path / "adapter", as_trained)):
        out = merge_lora(cfg, tmp_path / f"out{i}", adapter, dtype="float32", verify=True)
        got = _written(out)
        assert set(got) == set(stored)
        assert [k for k in want if not torch.equal(got[k], want[k])] == [], adapter
    # factors that do not fit the stack (another r): one error before anything is written
    _edit_config(as_trained, r=2)
    with pytest.raises(MergeError, match=r"experts\.(gate_up_proj|down_proj): LoRA A is"):
        merge_lora(cfg, tmp_path / "refused", as_trained, dtype="float32")
    assert not (tmp_path / "refused").exists()
