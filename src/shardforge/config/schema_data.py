"""The data keys: `datasets:` entries and how samples become sequences."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from shardforge.config.paths import local_path
from shardforge.config.view import ConfigView

DatasetType = Literal["completion", "chat_template", "alpaca", "input_output"]


class DatasetConfig(ConfigView):
    """One entry of `datasets:`: a local data file and how to turn its rows into tokens."""

    override_prefix: ClassVar[str | None] = None

    path: str = Field(
        description="Path to a local .json, .jsonl, .parquet or .txt file (or a directory of them)."
    )
    type: DatasetType = Field(
        "completion",
        description="completion: train on the raw text of `field`; alpaca: instruction/input/"
        "output rows in the Alpaca prompt; input_output: `segments` of text, each with a `label` "
        "(train on it or not); chat_template: render the conversation in `field_messages` with "
        "the chat template.",
    )
    ds_type: Literal["json", "parquet", "text"] | None = Field(
        None, description="File format; inferred from the file extension when absent."
    )
    field: str = Field("text", description="Column holding the text, for type completion.")
    field_messages: str = Field(
        "messages",
        description="Column holding the list of messages, for type chat_template.",
    )
    message_property_mappings: dict[str, str] = Field(
        default_factory=lambda: {"role": "role", "content": "content"},
        description="For chat_template: which key of each message holds the role and the "
        "content, e.g. {role: from, content: value} for ShareGPT-style rows.",
    )
    roles: dict[str, list[str]] | None = Field(
        None,
        description="For chat_template: the role names of the data mapped to template roles, "
        "e.g. {user: [human], assistant: [gpt]}. Unmapped roles are kept as they are.",
    )
    roles_to_train: list[str] = Field(
        default_factory=lambda: ["assistant"],
        description="For chat_template: the (mapped) roles whose turns are trained on, unless "
        "train_on_inputs is set.",
    )
    split: str = Field(
        "train",
        description="Split to read, with an optional slice as in `datasets`: train, "
        "train[:20%], train[10:200], train[50%:]. A local file is the split `train`.",
    )

    @field_validator("path")
    @classmethod
    def _local_file(cls, value: str) -> str:
        return local_path(value, "a local data file") or value

    @model_validator(mode="before")
    @classmethod
    def _axolotl_message_fields(cls, data: object) -> object:
        """Axolotl's older `message_field_role` / `message_field_content` spellings."""
        if not isinstance(data, dict):
            return data
        legacy = {"message_field_role": "role", "message_field_content": "content"}
        if not any(k in data for k in legacy):
            return data
        data = dict(data)
        mapping = dict(data.get("message_property_mappings") or {"role": "role"})
        mapping.setdefault("content", "content")
        for key, prop in legacy.items():
            if key in data:
                value = data.pop(key)
                if value is not None:
                    mapping[prop] = value
        data["message_property_mappings"] = mapping
        return data


class DataKeys(ConfigView):
    """Training data and batch shape."""

    # -- data ------------------------------------------------------------------------------------
    datasets: list[DatasetConfig] = Field(
        default_factory=list, description="Training data sets (local files)."
    )
    train_on_inputs: bool = Field(
        False,
        description="Also train on prompt tokens (alpaca instruction/input, unlabelled "
        "input_output segments, chat turns of roles not in roles_to_train).",
    )
    sequence_len: int = Field(2048, gt=0, description="Maximum tokens per training sequence.")
    sample_packing: bool = Field(
        False,
        description="Pack several whole samples into each sequence_len window instead of "
        "padding each; each sample attends only to itself (position ids restart per sample; "
        "needs an attn_implementation that honours them: eager, sdpa, flex_attention, "
        "flash_attention_2/3, varlen_attention).",
    )
    dataset_prepared_path: str | None = Field(
        None,
        description="Folder of prepared data sets (tokenized, templated, masked, packed), one "
        "sub-folder per hash of the data files, the tokenizer and the keys that change "
        "tokens: `shardforge preprocess` writes it, `train` reuses a matching one (else "
        "prepares and writes it, saying why). null: train prepares the data in memory.",
    )
    micro_batch_size: int = Field(1, gt=0, description="Sequences per rank per forward pass.")
    gradient_accumulation_steps: int = Field(
        1, gt=0, description="Micro-batches accumulated per optimizer step."
    )
    num_epochs: float = Field(1, gt=0, description="Passes over the data set (if max_steps unset).")
    max_steps: int | None = Field(
        None, gt=0, description="Stop after this many optimizer steps (overrides num_epochs)."
    )
