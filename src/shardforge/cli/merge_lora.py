"""`shardforge merge-lora CONFIG [--lora_model_dir DIR] --output_path DIR`: fuse a PEFT LoRA
adapter directory into the base model and write a complete Hugging Face model directory,
streaming one tensor at a time (Axolotl's `merge-lora`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from shardforge.cli._common import (
    OVERRIDE_CONTEXT,
    OVERRIDES_HELP,
    check_options,
    debug_option,
    fire_overrides,
    run_guarded,
    setup_logging,
    spelled_option,
    split_debug,
)

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

# the options `merge_lora` takes by keyword (and the fire entry point accepts)
OPTIONS: tuple[str, ...] = (
    "dtype",
    "max_shard_size",
    "verify",
    "overwrite",
    "save_tokenizer",
)


def do_merge_lora(
    config: str | Path,
    output_path: str | Path | None = None,
    lora_model_dir: str | Path | None = None,
    override_args: list[str] | None = None,
    quiet: bool = False,
    **options: Any,
) -> Path:
    """Load `config` (plus overrides) and run `merge_lora` with `options`."""
    from shardforge.config import load_cfg, parse_override_args
    from shardforge.merge.lora import merge_lora

    overrides = parse_override_args(override_args or [])
    cfg = load_cfg(config, command="merge", **overrides)
    return merge_lora(cfg, output_path, lora_model_dir, quiet=quiet, **options)


def _shard_size(value: str | int | None) -> str | int | None:
    if isinstance(value, str) and value.isdigit():
        return int(value)
    return value


@click.command(
    "merge-lora",
    context_settings=OVERRIDE_CONTEXT,
    epilog=EPILOG,
    help="Fuse the PEFT LoRA adapter of CONFIG's run (lora_model_dir, else output_dir, or "
    "--lora_model_dir) into the base model (base_model: a directory of safetensors weights) "
    "and write a complete Hugging Face model directory: safetensors weights + index, "
    "config.json, generation_config.json and tokenizer. Each adapted weight is "
    "W + scale * B @ A computed in float32 and stored in the output dtype; memory stays at "
    "about one tensor; the output appears only when complete. " + OVERRIDES_HELP,
)
@click.argument("config", type=click.Path(dir_okay=False))
@spelled_option(
    "lora_model_dir",
    default=None,
    help="The adapter directory (adapter_config.json + adapter_model.safetensors); default "
    "the config's lora_model_dir, else its output_dir.",
)
@spelled_option(
    "output_path",
    default=None,
    help="Directory to create (default <output_dir>/merged, as Axolotl).",
)
@click.option(
    "--dtype",
    default=None,
    help="Output dtype of floating tensors: bfloat16, float16, float32 or as_saved "
    "(default: the base config's dtype, else as the base model stores them).",
)
@spelled_option(
    "max_shard_size",
    default=None,
    help="Largest weights file, e.g. 5GB (default: as save_pretrained).",
)
@click.option(
    "--verify",
    is_flag=True,
    help="Re-read the output and compare every tensor with the base model and adapter read "
    "by the safetensors library and fused again.",
)
@click.option("--overwrite", is_flag=True, help="Replace an existing non-empty output directory.")
@click.option(
    "--save-tokenizer/--no-save-tokenizer",
    "--save_tokenizer/--no_save_tokenizer",
    "save_tokenizer",
    default=True,
    help="Write the tokenizer (default: on).",
)
@click.option("--quiet", is_flag=True, help="No progress bar.")
@debug_option()
@click.pass_context
def command(
    ctx: click.Context,
    config: str,
    lora_model_dir: str | None,
    output_path: str | None,
    dtype: str | None,
    max_shard_size: str | None,
    verify: bool,
    overwrite: bool,
    save_tokenizer: bool,
    quiet: bool,
    debug: bool,
) -> None:
    args, stray_debug = split_debug(list(ctx.args))
    args = check_options(ctx, args)
    setup_logging()  # --quiet hides the progress bar; the adapter and base model are printed
    out = run_guarded(
        lambda: do_merge_lora(
            config,
            output_path,
            lora_model_dir,
            args,
            quiet=quiet,
            dtype=dtype,
            max_shard_size=_shard_size(max_shard_size),
            verify=verify,
            overwrite=overwrite,
            save_tokenizer=save_tokenizer,
        ),
        debug or stray_debug,
    )
    click.echo(str(out))


def do_cli(
    config: str,
    output_path: str | None = None,
    lora_model_dir: str | None = None,
    debug: bool = False,
    quiet: bool = False,
    **kwargs: Any,
) -> None:
    """fire entry point: python -m shardforge.cli.merge_lora CONFIG [--output_path DIR]."""
    setup_logging()
    kwargs = {k.replace("-", "_"): v for k, v in kwargs.items()}
    if "no_save_tokenizer" in kwargs:
        kwargs["save_tokenizer"] = not kwargs.pop("no_save_tokenizer")
    options = {k: kwargs.pop(k) for k in list(kwargs) if k in OPTIONS}
    if "max_shard_size" in options:
        options["max_shard_size"] = _shard_size(options["max_shard_size"])
    out = run_guarded(
        lambda: do_merge_lora(
            config,
            output_path,
            lora_model_dir,
            fire_overrides(kwargs),
            quiet=quiet,
            **options,
        ),
        debug,
    )
    print(out)


if __name__ == "__main__":
    import fire

    fire.Fire(do_cli)
