"""The data keys: `datasets:` entries and how samples become sequences."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from shardforge.config.paths import local_path
from shardforge.config.view import ConfigView

DatasetType = Literal["completion", "chat_template", "alpaca", "input_output"]
EosPolicy = Literal["all", "turn", "last", "none"]


class DatasetConfig(ConfigView):
    """One entry of `datasets:`: a local data file and how to turn its rows into tokens."""

    override_prefix: ClassVar[str | None] = None

    path: str
    """Path to a local .json, .jsonl, .parquet or .txt file (or a directory of them)."""
    type: DatasetType = "completion"
    """completion: train on the raw text of `field`; alpaca: instruction/input/output rows in the
    Alpaca prompt; input_output: `segments` of text, each with a `label` (train on it or not);
    chat_template: render the conversation in `field_messages` with the chat template."""
    ds_type: Literal["json", "parquet", "text"] | None = None
    """File format; inferred from the file extension when absent."""
    field: str = "text"
    """Column holding the text, for type completion."""
    field_messages: str = "messages"
    """Column holding the list of messages, for type chat_template."""
    message_property_mappings: dict[str, str] = Field(
        default_factory=lambda: {"role": "role", "content": "content"}
    )
    """For chat_template: which key of each message holds the role and the content, e.g. {role:
    from, content: value} for ShareGPT-style rows."""
    roles: dict[str, list[str]] | None = None
    """For chat_template: the role names of the data mapped to template roles, e.g. {user: [human],
    assistant: [gpt]}. Unmapped roles are kept as they are."""
    roles_to_train: list[str] = Field(default_factory=lambda: ["assistant"])
    """For chat_template: the (mapped) roles whose turns are trained on, unless train_on_inputs is
    set."""
    split: str = "train"
    """Split to read, with an optional slice as in `datasets`: train, train[:20%], train[10:200],
    train[50%:]. A local file is the split `train`."""

    data_files: str | list[str] | None = None
    """Only these files of the folder `path` (names relative to it, or absolute paths), in the order
    given; the format from ds_type or each file's extension."""
    name: str | None = None
    """The configuration of a local data set folder to read: a `configs:` entry (config_name,
    data_files) of the YAML header of its README.md, as the Hub lays them out. A folder without one
    is an error (nothing is downloaded)."""
    revision: str | None = None
    """A Hub revision; a local path has none, so (as in Axolotl) it changes nothing there; nothing
    is downloaded."""
    shards: int | None = Field(None, gt=0)
    """Cut the rows (shuffled with `seed`) into this many contiguous shards and keep shard
    `shards_idx`, as Axolotl's dataset.shuffle(seed).shard(shards, idx)."""
    shards_idx: int | None = Field(None, ge=0)
    """Which shard to keep (0 when unset), with `shards`."""
    weight: float | None = Field(None, gt=0)
    """Mixing weight of this entry: its rows are taken round(weight x rows) times (2: every row
    twice; 0.5: half of them, drawn with `seed`). null: once."""
    chat_template: str | None = None
    """This entry's own chat template (a name, tokenizer_default, jinja with chat_template_jinja, or
    Jinja text); null: the top-level one."""
    chat_template_jinja: str | None = None
    """Jinja text (or a file) of this entry's chat template."""
    field_tools: str = "tools"
    """For chat_template: the column holding the tool definitions (a list of dicts) passed to the
    template as `tools`; rows without it render without tools."""
    field_thinking: str = "reasoning_content"
    """For chat_template: the key of a message holding its reasoning trace."""
    template_thinking_key: str = "reasoning_content"
    """For chat_template: the message key the template reads the reasoning trace from
    (field_thinking is copied to it)."""
    split_thinking: bool = False
    """For chat_template: move a <think>...</think> (or <reasoning>, <|begin_of_thought|>) block of
    an assistant's content to template_thinking_key."""
    train_on_eos: EosPolicy | None = None
    """For chat_template: which EOS tokens are targets: turn (null: the EOS after each trained
    turn), all, last (only the conversation's last), none."""
    train_on_eot: EosPolicy | None = None
    """For chat_template: which end-of-turn tokens (eot_tokens, else EOS) are targets, as
    train_on_eos; null: as train_on_eos."""
    drop_system_message: bool = False
    """For chat_template: drop a conversation's leading system message."""
    message_field_training: str | None = None
    """For chat_template: a message key whose true/false says whether that turn is trained (over
    roles_to_train)."""
    message_field_training_detail: str | None = None
    """For chat_template: a message key holding [{begin_offset, end_offset, train}] character ranges
    of its content; only tokens inside a trained range are targets."""

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


