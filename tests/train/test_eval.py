"""Evaluation: the held-out split, test_datasets, the schedule, and the eval loss at 1 and 2 ranks."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from train_helpers import EVALUATED, read_metrics, shared_run, write_config

from helpers.tiny import make_tokenizer, tiny_texts, write_jsonl
from shardforge.config import validate_cfg
from shardforge.errors import ConfigError
from shardforge.train.eval import build_datasets, eval_interval, held_out
from shardforge.train.preflight import preflight

# what the eval rows of a run look like: before the first step, every 2 steps, after the last
EVAL_STEPS = [0, 2, 4, 5]


def _eval_cfg(base_cfg: dict[str, Any], out: Path, **extra: Any) -> dict[str, Any]:
    # eval_batch_size 2: the same chunks at any world size (see below)
    return {**base_cfg, "output_dir": str(out), **EVALUATED, **extra}


def _evals(out: Path) -> dict[int, dict[str, Any]]:
    return {m["step"]: m for m in read_metrics(out) if "eval_loss" in m}


def test_eval_loss_is_the_same_at_one_and_two_ranks(
    base_cfg: dict[str, Any], tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Every chunk of eval_batch_size sequences is one forward pass on some rank, and the
    per-sequence sums are added in sequence order after the all-reduce: with the same weights
    (step 0, the base model) the eval loss is bit for bit the same at 1 and 2 ranks (each
    with one CPU thread). After
    training, the weights themselves differ in the last bits between world sizes (gradient
    reduction order, see test_loop.py), so later evaluations agree to 1e-6 relative."""
    import torch

    from shardforge.train.launch import do_train

    one = tmp_path / "one"
    cfg1 = _eval_cfg(base_cfg, one, micro_batch_size=6)  # global batch 12 at 1 rank
    # one thread, as each rank of the 2-rank run has: MKL's float32 products of a few rows
    # (here a loss chunk's 2 x 4 tokens) differ in the last bits between 1 and 2 threads
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert do_train(write_config(tmp_path / "one.yml", cfg1), [], "python") == 0
    finally:
        torch.set_num_threads(threads)
    run = shared_run(tmp_path_factory, "evaluated")  # 2 ranks, the same config
    two = run.out
    assert "sequences (val_set_size), before the first step, every 2 steps" in run.stderr
    assert "eval at step 0  loss" in run.stderr

    a, b = _evals(one), _evals(two)
    assert sorted(a) == sorted(b) == EVAL_STEPS
    assert a[0]["eval_loss"] == b[0]["eval_loss"]  # same weights: the same number
    for step in EVAL_STEPS:
        assert math.isclose(a[step]["eval_loss"], b[step]["eval_loss"], rel_tol=1e-6), step
        assert a[step]["eval_tokens"] == b[step]["eval_tokens"] > 0
        assert b[step]["eval_perplexity"] == pytest.approx(math.exp(b[step]["eval_loss"]))
    assert b[5]["eval_loss"] < b[0]["eval_loss"]  # it learns, and evaluation sees it
    # the held-out samples are not trained on: 48 samples, 5 held out, packed into fewer
    # training sequences than without the split (81)
    first_step = next(m for m in read_metrics(two) if "loss" in m)
    trained = round(12 / first_step["epoch"])
    assert trained < 81


def test_held_out_split_is_the_tail_of_the_merged_samples() -> None:
    assert held_out(100, 0.0) == []
    assert held_out(100, 0.05) == [95, 96, 97, 98, 99]
    assert len(held_out(101, 0.05)) == 6  # a fraction is rounded up
    assert held_out(100, 30) == list(range(70, 100))  # a whole number is a count
    with pytest.raises(ConfigError, match=r"val_set_size: holding out 100 of the 100"):
        held_out(100, 100)


def test_val_set_size_holds_out_the_samples_axolotl_holds_out(tmp_path: Path) -> None:
    """Axolotl shuffles the merged samples (Dataset.shuffle(seed)) and splits them with
    datasets' train_test_split(shuffle=False): its evaluation samples are these, at any seed."""
    from datasets import Dataset

    tok = make_tokenizer(320)
    rows = write_jsonl(tmp_path / "t.jsonl", [{"text": t} for t in tiny_texts(20, seed=1)])
    common = {"base_model": "m", "datasets": [{"path": str(rows)}], "sample_packing": False}
    in_file_order = {**common, "shuffle_merged_datasets": False}
    plain = build_datasets(validate_cfg(in_file_order), tok).train
    for seed, size in ((7, 0.05), (42, 0.2), (3, 3)):
        split = build_datasets(validate_cfg({**common, "seed": seed, "val_set_size": size}), tok)
        axolotl = Dataset.from_dict({"row": list(range(20))}).shuffle(seed=seed)
        held = axolotl.train_test_split(test_size=size, shuffle=False)["test"]["row"]
        assert split.eval is not None, (seed, size)
        assert split.eval.input_ids.tolist() == plain.input_ids[held].tolist(), (seed, size)


