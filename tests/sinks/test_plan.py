"""The output plan: the same bytes the safetensors library writes, the same shards and index
as save_pretrained (huggingface_hub's split)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shardforge.sinks.plan import TensorSpec, default_max_shard_size, plan_output, save_order


def test_header_and_layout_match_the_safetensors_library(tmp_path: Path) -> None:
    """Mixed dtypes: our planned file, filled with the same bytes, equals safetensors' own."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    tensors = {
        "b.bf16": torch.randn(3, 5, generator=g).to(torch.bfloat16),
        "a.f32": torch.randn(7, generator=g),
        "c.i64": torch.arange(4),
        "d.bool": torch.tensor([True, False, True]),
        "e.f16": torch.randn(2, 2, generator=g).half(),
        "s.scalar": torch.tensor(1.5),
    }
    save_file(tensors, tmp_path / "ref.safetensors", metadata={"format": "pt"})
    specs = [TensorSpec(k, t.dtype, tuple(t.shape)) for k, t in tensors.items()]
    plan = plan_output(specs, "5GB", 0)
    (pf,) = plan.files
    assert pf.name == "model.safetensors" and plan.index is None
    buf = bytearray(pf.size)
    buf[: len(pf.header)] = pf.header
    for planned in pf.tensors:
        data = tensors[planned.spec.name].reshape(-1).view(torch.uint8).numpy().tobytes()
        buf[planned.offset : planned.offset + len(data)] = data
    assert bytes(buf) == (tmp_path / "ref.safetensors").read_bytes()


def test_sharding_matches_huggingface_hub() -> None:
    from huggingface_hub import split_torch_state_dict_into_shards

    sd = {f"model.layers.{i}.w": torch.empty(100, 10) for i in range(12)}
    sd["model.embed.weight"] = torch.empty(500, 10)  # larger than a shard: its own file
    specs = [TensorSpec(k, t.dtype, tuple(t.shape)) for k, t in sd.items()]
    plan = plan_output(specs, "9KB", 123)
    ordered = {k: sd[k] for k in save_order(list(sd))}
    ref = split_torch_state_dict_into_shards(
        ordered, filename_pattern="model{suffix}.safetensors", max_shard_size="9KB"
    )
    assert plan.index is not None
    assert plan.index["weight_map"] == ref.tensor_to_filename
    assert plan.index["metadata"] == {"total_parameters": 123, **ref.metadata}
    assert [f.name for f in plan.files] == list(ref.filename_to_tensors)


def test_layer_numbers_sort_numerically() -> None:
    names = ["model.layers.10.w", "model.layers.2.w", "lm_head.weight", "model.embed.weight"]
    assert save_order(names)[:3] == ["lm_head.weight", "model.embed.weight", "model.layers.2.w"]


def test_default_shard_size_is_save_pretrained_s() -> None:
    import inspect

    from transformers import PreTrainedModel

    sig = inspect.signature(PreTrainedModel.save_pretrained)
    assert default_max_shard_size() == sig.parameters["max_shard_size"].default


def test_unstorable_dtype_is_refused() -> None:
    from shardforge.errors import MergeError

    with pytest.raises(MergeError, match="safetensors"):
        plan_output([TensorSpec("q", torch.quint8, (2,))], "5GB", 0)
