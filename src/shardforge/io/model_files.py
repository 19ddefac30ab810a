"""What a model folder is: the one list of the files a merge (or `save_pretrained`) writes,
and the refusal of `--overwrite` onto anything else.

`--overwrite` replaces a previous model only. A local folder or an s3:// prefix holding any
entry that is not in `MODEL_FILES` (a checkpoint folder, optimizer state, `trainer_state.json`,
logs, a user's notes, any sub-folder but the tokenizer's `additional_chat_templates/`) is
refused with one line naming what it holds; `--overwrite_non_model` replaces it anyway.

Names only, never contents: a file is judged by its name at the top of the folder.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from fnmatch import fnmatchcase
from pathlib import Path

from shardforge.errors import MergeError

# the names transformers' tokenizers save their files under (and *.model, *.tiktoken,
# *.jinja): what a model folder holds, what staging fetches for a tokenizer (`io.mirror`),
# whether a folder has a tokenizer (`sinks.companions`), what a prepared data set's hash
# reads of it besides its class's vocabulary files (`train.prepared_key`)
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "chat_template.json",
    "chat_template.jinja",
    "tokenizer.model",
)
# shardforge's integrity manifest of a merged folder (`sinks.manifest`)
MERGE_MANIFEST = "shardforge-manifest.json"
# the files a Hugging Face model folder holds, as a merge or `save_pretrained` writes them
MODEL_FILES = (
    # weights and their indexes (the merge; save_pretrained's older .bin form; PEFT adapters)
    "*.safetensors",
    "*.safetensors.index.json",
    "pytorch_model*.bin",
    "pytorch_model.bin.index.json",
    "adapter_model.bin",
    "adapter_config.json",
    # configs
    "config.json",
    "generation_config.json",
    "preprocessor_config.json",
    "processor_config.json",
    # tokenizers
    *TOKENIZER_FILES,
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
    "sentencepiece.model",
    "spm.model",
    "bpe.codes",
    "*.tiktoken",
    "chat_template.jinja",
    # trust_remote_code models save their code beside the weights
    "configuration_*.py",
    "modeling_*.py",
    "tokenization_*.py",
    # shardforge's integrity manifest; the model card PEFT's save_pretrained writes
    MERGE_MANIFEST,
    "README.md",
)
# the one sub-folder a model folder holds (transformers' CHAT_TEMPLATE_DIR: *.jinja files)
MODEL_FOLDERS = {"additional_chat_templates": "*.jinja"}
# names shown in a refusal's line (all of them below it)
SHOWN = 3


def is_model_file(name: str) -> bool:
    """Whether `name` (a path relative to the folder, `/`-separated) is a file a merge writes."""
    folder, _, rest = name.partition("/")
    if rest:
        pattern = MODEL_FOLDERS.get(folder)
        return pattern is not None and "/" not in rest and fnmatchcase(rest, pattern)
    return any(fnmatchcase(name, p) for p in MODEL_FILES)


def non_model_entries(names: Iterable[str]) -> list[str]:
    """The names among `names` (relative, `/`-separated) that no merge writes, sorted; what
    lies in another sub-folder is that folder, `NAME/`, once."""
    found = set()
    for name in names:
        if not is_model_file(name):
            folder, slash, _ = name.partition("/")
            found.add(folder + "/" if slash and folder not in MODEL_FOLDERS else name)
    return sorted(found)


def folder_entries(folder: Path) -> list[str]:
    """What `folder` holds, relative: its files, and the files of the model's own sub-folders
    (any other sub-folder is one entry, `NAME/`, not walked)."""
    found: list[str] = []
    for entry in os.scandir(folder):
        if entry.is_dir(follow_symlinks=False):
            if entry.name not in MODEL_FOLDERS:
                found.append(entry.name + "/")
                continue
            for sub in os.scandir(entry.path):
                is_file = sub.is_file(follow_symlinks=False)
                found.append(f"{entry.name}/{sub.name}" + ("" if is_file else "/"))
        elif entry.is_file(follow_symlinks=False):
            found.append(entry.name)
        else:  # a symlink, a socket: not something a merge writes
            found.append(entry.name + "@")
    return found


def refuse_non_model(where: object, names: Iterable[str]) -> None:
    """One `MergeError` line when `names` (what the output holds) are not all model files."""
    others = non_model_entries(names)
    if not others:
        return
    more = f", ... ({len(others)} entries)" if len(others) > SHOWN else ""
    raise MergeError(
        f"{where}: holds more than a model ({', '.join(others[:SHOWN])}{more}); --overwrite "
        "replaces a model only: choose another output path, or pass --overwrite_non_model to "
        "delete all of it",
        [f"not written by a merge: {n}" for n in others],
    )


def check_model_folder(folder: Path) -> None:
    """Refuse to replace `folder` unless it holds a model only (`refuse_non_model`)."""
    refuse_non_model(folder, folder_entries(folder))
