"""What `--overwrite` may replace: a folder that holds a model (the files a merge or
`save_pretrained` writes) and nothing else; anything more is refused, naming it, before the merge
reads a byte and again at the rename (what appeared while it ran counts)."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardforge.errors import MergeError
from shardforge.io.model_files import folder_entries, non_model_entries
from shardforge.io.publish import atomic_directory, check_output_path

MODEL = [
    "model-00001-of-00002.safetensors",
    "model-00002-of-00002.safetensors",
    "model.safetensors.index.json",
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "shardforge-manifest.json",
    "adapter_model.safetensors",
    "adapter_config.json",
    "additional_chat_templates/tool_use.jinja",
]


def _write(root: Path, names: list[str]) -> None:
    for name in names:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(name)


def test_a_model_folder_is_the_files_a_merge_writes(tmp_path: Path) -> None:
    _write(tmp_path / "model", MODEL)
    assert non_model_entries(folder_entries(tmp_path / "model")) == []
    run = [
        "checkpoint-10/optimizer.pt",
        "checkpoint-10/trainer_state.json",
        "trainer_state.json",
        "notes.txt",
        "additional_chat_templates/x.py",
        "runs/events.out.tfevents",
    ]
    _write(tmp_path / "run", [*MODEL, *run])
    assert non_model_entries(folder_entries(tmp_path / "run")) == [
        "additional_chat_templates/x.py",
        "checkpoint-10/",
        "notes.txt",
        "runs/",
        "trainer_state.json",
    ]
    # object keys: what lies in a sub-folder is named once, as the folder
    assert non_model_entries(["config.json", "ck/a", "ck/b", "ck/c/d"]) == ["ck/"]


def test_overwrite_refuses_more_than_a_model_and_replaces_a_model(tmp_path: Path) -> None:
    out = tmp_path / "out"
    _write(out, ["model.safetensors", "config.json", "trainer_state.json"])
    with pytest.raises(MergeError, match=r"out: holds more than a model \(trainer_state.json\)"):
        check_output_path(out, True, [])
    check_output_path(out, True, [], non_model=True)
    (out / "trainer_state.json").unlink()
    check_output_path(out, True, [])  # a model only
    # at the rename: a file that appeared while the merge ran is not deleted
    refused = pytest.raises(MergeError, match=r"holds more than a model \(notes.md\)")
    with refused, atomic_directory(out, overwrite=True, model_only=True) as tmp:
        (tmp / "model.safetensors").write_text("new")
        (out / "notes.md").write_text("written meanwhile")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "notes.md"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temporary left
    (out / "notes.md").unlink()
    with atomic_directory(out, overwrite=True, model_only=True) as tmp:
        (tmp / "model.safetensors").write_text("new")
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]
    assert (out / "model.safetensors").read_text() == "new"
