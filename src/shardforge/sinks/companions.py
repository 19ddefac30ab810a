"""The files that make a weights directory a complete Hugging Face model directory:
config.json (dtype updated), generation_config.json, tokenizer with its chat template."""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shardforge.errors import MergeError

if TYPE_CHECKING:
    import torch

log = logging.getLogger("shardforge")

GENERATION_CONFIG = "generation_config.json"
TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json", "tokenizer.model", "vocab.json")


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
    `llama3` stands for its template text; `tokenizer_default` keeps the tokenizer's own)."""
    from transformers import AutoTokenizer

    from shardforge.config.chat_templates import resolve_chat_template

    try:
        tok = AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code)
    except Exception as exc:
        raise MergeError(
            f"cannot load the tokenizer from {source!r} ({type(exc).__name__}); set "
            "tokenizer_config, or pass --no-save-tokenizer"
        ) from None
    if chat_template and chat_template != "tokenizer_default":
        tok.chat_template = resolve_chat_template(
            chat_template, chat_template_jinja, tok.chat_template
        )
    tok.save_pretrained(out)
