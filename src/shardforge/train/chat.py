"""`type: chat_template` rows -> (input_ids, labels), as Axolotl's chat_template strategy.

    chat_sample(row, ds, tok, opts)   the conversation rendered with the entry's chat template
                                      (its own, else the tokenizer's), trained turns as targets

The row's messages are mapped (message_property_mappings, roles), the reasoning trace is put
where the template reads it (field_thinking -> template_thinking_key, split_thinking), a leading
system message may be dropped (drop_system_message), tools (field_tools) and chat_template_kwargs
go to the template. A turn is trained when its role is in roles_to_train, or as its
message_field_training flag says; message_field_training_detail trains character ranges of its
content. train_on_eos / train_on_eot say which end tokens are targets.
"""

from __future__ import annotations

import functools
import json
from typing import Any

from shardforge.config.chat_templates import resolve_chat_template
from shardforge.config.schema import DatasetConfig
from shardforge.train.readers import Row
from shardforge.train.rows import IGNORE_INDEX, RowError, Sample, TokenizeOptions

# data set role names -> template roles when `roles` is unset (ShareGPT's human/gpt)
DEFAULT_ROLES: dict[str, list[str]] = {
    "user": ["human", "user"],
    "assistant": ["gpt", "assistant"],
    "system": ["system"],
    "tool": ["tool"],
}
# split_thinking: the delimiters of a reasoning block, and of an answer after it
THINKING_PAIRS: tuple[tuple[str, str], ...] = (
    ("<think>", "</think>"),
    ("<reasoning>", "</reasoning>"),
    ("<|begin_of_thought|>", "<|end_of_thought|>"),
)
ANSWER_PAIR: tuple[str, str] = ("<|begin_of_solution|>", "<|end_of_solution|>")


def _split_thinking(content: str) -> tuple[str, str] | None:
    """(reasoning, answer) of a content holding a delimited reasoning block, else None."""
    for start, end in THINKING_PAIRS:
        if start in content and end in content:
            a, b = content.find(start), content.find(end)
            rest = content[b + len(end) :].lstrip()
            first, last = ANSWER_PAIR
            if first in rest and last in rest:
                rest = rest[rest.find(first) + len(first) : rest.find(last)].strip()
            return content[a + len(start) : b].strip(), rest
    return None


def _tool_calls(value: Any) -> Any:
    """Tool-call arguments given as JSON text are parsed, as the templates expect a mapping."""
    if isinstance(value, list):
        _parse_function_json(value, "arguments", "field_messages", "tool call arguments")
    return value


def _parse_function_json(items: list[Any], key: str, field: str, what: str) -> None:
    """Each item's `function.<key>` given as JSON text (tool-call arguments, tool parameters)
    parsed in place, as the templates expect a mapping; bad JSON is the row's error."""
    for item in items:
        function = item.get("function") if isinstance(item, dict) else None
        if isinstance(function, dict) and isinstance(function.get(key), str):
            try:
                function[key] = json.loads(function[key])
            except json.JSONDecodeError as exc:
                raise RowError(field, f"{what}: {exc.msg}") from None


def _message(message: Any, j: int, ds: DatasetConfig, role_of: dict[str, str]) -> dict[str, Any]:
    mapping = {"role": "role", "content": "content", **ds.message_property_mappings}
    for prop in ("role", "content"):
        if not isinstance(message, dict) or mapping[prop] not in message:
            keys = ", ".join(sorted(map(str, message))) if isinstance(message, dict) else "-"
            raise RowError(
                "message_property_mappings",
                f"message {j} has no {prop} key {mapping[prop]!r} (its keys: {keys})",
            )
    training = {ds.message_field_training, ds.message_field_training_detail}
    mapped = set(mapping.values())
    out = {k: v for k, v in message.items() if k not in mapped and k not in training}
    out.update({prop: message[src] for prop, src in mapping.items() if src in message})
    out["role"] = role_of.get(message[mapping["role"]], message[mapping["role"]])
    if message.get(ds.field_thinking) is not None:
        out[ds.template_thinking_key] = message[ds.field_thinking]
    if ds.split_thinking and out["role"] == "assistant" and isinstance(out["content"], str):
        split = _split_thinking(out["content"])
        if split is not None:
            out[ds.template_thinking_key], out["content"] = split
    if "tool_calls" in out:
        out["tool_calls"] = _tool_calls(out["tool_calls"])
    return out


