"""A multi-turn conversation with the trained model, as `inference --chat` (the terminal) and
`inference --gradio` (a page) hold it: the messages, the generation settings (changed as it
runs) and one reply streamed piece by piece.

    settings = Settings.start(cfg, request)          # Axolotl's chat defaults, the options on top
    conv = Conversation()
    conv.add_user("Hello")
    for piece in stream_reply(loaded, cfg, conv.messages_for_model(), settings): ...

The conversation is rendered with the chat template training used (`use.model.tokenizer_of`)
and tokenized as training tokenizes rendered text; `save` appends it as one chat_template
row (`{"messages": [{"role", "content"}, ...]}`) that `train` reads (`type: chat_template`).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from shardforge.config import coerce_cfg
from shardforge.config.schema import ShardforgeConfig
from shardforge.errors import ShardforgeError
from shardforge.train.data import pad_token_id
from shardforge.use.inference import encode_messages, stop_ids
from shardforge.use.model import Loaded, load_model, pick
from shardforge.use.request import InferenceRequest


@dataclass(frozen=True)
class Spec:
    """A setting changed at run time (`/set NAME VALUE`, a slider on the page)."""

    cast: Callable[[str], Any]
    low: float
    high: float
    aliases: tuple[str, ...] = ()
    nullable: bool = False  # `/set NAME none` clears it
    note: str = ""


# each setting: its type, range, other names (Axolotl's chat: the same names and ranges)
SPECS: dict[str, Spec] = {
    "temperature": Spec(float, 0.0, 5.0, ("temp",), note="0: greedy decoding"),
    "top_p": Spec(float, 0.0, 1.0),
    "top_k": Spec(int, 0, 1000, note="0: no limit"),
    "min_p": Spec(float, 0.0, 1.0, nullable=True),
    "max_new_tokens": Spec(int, 1, 1_000_000, ("max_tokens", "max")),
    "repetition_penalty": Spec(float, 0.5, 3.0, ("rep",)),
    "seed": Spec(int, 0, 2**32 - 1, nullable=True, note="none: not reseeded"),
}


@dataclass
class Settings:
    """How the replies are generated; the defaults are Axolotl's chat and Gradio page's."""

    temperature: float = 0.9
    top_p: float = 0.95
    top_k: int = 40
    min_p: float | None = None
    max_new_tokens: int = 1024
    repetition_penalty: float = 1.1
    seed: int | None = None

    @classmethod
    def start(
        cls, cfg: ShardforgeConfig, request: InferenceRequest, page: bool = False
    ) -> Settings:
        """The starting settings: Axolotl's defaults, the page's keys (`page`:
        gradio_temperature, gradio_max_new_tokens), then the options given; seeded by the
        config's seed."""
        out = cls(seed=cfg.seed)
        if page and cfg.gradio_temperature is not None:
            out.temperature = cfg.gradio_temperature
        if page and cfg.gradio_max_new_tokens is not None:
            out.max_new_tokens = cfg.gradio_max_new_tokens
        for name in ("temperature", "top_p", "top_k", "min_p", "max_new_tokens"):
            if getattr(request, name) is not None:
                setattr(out, name, getattr(request, name))
        if request.repetition_penalty is not None:
            out.repetition_penalty = request.repetition_penalty
        return out

    def set(self, name: str, raw: str) -> str:
        """Set setting `name` (or an alias) from the text `raw`; its name. A ValueError says
        what is wrong."""
        key = next((k for k, s in SPECS.items() if name == k or name in s.aliases), None)
        if key is None:
            raise ValueError(f"unknown setting {name!r}; one of: {', '.join(SPECS)}")
        spec = SPECS[key]
        if spec.nullable and raw.lower() in ("none", "null", "off"):
            setattr(self, key, None)
            return key
        try:
            value = spec.cast(raw)
        except ValueError:
            raise ValueError(f"{key} expects {spec.cast.__name__} (got {raw!r})") from None
        if not spec.low <= value <= spec.high:
            raise ValueError(f"{key} must be in [{spec.low:g}, {spec.high:g}] (got {raw})")
        setattr(self, key, value)
        return key

    def reseed(self) -> None:
        """Seed sampling with `seed` (at the start, and when it is set): the same seed and
        settings, the same replies."""
        if self.seed is not None:
            torch.manual_seed(self.seed)

    def describe(self) -> list[str]:
        return [f"{f.name} = {getattr(self, f.name)}" for f in fields(self)]

    def generation_kwargs(self) -> dict[str, Any]:
        """transformers' `generate` keywords: greedy at temperature 0, else sampling."""
        out: dict[str, Any] = {
            "max_new_tokens": self.max_new_tokens,
            "repetition_penalty": self.repetition_penalty,
            "do_sample": self.temperature > 0,
        }
        if self.temperature > 0:
            out.update(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k)
            if self.min_p is not None:
                out["min_p"] = self.min_p
        return out


