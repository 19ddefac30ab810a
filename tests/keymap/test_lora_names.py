"""LoRA names and settings against real peft: the names `save_pretrained` writes and a
PEFT-wrapped model's state dict split into pairs / base / modules_to_save; scale, rank and
targeting agree with the layers peft builds; unsupported adapters and unknown names refused."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from helpers.tiny import make_model
from shardforge.errors import CheckpointError
from shardforge.keymap.lora import split_adapter_names, split_model_names
from shardforge.keymap.lora_settings import LoraSettings


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("base") / "llama", "llama", with_tokenizer=False)


def _peft(base: Path, **lora: Any) -> Any:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base)
    return get_peft_model(model, LoraConfig(**lora))


def _lora_layers(peft_model: Any) -> dict[str, Any]:
    """module path (as the base model names it) -> peft's LoRA layer."""
    from peft.tuners.lora import LoraLayer

    prefix = "base_model.model."
    return {
        n.removeprefix(prefix): m for n, m in peft_model.named_modules() if isinstance(m, LoraLayer)
    }


def _saved(peft_model: Any, directory: Path) -> tuple[list[str], dict[str, Any]]:
    from safetensors import safe_open

    peft_model.save_pretrained(directory)
    with safe_open(str(directory / "adapter_model.safetensors"), framework="pt") as f:
        names = list(f.keys())
    return names, json.loads((directory / "adapter_config.json").read_text())


def test_adapter_file_names(llama_dir: Path, tmp_path: Path) -> None:
    pm = _peft(
        llama_dir,
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "v_proj", "embed_tokens"],
        modules_to_save=["lm_head"],
    )
    names, _ = _saved(pm, tmp_path / "ad")
    split = split_adapter_names(names)
    layers = _lora_layers(pm)
    assert set(split.pairs) == set(layers)
    emb = split.pairs["model.embed_tokens"]
    assert emb.embedding and emb.a.endswith("lora_embedding_A")
    q = split.pairs["model.layers.0.self_attn.q_proj"]
    assert not q.embedding
    assert q.a == "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    assert q.b == "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
    # save_embedding_layers: the embedding's base weight travels with the adapter
    assert split.base == {
        "model.embed_tokens.weight": "base_model.model.model.embed_tokens.base_layer.weight"
    }
    assert split.replacements == {"lm_head.weight": "base_model.model.lm_head.weight"}
    assert split.fused_names()["model.layers.1.self_attn.v_proj.weight"] == (
        "model.layers.1.self_attn.v_proj"
    )


@pytest.mark.parametrize("prefixed", [True, False])
def test_model_state_dict_names(llama_dir: Path, prefixed: bool) -> None:
    pm = _peft(
        llama_dir,
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "v_proj", "embed_tokens"],
        modules_to_save=["lm_head"],
    )
    names = list(pm.state_dict())
    if not prefixed:
        names = [n.removeprefix("base_model.model.") for n in names]
    split = split_model_names(names)
    assert set(split.pairs) == set(_lora_layers(pm))
    # every base tensor under its Hugging Face name, lm_head's original kept apart
    from transformers import AutoModelForCausalLM

    hf = set(AutoModelForCausalLM.from_pretrained(llama_dir).state_dict())
    assert set(split.base) | set(split.originals) == hf
    assert set(split.originals) == {"lm_head.weight"}
    assert set(split.replacements) == {"lm_head.weight"}
    assert split.replacements["lm_head.weight"].endswith("lm_head.modules_to_save.default.weight")
    assert split.pairs["model.embed_tokens"].a.endswith("lora_embedding_A.default")


def test_one_adapter_of_several() -> None:
    names = [
        "m.q.base_layer.weight",
        "m.q.lora_A.one.weight",
        "m.q.lora_B.one.weight",
        "m.q.lora_A.two.weight",
        "m.q.lora_B.two.weight",
    ]
    with pytest.raises(CheckpointError, match="2 adapters"):
        split_model_names(names)
    split = split_model_names(names, adapter_name="two")
    assert split.pairs["m.q"].a == "m.q.lora_A.two.weight"
    with pytest.raises(CheckpointError, match="no adapter named"):
        split_model_names(names, adapter_name="three")


BAD_ADAPTER_NAMES: dict[str, tuple[list[str], str]] = {
    "no prefix": (["model.q.lora_A.weight", "model.q.lora_B.weight"], "start with"),
    "dora": (["base_model.model.q.lora_magnitude_vector"], "DoRA"),
    "lora bias": (
        ["base_model.model.q.lora_A.weight", "base_model.model.q.lora_B.bias"],
        "lora_bias",
    ),
    "half a pair": (["base_model.model.q.lora_A.weight"], "no B"),
    "misplaced factor": (["base_model.model.lora_A.weight"], "not a LoRA adapter tensor"),
    "extra segments": (["base_model.model.q.lora_A.default.weight"], "unexpected segments"),
    "trainable tokens": (["base_model.model.e.token_adapter.trainable_tokens_delta"], "tokens"),
    "mixed kinds": (
        ["base_model.model.e.lora_embedding_A", "base_model.model.e.lora_B.weight"],
        "mixes linear and embedding",
    ),
    "no module": (["base_model.model.weight"], "no module path"),
    "lora in a saved module": (
        [
            "base_model.model.q.lora_A.weight",
            "base_model.model.q.lora_B.weight",
            "base_model.model.q.weight",
        ],
        "modules_to_save copy",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_ADAPTER_NAMES))
