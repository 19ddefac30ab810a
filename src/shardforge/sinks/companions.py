"""The files that make a weights directory a complete Hugging Face model directory:
config.json (dtype updated), generation_config.json, tokenizer with its chat template."""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shardforge.errors import MergeError, shown
from shardforge.io.model_files import TOKENIZER_FILES

if TYPE_CHECKING:
    import torch

log = logging.getLogger("shardforge")

GENERATION_CONFIG = "generation_config.json"


def has_tokenizer(directory: Path) -> bool:
    return any((directory / f).is_file() for f in TOKENIZER_FILES)


def write_config(config: Any, dtype: torch.dtype | None, out: Path) -> None:
    """Save `config` with its dtype set to the output dtype (a copy is changed: the caller's
    config is shared by later merges in this process, `merge.prepare._architecture`)."""
    if dtype is not None:
        config = copy.deepcopy(config)
        if hasattr(config, "dtype"):
            config.dtype = dtype
        else:  # transformers 4.x
            config.torch_dtype = dtype
    config.save_pretrained(out)


def write_generation_config(sources: list[str], out: Path) -> bool:
    """Copy the first generation config found among `sources`; False when none has one."""
    from transformers import GenerationConfig

    for src in sources:
        where = Path(src) / GENERATION_CONFIG
        if Path(src).is_dir() and not where.is_file():
            continue
        try:
            gen = GenerationConfig.from_pretrained(src)
        except (OSError, ValueError) as exc:  # absent (a hub id offline), unreadable, not JSON
            if where.is_file():
                reason = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
                log.warning("%s: not copied (%s: %s)", where, type(exc).__name__, reason)
            continue
        gen.save_pretrained(out)
        return True
    return False


def write_tokenizer(
    source: str,
    out: Path,
    trust_remote_code: bool,
    chat_template: str | None,
    chat_template_jinja: str | None = None,
) -> None:
    """Save the tokenizer of `source` into `out`, with the config's chat template (a name such as
    `llama3` stands for its template text; `tokenizer_default` keeps the tokenizer's own). A
    template the config names but that cannot be had (an unknown name, `jinja` without its
    text) is no reason to fail a merge: the tokenizer keeps its own, with one notice."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code)
    except Exception as exc:
        raise MergeError(
            f"cannot load the tokenizer from {source!r} ({type(exc).__name__}); set "
            "tokenizer_config, or pass --no-save-tokenizer"
        ) from None
    template = chat_template_for(tok, chat_template, chat_template_jinja)
    if template is not None:
        tok.chat_template = template
    tok.save_pretrained(out)


def chat_template_for(
    tok: Any, chat_template: str | None, chat_template_jinja: str | None
) -> str | None:
    """The chat template the written tokenizer gets: the config's, else the tokenizer's own."""
    from shardforge.config.chat_templates import resolve_chat_template
    from shardforge.errors import ConfigError

    own = tok.chat_template if isinstance(tok.chat_template, str) else None
    try:
        return resolve_chat_template(chat_template, chat_template_jinja, own)
    except ConfigError as exc:
        reason = exc.problems[0]
        if reason.startswith("unknown template name"):  # not the whole list of names here
            reason = f"unknown template name {shown(chat_template, 80)} (docs/config.md)"
        log.warning(
            "notice: chat_template: %s; the tokenizer keeps its own chat template (%s)",
            reason,
            "it has one" if own else "it has none",
        )
        return own