@dataclass
class Conversation:
    """The turns so far (user and assistant messages) and an optional system prompt."""

    messages: list[dict[str, str]] = field(default_factory=list)
    system: str | None = None

    def messages_for_model(self) -> list[dict[str, str]]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + self.messages

    def add_user(self, text: str) -> None:
        if self.messages and self.messages[-1]["role"] == "user":  # a reply that failed
            self.messages[-1]["content"] += "\n" + text
        else:
            self.messages.append({"role": "user", "content": text})

    def add_assistant(self, text: str) -> None:
        self.messages.append({"role": "assistant", "content": text})

    def undo(self) -> bool:
        """Drop the last exchange (the reply and its question); False when there is none."""
        if not self.messages:
            return False
        if self.messages[-1]["role"] == "assistant":
            self.messages.pop()
        if self.messages and self.messages[-1]["role"] == "user":
            self.messages.pop()
        return True

    def drop_reply(self) -> bool:
        """Drop the last reply to generate it again; False when no question is left."""
        if self.messages and self.messages[-1]["role"] == "assistant":
            self.messages.pop()
        return bool(self.messages) and self.messages[-1]["role"] == "user"

    def save(self, path: Path) -> None:
        """Append the conversation as one chat_template row of a JSONL file."""
        row = {"messages": self.messages_for_model()}
        with path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


class _Stop:
    """A stopping criterion that ends generation once `event` is set (Ctrl-C, a closed page)."""

    def __init__(self, event: threading.Event) -> None:
        self.event = event

    def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> bool:
        return self.event.is_set()


def stream_reply(
    loaded: Loaded,
    cfg: ShardforgeConfig,
    messages: list[dict[str, str]],
    settings: Settings,
    stop: threading.Event | None = None,
) -> Iterator[str]:
    """The reply to `messages`, piece by piece as it is generated (transformers'
    `TextIteratorStreamer`; `generate` runs on a thread); `stop` set: it ends early."""
    from transformers import StoppingCriteriaList, TextIteratorStreamer

    tok, model = loaded.tokenizer, loaded.model
    inputs = encode_messages(tok, messages).to(loaded.device)
    streamer = TextIteratorStreamer(tok, skip_prompt=True, skip_special_tokens=True)
    extra: dict[str, Any] = {"pad_token_id": pad_token_id(tok), "streamer": streamer}
    ends = stop_ids(cfg, tok, model)
    if ends is not None:
        extra["eos_token_id"] = ends
    stop = stop or threading.Event()
    extra["stopping_criteria"] = StoppingCriteriaList([_Stop(stop)])
    failed: list[BaseException] = []

    def run() -> None:
        try:
            with torch.no_grad():
                model.generate(**inputs, **settings.generation_kwargs(), **extra)
        except BaseException as exc:  # handed to the reader below
            failed.append(exc)
            streamer.end()

    thread = threading.Thread(target=run, name="shardforge-generate", daemon=True)
    thread.start()
    try:
        yield from streamer
    finally:
        if thread.is_alive():  # the reader stopped early: so does generate
            stop.set()
        thread.join()
    if failed:
        raise ShardforgeError(f"generation failed: {str(failed[0]).splitlines()[0][:200]}")


def open_chat(
    cfg: Any, named_base: bool = False, page: bool = False, **options: Any
) -> tuple[ShardforgeConfig, Loaded, Settings, str]:
    """The config, the loaded model (the weights `options` name, as `inference` picks them),
    the starting settings and the model's name, for a chat (`page`: the Gradio page's)."""
    config = coerce_cfg(cfg)
    request = InferenceRequest(**options)
    picked = pick(config, request, named_base)
    loaded = load_model(config, picked)
    if not isinstance(loaded.tokenizer.chat_template, str):
        raise ShardforgeError(
            "a chat needs a chat template and the tokenizer has none: set chat_template in the "
            "config (e.g. chatml)"
        )
    return config, loaded, Settings.start(config, request, page), picked.describe()