class PretrainingDataset(ConfigView):
    """One entry of `pretraining_dataset:`: a local text corpus streamed, tokenized in windows
    of sequence_len and packed on the fly (Axolotl's `type: pretrain`)."""

    path: str
    """A local data file or folder (json/jsonl/parquet/text)."""
    name: str | None = None
    """A configuration of a local data set folder (its README's `configs:`)."""
    split: str = "train"
    """Only `train`: a stream is not sliced."""
    type: Literal["pretrain"] = "pretrain"
    """Axolotl's only streamed type."""
    text_column: str = "text"
    """Column holding the text."""
    data_files: str | list[str] | None = None
    """Files of a local data set folder to read (relative to path)."""
    trust_remote_code: bool = False
    """Accepted as Axolotl does; local files run no code."""
    skip: int | None = Field(None, ge=0)
    """Rows to skip at the start of the stream."""

    @field_validator("path")
    @classmethod
    def _local_file(cls, value: str) -> str:
        return local_path(value, "a local data file") or value


class StreamKeys(ConfigView):
    """Streamed data sets (`streaming`, `pretraining_dataset`): read, tokenized and packed on
    the fly, block by block (`train.streaming`)."""

    streaming: bool | None = None
    """Stream `datasets` instead of tokenizing them whole at start (needs max_steps); memory holds
    one block of streaming_multipack_buffer_size rows."""
    pretraining_dataset: list[PretrainingDataset] | None = None
    """A streamed text corpus (a path, or a list of one entry like Axolotl's); needs max_steps.
    Texts longer than sequence_len are cut into overlapping windows."""
    pretrain_multipack_attn: bool = True
    """pretraining_dataset with sample_packing: samples packed together attend only to themselves
    (false: across the whole window)."""
    streaming_multipack_buffer_size: int = Field(10000, gt=0)
    """Rows per block of a stream: shuffled (shuffle_merged_datasets) and packed together; the
    memory a stream holds. Alias: pretrain_multipack_buffer_size."""
    pretraining_sample_concatenation: bool | None = None
    """pretraining_dataset without sample_packing: true concatenates texts (each + EOS + pad) into
    sequence_len windows; else one text per row, truncated."""

    @model_validator(mode="before")
    @classmethod
    def _axolotl_stream_spellings(cls, data: object) -> object:
        """A plain path as pretraining_dataset; the deprecated pretrain_multipack_buffer_size."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        if isinstance(data.get("pretraining_dataset"), str):
            data["pretraining_dataset"] = [{"path": data["pretraining_dataset"]}]
        old = data.pop("pretrain_multipack_buffer_size", None)
        if old is not None:
            if data.get("streaming_multipack_buffer_size") is not None:
                raise ValueError(
                    "pretrain_multipack_buffer_size is deprecated, use "
                    "streaming_multipack_buffer_size; both are set, remove the first"
                )
            data["streaming_multipack_buffer_size"] = old
        return data

    @property
    def streamed(self) -> bool:
        """Training data come from a stream."""
        return bool(self.streaming or self.pretraining_dataset)


# keys a stream cannot honour without reading it whole: (key, is it set?)
STREAM_REFUSED: tuple[tuple[str, str], ...] = (
    ("val_set_size", "evaluate on test_datasets (loaded whole, as Axolotl does)"),
    ("dataset_exact_deduplication", "remove duplicates from the files beforehand"),
    ("dataset_shard_num", "cut the files beforehand"),
    ("shuffle_before_merging_datasets", "use shuffle_merged_datasets (the block shuffle)"),
    ("fix_untrained_tokens", "it needs every training token up front"),
    ("dataset_prepared_path", "a stream is tokenized on the fly; remove it"),
)


def stream_conflicts(cfg: Any) -> str | None:
    """Why a config's streamed data cannot run (None: they can)."""
    if not cfg.streamed:
        return None
    key = "pretraining_dataset" if cfg.pretraining_dataset else "streaming"
    if not cfg.max_steps:
        return f"{key}: needs max_steps (a stream has no length to count steps from)"
    if cfg.pretraining_dataset and len(cfg.pretraining_dataset) > 1:
        return "pretraining_dataset: one entry (as Axolotl reads only the first); merge the files"
    for name, instead in STREAM_REFUSED:
        if getattr(cfg, name):
            return f"{name}: cannot be used with {key} (a stream is never held whole); {instead}"
    for i, ds in enumerate(cfg.pretraining_dataset or cfg.datasets):
        where = f"{'pretraining_dataset' if cfg.pretraining_dataset else 'datasets'}[{i}]"
        if getattr(ds, "shards", None) or getattr(ds, "weight", None) not in (None, 1):
            return f"{where}: shards / weight cannot be used with {key}; cut the files instead"
        if ds.split != "train":
            return f"{where}.split: a stream is read whole ({ds.split!r}); cut the files instead"
    return None


