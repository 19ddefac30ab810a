"""Sample packing without cross-talk: a packed window computes what its samples compute alone.

The packed side goes through what the trainer uses (build_datasets, the FSDP2 model built by
build_meta_model / shard_model / materialize_and_load, model_inputs, the loop's loss); the
reference is a plain transformers model run on each tokenized sample by itself.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from train_helpers import losses, read_metrics, shared_run

from shardforge.config import validate_cfg
from shardforge.errors import ConfigError
from shardforge.train.data import (
    IGNORE_INDEX,
    Sample,
    Sequences,
    load_samples,
    load_tokenizer,
    model_inputs,
    to_sequences,
)
from shardforge.train.eval import build_datasets
from shardforge.train.model import (
    build_meta_model,
    load_model_config,
    materialize_and_load,
    shard_model,
)
from shardforge.train.packing import check_packing, plan_windows
from shardforge.train.runtime import Runtime, device_mesh, init_distributed
from shardforge.train.step import loss_sum
from shardforge.train.vocab import grow_vocab_size

CPU = torch.device("cpu")
# fp32 logits of a window vs its samples alone: the same arithmetic in GEMMs of other shapes
# (rows of one window vs of one sample) rounds differently; measured at most 2.4e-7 here.
# Attention across samples changes them by about 0.5 (asserted below), so 1e-5 tells them apart.
TOL = {"rtol": 1e-5, "atol": 1e-5}


def _segments(positions: list[int], length: int) -> list[tuple[int, int]]:
    """(start, stop) of the runs of consecutive positions 0, 1, 2, ... among the first
    `length` entries of a window."""
    starts = [i for i in range(length) if positions[i] == 0] + [length]
    return list(itertools.pairwise(starts))


def test_windows_hold_whole_samples_with_restarting_positions() -> None:
    samples = [
        Sample([1, 2, 3], [1, 2, 3]),
        Sample([4, 5], [-100, 5]),
        Sample([6, 7, 8, 9, 10, 11], [6, 7, 8, 9, 10, 11]),  # longer than a window: 2 pieces
        Sample([12], [12]),
        Sample([13, 14, 15], [13, 14, 15]),
    ]
    packed = to_sequences(samples, 4, packing=True, pad_id=0)
    assert packed.position_ids is not None
    # best fit in data order: each piece goes where the least room still fits it
    assert packed.input_ids.tolist() == [
        [1, 2, 3, 12],
        [4, 5, 10, 11],
        [6, 7, 8, 9],
        [13, 14, 15, 0],
    ]
    assert packed.position_ids.tolist() == [
        [0, 1, 2, 0],
        [0, 1, 0, 1],
        [0, 1, 2, 3],
        [0, 1, 2, 0],  # the padding is a segment of its own
    ]
    # every sample's (and piece's) first token is no target: it follows another sample
    assert packed.labels.tolist() == [
        [-100, 2, 3, -100],
        [-100, 5, -100, 11],
        [-100, 7, 8, 9],
        [-100, 14, 15, -100],
    ]
    assert packed.attention_mask.tolist() == [[1, 1, 1, 1]] * 3 + [[1, 1, 1, 0]]
    batch = packed.select([1, 0])
    assert batch.position_ids is not None
    assert batch.position_ids.tolist() == [[0, 1, 0, 1], [0, 1, 2, 0]]
    inputs = model_inputs(batch, CPU)
    assert set(inputs) == {"input_ids", "position_ids", "use_cache"}  # no attention mask
    padded = to_sequences(samples, 4, packing=False, pad_id=0)
    assert padded.position_ids is None and "attention_mask" in model_inputs(padded, CPU)


def test_best_fit_plan() -> None:
    assert plan_windows([3, 2, 4, 1], 4) == [[0, 3], [1], [2]]
    assert plan_windows([2, 3, 2, 1, 4], 5) == [[0, 1], [2, 3], [4]]
    windows = plan_windows([(7 * i) % 13 + 1 for i in range(200)], 16)
    assert sorted(i for w in windows for i in w) == list(range(200))
    assert all(w == sorted(w) for w in windows)


@pytest.fixture(scope="module")
def rank() -> Iterator[Runtime]:
    """A one-rank gloo process group in this process (what `--launcher python` runs)."""
    rt = init_distributed()
    yield rt
    dist.destroy_process_group()


def _trainer_model(cfg: Any, tokenizer: Any, rt: Runtime) -> torch.nn.Module:
    """The model as the trainer builds it: meta model, FSDP2, base weights broadcast."""
    model_config = load_model_config(cfg)
    grow_vocab_size(model_config, tokenizer)
    model = build_meta_model(cfg, model_config)
    check_packing(cfg, model)
    shard_model(model, cfg, device_mesh(rt, (1,)))
    materialize_and_load(model, cfg, CPU, rt.rank)
    return model.train()  # as in training (no dropout in these models)


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_a_packed_window_equals_its_samples_run_one_by_one(
    base_cfg: dict[str, Any], rank: Runtime, impl: str
) -> None:
    from transformers import AutoModelForCausalLM

    cfg = validate_cfg({**base_cfg, "sequence_len": 128, "attn_implementation": impl})
    tokenizer = load_tokenizer(cfg)
    seqs = build_datasets(cfg, tokenizer).train
    assert seqs.position_ids is not None
    samples = load_samples(cfg, tokenizer)
    by_ids = {tuple(s.input_ids): s for s in samples}
    model = _trainer_model(cfg, tokenizer, rank)
    alone_model = AutoModelForCausalLM.from_pretrained(cfg.base_model, attn_implementation=impl)

    # four windows of several samples each, as one micro-batch
    several = [i for i in range(len(seqs)) if int((seqs.position_ids[i] == 0).sum()) >= 3]
    batch = seqs.select(several[:4])
    assert len(several) >= 4 and batch.position_ids is not None
    with torch.no_grad():
        packed = model(**model_inputs(batch, CPU)).logits
        loss = float(loss_sum(model, batch, CPU))
        # the same windows with one causal mask over each (no isolation): visibly different
        crosstalk = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits

    want_loss, want_targets, found, leaked = 0.0, 0, 0, 0.0
    for row in range(len(batch)):
        length = int(batch.attention_mask[row].sum())
        for a, b in _segments(batch.position_ids[row].tolist(), length):
            sample = by_ids[tuple(batch.input_ids[row, a:b].tolist())]  # a whole sample
            ids = torch.tensor([sample.input_ids])
            labels = torch.tensor(sample.labels[1:])
            with torch.no_grad():
                alone = alone_model(input_ids=ids).logits[0]
            torch.testing.assert_close(packed[row, a:b], alone, **TOL)
            want_loss += float(
                F.cross_entropy(alone[:-1], labels, ignore_index=IGNORE_INDEX, reduction="sum")
            )
            want_targets += int((labels != IGNORE_INDEX).sum())
            leaked = max(leaked, float((crosstalk[row, a:b] - alone).abs().max()))
            found += 1
    assert found >= 8  # at least two samples in each window
    assert leaked > 1e-2  # attention across samples would have shown
    assert math.isclose(loss, want_loss, rel_tol=1e-6), (loss, want_loss)
    # targets: each sample's own, none of them a sample's first token
    assert int((batch.labels[:, 1:] != IGNORE_INDEX).sum()) == want_targets


def test_attention_that_cannot_isolate_is_refused(base_cfg: dict[str, Any]) -> None:
    """A registered attention function transformers builds no packed-sequence mask for."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    AttentionInterface.register("shardforge_test_attention", sdpa_attention_forward)
    cfg = validate_cfg({**base_cfg, "attn_implementation": "shardforge_test_attention"})
    model = build_meta_model(cfg)
    with pytest.raises(ConfigError) as err:
        check_packing(cfg, model)
    message = str(err.value)
    assert "sample_packing" in message and "attn_implementation" in message
    assert "shardforge_test_attention" in message
    check_packing(validate_cfg({**base_cfg, "sample_packing": False}), model)  # padding: fine


def test_packed_training_runs_on_two_ranks(tmp_path_factory: pytest.TempPathFactory) -> None:
    """A 2-rank packed run (windows of 96 tokens, several samples each: `shared_run`) trains
    and logs every step."""
    run = shared_run(tmp_path_factory, "packed")
    assert run.cfg["sequence_len"] == 96 and run.cfg["sample_packing"] is True
    out = run.out
    got = losses(out)
    assert sorted(got) == [1, 2, 3, 4, 5, 6]
    assert all(math.isfinite(v) for v in got.values()) and got[6] < got[1]
    assert all(m["tokens"] > 0 for m in read_metrics(out))
    assert (out / "checkpoint-6" / "trainer_state.json").is_file()


def test_sequences_without_positions_keep_the_attention_mask() -> None:
    ids = torch.tensor([[1, 2, 0]])
    batch = Sequences(ids, ids.clone(), torch.tensor([[1, 1, 0]]))
    inputs = model_inputs(batch, CPU)
    assert torch.equal(inputs["attention_mask"], torch.tensor([[1, 1, 0]]))
    assert "position_ids" not in inputs
