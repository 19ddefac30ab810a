"""The chat's pieces (use/chat.py): the settings changed at run time, the conversation (undo,
retry, save) and a reply streamed piece by piece; a saved conversation is chat_template data
that training's data pipeline reads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from helpers.tiny import PARROT_ANSWER
from shardforge.config import load_cfg
from shardforge.use.chat import Conversation, Settings, open_chat, stream_reply


def test_settings_take_axolotls_names_ranges_and_aliases() -> None:
    s = Settings()
    assert (s.temperature, s.top_p, s.top_k, s.max_new_tokens, s.repetition_penalty) == (
        0.9,
        0.95,
        40,
        1024,
        1.1,
    )
    assert s.set("temp", "0") == "temperature" and s.temperature == 0.0
    assert s.set("max", "12") == "max_new_tokens" and s.max_new_tokens == 12
    assert s.set("seed", "none") == "seed" and s.seed is None
    for name, raw, message in (
        ("top_p", "1.5", r"top_p must be in \[0, 1\]"),
        ("top_k", "x", "top_k expects int"),
        ("beam", "2", "unknown setting 'beam'"),
        ("top_k", "none", "top_k expects int"),  # only min_p and seed are cleared
    ):
        with pytest.raises(ValueError, match=message):
            s.set(name, raw)
    assert s.generation_kwargs() == {
        "max_new_tokens": 12,
        "repetition_penalty": 1.1,
        "do_sample": False,
    }
    s.set("temperature", "0.7")
    assert s.generation_kwargs()["do_sample"] is True
    assert s.generation_kwargs()["top_k"] == 40


def test_undo_retry_and_save(tmp_path: Path) -> None:
    conv = Conversation(system="Be brief.")
    assert not conv.undo() and not conv.drop_reply()
    conv.add_user("Hi")
    conv.add_assistant("Hello.")
    conv.add_user("Again")
    conv.add_assistant("Hello again.")
    assert conv.drop_reply() and conv.messages[-1] == {"role": "user", "content": "Again"}
    assert conv.undo() and [m["content"] for m in conv.messages] == ["Hi", "Hello."]
    out = tmp_path / "chat.jsonl"
    conv.save(out)
    conv.save(out)  # appended
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert (
        rows
        == [
            {
                "messages": [
                    {"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "Hi"},
                    {"role": "assistant", "content": "Hello."},
                ]
            }
        ]
        * 2
    )


def test_a_reply_streams_in_pieces_and_a_saved_chat_is_training_data(
    parrot: Path, parrot_cfg: Path, tmp_path: Path
) -> None:
    from shardforge.train.data import build_sequences, load_tokenizer

    cfg, loaded, settings, name = open_chat(load_cfg(parrot_cfg), model_dir=parrot)
    assert name == f"{parrot} (--model_dir)" and settings.seed == cfg.seed
    conv = Conversation()
    conv.add_user("What do you see?")
    pieces = list(stream_reply(loaded, cfg, conv.messages_for_model(), settings))
    assert "".join(pieces).strip() == PARROT_ANSWER and len(pieces) > 1
    conv.add_assistant("".join(pieces))
    saved = tmp_path / "saved.jsonl"
    conv.save(saved)

    data = yaml.safe_load(parrot_cfg.read_text())
    data["datasets"] = [{"path": str(saved), "type": "chat_template"}]
    train_cfg = tmp_path / "train.yml"
    train_cfg.write_text(yaml.safe_dump(data))
    config = load_cfg(train_cfg, command="train")
    tok = load_tokenizer(config)
    seqs = build_sequences(config, tok)
    trained = [int(t) for t in seqs.labels[0].tolist() if t != -100]
    assert tok.decode(trained, skip_special_tokens=True).strip() == PARROT_ANSWER
    assert "What do you see?" in tok.decode(seqs.input_ids[0].tolist())


def test_inference_answers_one_prompt_and_points_a_chat_elsewhere(parrot_cfg: Path) -> None:
    from shardforge.errors import ShardforgeError
    from shardforge.use.inference import inference

    with pytest.raises(ShardforgeError, match="inference\\(\\) answers one prompt"):
        inference(load_cfg(parrot_cfg), chat=True)