class DataKeys(ConfigView):
    """Training data and batch shape."""

    # -- data ------------------------------------------------------------------------------------
    datasets: list[DatasetConfig] = Field(default_factory=list)
    """Training data sets (local files)."""
    train_on_inputs: bool = False
    """Also train on prompt tokens (alpaca instruction/input, unlabelled input_output segments, chat
    turns of roles not in roles_to_train)."""
    sequence_len: int = Field(2048, gt=0)
    """Maximum tokens per training sequence."""
    sample_packing: bool = False
    """Pack several whole samples into each sequence_len window instead of padding each; each sample
    attends only to itself (position ids restart per sample; needs an attn_implementation that
    honours them: eager, sdpa, flex_attention, flash_attention_2/3, varlen_attention)."""
    dataset_prepared_path: str | None = None
    """Folder of prepared data sets (tokenized, templated, masked, packed), one sub-folder per hash
    of the data files, the tokenizer and the keys that change tokens: `shardforge preprocess` writes
    it, `train` reuses a matching one (else prepares and writes it, saying why). null: train
    prepares the data in memory."""
    micro_batch_size: int = Field(1, gt=0)
    """Sequences per rank per forward pass."""
    gradient_accumulation_steps: int = Field(1, gt=0)
    """Micro-batches accumulated per optimizer step."""
    num_epochs: float = Field(1, gt=0)
    """Passes over the data set (if max_steps unset)."""
    max_steps: int | None = Field(None, gt=0)
    """Stop after this many optimizer steps (overrides num_epochs)."""
    default_system_message: str | None = None
    """Replaces the default system message of the chat template (its text 'You are a helpful
    assistant.', e.g. qwen2_vl's), as Axolotl does; a template without it is unchanged."""
    chat_template_kwargs: dict[str, Any] | None = None
    """Extra variables passed to the chat template (e.g. {enable_thinking: false})."""
    min_sample_len: int | None = Field(None, ge=0)
    """Drop samples with fewer tokens (null: 2, as Axolotl: a shorter one has nothing to
    predict)."""
    excess_length_strategy: Literal["drop", "truncate", "raise"] | None = None
    """A sample longer than sequence_len: drop it, truncate it, or raise an error naming it. null:
    truncate (packed: cut into sequence_len pieces), shardforge's behaviour before this key."""
    dataset_exact_deduplication: bool = False
    """Drop samples whose tokens and labels repeat an earlier sample's."""
    shuffle_before_merging_datasets: bool = False
    """Shuffle each data set's samples (with seed) before they are merged."""
    shuffle_merged_datasets: bool = True
    """Shuffle the merged samples (with seed) before packing; false keeps the file order for packing
    (batches are drawn in a shuffled order either way)."""
    dataset_shard_num: int | None = Field(None, gt=0)
    """Keep one contiguous shard of the merged samples: how many."""
    dataset_shard_idx: int | None = Field(None, ge=0)
    """Which shard, with dataset_shard_num."""
    dataloader_drop_last: bool = False
    """Each epoch uses only whole global batches: the samples left over after the last whole batch
    of an epoch are not trained on in that epoch (its steps: floor(sequences / global batch)).
    false: the last batch of an epoch is completed with the first samples of the next epoch's
    order."""