def test_bad_adapter_names(case: str) -> None:
    names, words = BAD_ADAPTER_NAMES[case]
    with pytest.raises(CheckpointError, match=words):
        split_adapter_names(names, "adapter_model.safetensors")


def test_bad_model_names() -> None:
    with pytest.raises(CheckpointError, match="both"):
        split_model_names(["a.q.weight", "base_model.model.a.q.weight"])
    with pytest.raises(CheckpointError, match="misplaced"):
        split_model_names(["base_layer.weight"])
    with pytest.raises(CheckpointError, match="DoRA"):
        split_model_names(["a.q.lora_magnitude_vector.default.weight"])
    with pytest.raises(CheckpointError, match="lora_bias"):
        split_model_names(["a.q.lora_A.default.weight", "a.q.lora_B.default.bias"])


# --------------------------------------------------------------------------------- settings


@pytest.mark.parametrize(
    "lora",
    [
        {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]},
        {"r": 4, "lora_alpha": 8, "use_rslora": True, "target_modules": ["q_proj", "o_proj"]},
        {
            "r": 4,
            "lora_alpha": 8,
            "target_modules": ["q_proj", "v_proj", "down_proj"],
            "rank_pattern": {"q_proj": 2, "layers.1.mlp.down_proj": 6},
            "alpha_pattern": {"v_proj": 3},
        },
        {
            "r": 2,
            "lora_alpha": 5,
            "target_modules": r".*\.(k_proj|gate_proj)",
            "exclude_modules": ["model.layers.0.mlp.gate_proj"],
        },
        {"r": 2, "lora_alpha": 2, "target_modules": ["q_proj"], "layers_to_transform": [1]},
        {"r": 2, "lora_alpha": 2, "target_modules": "all-linear"},
    ],
    ids=["plain", "rslora", "patterns", "regex-exclude", "layers", "all-linear"],
)
def test_settings_agree_with_peft(llama_dir: Path, tmp_path: Path, lora: dict[str, Any]) -> None:
    pm = _peft(llama_dir, **lora)
    _, config = _saved(pm, tmp_path / "ad")
    settings = LoraSettings.from_adapter_config(config)
    layers = _lora_layers(pm)
    assert layers
    for module, layer in layers.items():
        assert settings.targets(module), module
        assert settings.rank(module) == layer.r["default"], module
        assert settings.scale(module) == layer.scaling["default"], module  # the same float
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(llama_dir)
    linear = {n for n, m in base.named_modules() if isinstance(m, torch.nn.Linear)}
    for name in linear - set(layers):  # peft left it alone: so does the fuse
        assert not settings.targets(name) or name == "lm_head", name


def test_settings_values() -> None:
    s = LoraSettings.from_adapter_config(
        {"r": 16, "lora_alpha": 32, "use_rslora": True, "modules_to_save": ["lm_head"]}
    )
    assert s.scale("x") == 32 / 4.0
    assert s.saves("lm_head") and s.saves("model.lm_head") and not s.saves("lm_head2")
    assert LoraSettings.from_adapter_config({"r": 8, "lora_alpha": 16}).scale("x") == 2.0
    # peft's ParamWrapper targets (fused MoE experts): a name or its last segments
    s = LoraSettings.from_adapter_config({"r": 8, "lora_alpha": 16, "target_parameters": ["up"]})
    assert s.targets_parameter("model.layers.0.mlp.experts.up")
    assert not s.targets_parameter("model.layers.0.mlp.experts.gate_up")


REFUSED: dict[str, tuple[dict[str, Any], str]] = {
    "dora": ({"use_dora": True}, "DoRA"),
    "lora bias": ({"lora_bias": True}, "lora_bias"),
    "bias all": ({"bias": "all"}, "bias"),
    "trainable tokens": ({"trainable_token_indices": [1, 2]}, "trainable tokens"),
    "unknown setting": ({"use_new_thing": True}, "does not know"),
    "other peft type": ({"peft_type": "LOHA"}, "LOHA"),
    "zero rank": ({"r": 0}, "r 0"),
    "string rank": ({"r": "8"}, "positive number"),
    "fractional rank": ({"r": 2.5}, "positive number"),
    "bad pattern": ({"rank_pattern": {"q": -1}}, "positive number"),
    "bad modules": ({"modules_to_save": [1]}, "list of names"),
    "bad flag": ({"use_rslora": "yes"}, "true or false"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_refused_settings(case: str) -> None:
    change, words = REFUSED[case]
    data = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "use_dora": False, **change}
    with pytest.raises(CheckpointError, match=words) as info:
        LoraSettings.from_adapter_config(data, "ad/adapter_config.json")
    assert "ad/adapter_config.json" in info.value.message
