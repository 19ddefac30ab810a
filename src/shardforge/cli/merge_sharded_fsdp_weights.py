"""`shardforge merge-sharded-fsdp-weights CONFIG --output_path DIR`: merge a sharded FSDP (DCP)
checkpoint into a complete Hugging Face model directory, streaming with bounded memory."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from shardforge.cli._common import (
    OVERRIDE_CONTEXT,
    OVERRIDES_HELP,
    fire_overrides,
    run_guarded,
    setup_logging,
    split_debug,
)

EPILOG = """\b
Examples:
  # latest complete checkpoint under the config's output_dir
  shardforge merge-sharded-fsdp-weights examples/tiny-llama.yml --output_path outputs/merged
  # a given step, cast to bf16, verified, 5GB shards
  shardforge merge-sharded-fsdp-weights cfg.yml --output-path out --step 200 \\
      --dtype bfloat16 --verify --max_shard_size 5GB
  # an HF Trainer / accelerate checkpoint
  shardforge merge-sharded-fsdp-weights cfg.yml --output_path out \\
      --checkpoint runs/checkpoint-500/pytorch_model_fsdp_0
  # a Lightning sharded checkpoint
  shardforge merge-sharded-fsdp-weights cfg.yml --output_path out \\
      --checkpoint lightning_logs/version_0/checkpoints/last.ckpt
  python -m shardforge.cli.merge_sharded_fsdp_weights cfg.yml --output_path out
"""


def do_merge_sharded_fsdp_weights(
    config: str | Path,
    output_path: str | Path,
    override_args: list[str] | None = None,
    **options: Any,
) -> Path:
    """Load `config` (plus overrides) and run `merge_fsdp_weights` with `options`."""
    from shardforge.config import load_cfg, parse_override_args
    from shardforge.merge import merge_fsdp_weights

    overrides = parse_override_args(override_args or [])
    cfg = load_cfg(config, **overrides)
    return merge_fsdp_weights(cfg, output_path, **options)


@click.command(
    "merge-sharded-fsdp-weights",
    context_settings=OVERRIDE_CONTEXT,
    epilog=EPILOG,
    help="Merge the sharded FSDP checkpoint of CONFIG's run (the latest complete one under "
    "output_dir, or --checkpoint) into a complete Hugging Face model directory: safetensors "
    "weights + index, config.json, generation_config.json and tokenizer. Memory stays at about "
    "one tensor; the output appears only when complete. " + OVERRIDES_HELP,
)
@click.argument("config", type=click.Path(dir_okay=False))
@click.option(
    "--output_path", "--output-path", "output_path", required=True, help="Directory to create."
)
@click.option(
    "--checkpoint", default=None, help="A DCP directory or checkpoint root (default: output_dir)."
)
@click.option("--step", type=int, default=None, help="Merge this step instead of the latest.")
@click.option(
    "--dtype",
    default=None,
    help="Output dtype of floating tensors: bfloat16, float16, float32 or as_saved "
    "(default: the config's torch_dtype, else as saved).",
)
@click.option(
    "--max_shard_size",
    "--max-shard-size",
    "max_shard_size",
    default=None,
    help="Largest weights file, e.g. 5GB (default: as save_pretrained).",
)
@click.option("--verify", is_flag=True, help="Re-read the output and compare every tensor.")
@click.option(
    "--remove_checkpoint_dir",
    "--remove-checkpoint-dir",
    "remove_checkpoint_dir",
    is_flag=True,
    help="Delete the sharded model checkpoint after a passed verification (implies --verify).",
)
@click.option("--overwrite", is_flag=True, help="Replace an existing non-empty output directory.")
@click.option(
    "--save-tokenizer/--no-save-tokenizer",
    "--save_tokenizer/--no_save_tokenizer",
    "save_tokenizer",
    default=True,
    help="Write the tokenizer (default: on).",
)
@click.option(
    "--engine",
    type=click.Choice(["stream", "transformers"]),
    default="stream",
    help="stream (bounded memory, default) or transformers (meta model + dcp.load + "
    "save_pretrained; whole model in memory).",
)
@click.option("--quiet", is_flag=True, help="No progress bar.")
@click.option("--debug", is_flag=True, help="Show a traceback on errors.")
@click.pass_context
def command(
    ctx: click.Context,
    config: str,
    output_path: str,
    checkpoint: str | None,
    step: int | None,
    dtype: str | None,
    max_shard_size: str | None,
    verify: bool,
    remove_checkpoint_dir: bool,
    overwrite: bool,
    save_tokenizer: bool,
    engine: str,
    quiet: bool,
    debug: bool,
) -> None:
    args, stray_debug = split_debug(list(ctx.args))
    setup_logging()  # --quiet hides the progress bar; the chosen checkpoint is still printed
    out = run_guarded(
        lambda: do_merge_sharded_fsdp_weights(
            config,
            output_path,
            args,
            save_tokenizer=save_tokenizer,
            checkpoint=checkpoint,
            step=step,
            dtype=dtype,
            max_shard_size=_shard_size(max_shard_size),
            verify=verify,
            remove_checkpoint_dir=remove_checkpoint_dir,
            overwrite=overwrite,
            engine=engine,
            quiet=quiet,
        ),
        debug or stray_debug,
    )
    click.echo(str(out))


def _shard_size(value: str | int | None) -> str | int | None:
    if isinstance(value, str) and value.isdigit():
        return int(value)
    return value


def do_cli(
    config: str,
    output_path: str | None = None,
    debug: bool = False,
    quiet: bool = False,
    **kwargs: Any,
) -> None:
    """fire entry point: python -m shardforge.cli.merge_sharded_fsdp_weights CONFIG --output_path DIR."""
    from shardforge.cli._common import fail

    setup_logging()  # --quiet hides the progress bar; the chosen checkpoint is still printed
    known = {
        "checkpoint",
        "step",
        "dtype",
        "max_shard_size",
        "verify",
        "remove_checkpoint_dir",
        "overwrite",
        "save_tokenizer",
        "engine",
    }
    kwargs = {k.replace("-", "_"): v for k, v in kwargs.items()}
    out_path = output_path or kwargs.pop("output_path", None)
    if out_path is None:
        fail("--output_path is required", 2)
    options = {k: kwargs.pop(k) for k in list(kwargs) if k in known}
    if "max_shard_size" in options:
        options["max_shard_size"] = _shard_size(options["max_shard_size"])
    out = run_guarded(
        lambda: do_merge_sharded_fsdp_weights(
            config, out_path, fire_overrides(kwargs), quiet=quiet, **options
        ),
        debug,
    )
    print(out)


if __name__ == "__main__":
    import fire

    fire.Fire(do_cli)
