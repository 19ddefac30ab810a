"""`inference`: generate from trained weights (see `use.model` for which ones), the prompt rendered
with the chat template the run trained with (the config's, else the tokenizer's own for
chat_template data), greedy unless asked to sample.

    from shardforge.config import load_cfg
    from shardforge.use.inference import inference
    out = inference(load_cfg("cfg.yml"), "The robot", max_new_tokens=16)   # out.text, out.new_ids

Generation is transformers' `generate` with its own option names (`InferenceRequest`); with
`stream=True` the new text is printed as it comes (transformers' `TextStreamer`). Sampling is
seeded by the config's `seed`. The config's `eot_tokens` end the answer too.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from shardforge.config import coerce_cfg
from shardforge.config.schema import ShardforgeConfig
from shardforge.errors import ShardforgeError
from shardforge.train.data import pad_token_id
from shardforge.use.model import Loaded, load_model, pick
from shardforge.use.request import InferenceRequest

log = logging.getLogger("shardforge")


@dataclass(frozen=True)
class Generation:
    """The prompt's token ids, the generated ones, and those decoded (special tokens left out)."""

    prompt_ids: list[int]
    new_ids: list[int]
    text: str


def trained_with_chat_template(cfg: ShardforgeConfig) -> bool:
    """Whether the run rendered its text with a chat template: the config names one, or a data
    set (training's or the held-out one) is of type chat_template, rendered with the config's
    template, else the tokenizer's own."""
    datasets = (*cfg.datasets, *cfg.test_datasets)
    return cfg.chat_template is not None or any(ds.type == "chat_template" for ds in datasets)


def encode_prompt(cfg: ShardforgeConfig, tokenizer: Any, prompt: str, raw: bool = False) -> Any:
    """The model's input for `prompt`: where the run trained with a chat template (and not
    `raw`), a one-turn conversation ending in the assistant's header (tokenized as training
    tokenizes rendered text), else the text as it is with the tokenizer's usual special
    tokens."""
    if raw or not trained_with_chat_template(cfg):
        return tokenizer(prompt, return_tensors="pt")
    if not isinstance(tokenizer.chat_template, str):
        log.warning(
            "the tokenizer has no chat template: the prompt goes in as it is (set chat_template)"
        )
        return tokenizer(prompt, return_tensors="pt")
    return encode_messages(tokenizer, [{"role": "user", "content": prompt}])


def encode_messages(tokenizer: Any, messages: list[dict[str, str]]) -> Any:
    """The model's input for a conversation: rendered with the tokenizer's chat template (the
    one training used: see `use.model.tokenizer_of`), ending in the assistant's header, and
    tokenized as training tokenizes rendered text (the template brings its special tokens)."""
    if not isinstance(tokenizer.chat_template, str):
        raise ShardforgeError(
            "a chat needs a chat template and the tokenizer has none: set chat_template in the "
            "config (e.g. chatml)"
        )
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(str(text), add_special_tokens=False, return_tensors="pt")


def stop_ids(cfg: ShardforgeConfig, tokenizer: Any, model: Any) -> list[int] | None:
    """The model's EOS ids plus the config's eot_tokens (None: the model's own, unchanged)."""
    if not cfg.eot_tokens:
        return None
    own = model.generation_config.eos_token_id
    ids = [own] if isinstance(own, int) else list(own or [])
    for token in cfg.eot_tokens:
        tid = tokenizer.convert_tokens_to_ids(token)
        if isinstance(tid, int) and tid != tokenizer.unk_token_id and tid not in ids:
            ids.append(tid)
    return ids


def generate(
    loaded: Loaded, cfg: ShardforgeConfig, request: InferenceRequest, stream: bool = False
) -> Generation:
    """Generate from `request.prompt` with the loaded model (`stream`: print as it comes)."""
    from transformers import TextStreamer

    assert request.prompt is not None
    tok, model = loaded.tokenizer, loaded.model
    inputs = encode_prompt(cfg, tok, request.prompt, request.raw_prompt).to(loaded.device)
    extra: dict[str, Any] = {"pad_token_id": pad_token_id(tok)}
    stop = stop_ids(cfg, tok, model)
    if stop is not None:
        extra["eos_token_id"] = stop
    if stream:
        extra["streamer"] = TextStreamer(tok, skip_prompt=True, skip_special_tokens=True)
    if request.do_sample:
        torch.manual_seed(cfg.seed)
    with torch.no_grad():
        out = model.generate(**inputs, **request.generation_kwargs(), **extra)
    prompt_ids = inputs["input_ids"][0].tolist()
    new_ids = out[0, len(prompt_ids) :].tolist()
    return Generation(prompt_ids, new_ids, str(tok.decode(new_ids, skip_special_tokens=True)))


def inference(
    cfg: Any,
    prompt: str | None = None,
    read_prompt: Callable[[], str] | None = None,
    stream: bool = False,
    named_base: bool = False,
    **options: Any,
) -> Generation:
    """Generate from the weights `options` name (`InferenceRequest`'s fields; none: the run's
    own, or base_model where it names the model: `named_base`, the user gave --base_model) for
    `prompt`, else the text `read_prompt()` returns (asked for once the config and the weights
    were found, before they are loaded)."""
    config = coerce_cfg(cfg)
    request = InferenceRequest(prompt=prompt, **options)
    if request.chat or request.gradio:
        raise ShardforgeError(
            "inference() answers one prompt; for a chat use shardforge.use.chat.open_chat with "
            "use.chat_terminal.chat or use.gradio_page.serve (or the command's --chat/--gradio)"
        )
    picked = pick(config, request, named_base)
    if request.prompt is None:
        if read_prompt is None:
            raise ShardforgeError("no prompt: give --prompt TEXT or the prompt on standard input")
        request = dataclasses.replace(request, prompt=read_prompt())  # checked again
    loaded = load_model(config, picked)
    return generate(loaded, config, request, stream)
