"""The torch-file sink's tensor order: the model's state-dict order, found in linear time."""

from __future__ import annotations

import torch

from shardforge.sinks.plan import TensorSpec
from shardforge.sinks.torch_file import saved_order


class CountingName(str):
    """A tensor name that counts the equality tests made on it."""

    compared = 0

    def __eq__(self, other: object) -> bool:
        CountingName.compared += 1
        return str.__eq__(self, other)

    def __hash__(self) -> int:
        return str.__hash__(self)


def test_a_100k_tensor_model_is_ordered_in_linear_time() -> None:
    """Bug: `--format torch` ordered its tensors with a nested scan (n^2 name comparisons:
    10^10 for a 100k-tensor MoE checkpoint)."""
    n = 100_000
    names = [CountingName(f"model.layers.{i // 1000}.experts.{i % 1000}.w") for i in range(n)]
    specs = [TensorSpec(name, torch.float32, (2,)) for name in reversed(names)]
    CountingName.compared = 0
    ordered = saved_order(specs, names)
    assert [s.name for s in ordered] == names
    assert CountingName.compared <= 4 * n, CountingName.compared


def test_tensors_not_named_keep_their_order_after_the_named() -> None:
    specs = [TensorSpec(n, torch.float32, ()) for n in ("c", "a", "x", "b")]
    assert [s.name for s in saved_order(specs, ["a", "b", "c"])] == ["a", "b", "c", "x"]
