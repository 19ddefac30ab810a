"""`shardforge inference --chat` driven through a pseudo-terminal (pexpect), as a user types: two
turns, `/set temperature 0`, `/undo`, `/save`, `/quit`; the saved JSONL is chat_template data
that training's data pipeline reads. Every slash command, in this process."""

from __future__ import annotations

import io
import json
import os
import sys
from pathlib import Path

import pytest
import yaml

from helpers.tiny import PARROT_ANSWER
from shardforge.config import load_cfg


@pytest.mark.slow  # the command runs in its own process
def test_two_turns_set_undo_save_quit(parrot: Path, parrot_cfg: Path, tmp_path: Path) -> None:
    import pexpect

    saved = tmp_path / "session.jsonl"
    args = ["-m", "shardforge.cli.main", "inference", str(parrot_cfg), "--model_dir", str(parrot)]
    child = pexpect.spawn(
        sys.executable,
        [*args, "--chat", "--max_new_tokens", "32"],
        cwd=str(tmp_path),
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        encoding="utf-8",
        timeout=180,
    )
    try:
        child.expect_exact(f"chat with {parrot} (--model_dir)")
        child.expect_exact(">>> ")
        child.sendline("What do you see?")
        child.expect_exact(PARROT_ANSWER)
        child.expect_exact(">>> ")
        child.sendline("/set temperature 0")
        child.expect_exact("temperature = 0.0")
        child.expect_exact(">>> ")
        child.sendline("And now?")
        child.expect_exact(PARROT_ANSWER)
        child.expect_exact(">>> ")
        child.sendline("/undo")
        child.expect_exact("removed the last exchange")
        child.expect_exact(">>> ")
        child.sendline(f"/save {saved}")
        child.expect_exact(f"saved to {saved}")
        child.expect_exact(">>> ")
        child.sendline("/quit")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0, child.before

    rows = [json.loads(line) for line in saved.read_text().splitlines()]
    assert rows == [
        {
            "messages": [
                {"role": "user", "content": "What do you see?"},
                {"role": "assistant", "content": PARROT_ANSWER},
            ]
        }
    ]
    # the saved conversation is training data: read and tokenized by train's data pipeline
    from shardforge.train.data import build_sequences, load_tokenizer

    data = yaml.safe_load(parrot_cfg.read_text())
    data["datasets"] = [{"path": str(saved), "type": "chat_template"}]
    train_cfg = tmp_path / "train.yml"
    train_cfg.write_text(yaml.safe_dump(data))
    config = load_cfg(train_cfg, command="train")
    tok = load_tokenizer(config)
    labels = build_sequences(config, tok).labels[0].tolist()
    assert tok.decode([t for t in labels if t != -100], skip_special_tokens=True) == PARROT_ANSWER


def test_every_slash_command(parrot: Path, parrot_cfg: Path, tmp_path: Path) -> None:
    from shardforge.use.chat import open_chat
    from shardforge.use.chat_terminal import ChatTerminal

    cfg, loaded, settings, name = open_chat(load_cfg(parrot_cfg), model_dir=parrot)
    lines = iter(
        [
            "/help", "/history", "/retry", "/undo", "/save", "/system Be brief.", "/system",
            "Hi", "/retry", "/set top_k 5", "/set top_k x", "/set beam 2", "/set", "/status",
            "/history", "/new", "/history", "/system clear", "/nope", "/exit",
        ]
    )  # fmt: skip
    out = io.StringIO()
    ChatTerminal(loaded, cfg, settings, name, read=lambda _: next(lines), out=out).run()
    text = out.getvalue()
    for expected in (
        "/set NAME VALUE", "no messages yet", "nothing to retry yet", "nothing to undo",
        "nothing to save yet", "system prompt set", "system prompt: Be brief.", "top_k = 5",
        "top_k expects int (got 'x')", "unknown setting 'beam'", "usage: /set NAME VALUE",
        f"model: {name}", "  messages = 2", "system: Be brief.", f"assistant: {PARROT_ANSWER}",
        "new conversation", "system prompt cleared", "unknown command /nope; /help lists them",
    ):  # fmt: skip
        assert expected in text, (expected, text)
    assert text.count(PARROT_ANSWER) == 3  # the reply, the retried one, and /history
    assert next(lines, None) is None  # /exit left
