"""Streamed data (`streaming`, `pretraining_dataset`): read, tokenized and packed block by block.

The ranks share the stream's positions without overlap; a resume continues the stream (also at
another world size); a data file is never held whole.
"""

from __future__ import annotations

import json
import math
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from train_helpers import losses, train_configs, write_config

from helpers.dist import run_on_ranks
from helpers.tiny import write_jsonl
from shardforge.config import load_cfg, validate_cfg
from shardforge.errors import ConfigError
from shardforge.train.data import load_tokenizer
from shardforge.train.preflight import check_datasets, preflight
from shardforge.train.runtime import Runtime
from shardforge.train.step import micro_batches
from shardforge.train.streaming import Position, Stream, StreamOrder

RTOL = 1e-6  # 1 and 2 ranks differ only in the order of fp32 reductions (see test_loop)


def _raw(base_cfg: dict[str, Any], **changes: Any) -> dict[str, Any]:
    """The shared base's config with its texts as a streamed pretraining corpus (blocks of 8)."""
    data = str(Path(base_cfg["datasets"][0]["path"]))
    cfg = {**base_cfg, "datasets": [], "pretraining_dataset": data, "streaming": True}
    cfg.update({"streaming_multipack_buffer_size": 8, "save_steps": None, **changes})
    return cfg


def _cfg(base_cfg: dict[str, Any], **changes: Any) -> Any:
    return validate_cfg(_raw(base_cfg, **changes), command="train")


def _rows(seqs: Any) -> list[tuple[int, ...]]:
    return [tuple(r) for r in seqs.input_ids.tolist()]


def _ranks_take(rank: int, world: int, cfg: Any, steps: int, out: str) -> None:
    """Each rank's micro-batches of `steps` optimizer steps, written to out/rank{rank}.pt."""
    tok = load_tokenizer(cfg)
    gb = cfg.micro_batch_size * world * cfg.gradient_accumulation_steps
    stream, rt = Stream(cfg, tok, steps * gb), Runtime(rank, world, rank, torch.device("cpu"))
    seen = [
        _rows(b)
        for step in range(steps)
        for b in micro_batches(stream, StreamOrder(), step * gb, cfg, rt)
    ]
    torch.save(seen, Path(out) / f"rank{rank}.pt")


def _take_then_train(
    rank: int, world: int, cfg: Any, steps: int, out: str, config: str, stores: str
) -> None:
    """On each of 2 ranks: `_ranks_take`, then train `config` as a rank of `shardforge train`
    does (`train_configs`): two checks, one launch."""
    _ranks_take(rank, world, cfg, steps, out)
    train_configs(rank, world, [(config, None)], stores)


