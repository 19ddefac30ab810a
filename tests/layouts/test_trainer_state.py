"""shardforge's trainer_state.json, read once for training's resume and the merge's dtype."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardforge.errors import CheckpointError
from shardforge.layouts.layout import Candidate
from shardforge.layouts.trainer_state import FORMAT, FORMAT_VERSION, STATE_FILE, read_state
from shardforge.merge.locate import recorded_dtype

STATE = {"format": FORMAT, "format_version": FORMAT_VERSION, "step": 3, "base_dtype": "bfloat16"}


def _step(tmp_path: Path, text: str) -> Path:
    (tmp_path / "model").mkdir()
    (tmp_path / STATE_FILE).write_text(text)
    return tmp_path


def test_a_state_is_read_and_its_dtype_is_the_merges(tmp_path: Path) -> None:
    step = _step(tmp_path, json.dumps(STATE))
    assert read_state(step)["step"] == 3
    candidate = Candidate("shardforge", 3, step / "model")
    assert recorded_dtype(candidate) == "bfloat16"


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("[" * 100_000 + "]" * 100_000, "nested too deeply"),  # not a RecursionError
        (json.dumps({**STATE, "format": "other"}), "not a shardforge v1 trainer state"),
        ("{not json", "not valid JSON"),
    ],
)
def test_what_is_not_a_state_is_one_error_and_no_dtype(
    text: str, words: str, tmp_path: Path
) -> None:
    step = _step(tmp_path, text)
    with pytest.raises(CheckpointError, match=words):
        read_state(step)
    candidate = Candidate("shardforge", 3, step / "model")
    assert recorded_dtype(candidate) is None
