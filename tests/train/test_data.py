"""Training data: tokenization by type, packing/padding, the global order, rank slices."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helpers.tiny import make_tokenizer, tiny_conversations
from shardforge.config import validate_cfg
from shardforge.config.schema import DatasetConfig
from shardforge.train.data import (
    IGNORE_INDEX,
    GlobalOrder,
    Sample,
    TokenizeOptions,
    build_sequences,
    rank_slice,
    to_sequences,
    tokenize_row,
)


@pytest.fixture(scope="module")
def tok():  # type: ignore[no-untyped-def]
    return make_tokenizer(320)


def test_completion_appends_eos_and_trains_on_all_tokens(tok) -> None:  # type: ignore[no-untyped-def]
    sample = tokenize_row(
        {"text": "The cat sees the moon."}, DatasetConfig(path="x"), tok, TokenizeOptions()
    )
    assert sample.input_ids[-1] == tok.eos_token_id
    assert sample.labels == sample.input_ids
    assert tok.decode(sample.input_ids[:-1]) == "The cat sees the moon."


def test_chat_template_trains_on_assistant_turns_only(tok) -> None:  # type: ignore[no-untyped-def]
    messages = tiny_conversations(1)[0]
    ds = DatasetConfig(path="x", type="chat_template")
    sample = tokenize_row({"messages": messages}, ds, tok, TokenizeOptions())
    trained = [t for t, lab in zip(sample.input_ids, sample.labels, strict=True) if lab != -100]
    assert tok.decode(trained) == messages[1]["content"] + "</s>"
    assert sample.labels[0] == IGNORE_INDEX


def test_packing_and_padding() -> None:
    samples = [Sample([1, 2, 3], [1, 2, 3]), Sample([4, 5], [-100, 5])]
    packed = to_sequences(samples, 4, packing=True, pad_id=0)  # whole samples (test_packing.py)
    assert packed.input_ids.tolist() == [[1, 2, 3, 0], [4, 5, 0, 0]]
    assert packed.labels.tolist() == [[-100, 2, 3, -100], [-100, 5, -100, -100]]
    assert packed.attention_mask.tolist() == [[1, 1, 1, 0], [1, 1, 0, 0]]
    padded = to_sequences(samples, 2, packing=False, pad_id=9)
    assert padded.input_ids.tolist() == [[1, 2], [4, 5]]
    assert padded.labels.tolist() == [[1, 2], [-100, 5]]


def test_global_order_is_a_seeded_permutation_per_epoch() -> None:
    order = GlobalOrder(10, seed=3)
    first, second = order.indices(0, 10), order.indices(10, 10)
    assert sorted(first) == sorted(second) == list(range(10))
    assert first != second  # a new permutation every epoch
    assert GlobalOrder(10, seed=3).indices(7, 6) == first[7:] + second[:3]
    assert GlobalOrder(10, seed=4).indices(0, 10) != first


@pytest.mark.parametrize("world,micro,accum", [(1, 6, 2), (2, 3, 2), (3, 2, 2), (4, 3, 1)])
def test_rank_slices_cover_the_global_batch_exactly(world: int, micro: int, accum: int) -> None:
    consumed = 36
    positions = []
    for a in range(accum):
        for r in range(world):
            start, count = rank_slice(consumed, a, r, world, micro)
            positions += range(start, start + count)
    assert sorted(positions) == list(range(consumed, consumed + 12))


def test_build_sequences_is_deterministic(tmp_path: Path) -> None:
    from helpers.tiny import make_model, tiny_texts, write_jsonl

    base = make_model(tmp_path / "base")
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in tiny_texts(20)])
    cfg = validate_cfg(
        {"base_model": str(base), "datasets": [{"path": str(data)}], "sequence_len": 16}
    )
    from shardforge.train.data import load_tokenizer

    a = build_sequences(cfg, load_tokenizer(cfg))
    b = build_sequences(cfg, load_tokenizer(cfg))
    assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.labels, b.labels)
    assert len(a) == 20  # not packed: one padded or truncated row per sample