def _messages(row: Row, ds: DatasetConfig) -> tuple[list[dict[str, Any]], list[Any], list[Any]]:
    """The row's conversation with the mapped property and role names, and each message's
    training flag and training detail (None where it has none)."""
    messages = row.get(ds.field_messages)
    if not isinstance(messages, list) or not messages:
        found = ", ".join(sorted(map(str, row))) or "none"
        raise RowError(
            "field_messages", f"no message list in {ds.field_messages!r} (the row's keys: {found})"
        )
    role_of = {name: role for role, names in (ds.roles or DEFAULT_ROLES).items() for name in names}
    out = [_message(m, j, ds, role_of) for j, m in enumerate(messages)]
    flags = [_get(m, ds.message_field_training) for m in messages]
    details = [_get(m, ds.message_field_training_detail) for m in messages]
    if ds.drop_system_message and out[0]["role"] == "system":
        out, flags, details = out[1:], flags[1:], details[1:]
    return out, flags, details


def _get(message: Any, key: str | None) -> Any:
    return message.get(key) if key and isinstance(message, dict) else None


def _tools(row: Row, ds: DatasetConfig) -> list[Any] | None:
    tools = row.get(ds.field_tools)
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise RowError("field_tools", f"{ds.field_tools!r} must be a list of tool definitions")
    _parse_function_json(tools, "parameters", "field_tools", "tool parameters")
    return tools


@functools.lru_cache(maxsize=32)
def _entry_template(value: str | None, jinja: str | None, own: str | None) -> str | None:
    if value is None and jinja is None:
        return None
    return resolve_chat_template(value, jinja, own)


class _Renderer:
    """The entry's template with its extra variables (tools, chat_template_kwargs)."""

    def __init__(self, tok: Any, ds: DatasetConfig, opts: TokenizeOptions, tools: Any) -> None:
        own = tok.chat_template if isinstance(tok.chat_template, str) else None
        self.tok = tok
        self.extra: dict[str, Any] = dict(opts.template_kwargs)
        template = _entry_template(ds.chat_template, ds.chat_template_jinja, own)
        if template is not None:
            self.extra["chat_template"] = template
        if tools is not None:
            self.extra["tools"] = tools

    def __call__(self, messages: list[Any], prompt: bool) -> str:
        return str(
            self.tok.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=prompt, **self.extra
            )
        )

    def attempt(self, messages: list[Any], prompt: bool) -> str | None:
        try:
            return self(messages, prompt)
        except Exception:  # a template may refuse a partial conversation (raise_exception, ...)
            return None


def _turn_end(text: str, start: int, end: int, content: Any, eot: tuple[str, ...]) -> int:
    """With eot_tokens, a trained turn ends after the first of them following its content."""
    if not eot:
        return end
    after = _content_end(text, start, end, content)
    hits = [i + len(t) for t in eot if (i := text.find(t, after, end)) >= 0]
    return min(hits) if hits else end


def _content_end(text: str, start: int, end: int, content: Any) -> int:
    if isinstance(content, str) and content:
        found = text.find(content, start, end)
        return found + len(content) if found >= 0 else start
    return start


def _detail_spans(text: str, start: int, end: int, content: Any, detail: Any) -> list[Any]:
    """message_field_training_detail: the trained character ranges of a turn's content
    (begin_offset..end_offset inclusive, within the content as rendered)."""
    if not isinstance(content, str) or not isinstance(detail, list):
        raise RowError(
            "message_field_training_detail",
            "training details need a text content and a list of {begin_offset, end_offset, train}",
        )
    base = text.find(content, start, end)
    if base < 0:
        return []
    return [
        (base + int(d["begin_offset"]), base + int(d["end_offset"]) + 1)
        for d in detail
        if isinstance(d, dict) and d.get("train")
    ]