def test_build_datasets_holds_out_or_reads_test_datasets(tmp_path: Path) -> None:
    tok = make_tokenizer(320)
    train = write_jsonl(tmp_path / "train.jsonl", [{"text": t} for t in tiny_texts(20, seed=1)])
    test = write_jsonl(tmp_path / "test.jsonl", [{"text": t} for t in tiny_texts(3, seed=2)])
    common = {"base_model": "unused", "datasets": [{"path": str(train)}], "sequence_len": 64}

    data = build_datasets(validate_cfg({**common, "sample_packing": False}), tok)
    assert data.eval is None and len(data.train) == 20
    split = build_datasets(validate_cfg({**common, "val_set_size": 4}), tok)
    assert split.eval is not None and split.eval_key == "val_set_size"
    assert (len(split.train), len(split.eval)) == (16, 4)  # padded: one sequence per sample
    held = held_out(20, 4)
    assert split.eval.input_ids[0].tolist() == data.train.input_ids[held[0]].tolist()

    cfg = validate_cfg({**common, "test_datasets": [{"path": str(test)}], "eval_sequence_len": 16})
    tested = build_datasets(cfg, tok)
    assert tested.eval is not None and tested.eval_key == "test_datasets"
    assert len(tested.train) == 20 and tested.eval.input_ids.shape == (3, 16)
    packed = validate_cfg(
        {**cfg.model_dump(), "eval_sample_packing": True, "eval_sequence_len": 512}
    )
    assert build_datasets(packed, tok).eval.input_ids.shape == (1, 512)  # type: ignore[union-attr]


def test_training_samples_without_target_tokens_are_refused(tmp_path: Path) -> None:
    """Alpaca samples truncated to a sequence_len shorter than their prompt (the tiny
    tokenizer's prompt is ~120 tokens) hold no target token: training them would change nothing (a loss
    of 0 at every step), so it is one error naming the key, as for the evaluation samples."""
    tok = make_tokenizer(320)
    rows = [{"instruction": "Tell me a story.", "input": "", "output": t} for t in tiny_texts(4)]
    data = write_jsonl(tmp_path / "a.jsonl", rows)
    cfg = {"base_model": "m", "datasets": [{"path": str(data), "type": "alpaca"}]}
    short = validate_cfg({**cfg, "sequence_len": 64, "sample_packing": False})
    with pytest.raises(ConfigError, match=r"^datasets: the training samples hold no target"):
        build_datasets(short, tok)
    assert build_datasets(validate_cfg({**cfg, "sequence_len": 256}), tok).train is not None


def test_eval_interval() -> None:
    def cfg(**extra: Any) -> Any:
        return validate_cfg({"base_model": "m", **extra})

    assert eval_interval(cfg(), 10, 30) is None
    assert eval_interval(cfg(eval_steps=5), 10, 30) == 5
    assert eval_interval(cfg(eval_steps=0.25), 10, 30) == 8  # ceil(0.25 x 30)
    assert eval_interval(cfg(evals_per_epoch=3), 10, 30) == 3
    assert eval_interval(cfg(evals_per_epoch=0), 10, 30) is None  # Axolotl's "none"


@pytest.mark.parametrize(
    "extra,message",
    [
        ({"val_set_size": 1.5}, r"val_set_size: 1.5 is neither a fraction below 1"),
        ({"val_set_size": -0.1}, r"val_set_size: must be >= 0"),
        ({"eval_steps": 2.5}, r"eval_steps: 2.5 is neither a number of steps"),
        ({"eval_steps": 0}, r"eval_steps: must be > 0"),
        ({"eval_steps": 4, "evals_per_epoch": 2}, r"eval_steps and evals_per_epoch are both set"),
        (
            {"val_set_size": 0.1, "test_datasets": [{"path": "t.jsonl"}]},
            r"val_set_size and test_datasets are both set",
        ),
        ({"test_datasets": [{"pth": "t.jsonl"}]}, r"test_datasets\[0\]\.pth: unknown key"),
        ({"eval_batch_size": 0}, r"eval_batch_size: must be > 0"),
    ],
)
def test_eval_keys_are_validated_naming_the_key(extra: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        validate_cfg({"base_model": "m", **extra}, command="train")


def test_axolotl_test_datasets_entries_are_sorted_like_datasets(tmp_path: Path) -> None:
    """An Axolotl-only dataset key in a test_datasets entry is named under test_datasets[i]."""
    with pytest.raises(ConfigError, match=r"test_datasets\[0\]\.conversation: .*not supported"):
        validate_cfg(
            {"base_model": "m", "test_datasets": [{"path": "t.jsonl", "conversation": "vicuna"}]},
            command="train",
        )
    cfg = validate_cfg(
        {"base_model": "m", "test_datasets": [{"path": "t.jsonl", "split": "train", "name": None}]},
        command="train",
    )
    assert cfg.test_datasets[0].path == "t.jsonl"


def test_preflight_names_a_missing_test_dataset(base_cfg: dict[str, Any], tmp_path: Path) -> None:
    cfg = validate_cfg(
        {
            **base_cfg,
            "output_dir": str(tmp_path / "out"),
            "test_datasets": [{"path": str(tmp_path / "missing.jsonl")}],
        },
        command="train",
    )
    with pytest.raises(ConfigError, match=r"test_datasets\[0\]\.path: data file .* not found"):
        preflight(cfg)
