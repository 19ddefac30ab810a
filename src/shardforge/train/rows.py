"""What tokenizing a row yields, and what it takes from the config besides the entry.

Sample            (input_ids, labels) of one row; IGNORE_INDEX marks a position not trained
TokenizeOptions   the top-level keys tokenization reads (train_on_inputs, eot_tokens, ...)
RowError          a row the entry cannot use; `field` names the entry's key at fault
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from shardforge.config.schema import ShardforgeConfig

IGNORE_INDEX = -100


@dataclass(frozen=True)
class Sample:
    input_ids: list[int]
    labels: list[int]


@dataclass(frozen=True)
class TokenizeOptions:
    """What tokenization takes from the config besides the data set entry."""

    train_on_inputs: bool = False
    eot_tokens: tuple[str, ...] = ()
    # extra variables of the chat template (chat_template_kwargs)
    template_kwargs: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, cfg: ShardforgeConfig) -> TokenizeOptions:
        return cls(
            cfg.train_on_inputs,
            tuple(cfg.eot_tokens or ()),
            dict(cfg.chat_template_kwargs or {}),
        )


class RowError(ValueError):
    """A row the data set entry cannot turn into tokens; `field` is the entry's key at fault."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field
