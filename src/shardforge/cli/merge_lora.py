"""`shardforge merge-lora CONFIG [--lora_model_dir DIR] --output_path DIR`: fuse a PEFT LoRA
adapter directory into the base model and write a complete Hugging Face model directory,
streaming one tensor at a time (Axolotl's `merge-lora`; its `do_merge_lora(cfg=...)` and
`do_cli` are here too)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from shardforge.cli._common import (
    config_argument,
    fire_entry,
    load_config,
    quiet_libraries,
    shardforge_command,
)
from shardforge.merge.request import LoraMergeRequest

EPILOG = """\b
Examples:
  # the adapter saved in the config's output_dir -> <output_dir>/merged
  shardforge merge-lora cfg.yml
  # another adapter directory, bf16 output, verified
  shardforge merge-lora cfg.yml --lora_model_dir runs/lora/checkpoint-500 \\
      --output_path out/merged --dtype bfloat16 --verify
  # 2GB shards, no tokenizer
  shardforge merge-lora cfg.yml --output-path out --max_shard_size 2GB --no_save_tokenizer
  # another base model (a config override)
  shardforge merge-lora cfg.yml --output_path out --base_model models/llama-3.2-1b
  python -m shardforge.cli.merge_lora cfg.yml --lora_model_dir adapter --output_path out
"""


def do_merge_lora(
    *,
    cfg: Any,
    output_path: str | Path | None = None,
    lora_model_dir: str | Path | None = None,
    save_tokenizer: bool = True,
    **options: Any,
) -> Path:
    """Axolotl's `do_merge_lora(cfg=cfg)`: fuse the adapter of `cfg`'s run (`lora_model_dir`,
    else the config's lora_model_dir, else output_dir) into its base model, written to
    `output_path` (default <output_dir>/merged, where Axolotl writes it). `cfg`:
    `shardforge.cli.config.load_cfg`'s result, a mapping, `ShardforgeConfig` or config path;
    only the keys the merge reads are validated. `options`: the other fields of
    `LoraMergeRequest` (dtype, max_shard_size, verify, overwrite, quiet). Returns the output
    directory."""
    from shardforge.merge.lora import merge_lora

    request = LoraMergeRequest(
        lora_model_dir, output_path, save_tokenizer=save_tokenizer, **options
    )
    return merge_lora(cfg, **dataclasses.asdict(request))


@shardforge_command(
    "merge-lora",
    epilog=EPILOG,
    params=[config_argument()],
    request=LoraMergeRequest,
)
def command(config: str, overrides: list[str], **options: Any) -> str:
    """Fuse the PEFT LoRA adapter of CONFIG's run (lora_model_dir, else output_dir, or
    --lora_model_dir) into the base model (base_model: a directory of safetensors weights)
    and write a complete Hugging Face model directory: safetensors weights + index,
    config.json, generation_config.json and tokenizer. Each adapted weight is W + scale * B
    @ A computed in float32 and stored in the output dtype; memory stays at about one
    tensor; the output appears only when complete."""
    # --quiet hides the progress bar; the adapter and base model are still printed (on stderr)
    cfg = load_config(config, overrides, "merge-lora")
    with quiet_libraries(options["quiet"]):  # --quiet: no transformers bars or warnings either
        return f"{do_merge_lora(cfg=cfg, **options)}\n"


do_cli = fire_entry(command)


if __name__ == "__main__":
    import fire

    fire.Fire(do_cli)
