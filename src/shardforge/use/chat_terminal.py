"""`inference --chat`: the multi-turn chat in the terminal (Axolotl's `--chat`). A line is a
message, or a slash command:

    /help  /new  /system [TEXT|clear]  /set NAME VALUE  /status  /history  /retry  /undo
    /save [PATH]  /quit

Replies are streamed to stdout as they are generated (Ctrl-C stops one); the prompt `>>> ` is
written before each line is read. End of input (Ctrl-D) quits as /quit does.
"""

from __future__ import annotations

import contextlib
import shlex
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, TextIO

from shardforge.config.schema import ShardforgeConfig
from shardforge.use.chat import SPECS, Conversation, Settings, stream_reply
from shardforge.use.model import Loaded

PROMPT = ">>> "

# command -> (aliases, usage, help)
COMMANDS: dict[str, tuple[tuple[str, ...], str, str]] = {
    "help": (("?",), "/help", "show this help"),
    "new": (
        ("clear", "reset"),
        "/new",
        "start a new conversation (keeps the system prompt and settings)",
    ),
    "system": ((), "/system [TEXT|clear]", "show, set or clear the system prompt"),
    "set": ((), "/set NAME VALUE", "change a generation setting: " + ", ".join(SPECS)),
    "status": (("params",), "/status", "show the model and the generation settings"),
    "history": ((), "/history", "show the conversation so far"),
    "retry": (("regen",), "/retry", "generate the last reply again"),
    "undo": ((), "/undo", "remove the last exchange"),
    "save": ((), "/save [PATH]", "append the conversation as chat_template JSONL (train reads it)"),
    "quit": (("exit", "q"), "/quit", "leave the chat"),
}


def _command(name: str) -> str | None:
    return next((c for c, (aliases, _, _) in COMMANDS.items() if name in (c, *aliases)), None)


@dataclass
class ChatTerminal:
    """The chat loop: `run()` reads lines with `read` until /quit or end of input."""

    loaded: Loaded
    cfg: ShardforgeConfig
    settings: Settings
    model_name: str
    read: Callable[[str], str] = input
    out: TextIO = sys.stdout

    def __post_init__(self) -> None:
        self.conversation = Conversation()

    def say(self, text: str) -> None:
        self.out.write(text + "\n")
        self.out.flush()

    def run(self) -> None:
        self.say(f"chat with {self.model_name}: /help lists the commands, /quit leaves")
        self.settings.reseed()
        while True:
            try:
                line = self.read(PROMPT)
            except EOFError:
                self.say("")
                return
            except KeyboardInterrupt:  # a line abandoned: a new prompt
                self.say("")
                continue
            if not line.strip():
                continue
            if line.startswith("/"):
                action = self.dispatch(line)
                if action == "quit":
                    return
                if action != "reply":
                    continue
            else:
                self.conversation.add_user(line)
            self.reply()

    def dispatch(self, line: str) -> str | None:
        """Run a slash command; "quit", "reply" (generate again) or None."""
        name, _, args = line[1:].partition(" ")
        command = _command(name.lower())
        if command is None:
            self.say(f"unknown command /{name}; /help lists them")
            return None
        result: str | None = getattr(self, f"cmd_{command}")(args.strip())
        return result

    def reply(self) -> None:
        stop = threading.Event()
        pieces: list[str] = []
        try:
            for piece in stream_reply(
                self.loaded, self.cfg, self.conversation.messages_for_model(), self.settings, stop
            ):
                pieces.append(piece)
                self.out.write(piece)
                self.out.flush()
        except KeyboardInterrupt:
            stop.set()
            self.say("\n(stopped)")
        self.say("")
        self.conversation.add_assistant("".join(pieces))

    def cmd_help(self, args: str) -> None:
        for aliases, usage, text in COMMANDS.values():
            also = f" (also {', '.join('/' + a for a in aliases)})" if aliases else ""
            self.say(f"  {usage:22} {text}{also}")

    def cmd_new(self, args: str) -> None:
        self.conversation.messages.clear()
        self.say("new conversation")

    def cmd_system(self, args: str) -> None:
        if not args:
            self.say(f"system prompt: {self.conversation.system or '(none)'}")
        elif args == "clear":
            self.conversation.system = None
            self.say("system prompt cleared")
        else:
            self.conversation.system = args
            self.say("system prompt set")

    def cmd_set(self, args: str) -> None:
        parts = args.replace("=", " ").split()
        if len(parts) != 2:
            self.say("usage: /set NAME VALUE (" + ", ".join(SPECS) + ")")
            return
        try:
            key = self.settings.set(parts[0].lower(), parts[1])
        except ValueError as exc:
            self.say(str(exc))
            return
        if key == "seed":
            self.settings.reseed()
        self.say(f"{key} = {getattr(self.settings, key)}")

    def cmd_status(self, args: str) -> None:
        self.say(f"model: {self.model_name}")
        for line in self.settings.describe():
            self.say(f"  {line}")
        self.say(f"  messages = {len(self.conversation.messages)}")

    def cmd_history(self, args: str) -> None:
        shown = self.conversation.messages_for_model()
        if not shown:
            self.say("no messages yet")
        for message in shown:
            self.say(f"{message['role']}: {message['content']}")

    def cmd_retry(self, args: str) -> str | None:
        if not self.conversation.drop_reply():
            self.say("nothing to retry yet")
            return None
        return "reply"

    def cmd_undo(self, args: str) -> None:
        self.say("removed the last exchange" if self.conversation.undo() else "nothing to undo")

    def cmd_save(self, args: str) -> None:
        if not self.conversation.messages:
            self.say("nothing to save yet")
            return
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        path = Path(shlex.split(args)[0] if args else f"chat-{stamp}.jsonl")
        try:
            self.conversation.save(path)
        except OSError as exc:
            self.say(f"cannot save to {path}: {exc.strerror or exc}")
            return
        self.say(f"saved to {path}")

    def cmd_quit(self, args: str) -> str:
        return "quit"


def chat(
    loaded: Loaded, cfg: ShardforgeConfig, settings: Settings, model_name: str, **io: Any
) -> None:
    """Run the terminal chat until /quit (`io`: `read`, `out` for ChatTerminal)."""
    with contextlib.suppress(ImportError):  # not on every platform
        import readline  # noqa: F401  (line editing and history for input())
    ChatTerminal(loaded, cfg, settings, model_name, **io).run()