@pytest.fixture(scope="module")
def two_ranks(base_cfg: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One launch of 2 gloo ranks: take/ holds each rank's micro-batches of 12 steps of 12
    sequences (`_ranks_take`); a/ the output of a pretraining run of 4 steps (checkpoints at 2
    and 4), a.yml its config, which passed the launcher's checks first."""
    root = tmp_path_factory.mktemp("streamed")
    (root / "take").mkdir()
    (root / "stores").mkdir()
    cfg = _raw(base_cfg, max_steps=4, output_dir=str(root / "a"), save_steps=2)
    cfg.update(warmup_steps=0, micro_batch_size=3)
    config = write_config(root / "a.yml", cfg)
    preflight(load_cfg(config, command="train").to_model(), str(config))  # as the launcher
    take = _cfg(base_cfg, micro_batch_size=3, max_steps=12)
    run_on_ranks(
        _take_then_train, 2, take, 12, str(root / "take"), str(config), str(root / "stores")
    )
    return root


@pytest.mark.slow
def test_two_gloo_ranks_take_disjoint_sequences_covering_the_stream(
    base_cfg: dict[str, Any], two_ranks: Path
) -> None:
    """2 gloo ranks, 12 steps of 12 sequences: more than one epoch of the 48 texts (packed:
    138 windows an epoch), so the blocks, the epoch's end and its restart are crossed."""
    cfg = _cfg(base_cfg, micro_batch_size=3, max_steps=12)
    r0, r1 = (torch.load(two_ranks / "take" / f"rank{r}.pt") for r in (0, 1))
    taken = [row for a, b in zip(r0, r1, strict=True) for row in a + b]
    stream = Stream(cfg, load_tokenizer(cfg), 144)
    whole = _rows(stream.select(list(range(144))))
    assert stream.state()["epoch"] == 1
    assert sorted(taken) == sorted(whole)  # nothing lost, nothing doubled
    epoch = taken[:138]  # one epoch: no window twice (packed windows of distinct texts)
    assert len(set(epoch)) == len(epoch)
    assert taken != [row for a in r0 for row in a]


def test_the_first_epoch_holds_every_text_once(base_cfg: dict[str, Any]) -> None:
    """Unpacked, unconcatenated pretraining: one row per text, each text exactly once per epoch
    (shuffled within its block), and the next epoch starts again."""
    cfg = _cfg(base_cfg, sample_packing=False, max_steps=1)
    tok = load_tokenizer(cfg)
    lines = Path(cfg.pretraining_dataset[0].path).read_text().splitlines()
    texts = [json.loads(line)["text"] for line in lines]
    want = sorted(tuple(tok(t, truncation=True, max_length=30)["input_ids"]) for t in texts)
    stream = Stream(cfg, tok, 96)
    got = stream.select(list(range(2 * len(texts))))
    rows = [
        tuple(i for i, m in zip(r, k, strict=True) if m)
        for r, k in zip(got.input_ids.tolist(), got.attention_mask.tolist(), strict=True)
    ]
    assert sorted(rows[: len(texts)]) == want == sorted(rows[len(texts) :])
    assert rows[: len(texts)] != rows[len(texts) :]  # epoch 2 is shuffled anew
    assert stream.state()["epoch"] == 1


def test_a_resumed_stream_continues_without_tokenizing_the_rows_before(
    base_cfg: dict[str, Any],
) -> None:
    cfg = _cfg(base_cfg, max_steps=1)
    tok = load_tokenizer(cfg)
    ahead = Stream(cfg, tok, 60)
    ahead.select(list(range(25)))  # blocks of 8 texts give about 20 windows
    saved = ahead.state()
    assert saved["block"] == 1
    want = _rows(ahead.select(list(range(25, 45))))
    calls = 0

    def counting(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        return tok.__class__.__call__(tok, *args, **kwargs)

    resumed = Stream(cfg, tok, 60)
    resumed.tokenizer = _Counting(tok, counting)
    resumed.resume(saved, 25)
    assert _rows(resumed.select(list(range(25, 45)))) == want
    assert ahead.state() == resumed.state()
    assert calls <= 16  # one call per text of blocks 1 and 2: block 0 was read, not tokenized
    replayed = Stream(cfg, tok, 60)
    replayed.resume(None, 25)  # no block recorded: from the start, the same sequences
    assert _rows(replayed.select(list(range(25, 45)))) == want


class _Counting:
    """A tokenizer whose calls are counted (its attributes are the tokenizer's)."""

    def __init__(self, tok: Any, call: Any) -> None:
        self._tok, self._call = tok, call

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._call(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tok, name)


def test_a_file_larger_than_the_buffer_is_never_held_whole(
    base_cfg: dict[str, Any], tmp_path: Path
) -> None:
    """20,000 rows (~2.6 MB of JSON lines): reading to the last block holds one block at a time;
    tracemalloc's peak stays far below the file's size."""
    big = write_jsonl(
        tmp_path / "big.jsonl", [{"text": f"row {i} " + "ab " * 40} for i in range(20_000)]
    )
    cfg = _cfg(base_cfg, max_steps=1, pretraining_dataset=str(big))
    stream = Stream(cfg, load_tokenizer(cfg), 10)
    size = big.stat().st_size
    tracemalloc.start()
    try:
        stream.seek(Position(0, 20_000 // 8 - 1, 0))  # every row before the last block is read
        last = stream.select([0])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(last) == 1
    assert peak < size / 10, (peak, size)


def test_the_stream_keys_change_the_sequences(base_cfg: dict[str, Any]) -> None:
    tok = load_tokenizer(_cfg(base_cfg, max_steps=1))

    def first(**keys: Any) -> Any:
        return Stream(_cfg(base_cfg, max_steps=1, **keys), tok, 4).select([0, 1])

    packed = first()
    assert packed.position_ids is not None  # pretrain_multipack_attn (default true)
    assert first(pretrain_multipack_attn=False).position_ids is None
    single = first(sample_packing=False)
    concatenated = first(sample_packing=False, pretraining_sample_concatenation=True)
    assert concatenated.attention_mask.sum() > single.attention_mask.sum()
    assert not torch.equal(first(streaming_multipack_buffer_size=16).input_ids, packed.input_ids)
    assert not torch.equal(first(shuffle_merged_datasets=False).input_ids, packed.input_ids)


def test_stream_config_checks(base_cfg: dict[str, Any]) -> None:
    raw = _raw(base_cfg, max_steps=1, pretrain_multipack_buffer_size=5)
    del raw["streaming_multipack_buffer_size"]
    cfg = validate_cfg(raw, command="train")
    assert cfg.streaming_multipack_buffer_size == 5  # Axolotl's deprecated spelling
    assert cfg.pretraining_dataset[0].text_column == "text"
    for changes, words in (
        ({"max_steps": None}, "needs max_steps"),
        ({"max_steps": 2, "val_set_size": 0.1}, "val_set_size: cannot be used"),
    ):
        with pytest.raises(ConfigError, match=words):
            _cfg(base_cfg, **changes)
    hub = _cfg(base_cfg, max_steps=1, pretraining_dataset=[{"path": "HuggingFaceFW/fineweb-edu"}])
    (problem,) = check_datasets(hub)
    assert problem[0] == "pretraining_dataset[0].path" and "not downloaded" in problem[1]


@pytest.mark.slow
def test_pretraining_trains_and_resumes_the_stream_at_another_world_size(
    two_ranks: Path, tmp_path: Path
) -> None:
    """2 ranks, 4 steps (checkpoints at 2 and 4): the loss falls. Resumed from checkpoint-2 on
    1 rank, steps 3 and 4 see the same sequences (the same losses): the stream continues at
    the checkpoint's position, nothing repeated or skipped."""
    cfg = yaml.safe_load((two_ranks / "a.yml").read_text())
    two = losses(two_ranks / "a")
    assert two[4] < two[1] - 0.3, two
    from shardforge.train.launch import do_train

    b = {**cfg, "output_dir": str(tmp_path / "b"), "micro_batch_size": 6}
    b["resume_from_checkpoint"] = str(two_ranks / "a" / "checkpoint-2")
    assert do_train(write_config(tmp_path / "b.yml", b), [], "python") == 0
    one = losses(tmp_path / "b")
    assert sorted(one) == [3, 4]
    for step in (3, 4):
        assert math.isclose(one[step], two[step], rel_tol=RTOL), (step, one, two)
