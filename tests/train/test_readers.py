"""Local data files -> rows: every file format, a folder's files in name order, a missing path."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from shardforge.config.schema import DatasetConfig
from shardforge.errors import ConfigError
from shardforge.train.readers import data_files, read_rows


def test_readers_for_every_format(tmp_path: Path) -> None:
    (tmp_path / "a.jsonl").write_text('{"text": "one"}\n\n{"text": "two"}\n')
    (tmp_path / "b.json").write_text('[{"text": "three"}]')
    (tmp_path / "c.txt").write_text("four\nfive\n")
    pq.write_table(pa.table({"text": ["six"]}), tmp_path / "d.parquet")
    rows = read_rows(DatasetConfig(path=str(tmp_path)), "datasets[0]")
    assert [r["text"] for r in rows] == ["one", "two", "three", "four", "five", "six"]
    with pytest.raises(ConfigError, match=r"datasets\[3\].path"):
        read_rows(DatasetConfig(path=str(tmp_path / "missing.jsonl")), "datasets[3]")


def test_data_files_infer_the_format_or_name_ds_type(tmp_path: Path) -> None:
    (tmp_path / "rows.jsonl").write_text('{"text": "one"}\n')
    (tmp_path / "rows.csv").write_text("text\none\n")
    assert data_files(DatasetConfig(path=str(tmp_path / "rows.jsonl")), "datasets[0]") == [
        (tmp_path / "rows.jsonl", "json")
    ]
    with pytest.raises(ConfigError, match=r"datasets\[1\]\.ds_type: .*rows\.csv"):
        data_files(DatasetConfig(path=str(tmp_path / "rows.csv")), "datasets[1]")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"test_datasets\[0\]\.path: directory .* holds no"):
        data_files(DatasetConfig(path=str(tmp_path / "empty")), "test_datasets[0]")


def test_a_hub_data_set_id_is_told_it_is_not_downloaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="Hub data sets are not downloaded; save it locally"):
        data_files(DatasetConfig(path="tatsu-lab/alpaca", type="alpaca"), "datasets[0]")
    with pytest.raises(ConfigError) as missing:
        data_files(DatasetConfig(path="data/train.jsonl"), "datasets[0]")
    assert "check the path" in str(missing.value) and "Hub" not in str(missing.value)