def chat_sample(row: Row, ds: DatasetConfig, tok: Any, opts: TokenizeOptions) -> Sample:
    """The conversation rendered with the chat template; trained turns are targets.

    Each trained turn is the text its message adds to the rendering of the messages before it
    (after the generation prompt, for assistant turns); with eot_tokens it ends after the first
    of them. When the template does not render prefixes consistently every token is a target.
    """
    messages, flags, details = _messages(row, ds)
    render = _Renderer(tok, ds, opts, _tools(row, ds))
    try:
        text = render(messages, prompt=False)
    except Exception as exc:
        raise RowError("field_messages", f"the chat template cannot render it ({exc})") from None
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    per_turn = any(f is not None for f in flags + details)
    if opts.train_on_inputs and not per_turn:
        return Sample(ids, list(ids))
    prefixes = [render.attempt(messages[: i + 1], prompt=False) for i in range(len(messages))]
    if not all(p is not None and text.startswith(p) for p in prefixes):
        return Sample(ids, list(ids))
    spans: list[tuple[int, int]] = []
    turns: list[tuple[int, int, int, bool]] = []  # (turn start, content end, turn end, trained)
    for i, message in enumerate(messages):
        region = (len(prefixes[i - 1] or "") if i else 0, len(prefixes[i] or ""))
        content_end = _content_end(text, *region, message.get("content"))
        trained = _trained(message["role"], flags[i], details[i], ds, opts)
        turns.append((region[0], content_end, region[1], trained))
        if not trained:
            continue
        before = render.attempt(messages[:i], prompt=message["role"] == "assistant")
        start = len(before) if before is not None and text.startswith(before) else region[0]
        if details[i]:
            spans += _detail_spans(text, start, region[1], message.get("content"), details[i])
            continue
        end = _turn_end(text, start, region[1], message.get("content"), opts.eot_tokens)
        spans.append((start, end))
    offsets = enc["offset_mapping"]
    labels = [
        tid if any(s <= a < e for s, e in spans) else IGNORE_INDEX
        for tid, (a, _b) in zip(ids, offsets, strict=True)
    ]
    _end_tokens(ids, labels, offsets, turns, ds, tok, opts)
    return Sample(ids, labels)


def _trained(role: str, flag: Any, detail: Any, ds: DatasetConfig, opts: TokenizeOptions) -> bool:
    if flag is not None:
        return bool(flag)
    if detail is not None:
        return bool(detail)
    return opts.train_on_inputs or role in ds.roles_to_train


def _token_ids(tok: Any, tokens: tuple[str, ...]) -> set[int]:
    out = set()
    for token in tokens:
        ids = tok.encode(token, add_special_tokens=False)
        if len(ids) == 1:
            out.add(int(ids[0]))
    return out


def _end_tokens(
    ids: list[int],
    labels: list[int],
    offsets: Any,
    turns: list[tuple[int, int, int, bool]],
    ds: DatasetConfig,
    tok: Any,
    opts: TokenizeOptions,
) -> None:
    """train_on_eot / train_on_eos: the first end token after each turn's content is a
    target for every turn (all), for trained turns (turn, the default), for the last turn that
    has one (last) or for none."""
    eos = {int(tok.eos_token_id)} if tok.eos_token_id is not None else set()
    eot = _token_ids(tok, opts.eot_tokens) if opts.eot_tokens else eos
    eos_policy = ds.train_on_eos or "turn"
    eot_policy = ds.train_on_eot or eos_policy
    if eos & eot and eos_policy != eot_policy:
        raise RowError(
            "train_on_eot",
            f"train_on_eos ({eos_policy}) and train_on_eot ({eot_policy}) differ but the EOS "
            "token is an end-of-turn token; set them alike",
        )
    for wanted, policy in ((eot, eot_policy), (eos, eos_policy)):
        if wanted and policy != "turn":
            _apply_policy(ids, labels, offsets, turns, wanted, policy)


def _apply_policy(
    ids: list[int],
    labels: list[int],
    offsets: Any,
    turns: list[tuple[int, int, int, bool]],
    wanted: set[int],
    policy: str,
) -> None:
    found = []
    for _start, content_end, end, trained in turns:
        idx = next(
            (k for k, (a, _b) in enumerate(offsets) if content_end <= a < end and ids[k] in wanted),
            None,
        )
        if idx is not None:
            found.append((idx, trained))
    for n, (idx, _trained_turn) in enumerate(found):
        train = policy == "all" or (policy == "last" and n == len(found) - 1)
        labels[idx] = ids[idx] if train else IGNORE_INDEX
